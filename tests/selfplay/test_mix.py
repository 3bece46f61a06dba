"""Self-play games inside ``env.mix`` (docs/selfplay.md, docs/curriculum.md): a mix entry
that is a multi-seat game is drawn before the turn loop reads its seats (``MixEnv``'s
``choose_for_seed``), so its games give one episode per seat as they do alone; the run logs
and evaluates it per env, against its fixed opponents."""

from __future__ import annotations

import json
from functools import partial

import pytest

from turnrl.config import ConfigError, load_config
from turnrl.envs import StepResult, make_env, register_env
from turnrl.envs.mix import MixEnv, mix_choice
from turnrl.metrics import read_metrics
from turnrl.policy import training_seeds
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.trainer import LocalSource, learn
from turnrl.types import read_episodes


@register_env("test-mix-solo")
class Solo:
    """One seat, one reply, always solved."""

    async def reset(self, seed):
        return "Say anything."

    async def step(self, action):
        return StepResult("", 1.0, True, {"success": True})


WEIGHTS = [1.0, 1.0]


def _mixed_rollout(tiny, seeds):
    model, tok = tiny
    chat = ChatFormat(tok)
    make = partial(MixEnv, [partial(make_env, "test-chatter"), partial(make_env, "test-mix-solo")],
                   WEIGHTS, 3, ["test-chatter", "test-mix-solo"])
    return run_sync(run_episodes(
        make, [(seed, seed) for seed in seeds], HFEngine(model, tok.pad_token_id, seed=1), chat,
        SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="mix"))


def test_a_mixed_self_play_game_gives_one_episode_per_seat_beside_single_agent_games(tiny):
    seeds = list(range(12))
    drawn = {seed: mix_choice(WEIGHTS, 3, seed) for seed in seeds}
    assert set(drawn.values()) == {0, 1}  # both entries are played
    episodes = _mixed_rollout(tiny, seeds)
    by_group = {seed: [ep for ep in episodes if ep.group == seed] for seed in seeds}
    for seed, played in by_group.items():
        if drawn[seed] == 1:  # the single-agent entry: one episode, no seat
            assert len(played) == 1 and "role" not in played[0].info
            assert played[0].success and played[0].reward == 1.0
            continue
        assert [ep.info["role"] for ep in played] == ["a", "b"]
        assert all(ep.status == "done" for ep in played)
        assert len({ep.info["game_id"] for ep in played}) == 1
        assert played[0].info["play_order"] == ["a", "b", "a", "b"]
        assert played[0].reward == -played[1].reward  # zero-sum, each seat its own reward
        for ep in played:  # each seat trains exactly its own two moves
            assert [t.action for t in ep.turns] == ep.info["moves"]
            trained = [i for i, m in enumerate(ep.loss_mask) if m]
            assert trained == [i for t in ep.turns for i in range(t.start, t.end)]


def test_an_entry_that_fails_to_build_fails_its_own_games_only(tiny):
    model, tok = tiny
    chat = ChatFormat(tok)

    def broken():
        raise RuntimeError("the game server is down")
    make = partial(MixEnv, [broken, partial(make_env, "test-mix-solo")], WEIGHTS, 3)
    seeds = list(range(8))
    episodes = run_sync(run_episodes(
        make, [(seed, seed) for seed in seeds], HFEngine(model, tok.pad_token_id, seed=1), chat,
        SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="mix"))
    assert len(episodes) == len(seeds)
    for seed, ep in zip(seeds, episodes, strict=True):
        if mix_choice(WEIGHTS, 3, seed) == 0:
            assert ep.status == "error" and "the game server is down" in ep.info["reason"]
        else:
            assert ep.status == "done" and ep.success
    assert {mix_choice(WEIGHTS, 3, seed) for seed in seeds} == {0, 1}


