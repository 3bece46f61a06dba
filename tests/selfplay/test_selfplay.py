"""Self-play: one game, one episode per seat (envs/contract.py ``seats``, rollout/loop.py),
opponents (turnrl/selfplay.py) and per-role evaluation (docs/selfplay.md)."""

from __future__ import annotations

from functools import partial

import pytest

from tests.conftest import MovesEngine
from turnrl.envs import StepResult, make_env, register_env
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams


def _play(tokenizer, env_name, moves, games=1, max_turns=8, **options):
    chat = ChatFormat(tokenizer)
    params = SamplingParams(8, 1.0, stop_token_ids=(chat.end_of_turn,))
    return run_sync(run_episodes(partial(make_env, env_name, **options),
                                 [(seed, seed) for seed in range(games)],
                                 MovesEngine(tokenizer, moves), chat, params,
                                 env_name=env_name, max_turns=max_turns))


def _trained_text(tokenizer, episode):
    return [tokenizer.decode(episode.token_ids[t.start:t.end], skip_special_tokens=True)
            for t in episode.turns]


def test_one_tictactoe_game_gives_an_episode_per_seat_with_complementary_masks(tiny):
    _, tok = tiny
    # X 1, O 2, X 3, O 4, X 5, O 6, X 7: X completes the 3-5-7 diagonal on the 7th move
    x, o = _play(tok, "tictactoe", [str(cell) for cell in range(1, 10)], opponent="self")
    assert (x.info["role"], o.info["role"]) == ("X", "O")
    assert x.info["opponent"] == o.info["opponent"] == "self"
    assert (x.reward, o.reward) == (1.0, -1.0) and x.reward + o.reward == 0
    assert (x.info["outcome"], o.info["outcome"]) == ("win", "loss")
    assert x.success and not o.success
    assert x.status == o.status == "done" and x.group == o.group
    assert [t.action for t in x.turns] == ["1", "3", "5", "7"]
    assert [t.action for t in o.turns] == ["2", "4", "6"]
    # each turn's state is the env's state_key (GiGPO's anchors): the seat to move and board
    assert [t.state for t in x.turns] == ["X:.........", "X:XO.......", "X:XOXO.....",
                                          "X:XOXOXO..."]
    assert [t.state for t in o.turns] == ["O:X........", "O:XOX......", "O:XOXOX...."]
    # each seat trains exactly its own replies: every move is trained once, in one episode
    for episode in (x, o):
        trained = [i for i, m in enumerate(episode.loss_mask) if m]
        spans = [i for t in episode.turns for i in range(t.start, t.end)]
        assert trained == spans
    moves = sorted(a.strip() for ep in (x, o) for a in _trained_text(tok, ep))
    assert moves == ["1", "2", "3", "4", "5", "6", "7"]
    # the other seat's moves reach each episode as environment tokens only
    o_text_env = tok.decode([t for t, m in zip(o.token_ids, o.loss_mask, strict=True) if not m])
    assert "X played 1." in o_text_env and "X played 3." in o_text_env
    x_text_env = tok.decode([t for t, m in zip(x.token_ids, x.loss_mask, strict=True) if not m])
    assert "O played 2." in x_text_env and "O played 6." in x_text_env
    assert "X played" not in x_text_env  # a seat is not told its own moves as news
    # the final turn of each seat carries the end of the game as that seat reads it
    assert x.turns[-1].observation.endswith("You win.")
    assert o.turns[-1].observation.endswith("You lose.")
    assert x.turns[-1].reward == 1.0 and o.turns[-1].reward == -1.0
    assert all(t.reward == 0.0 for t in x.turns[:-1] + o.turns[:-1])


def test_a_draw_and_an_illegal_move(tiny):
    _, tok = tiny
    # X 1, O 5, X 9, O 3, X 7, O 4, X 6, O 8, X 2: a full board, no line
    x, o = _play(tok, "tictactoe", ["1", "5", "9", "3", "7", "4", "6", "8", "2"],
                 opponent="self")
    assert (x.info["outcome"], o.info["outcome"]) == ("draw", "draw")
    assert x.reward == o.reward == 0.0 and len(x.turns) == 5 and len(o.turns) == 4
    # O names a taken cell on its first move: O loses, X wins, both say why
    x, o = _play(tok, "tictactoe", ["5", "5"], opponent="self")
    assert (x.reward, o.reward) == (1.0, -1.0)
    assert o.info["outcome"] == "illegal" and "cell 5 is taken" in o.info["reason"]
    assert "opponent's illegal move" in x.info["reason"]


