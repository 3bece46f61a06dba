"""Async parity of the env plan and the temperature schedule (distributed/plan.py): the
learner decides each group's temperature, mix entry and curriculum level when it issues it;
the workers play exactly that; metrics, labels and resume as the sync trainer has them
(tests/trainer/test_curriculum.py, tests/selfplay/test_mix.py, tests/algorithms)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import groups_within, local_ray
from turnrl.config import load_config
from turnrl.distributed.book import GroupPlan
from turnrl.distributed.plan import GroupPlanner
from turnrl.envs import StepResult, register_env
from turnrl.envs.mix import mix_choice
from turnrl.metrics import read_metrics
from turnrl.rollout.loop import Group
from turnrl.types import Episode, read_episodes

TINY = ["--model.name", "tiny", "--rollout.max_new_tokens", "2", "--rollout.max_turns", "1",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.progress", "false",
        "--run.tensorboard", "false", "--run.mode", "async", "--ray.num_workers", "1",
        "--optim.lr", "1e-3", "--eval.episodes", "0"]


class Fixed:
    """One turn; whatever the reply, solved iff ``solved``."""

    cooperative = True

    def __init__(self, solved: bool):
        self.solved = solved

    async def reset(self, seed: int) -> str:
        return "Say anything."

    async def step(self, action: str) -> StepResult:
        return StepResult("", float(self.solved), True, {"success": self.solved})


@register_env("plan-knob")
def knob(difficulty: int = 0) -> Fixed:
    """Solved at difficulty 0 and 1, never at 2."""
    return Fixed(difficulty < 2)


@register_env("plan-always")
def always() -> Fixed:
    return Fixed(True)


@register_env("plan-never")
def never() -> Fixed:
    return Fixed(False)


MIX = TINY + ["--env.name", "mix", "--env.mix",
              "[{name: plan-always, weight: 3}, {name: plan-never, weight: 1}]"]
KNOB = TINY + ["--env.name", "plan-knob", "--env.curriculum.option", "difficulty",
               "--env.curriculum.levels", "[0, 1, 2]", "--env.curriculum.window", "1"]


def _group(assignment: int, seed: int, successes: list[bool]) -> Group:
    return Group(assignment, seed, [Episode(env="x", seed=seed, group=assignment,
                                            reward=float(s), success=s) for s in successes])


# ---- the learner's decisions (no Ray) --------------------------------------------------------

def test_the_plan_carries_the_step_temperature_the_mix_draw_and_the_current_level():
    step = {"now": 0.9}
    cfg = load_config(None, MIX + ["--explore.temperature_schedule", "linear",
                                   "--explore.temperature_end", "0.5"])
    planner = GroupPlanner(cfg, lambda: step["now"])
    draws = [planner.plan(seed) for seed in range(40)]
    assert [p.entry for p in draws] == [mix_choice([3.0, 1.0], cfg.run.seed, s)
                                        for s in range(40)]  # sync's draw for the seed
    assert {p.entry for p in draws} == {0, 1} and {p.level for p in draws} == {None}
    assert {p.temperature for p in draws} == {0.9}
    step["now"] = 0.7  # the learner stepped on: groups issued now sample cooler
    assert planner.plan(3).temperature == 0.7
    # no schedule: the workers keep rollout.temperature
    assert GroupPlanner(load_config(None, MIX), lambda: 0.1).plan(0).temperature is None

    # the learner names each group's env by the entry played; per-env metrics as sync's
    groups = [_group(i, s, [draws[s].entry == 0] * 2) for i, s in enumerate((0, 1, 2, 3))]
    planner.record(groups, {i: draws[s] for i, s in enumerate((0, 1, 2, 3))})
    labels = {ep.env for g in groups for ep in g.episodes}
    assert labels <= {"plan-always", "plan-never"}
    metrics = planner.step_metrics()
    for label in labels:
        assert metrics[f"env/{label}/success"] == float(label == "plan-always")
    assert sum(metrics[f"env/{label}/episodes"] for label in labels) == 8


def test_only_groups_played_at_the_current_level_count_towards_its_window():
    planner = GroupPlanner(load_config(None, KNOB), saved={"curriculum": {"level": 1,
                                                                          "window": []}})
    assert planner.plan(5) == GroupPlan(None, None, 1)  # a resumed run's level
    old, now = GroupPlan(level=0), GroupPlan(level=1)
    planner.record([_group(0, 5, [False, False]), _group(1, 6, [True, True])],
                   {0: old, 1: now})
    metrics = planner.step_metrics()
    assert metrics["curriculum/success"] == 1.0  # the level-0 group says nothing of level 1
    assert (metrics["curriculum/level"], metrics["curriculum/move"]) == (1, 1)
    assert planner.plan(7).level == 2 and planner.state_dict()["curriculum"]["level"] == 2
    planner.record([_group(2, 7, [True, True])], {2: now})  # issued before the move
    assert planner.step_metrics() == {"curriculum/level": 2.0, "curriculum/value": 2.0}


def test_a_worker_samples_each_group_at_its_temperature_on_its_entry(tiny):
    """The behaviour log-probs of each group are the sent model's at that group's planned
    temperature (not at the other group's), and each group plays the entry it names."""
    import torch

    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.trainer.step import UpdateSettings, with_proximal_logprobs
    from turnrl.types import Batch

    cfg = load_config(None, MIX + ["--rollout.max_new_tokens", "4"])
    model = tiny[0]
    worker = RolloutWorker(cfg, pool_size=8)
    try:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        worker.set_weights(0, without_tied_weights(state))
        plans = {0: GroupPlan(0.5, 0, None), 1: GroupPlan(2.0, 1, None)}
        worker.assign([(a, 100, plan) for a, plan in plans.items()])  # same seed and prompt
        groups = groups_within(worker, 60)
        while len(groups) < 2:
            groups += groups_within(worker, 60)
        for group in groups:
            plan = plans[group.assignment]
            assert all(ep.success == (plan.entry == 0) for ep in group.episodes)
            batch = Batch.from_episodes(group.episodes, torch.zeros(2),
                                        worker.engine.pad_token_id)
            mask = batch.loss_mask.bool()
            own, other = (with_proximal_logprobs(model, batch, UpdateSettings(
                cfg.algo, cfg.optim, t, 6)).prox_logprobs[mask] for t in (plan.temperature,
                                                                             2.5 - plan.temperature))
            assert torch.allclose(own, batch.old_logprobs[mask], atol=1e-4)
            assert not torch.allclose(other, batch.old_logprobs[mask], atol=1e-2)
    finally:
        worker.stop()


# ---- a real local Ray cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_cluster():
    """A local Ray cluster with this module's envs shipped by value."""
    import tests.conftest as conftest

    with local_ray(conftest, sys.modules[__name__]) as ray:
        yield ray


@pytest.mark.slow
def test_an_async_mix_under_a_temperature_schedule_logs_per_env_as_sync(plan_cluster,
                                                                        tmp_path):
    from turnrl.launch import train_async

    train_async(load_config(None, MIX + ["--run.steps", "2", "--run.out_dir", str(tmp_path),
                                         "--explore.temperature_schedule", "linear",
                                         "--explore.temperature_end", "0.5",
                                         "--run.sample_episodes", "4"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        played = {label: row.get(f"env/{label}/episodes", 0)
                  for label in ("plan-always", "plan-never")}
        assert sum(played.values()) == 4  # 2 groups of 2, each named by its entry
        if played["plan-always"]:
            assert row["env/plan-always/success"] == 1
        if played["plan-never"]:
            assert row["env/plan-never/success"] == 0
        assert row["success/rate"] == played["plan-always"] / 4
        assert 0 < row["offpolicy/ess"] <= 1 + 1e-6
    episodes = read_episodes(tmp_path / "episodes" / "step-000001.jsonl")
    assert episodes and {ep.env for ep in episodes} <= {"plan-always", "plan-never"}
    assert all(ep.success == (ep.env == "plan-always") for ep in episodes)


@pytest.mark.slow
def test_an_async_curriculum_moves_and_a_resumed_run_keeps_its_level(plan_cluster, tmp_path):
    from turnrl.launch import train_async

    def run(steps: int, resume: bool = False):
        train_async(load_config(None, KNOB + ["--run.steps", str(steps), "--run.out_dir",
                                              str(tmp_path)]), resume=resume)

    run(2)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    # step 1: every group was issued at level 0, solved (1 > 0.8 over a 1-step window): up
    assert (rows[0]["curriculum/level"], rows[0]["curriculum/move"]) == (0, 1)
    assert rows[0]["curriculum/success"] == 1
    assert rows[1]["curriculum/level"] == 1  # groups of level 0 alone, or level 1 solved
    state = json.loads(sorted(tmp_path.glob("checkpoints/step-*"))[-1].joinpath(
        "state.json").read_text())
    saved = state["curriculum"]["level"]
    assert saved == 1 + rows[1].get("curriculum/move", 0)
    run(3, resume=True)
    resumed = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert resumed["step"] == 3 and resumed["curriculum/level"] == saved
    if "curriculum/success" in resumed:  # groups played at that level: 2 is never solved
        assert resumed["curriculum/success"] == float(saved < 2)


@pytest.mark.slow
def test_an_async_mix_plays_a_self_play_entry_one_episode_per_seat(plan_cluster, tmp_path):
    """A self-play entry in an async mix: the worker's engine plays both seats of the
    entry's game; per-env and per-seat metrics as in sync mode."""
    from turnrl.launch import train_async

    train_async(load_config(None, TINY + [
        "--env.name", "mix", "--env.mix",
        "[{name: tictactoe-selfplay, label: ttt}, {name: plan-always}]",
        "--rollout.max_turns", "3", "--rollout.groups_per_step", "4", "--run.steps", "2",
        "--run.sample_episodes", "40", "--run.out_dir", str(tmp_path)]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    for row in rows:
        ttt, always = row.get("env/ttt/episodes", 0), row.get("env/plan-always/episodes", 0)
        assert ttt % 4 == 0 and always % 2 == 0  # a game gives an episode per seat
        assert ttt / 4 + always / 2 == 4  # 4 groups of 2 games
        if ttt:
            assert row["env/ttt/X/reward"] == pytest.approx(-row["env/ttt/O/reward"])
    assert any(row.get("env/ttt/episodes") for row in rows)  # the game was drawn
    episodes = [ep for step in (1, 2)
                for ep in read_episodes(tmp_path / "episodes" / f"step-{step:06d}.jsonl")]
    assert {ep.env for ep in episodes} <= {"ttt", "plan-always"}
    assert all(("role" in ep.info) == (ep.env == "ttt") for ep in episodes)