def _mix_args(tmp_path, run_seed, *extra):
    return ["--model.name", "tiny", "--env.name", "mix", "--env.mix",
            "[{name: tictactoe-selfplay, label: ttt}, {name: guess-number}]",
            "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
            "--rollout.groups_per_step", "4", "--run.steps", "2", "--eval.episodes", "2",
            "--run.seed", str(run_seed), "--run.progress", "false",
            "--run.tensorboard", "false", "--run.sample_episodes", "100",
            "--run.out_dir", str(tmp_path), *extra]


def _both_played(run_seed: int) -> bool:
    cfg = load_config(None, _mix_args("/tmp", run_seed))
    for step in (0, 1):  # the steps logged as 1 and 2
        drawn = {mix_choice([1.0, 1.0], run_seed, seed) for seed, _ in training_seeds(cfg, step)}
        if drawn != {0, 1}:
            return False
    return True


def test_a_run_mixing_a_self_play_game_trains_both_seats_and_reports_it_per_env(tmp_path):
    run_seed = next(seed for seed in range(50) if _both_played(seed))  # both envs each step
    result = learn(load_config(None, _mix_args(tmp_path, run_seed, "--algo.advantage", "rae")),
                   LocalSource())
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    cfg = load_config(None, _mix_args(tmp_path, run_seed))
    for step, row in enumerate(rows, start=1):
        drawn = [mix_choice([1.0, 1.0], run_seed, seed)
                 for seed, _ in training_seeds(cfg, step - 1)[::2]]  # a group's env
        # a self-play group: 2 games, an episode per seat; a guess-number group: 2 episodes
        assert row["env/ttt/episodes"] == 2 * 2 * drawn.count(0)
        assert row["env/guess-number/episodes"] == 2 * drawn.count(1)
        assert row["game/opponent/self"] == row["env/ttt/episodes"]
        # per env and seat; zero-sum: the seats' rewards and RAE baselines mirror each other
        assert row["env/ttt/X/reward"] == pytest.approx(-row["env/ttt/O/reward"])
        assert 0 <= row["env/ttt/X/win"] <= 1
        assert row["rae/baseline/ttt/X"] == pytest.approx(-row["rae/baseline/ttt/O"], abs=1e-9)
        assert "rae/baseline/guess-number/" in row and "env/guess-number/X/win" not in row
    for step in (1, 2):
        episodes = read_episodes(tmp_path / "episodes" / f"step-{step:06d}.jsonl")
        games = [ep for ep in episodes if ep.env == "ttt"]
        assert {ep.info["role"] for ep in games} == {"X", "O"}
        by_game = {}
        for ep in games:
            by_game.setdefault((ep.group, ep.info["game_id"]), []).append(ep)
        assert all(sorted(ep.info["role"] for ep in seats) == ["O", "X"]
                   for seats in by_game.values())
        assert all(seats[0].reward == -seats[1].reward for seats in by_game.values())
        assert all("role" not in ep.info for ep in episodes if ep.env == "guess-number")
    # evaluated per env: the self-play entry against its fixed opponents, per role
    for when, evaluated in (("before", result.before), ("after", result.after)):
        assert set(evaluated.per_env) == {"ttt@random", "ttt@minimax", "guess-number"}
        saved = json.loads((tmp_path / f"eval_{when}.json").read_text())
        metrics = saved["env_metrics"]
        for label in ("ttt@random", "ttt@minimax"):
            assert {k.split("/")[1] for k in metrics if k.startswith(f"{label}/")} == {"X", "O"}
    evaluated = read_episodes(tmp_path / "eval_after.jsonl")
    assert {ep.info.get("opponent") for ep in evaluated} == {"random", "minimax", None}


@pytest.mark.parametrize("opponent, recorded", [("pool", {"pool-v0", "pool-v1"}),
                                                ("model", {"model:tiny"})])