def test_kuhn_self_play_is_zero_sum_per_deal(tiny):
    _, tok = tiny
    # first bets, second calls: a showdown for 2 chips, the higher card wins
    episodes = _play(tok, "kuhn-poker", ["bet", "call"], games=6, opponent="self")
    assert len(episodes) == 12
    for first, second in zip(episodes[::2], episodes[1::2], strict=True):
        assert (first.info["role"], second.info["role"]) == ("first", "second")
        assert first.reward + second.reward == 0 and abs(first.reward) == 1.0
        assert first.info["history"] == "bb" and first.info["cards"] == second.info["cards"]
        cards = first.info["cards"]
        assert (first.reward > 0) == ("JQK".index(cards[0]) > "JQK".index(cards[1]))
    # the second seat's prompt shows the first seat's bet as environment text
    second = episodes[1]
    env_text = tok.decode([t for t, m in zip(second.token_ids, second.loss_mask, strict=True)
                           if not m])
    assert "Player 1 bets." in env_text and "call or fold" in env_text


def test_turn_limit_ends_every_seat_of_the_game(tiny):
    _, tok = tiny
    x, o = _play(tok, "tictactoe", [str(c) for c in range(1, 10)], max_turns=2,
                 opponent="self")
    assert x.status == o.status == "truncated"
    assert x.end_reason == o.end_reason == "turn_limit"
    assert "seat X ended the game" in o.info["reason"]
    assert len(x.turns) == 2 and len(o.turns) == 2 and x.reward == o.reward == 0.0


@register_env("test-unfair-game")
class UnfairGame:
    """Two seats that both win: a broken zero-sum game (or, ``fail``, one whose step raises
    on the second seat's move, or that never ends)."""

    zero_sum = True
    seats = ("a", "b")

    def __init__(self, mode: str = "same"):
        self.mode, self.moves = mode, 0

    async def reset(self, seed):
        self.moves = 0
        return self.observe("a")

    @property
    def seat_to_move(self):
        if self.mode == "bad-mover" and self.moves:
            return "c"
        return self.seats[self.moves % 2]

    def observe(self, seat):
        return f"move {self.moves}, seat {seat}"

    async def step(self, action):
        self.moves += 1
        if self.mode == "fail" and self.moves == 2:
            raise RuntimeError("the opponent's engine crashed")
        if self.mode == "endless" or self.moves < 2:
            return StepResult("ok", 0.0, False, {})
        if self.mode == "no-seats":
            return StepResult("over", 1.0, True, {"outcome": "win"})
        if self.mode == "bad-reward":
            return StepResult("over", 0.0, True, {"seats": {"a": {"reward": float("nan")},
                                                            "b": {"reward": 0.0}}})
        reward = {"same": 1.0, "fair": 1.0}[self.mode]
        return StepResult("over", 0.0, True, {"seats": {
            "a": {"reward": reward}, "b": {"reward": reward if self.mode == "same" else -1.0}}})


@pytest.mark.parametrize("mode, flagged", [("same", True), ("fair", False)])
def test_a_zero_sum_game_that_pays_both_seats_is_flagged(tiny, mode, flagged):
    _, tok = tiny
    a, b = _play(tok, "test-unfair-game", ["go"], mode=mode)
    assert a.status == b.status == "done"
    if flagged:
        assert "every seat got the same reward" in a.info["zero_sum_violation"]
        assert b.info["zero_sum_violation"] == a.info["zero_sum_violation"]
    else:
        assert "zero_sum_violation" not in a.info and a.reward + b.reward == 0


