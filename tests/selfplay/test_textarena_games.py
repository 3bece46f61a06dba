"""TextArena two-player games through the adapter (textarena-2p, textarena-selfplay) and the
opponent behind an OpenAI-compatible endpoint (turnrl/selfplay/endpoint.py EndpointOpponent), with
TextArena's own rules and rewards, offline (docs/selfplay.md)."""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import MovesEngine
from turnrl.envs import make_env
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams

pytest.importorskip("textarena")




def _play(tokenizer, make, moves, seeds=(0,), max_turns=12, env_timeout_s=None):
    chat = ChatFormat(tokenizer)
    params = SamplingParams(8, 1.0, stop_token_ids=(chat.end_of_turn,))
    extra = {"env_timeout_s": env_timeout_s} if env_timeout_s else {}
    return run_sync(run_episodes(make, [(seed, seed) for seed in seeds],
                                 MovesEngine(tokenizer, moves), chat, params,
                                 env_name="textarena", max_turns=max_turns, **extra))


def _env_text(tokenizer, episode) -> str:
    return tokenizer.decode([t for t, m in zip(episode.token_ids, episode.loss_mask, strict=True)
                             if not m])


def _replay(game, seed, moves):
    """TextArena itself, played with the same seed and moves: its rewards and game info."""
    import textarena

    env = textarena.make(game)
    env.reset(num_players=2, seed=seed)
    for move in moves:
        done, _ = env.step(move)
        if done:
            break
    return env.close()


# ---- self-play -----------------------------------------------------------------------------

def test_tictactoe_self_play_gives_an_episode_per_seat_with_textarenas_rewards(tiny):
    _, tok = tiny
    # player0 takes 4, 2, 6: the anti-diagonal, on the fifth move
    moves = ["[4]", "[0]", "[2]", "[1]", "[6]"]
    p0, p1 = _play(tok, partial(make_env, "textarena-selfplay", game="TicTacToe-v0"), moves)
    assert (p0.info["role"], p1.info["role"]) == ("player0", "player1")
    assert p0.info["opponent"] == p1.info["opponent"] == "self"
    rewards, info = _replay("TicTacToe-v0", 0, moves)
    assert (p0.reward, p1.reward) == (rewards[0], rewards[1]) == (1, -1)
    assert (p0.info["outcome"], p1.info["outcome"]) == ("win", "loss")
    assert p0.info["reason"] == info[0]["reason"] and "Player 0" in p0.info["reason"]
    assert p0.status == p1.status == "done" and p0.group == p1.group
    assert [t.action.strip() for t in p0.turns] == ["[4]", "[2]", "[6]"]
    assert [t.action.strip() for t in p1.turns] == ["[0]", "[1]"]
    for episode in (p0, p1):  # each seat trains exactly its own replies
        trained = [i for i, m in enumerate(episode.loss_mask) if m]
        assert trained == [i for t in episode.turns for i in range(t.start, t.end)]
    # the other seat's moves reach each seat as environment text, in TextArena's words
    p1_env, p0_env = _env_text(tok, p1), _env_text(tok, p0)
    assert "[Player 0] [4]" in p1_env and "[Player 0] [2]" in p1_env
    assert "[Player 1] [0]" in p0_env and "[Player 1] [1]" in p0_env
    assert "You are Player 1" in p1_env and "You are Player 0" not in p1_env
    assert "You are Player 0" in p0_env and "You are Player 1" not in p0_env
    assert "[Player 0]" not in p0_env and "[Player 1]" not in p1_env  # no echo of its own
    assert "Game over: win" in p0.turns[-1].observation
    assert "Game over: loss" in p1.turns[-1].observation
    assert p0.turns[-1].reward == 1 and p1.turns[-1].reward == -1


def test_an_invalid_move_gets_textarenas_rule_a_resubmit_then_the_loss(tiny):
    _, tok = tiny
    moves = ["[4]", "[4]", "[9]"]  # player1 takes a taken cell, then one off the board
    p0, p1 = _play(tok, partial(make_env, "textarena-selfplay", game="TicTacToe-v0"), moves)
    rewards, info = _replay("TicTacToe-v0", 0, moves)
    assert (p0.reward, p1.reward) == (rewards[0], rewards[1]) == (1, -1)
    assert p1.info["outcome"] == "illegal" and p0.info["outcome"] == "win"
    assert p1.info["reason"] == info[1]["reason"] and p1.info["reason"]
    # the same seat moved twice in a row: the game's complaint is its second observation
    assert [t.action.strip() for t in p1.turns] == ["[4]", "[9]"]
    assert "invalid" in p1.turns[0].observation.lower()


