"""The game view of report.html (turnrl/report/games.py): a game's seats' moves interleaved
in the order they were played, who played each, and each seat's reward; from games played by
the real turn loop (scripted moves, so the games are long) and from a real tiny self-play
run's sample files."""

from __future__ import annotations

import json
from functools import partial
from html.parser import HTMLParser

import pytest

from tests.conftest import MovesEngine
from turnrl.envs import make_env
from turnrl.evaluation import episode_transcript, whole_games
from turnrl.metrics import MetricsLogger
from turnrl.report import write_html_report
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams
from turnrl.types import read_episodes


class _Page(HTMLParser):
    """Each game view of a page: its summary, seat rows and moves (seat, label, text)."""

    def __init__(self, html: str):
        super().__init__()
        self.games: list[dict] = []
        self._stack: list[tuple[str, dict]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        cls = attrs.get("class", "")
        if tag == "details" and cls == "game":
            self.games.append({"opponent": attrs["data-opponent"], "summary": "",
                               "rows": [], "moves": [], "notes": ""})
        elif tag == "div" and cls.startswith("move "):
            self.games[-1]["moves"].append({"seat": attrs["data-seat"],
                                            "number": int(attrs["data-move"]), "who": "",
                                            "text": "", "saw": ""})
        elif tag == "tr" and self._inside("details", "game"):
            self.games[-1]["rows"].append([])
        self._stack.append((tag, attrs))

    def handle_endtag(self, tag):
        while self._stack and self._stack.pop()[0] != tag:
            pass

    def _inside(self, tag, cls=None):
        return any(t == tag and (cls is None or a.get("class", "").startswith(cls))
                   for t, a in self._stack)

    def handle_data(self, data):
        if not self.games or not self._inside("details", "game"):
            return
        game, tag = self.games[-1], self._stack[-1][0] if self._stack else ""
        if tag == "summary" and not self._inside("details", "saw"):
            game["summary"] += data
        elif tag == "td":
            game["rows"][-1].append(data)
        elif tag == "p" and self._stack[-1][1].get("class") == "note":
            game["notes"] += data
        elif self._inside("div", "move "):
            move = game["moves"][-1]
            if tag == "span":
                move["who"] += data
            elif tag == "pre" and self._inside("details", "saw"):
                move["saw"] += data
            elif tag == "pre":
                move["text"] += data


def _play(tokenizer, make, moves, seeds=(0,), max_turns=12):
    chat = ChatFormat(tokenizer)
    params = SamplingParams(8, 1.0, stop_token_ids=(chat.end_of_turn,))
    return run_sync(run_episodes(make, [(seed, seed) for seed in seeds],
                                 MovesEngine(tokenizer, moves), chat, params,
                                 env_name="game", max_turns=max_turns))


def _recorded_run(run_dir, tokenizer, episodes):
    """A run directory holding ``episodes`` as a step's sample transcripts, as the trainer
    writes them (trainer/evaluation.py ``write_transcripts``)."""
    run_dir.mkdir()
    with MetricsLogger(run_dir) as logger:
        logger.log(1, {"reward/mean": 0.0})
    (run_dir / "samples").mkdir()
    (run_dir / "samples" / "step-000001.json").write_text(json.dumps(
        [episode_transcript(ep, tokenizer.decode) for ep in episodes]))
    return _Page(write_html_report([run_dir]).read_text())


GAMES = [  # (env, options, scripted moves, play order)
    ("tictactoe", {"opponent": "self"}, ["1", "4", "2", "5", "3"],  # X wins 1-2-3
     ["X", "O", "X", "O", "X"]),
    # Kuhn Poker: check, bet, call: the first seat moves again after the second's bet
    ("kuhn-poker", {"opponent": "self"}, ["check", "bet", "call"],
     ["first", "second", "first"]),
]


@pytest.mark.parametrize("env_name, options, moves, order", GAMES,
                         ids=[g[0] for g in GAMES])
def test_a_self_play_game_is_shown_move_by_move_in_play_order(tiny, tmp_path, env_name,
                                                               options, moves, order):
    _, tok = tiny
    episodes = _play(tok, partial(make_env, env_name, **options), moves)
    assert [ep.info["play_order"] for ep in episodes] == [order] * 2
    (game,) = _recorded_run(tmp_path / "run", tok, episodes).games
    # the moves: one per entry of play_order, the seat's own turns in turn
    assert [m["seat"] for m in game["moves"]] == order
    assert [m["number"] for m in game["moves"]] == list(range(1, len(order) + 1))
    by_seat = {ep.info["role"]: [t.action for t in ep.turns] for ep in episodes}
    taken = dict.fromkeys(by_seat, 0)
    for move in game["moves"]:
        assert move["text"] == by_seat[move["seat"]][taken[move["seat"]]]
        taken[move["seat"]] += 1
        assert f"seat {move['seat']}" in move["who"] and "policy" in move["who"]
    assert taken == {seat: len(actions) for seat, actions in by_seat.items()}
    # what each seat saw before its second move is its view after its first
    first = {ep.info["role"]: ep for ep in episodes}
    second_x = [m for m in game["moves"] if m["seat"] == order[0]][1]
    assert second_x["saw"] == first[order[0]].turns[0].observation
    # each seat's reward and outcome, and who played it
    assert game["opponent"] == "self" and "(self-play)" in game["summary"]
    rows = {row[0]: row for row in game["rows"][1:]}
    for ep in episodes:
        seat, by, reward, outcome = rows[ep.info["role"]][:4]
        assert (by, float(reward), outcome) == ("policy", ep.reward, ep.info["outcome"])
        assert f"{ep.info['role']} {ep.reward:g}" in game["summary"]


def test_a_seat_that_moves_twice_in_a_row_is_shown_so(tiny, tmp_path):
    """TextArena's resubmit after an invalid move: player1 moves twice running; the view
    follows play_order, not alternation."""
    pytest.importorskip("textarena")
    _, tok = tiny
    episodes = _play(tok, partial(make_env, "textarena-selfplay", game="TicTacToe-v0"),
                     ["[4]", "[4]", "[9]"])
    order = ["player0", "player1", "player1"]
    assert episodes[0].info["play_order"] == order
    (game,) = _recorded_run(tmp_path / "run", tok, episodes).games
    assert [(m["seat"], m["text"].strip()) for m in game["moves"]] == \
        list(zip(order, ["[4]", "[4]", "[9]"], strict=True))
    assert "invalid" in game["moves"][2]["saw"].lower()  # its complaint, before the resubmit


def test_a_game_against_the_pool_names_the_opponent_and_the_policys_seat(tiny, tmp_path):
    from turnrl.selfplay.pool import OpponentPool

    model, tok = tiny
    chat = ChatFormat(tok)
    pool = OpponentPool(chat, SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,)),
                        size=1, every=1)
    pool.offer(7, model)
    make = pool.attach(partial(make_env, "tictactoe", opponent="pool", role="o"))
    (episode,) = _play(tok, make, ["5", "1", "9"])
    (game,) = _recorded_run(tmp_path / "run", tok, [episode]).games
    assert game["opponent"] == "pool-v7" and "O vs pool-v7" in game["summary"]
    assert [m["seat"] for m in game["moves"]] == ["O"] * len(episode.turns)
    assert game["rows"][1][:3] == ["O", "policy (against pool-v7)", f"{episode.reward:g}"]