def test_a_failing_or_endless_game_ends_with_its_reason_and_the_rest_play_on(tiny):
    _, tok = tiny
    episodes = _play(tok, "test-unfair-game", ["go"], games=3, mode="fail")
    assert len(episodes) == 6
    for episode in episodes:
        assert episode.status == "error" and episode.end_reason == "env_error"
        assert "the opponent's engine crashed" in episode.info["reason"]
    a, b = _play(tok, "test-unfair-game", ["go"], max_turns=5, mode="endless")
    assert a.end_reason == b.end_reason == "turn_limit"
    assert len(a.turns) == 5 and len(b.turns) == 5


@pytest.mark.parametrize("mode, reason", [
    ("no-seats", "must give info['seats']"),
    ("bad-reward", "info['seats']['a'] must be a dict with a finite 'reward'"),
    ("bad-mover", "seat_to_move is 'c', not one of its seats"),
])
def test_a_malformed_game_fails_with_a_one_line_reason(tiny, mode, reason):
    _, tok = tiny
    a, b = _play(tok, "test-unfair-game", ["go"], mode=mode)
    for episode in (a, b):
        assert episode.status == "error" and episode.end_reason == "env_error"
        assert reason in episode.info["reason"] and "\n" not in episode.info["reason"]


def test_bad_seats_are_refused_in_one_line():
    from turnrl.envs.contract import seats

    class Env:
        pass

    for bad in [("only",), ("a", "a"), "ab", ("a", "")]:
        env = Env()
        env.seats = bad
        with pytest.raises(ValueError, match="two or more distinct role names"):
            seats(env)
    assert seats(make_env("tictactoe")) == ()
    assert seats(make_env("tictactoe", opponent="self")) == ("X", "O")


# ---- groups per role, and per-role results ---------------------------------------------------

def _episode(role, outcome, reward, group=0, status="done", env="tictactoe"):
    from turnrl.types import Episode

    info = {"role": role, "opponent": "self"}
    if outcome is not None:
        info["outcome"] = outcome
    return Episode(env=env, seed=0, group=group, reward=reward, status=status, info=info)


def test_grpo_groups_split_by_role():
    from turnrl.algorithms.advantages import ADVANTAGE_FNS
    from turnrl.algorithms.credit import episode_group_ids
    from turnrl.algorithms.estimators import Outcome

    games = [("X", "win", 1.0), ("O", "loss", -1.0), ("X", "draw", 0.0), ("O", "draw", 0.0)]
    episodes = [_episode(role, outcome, reward) for role, outcome, reward in games]
    ids = episode_group_ids(episodes).tolist()
    assert ids[0] == ids[2] and ids[1] == ids[3] and ids[0] != ids[1]
    # one group per role: X's baseline is 0.5, O's -0.5; a pooled group would give X's win +1
    advantages = Outcome(ADVANTAGE_FNS["dr_grpo"]).advantages(episodes, None, 0).tolist()
    assert advantages == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # no role (every single-agent env): the groups stay as they were
    plain = [_episode("X", "win", 1.0, group=g) for g in (3, 3, 5)]
    for ep in plain:
        del ep.info["role"]
    assert episode_group_ids(plain).tolist() == [0, 0, 1]


def test_dynamic_sampling_judges_a_self_play_group_per_role():
    from turnrl.algorithms.exploration import dynamic_sampling

    # group 0: X won both games (O lost both): every role's rewards are equal, no signal;
    # group 1: X won one game and drew the other: signal, though the pooled rewards of
    # group 0 differ as much
    flat = [_episode("X", "win", 1.0, group=0), _episode("O", "loss", -1.0, group=0),
            _episode("X", "win", 1.0, group=0), _episode("O", "loss", -1.0, group=0),
            _episode("X", "win", 1.0, group=1), _episode("O", "loss", -1.0, group=1),
            _episode("X", "draw", 0.0, group=1), _episode("O", "draw", 0.0, group=1)]
    kept, metrics = dynamic_sampling(flat, lambda r: [], groups_needed=2, max_rounds=0)
    assert {ep.group for ep in kept} == {1} and len(kept) == 4
    assert metrics["dynamic/dropped_groups"] == 1.0