def test_kuhn_poker_self_play_matches_textarena_and_is_zero_sum(tiny):
    _, tok = tiny
    for seed in (0, 1, 2):
        moves = ["[check]", "[bet]", "[call]"] * 6
        episodes = _play(tok, partial(make_env, "textarena-selfplay", game="KuhnPoker-v0"),
                         moves, seeds=(seed,), max_turns=20)
        by_role = {ep.info["role"]: ep for ep in episodes}
        rewards, _ = _replay("KuhnPoker-v0", seed, moves)
        assert {role: ep.reward for role, ep in by_role.items()} == \
            {"player0": rewards[0], "player1": rewards[1]}
        assert sum(ep.reward for ep in episodes) == 0
        assert all("zero_sum_violation" not in ep.info for ep in episodes)
        assert all(ep.status == "done" for ep in episodes)


def test_a_game_that_does_not_end_stops_at_the_turn_limit(tiny):
    _, tok = tiny
    # SimpleNegotiation lasts 10 turns; two turns a seat is less
    episodes = _play(tok, partial(make_env, "textarena-selfplay", game="SimpleNegotiation-v0"),
                     ["I make no offer."], max_turns=2)
    assert {ep.status for ep in episodes} == {"truncated"}
    assert {ep.end_reason for ep in episodes} == {"turn_limit"}
    (alone,) = _play(tok, partial(make_env, "textarena-2p", game="SimpleNegotiation-v0",
                                  opponent="random", seat=0), ["I make no offer."], max_turns=2)
    assert alone.status == "truncated" and alone.end_reason == "turn_limit"


# ---- a fixed opponent ----------------------------------------------------------------------

def test_against_the_random_player_only_the_policys_seat_is_an_episode(tiny):
    _, tok = tiny
    moves = ["[4]", "[0]", "[8]", "[2]", "[6]", "[1]", "[3]", "[5]", "[7]"]
    for seat in ("0", "1"):
        (episode,) = _play(tok, partial(make_env, "textarena-2p", game="TicTacToe-v0",
                                        seat=seat), moves, seeds=(3,))
        assert episode.info["role"] == f"player{seat}" and episode.info["opponent"] == "random"
        assert episode.status == "done"
        outcome = {1: "win", 0: "draw", -1: "loss"}[int(episode.reward)]
        assert episode.info["outcome"] in (outcome, "illegal")
        env_text = _env_text(tok, episode)
        other = 1 - int(seat)
        assert f"[Player {other}] [" in env_text  # the random player's moves, as text
    # a game that lists no moves (Nim): the random player forfeits by TextArena's rule
    (won,) = _play(tok, partial(make_env, "textarena-2p", game="Nim-v0", seat=0), ["[0 3]"])
    assert won.reward == 1 and won.info["outcome"] == "win"
    assert "format" in won.info["reason"]


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match="opponent must be one of"):
        make_env("textarena-2p", opponent="minimax")
    with pytest.raises(ValueError, match="seat must be 0, 1 or both"):
        make_env("textarena-2p", seat="2")
    env = make_env("textarena-2p", opponent="endpoint")
    with pytest.raises(RuntimeError, match="has no player"):
        run_sync(env.reset(1))  # seed 1: the policy is player1, the endpoint moves first


# ---- the endpoint opponent -------------------------------------------------------------------