def test_a_mix_entry_against_an_outside_opponent_plays_it(tmp_path, opponent, recorded):
    entries = (f"[{{name: tictactoe, options: {{opponent: {opponent}, role: both}}, label: "
               "ttt}, {name: guess-number}]")
    run_seed = next(seed for seed in range(50) if _both_played(seed))
    args = _mix_args(tmp_path, run_seed, "--env.mix", entries, "--env.opponent_model", "tiny")
    result = learn(load_config(None, args), LocalSource())
    rows = read_metrics(tmp_path / "metrics.jsonl")
    played = set()
    for step in (1, 2):
        episodes = read_episodes(tmp_path / "episodes" / f"step-{step:06d}.jsonl")
        games = [ep for ep in episodes if ep.env == "ttt"]
        assert games and all(ep.status == "done" for ep in games)  # each game had its player
        played |= {ep.info["opponent"] for ep in games}
        assert all("opponent" not in ep.info for ep in episodes if ep.env == "guess-number")
        row = rows[step - 1]
        assert sum(v for k, v in row.items() if k.startswith("game/opponent/") and
                   not k.endswith("/none")) == row["env/ttt/episodes"] == len(games)
    assert played == recorded  # the pool: version 0, then the first update's copy too
    if opponent == "pool":  # logged after each update's offer: versions 0-1, then 0-2
        assert [row["game/pool_versions"] for row in rows] == [2.0, 3.0]
    assert set(result.after.per_env) == {"ttt@random", "ttt@minimax", "guess-number"}


def test_a_mix_takes_one_kind_of_outside_opponent_and_checks_its_settings():
    def mix(*entries):
        return ["--env.name", "mix", "--env.mix", f"[{', '.join(entries)}]"]

    pool, model = ("{name: tictactoe, options: {opponent: pool}}",
                   "{name: kuhn-poker, options: {opponent: model}}")
    with pytest.raises(ConfigError, match="entries play against opponents pool and model; a "
                                          "run builds one outside opponent"):
        load_config(None, mix(pool, model, "{name: guess-number}"))
    with pytest.raises(ConfigError, match="opponent model needs env.opponent_model"):
        load_config(None, mix(model, "{name: guess-number}"))
    with pytest.raises(ConfigError, match="opponent endpoint needs env.opponent_endpoint"):
        load_config(None, mix("{name: kuhn-poker, options: {opponent: endpoint}}"))
    cfg = load_config(None, mix(pool, "{name: kuhn-poker-selfplay, options: {opponent: pool}, "
                                      "label: kp}"))
    assert cfg.env.outside_opponent() == "pool"
    assert load_config(None, mix("{name: guess-number}")).env.outside_opponent() == ""


def test_a_mix_takes_self_play_entries_in_both_modes():
    for entry in ("{name: tictactoe-selfplay}", "{name: tictactoe, options: {opponent: self}}",
                  "{name: textarena-selfplay}"):
        for mode in ("sync", "async"):  # async: the workers play each entry's seats
            cfg = load_config(None, ["--env.name", "mix", "--run.mode", mode, "--env.mix",
                                     f"[{entry}, {{name: guess-number}}]"])
            assert cfg.env.mix_plan()[0].name in entry


def test_turnrl_eval_refuses_a_mix_with_a_self_play_entry_and_names_the_fix():
    from turnrl.checkpoint_eval import refuse_mixed_self_play

    def mix(entries):
        return load_config(None, ["--env.name", "mix", "--env.mix", entries]).env.mix_plan()

    with pytest.raises(ConfigError, match=r"env.mix\[1\] \(kp\) is self-play \(or a pool\): "
                                          r"evaluate it alone with --env.name "
                                          r"kuhn-poker-selfplay --env.options.opponent random"):
        refuse_mixed_self_play(mix("[{name: guess-number}, "
                                   "{name: kuhn-poker-selfplay, label: kp}]"))
    with pytest.raises(ConfigError, match=r"env.mix\[0\] \(tictactoe\) is self-play \(or a "
                                          r"pool\): evaluate it alone with --env.name tictactoe "
                                          r"--env.options.opponent random"):
        refuse_mixed_self_play(mix("[{name: tictactoe, options: {opponent: pool}}]"))
    refuse_mixed_self_play(mix("[{name: guess-number}, {name: kuhn-poker-selfplay, label: kp, "
                               "options: {opponent: nash}}]"))  # a fixed opponent: fine