def test_per_role_outcomes_by_hand():
    from turnrl.selfplay.outcomes import outcome_metrics, role_outcomes
    from turnrl.stats import wilson_interval

    episodes = [_episode("X", "win", 1.0), _episode("X", "win", 1.0),
                _episode("X", "illegal", -1.0), _episode("X", "draw", 0.0),
                _episode("X", None, 0.0, status="error"),
                _episode("O", "loss", -1.0), _episode("O", "draw", 0.0)]
    table = role_outcomes(episodes)
    x, o = table["X"], table["O"]
    assert x["episodes"] == 5 and x["failed"] == 1
    assert (x["win"], x["draw"], x["loss"]) == (0.4, 0.2, 0.2)  # illegal is a loss
    assert (x["win_lo"], x["win_hi"]) == pytest.approx(wilson_interval(2, 5))
    assert (x["loss_lo"], x["loss_hi"]) == pytest.approx(wilson_interval(1, 5))
    assert x["reward"] == pytest.approx(0.2)
    assert (o["win"], o["draw"], o["loss"]) == (0.0, 0.5, 0.5) and o["failed"] == 0
    assert (o["win_lo"], o["win_hi"]) == pytest.approx(wilson_interval(0, 2))
    # several opponents: one block each, labelled by the episode's env
    vs = [_episode("X", "win", 1.0, env="ttt@random"), _episode("X", "loss", -1.0,
                                                                  env="ttt@minimax")]
    metrics = outcome_metrics(vs)
    assert metrics["ttt@random/X/win"] == 1.0 and metrics["ttt@minimax/X/win"] == 0.0
    assert outcome_metrics([_episode("X", "win", 1.0)])["X/win"] == 1.0


# ---- opponents -----------------------------------------------------------------------------

def test_the_pool_keeps_frozen_copies_by_its_rule_and_games_record_the_version(tiny):
    import torch

    from turnrl.selfplay.pool import OpponentPool

    model, tok = tiny
    chat = ChatFormat(tok)
    params = SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,))
    pool = OpponentPool(chat, params, size=2, every=2, seed=0)
    offered = [pool.offer(version, model) for version in range(5)]
    assert offered == [True, False, True, False, True] and pool.versions() == [2, 4]
    assert not pool.offer(4, model)  # a version is kept once
    frozen = pool.members[-1].model
    weight = next(model.parameters())
    with torch.no_grad():
        weight.add_(1.0)  # training goes on: the frozen copy must not move
    try:
        assert not torch.equal(next(frozen.parameters()), weight)
        assert not next(frozen.parameters()).requires_grad
    finally:
        with torch.no_grad():
            weight.sub_(1.0)
    # a resumed run's pool starts with the version it resumes from, whatever the rule says
    resumed = OpponentPool(chat, params, size=2, every=2)
    assert resumed.offer(3, model) and resumed.versions() == [3]
    # games against the pool: every episode names the version it played
    engine = MovesEngine(tok, ["5", "1", "9", "3"])
    for env_name, options in (("tictactoe", {}), ("kuhn-poker", {})):
        make = pool.attach(partial(make_env, env_name, opponent="pool", **options))
        episodes = run_sync(run_episodes(make, [(s, s) for s in range(6)], engine, chat,
                                         SamplingParams(4, 1.0, stop_token_ids=(
                                             chat.end_of_turn,)), env_name=env_name))
        assert {ep.info["opponent"] for ep in episodes} <= {"pool-v2", "pool-v4"}
        assert all(ep.status == "done" for ep in episodes)
    with pytest.raises(ValueError, match=">= 1"):
        OpponentPool(chat, params, size=0, every=1)


class FailingPlayer:
    name = "broken"

    def act(self, system_prompt, observation):
        raise ConnectionError("opponent endpoint refused the connection")


def test_a_failing_opponent_fails_its_game_with_the_reason_and_the_others_play_on(tiny):
    from turnrl.selfplay.pool import OpponentPool

    model, tok = tiny
    chat = ChatFormat(tok)
    params = SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,))
    pool = OpponentPool(chat, params, size=1, every=1)
    pool.offer(0, model)
    built = []

    def make():  # every other game's opponent is broken
        env = make_env("tictactoe", opponent="pool", role="x")
        env.set_opponent(FailingPlayer() if len(built) % 2 else pool.sample())
        built.append(env)
        return env
    engine = MovesEngine(tok, ["5", "1", "9", "3"])
    episodes = run_sync(run_episodes(make, [(s, s) for s in range(4)], engine, chat,
                                     SamplingParams(4, 1.0, stop_token_ids=(chat.end_of_turn,)),
                                     env_name="tictactoe"))
    broken, fine = episodes[1::2], episodes[::2]
    for episode in broken:
        assert episode.status == "error" and episode.end_reason == "env_error"
        assert "opponent endpoint refused the connection" in episode.info["reason"]
    assert all(ep.status == "done" and ep.info["opponent"] == "pool-v0" for ep in fine)