def test_files_that_do_not_fit_together_are_said_so_not_a_crash(tiny, tmp_path):
    _, tok = tiny
    episodes = _play(tok, partial(make_env, "tictactoe", opponent="self"), ["5", "1", "9"])
    episodes[0].info["play_order"] = ["X", "O", "X", "X", "X"]  # more X moves than X made
    (game,) = _recorded_run(tmp_path / "a", tok, episodes).games
    assert game["moves"] == [] and "more moves than its" in game["notes"]
    (alone,) = _recorded_run(tmp_path / "b", tok, episodes[1:]).games  # one seat only
    assert "the other seat's episode is not in the samples" in alone["notes"]
    assert [(m["seat"], m["number"]) for m in alone["moves"]] == [("O", 2), ("O", 4)]


def test_a_self_play_runs_samples_hold_whole_games_and_the_page_shows_them(tmp_path):
    from turnrl.config import load_config
    from turnrl.trainer import train

    train(load_config(None, [
        "--model.name", "tiny", "--env.name", "tictactoe-selfplay",
        "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--run.steps", "1", "--eval.episodes", "0",
        "--run.sample_episodes", "3", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.out_dir", str(tmp_path)]))
    saved = read_episodes(tmp_path / "episodes" / "step-000001.jsonl")
    assert len(saved) == 4  # 3 asked for, the third's game partner added
    games = {ep.info["game_id"] for ep in saved}
    assert len(games) == 2 and all(
        sorted(ep.info["role"] for ep in saved if ep.info["game_id"] == g) == ["O", "X"]
        for g in games)
    page = _Page(write_html_report([tmp_path]).read_text())
    assert len(page.games) == 2
    for game in page.games:
        order = next(ep.info["play_order"] for ep in saved
                     if f"seed {ep.seed}, game {ep.info['game_id']}:" in game["summary"])
        assert [m["seat"] for m in game["moves"]] == order
        assert {row[0] for row in game["rows"][1:]} == {"X", "O"}


def test_whole_games_adds_the_missing_seats_only():
    from turnrl.types import Episode

    def seat(game, role):
        return Episode(env="g", seed=0, group=0, info={"role": role, "game_id": game})
    episodes = [seat(0, "X"), seat(0, "O"), seat(1, "X"), seat(1, "O"),
                Episode(env="g", seed=1, group=1, info={"role": "X", "opponent": "random"})]
    assert whole_games(episodes[:1], episodes) == episodes[:2]
    assert whole_games(episodes[1:3], episodes) == episodes[:4]
    assert whole_games(episodes[4:], episodes) == episodes[4:]


def test_turnrl_eval_of_a_game_reports_each_role_and_the_page_shows_its_games(tmp_path,
                                                                               capsys):
    from turnrl.cli import main
    from turnrl.config import load_config
    from turnrl.trainer import train

    run = tmp_path / "run"
    train(load_config(None, [
        "--model.name", "tiny", "--env.name", "tictactoe-selfplay",
        "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "1", "--run.steps", "1", "--eval.episodes", "0",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.out_dir", str(run)]))
    capsys.readouterr()
    assert main(["eval", str(run), "--env.options.opponent", "random", "--eval.episodes", "6",
                 "--out", str(run / "eval.json")]) == 0
    out = capsys.readouterr().out
    saved = json.loads((run / "eval.json").read_text())["result"]["games"]
    assert set(saved["roles"]) == {"X", "O"}  # the policy's seat by the seed's parity
    for role, row in saved["roles"].items():
        assert row["episodes"] == 3
        assert row["win"] + row["draw"] + row["loss"] + row["failed"] / 3 == pytest.approx(1)
        assert f"step-000001 as {role}: win {100 * row['win']:.1f}%" in out
    assert sorted(t["game"]["role"] for t in saved["samples"]) == ["O", "O", "X", "X"]
    page = _Page(write_html_report([run]).read_text())
    evaluated = [g for g in page.games if g["summary"].startswith("turnrl eval: step-000001")]
    assert len(evaluated) == 4 and {g["opponent"] for g in evaluated} == {"random"}
    for game, transcript in zip(evaluated, saved["samples"], strict=True):
        role = transcript["game"]["role"]
        assert f"{role} vs random" in game["summary"]
        assert [m["seat"] for m in game["moves"]] == [role] * transcript["turns"]
        assert game["rows"][1][:2] == [role, "policy (against random)"]