class ChatHandler(BaseHTTPRequestHandler):
    """A minimal chat-completions endpoint: replies the server's next scripted move; keeps
    each request body; ``hang`` (an event) holds every request until it is set."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        if self.server.hang is not None:
            self.server.hang.wait(30)
            return
        move = self.server.moves.pop(0) if self.server.moves else "[pass]"
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": move},
                              "finish_reason": "stop"}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextmanager
def chat_server(moves=(), hang=None):
    server = ThreadingHTTPServer(("127.0.0.1", 0), ChatHandler)
    server.daemon_threads = True
    server.moves, server.requests, server.hang = list(moves), [], hang
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        if hang is not None:
            hang.set()
        server.shutdown()
        server.server_close()


def _with_opponent(player, **options):
    def make():
        env = make_env("textarena-2p", opponent="endpoint", **options)
        env.set_opponent(player() if callable(player) else player)
        return env
    return make


def test_an_endpoint_opponent_plays_the_other_seat_and_is_recorded(tiny):
    from turnrl.selfplay.endpoint import EndpointOpponent

    _, tok = tiny
    with chat_server(moves=["[0]", "[1]"]) as (server, url):
        opponent = EndpointOpponent(url, "scripted", timeout_s=30)
        (episode,) = _play(tok, _with_opponent(opponent, game="TicTacToe-v0", seat=0),
                           ["[4]", "[2]", "[6]"])
    assert episode.info["opponent"] == "endpoint:scripted"
    assert episode.status == "done" and episode.reward == 1 and episode.info["outcome"] == "win"
    assert "[Player 1] [0]" in _env_text(tok, episode)
    path, body = server.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "scripted"
    system, user = body["messages"]
    assert system["role"] == "system" and "two-player game" in system["content"]
    # the endpoint reads its own seat's view, TextArena's prompt for player 1 included
    assert "You are Player 1" in user["content"] and "[Player 0] [4]" in user["content"]
    assert len(server.requests) == 2


def test_a_dead_or_hanging_endpoint_fails_its_game_with_the_reason_and_the_rest_play_on(tiny):
    from turnrl.selfplay.endpoint import EndpointOpponent

    _, tok = tiny
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    hang = threading.Event()
    with chat_server(moves=["[0]", "[1]"] * 4) as (_, live), \
            chat_server(hang=hang) as (stuck, hanging):
        players = [EndpointOpponent(dead_url, "gone", timeout_s=5),
                   EndpointOpponent(hanging, "slow", timeout_s=1),
                   EndpointOpponent(live, "ok", timeout_s=30)]
        built = []

        def make():
            env = make_env("textarena-2p", game="TicTacToe-v0", opponent="endpoint", seat=0)
            env.set_opponent(players[len(built) % 3])
            built.append(env)
            return env
        dead, slow, fine = _play(tok, make, ["[4]", "[2]", "[6]"], seeds=(0, 1, 2))
    assert dead.status == "error" and "opponent endpoint:gone at" in dead.info["reason"]
    assert "unreachable" in dead.info["reason"]
    assert "127.0.0.1" in dead.info["reason"]
    assert slow.status == "error" and "did not answer within 1s" in slow.info["reason"]
    assert "endpoint:slow" in slow.info["reason"]
    assert stuck.requests  # the hanging server was asked
    assert fine.status == "done" and fine.info["opponent"] == "endpoint:ok"
    # a reply that is not a chat completion: the game fails, naming what is missing
    from turnrl.selfplay.endpoint import EndpointError, reply_content
    with pytest.raises(EndpointError, match=r"no choices\[0\].message.content"):
        reply_content({"error": "overloaded"})


def test_the_built_in_games_take_the_endpoint_opponent_too(tiny, tmp_path):
    from turnrl.config import ConfigError, load_config
    from turnrl.selfplay.endpoint import EndpointOpponent

    _, tok = tiny
    with chat_server(moves=["1", "2", "4"]) as (server, url):
        opponent = EndpointOpponent(url + "/v1/chat/completions", "scripted", timeout_s=30)
        make = partial(make_env, "tictactoe", opponent="endpoint", role="x")
        (episode,) = _play(tok, lambda: _attach(make(), opponent), ["5", "9", "3", "7"])
    # X 5, O 1, X 9, O 2, X 3, O 4, then X 7 completes 3-5-7
    assert episode.info["opponent"] == "endpoint:scripted" and episode.reward == 1.0
    assert episode.info["outcome"] == "win" and "reason" not in episode.info
    assert len(server.requests) == 3
    assert "You play O." in server.requests[0][1]["messages"][1]["content"]
    with pytest.raises(ConfigError, match="needs env.opponent_endpoint and"):
        load_config(None, ["--env.name", "tictactoe", "--env.options.opponent", "endpoint",
                           "--run.mode", "async", "--run.out_dir", str(tmp_path)])
    # async workers build the endpoint opponent themselves (tests/selfplay/test_async.py)
    load_config(None, ["--env.name", "tictactoe", "--env.options.opponent", "endpoint",
                       "--env.opponent_endpoint", url, "--env.opponent_endpoint_model", "m",
                       "--run.mode", "async", "--run.out_dir", str(tmp_path)])


def _attach(env, player):
    env.set_opponent(player)
    return env


# ---- the trainer -----------------------------------------------------------------------------

def _train_cfg(tmp_path, *extra):
    from turnrl.config import load_config

    return load_config(None, [
        "--model.name", "tiny", "--env.name", "textarena-selfplay",
        "--env.options.game", "TicTacToe-v0", "--rollout.max_new_tokens", "4",
        "--rollout.max_turns", "6", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--run.steps", "1", "--eval.episodes", "4",
        "--run.progress", "false", "--run.tensorboard", "false",
        "--run.out_dir", str(tmp_path), *extra])


def test_turnrl_train_runs_self_play_on_a_textarena_game(tmp_path):
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train
    from turnrl.types import read_episodes

    # Nim: its prompts leave the tiny model's 1024-token context room for whole games
    # (TicTacToe-v0's run out of it after one move, as the CLI run in the report shows)
    train(_train_cfg(tmp_path, "--env.options.game", "Nim-v0", "--run.steps", "2",
                     "--algo.advantage", "rae"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["game/player0/reward"] == pytest.approx(-row["game/player1/reward"])
        assert row["game/opponent/self"] == 8.0 and row["warn/zero_sum"] == 0.0
        x, o = row["rae/baseline/textarena-selfplay/player0"], \
            row["rae/baseline/textarena-selfplay/player1"]
        assert x == pytest.approx(-o, abs=1e-9)
    sample = read_episodes(sorted((tmp_path / "episodes").glob("*.jsonl"))[0])
    assert {ep.info["role"] for ep in sample} == {"player0", "player1"}
    finished = [ep for ep in sample if ep.status == "done"]
    assert finished and all(ep.info["game"] == "Nim-v0" for ep in finished)
    assert {abs(ep.reward) for ep in finished} == {1.0}  # TextArena's win/loss
    # evaluated against the random player, per seat (the tiny model's 1024-token context
    # may cut TextArena's long prompts short: those games count as failed)
    metrics = json.loads((tmp_path / "eval_after.json").read_text())["env_metrics"]
    assert metrics["player0/episodes"] + metrics["player1/episodes"] == 4
    evaluated = read_episodes(tmp_path / "eval_after.jsonl")
    assert {ep.info["opponent"] for ep in evaluated} == {"random"}


def test_turnrl_train_against_turnrl_serve_as_the_endpoint_opponent(tmp_path, tiny):
    """The opponent is TurnRL's own OpenAI-compatible server (``turnrl serve``'s app, on a
    thread) with the tiny model: a real HTTP round trip per move."""
    import torch

    from turnrl.config import ConfigError, ServeConfig
    from turnrl.metrics import read_metrics
    from turnrl.samplers import HFEngine
    from turnrl.serve import Server
    from turnrl.serve.app import RunningServer
    from turnrl.trainer import train
    from turnrl.types import read_episodes

    model, tokenizer = tiny
    torch.set_num_threads(1)
    server = Server(model, ChatFormat(tokenizer), HFEngine(model, tokenizer.pad_token_id, seed=0),
                    name="tiny", max_context=model.config.max_position_embeddings,
                    cfg=ServeConfig(max_tokens=8))
    with RunningServer(server) as running:
        # Nim: its prompts fit the tiny model's 1024-token context on both sides
        train(_train_cfg(tmp_path, "--env.name", "textarena-2p", "--env.options.game", "Nim-v0",
                         "--env.options.opponent",
                         "endpoint", "--env.opponent_endpoint", running.base_url,
                         "--env.opponent_endpoint_model", "tiny", "--eval.episodes", "0"))
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["game/opponent/endpoint:tiny"] == 4.0
    sample = read_episodes(sorted((tmp_path / "episodes").glob("*.jsonl"))[0])
    assert {ep.info["opponent"] for ep in sample} == {"endpoint:tiny"}
    assert {ep.status for ep in sample} == {"done"}
    # where the policy is player1, the served model moved first: its move reached the policy
    second = [ep for ep in sample if ep.info["role"] == "player1"]
    assert all("[Player 0] " in _env_text(tokenizer, ep) for ep in second)
    with pytest.raises(ConfigError, match="needs env.opponent_endpoint"):
        _train_cfg(tmp_path, "--env.name", "textarena-2p", "--env.options.opponent", "endpoint")