def test_pool_without_a_player_says_so():
    env = make_env("kuhn-poker", opponent="pool", role="second")
    with pytest.raises(RuntimeError, match="has no player"):
        run_sync(env.reset(0))


# ---- the trainer ---------------------------------------------------------------------------

def _train_cfg(tmp_path, *extra):
    from turnrl.config import load_config

    return load_config(None, [
        "--model.name", "tiny", "--env.name", "tictactoe", "--rollout.max_new_tokens", "3",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.steps", "2",
        "--eval.episodes", "4", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.out_dir", str(tmp_path), *extra])


def test_a_self_play_run_with_rae_trains_both_seats_and_evaluates_each_role(tmp_path, capsys):
    import json

    from turnrl.metrics import read_metrics
    from turnrl.trainer import train
    from turnrl.types import read_episodes

    train(_train_cfg(tmp_path, "--env.options.opponent", "self", "--algo.advantage", "rae"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        # one baseline per seat; self-play is zero-sum, so they mirror each other
        x, o = row["rae/baseline/tictactoe/X"], row["rae/baseline/tictactoe/O"]
        assert x == pytest.approx(-o, abs=1e-9)
        assert row["game/X/reward"] == pytest.approx(-row["game/O/reward"])
        assert row["game/opponent/self"] == 8.0 and row["warn/zero_sum"] == 0.0
    sample = read_episodes(sorted((tmp_path / "episodes").glob("*.jsonl"))[0])
    assert {ep.info["role"] for ep in sample} == {"X", "O"}
    assert {ep.info["opponent"] for ep in sample} == {"self"}
    # evaluation: against the fixed opponents, per role, with intervals
    saved = json.loads((tmp_path / "eval_after.json").read_text())
    assert set(saved["per_env"]) == {"tictactoe@random", "tictactoe@minimax"}
    metrics = saved["env_metrics"]
    for label in saved["per_env"]:
        for role in ("X", "O"):
            rates = [metrics[f"{label}/{role}/{k}"] for k in ("win", "draw", "loss")]
            failed = metrics[f"{label}/{role}/failed"] / metrics[f"{label}/{role}/episodes"]
            assert sum(rates) + failed == pytest.approx(1.0)
            assert metrics[f"{label}/{role}/win_lo"] <= metrics[f"{label}/{role}/win"] \
                <= metrics[f"{label}/{role}/win_hi"]
    evaluated = read_episodes(tmp_path / "eval_after.jsonl")
    assert {ep.info["opponent"] for ep in evaluated} == {"random", "minimax"}
    assert "tictactoe@random/X/win: " in capsys.readouterr().out


def test_kuhn_self_play_with_grpo_reports_exploitability_and_each_role(tmp_path):
    import json

    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    train(_train_cfg(tmp_path, "--env.name", "kuhn-poker-selfplay", "--run.steps", "1"))
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["game/first/reward"] == pytest.approx(-row["game/second/reward"])
    saved = json.loads((tmp_path / "eval_after.json").read_text())
    assert set(saved["per_env"]) == {"kuhn-poker-selfplay@random", "kuhn-poker-selfplay@nash"}
    metrics = saved["env_metrics"]
    assert 0 <= metrics["exploitability"] <= 2
    assert {k.split("/")[1] for k in metrics if k.startswith("kuhn-poker-selfplay@nash/")} \
        == {"first", "second"}


def test_another_local_model_plays_the_other_seat_and_is_recorded(tmp_path):
    from turnrl.config import ConfigError
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train
    from turnrl.types import read_episodes

    train(_train_cfg(tmp_path, "--env.options.opponent", "model", "--env.opponent_model",
                     "tiny", "--run.steps", "1", "--eval.episodes", "0"))
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["game/opponent/model:tiny"] == 4.0 and "game/pool_versions" not in row
    sample = read_episodes(sorted((tmp_path / "episodes").glob("*.jsonl"))[0])
    assert {ep.info["opponent"] for ep in sample} == {"model:tiny"}
    with pytest.raises(ConfigError, match="needs env.opponent_model"):
        _train_cfg(tmp_path, "--env.options.opponent", "model")


def test_async_mode_refuses_the_pool_on_vllm_workers_in_one_line(tmp_path):
    from turnrl.config import ConfigError

    with pytest.raises(ConfigError, match="opponent pool with rollout.sampler vllm"):
        _train_cfg(tmp_path, "--env.options.opponent", "pool", "--run.mode", "async",
                   "--rollout.sampler", "vllm", "--ray.worker_gpus", "1")
    for opponent in ("self", "model", "pool"):  # the workers build them (test_selfplay_async)
        _train_cfg(tmp_path, "--env.options.opponent", opponent, "--run.mode", "async",
                   "--env.opponent_model", "tiny")


def test_a_hanging_opponent_times_out_its_game_only(tiny):
    import threading

    _, tok = tiny
    chat = ChatFormat(tok)
    release = threading.Event()

    class HangingPlayer:
        name = "hangs"

        def act(self, system_prompt, observation):
            release.wait(60)  # a stuck opponent (released when the test ends)
            return "5"

    class RandomPlayer:
        name = "quick"

        def act(self, system_prompt, observation):
            return next(str(c + 1) for c in range(9) if str(c + 1) in observation)

    built = []

    def make():
        env = make_env("tictactoe", opponent="pool", role="x")
        env.set_opponent(HangingPlayer() if len(built) == 0 else RandomPlayer())
        built.append(env)
        return env
    try:
        episodes = run_sync(run_episodes(
            make, [(0, 0), (1, 1)], MovesEngine(tok, ["5", "1", "9", "3"]), chat,
            SamplingParams(4, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="tictactoe",
            env_timeout_s=3.0))  # the fine game's calls: within it on a busy machine
    finally:
        release.set()
    stuck, fine = episodes
    assert stuck.status == "timeout" and "timed out" in stuck.info["reason"]
    assert fine.status == "done" and fine.info["opponent"] == "quick"


def test_the_selfplay_names_default_to_self_play(tmp_path):
    from turnrl.config import load_config

    assert make_env("tictactoe-selfplay").seats == ("X", "O")
    assert make_env("kuhn-poker-selfplay").seats == ("first", "second")
    assert make_env("kuhn-poker-selfplay", opponent="nash").seats == ()
    load_config(None, ["--env.name", "tictactoe-selfplay", "--run.mode", "async"])
    # self-play and outside opponents inside a mix: tests/selfplay/test_mix.py


def test_turnrl_eval_names_the_option_that_picks_a_fixed_opponent():
    from turnrl.checkpoint_eval import refuse_self_play
    from turnrl.config import ConfigError

    with pytest.raises(ConfigError, match="add --env.options.opponent random"):
        refuse_self_play(make_env("tictactoe-selfplay"), "tictactoe-selfplay", {})
    with pytest.raises(ConfigError, match="one of random, nash"):
        refuse_self_play(make_env("kuhn-poker", opponent="pool"), "kuhn-poker",
                         {"opponent": "pool"})
    refuse_self_play(make_env("kuhn-poker"), "kuhn-poker", {})  # a fixed opponent: fine


def test_demonstrations_of_a_self_play_game_play_its_fixed_opponent(tiny):
    from turnrl.demos.scripted import env_demonstrations

    _, tok = tiny
    demos, failed = env_demonstrations("tictactoe-selfplay", {}, 8, ChatFormat(tok), 9)
    # minimax against the random player: it wins most games, in both roles
    assert len(demos) >= 5 and len(demos) + len(failed) == 8
    prompts = [tok.decode(ep.token_ids[:ep.turns[0].start]) for d in demos
               for ep in d.episodes]
    assert {("You play X" in p, "You play O" in p) for p in prompts} == {(True, False),
                                                                         (False, True)}
