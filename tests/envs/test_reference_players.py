"""The adapters' reference players solve their envs, so demonstrations (sft.env_demos) and
guidance (explore.guidance) work on reasoning-gym and the gymnasium toy-text games."""

from __future__ import annotations

import pytest

from turnrl.envs import make_env
from turnrl.envs.reference import play, reference_player
from turnrl.rollout import ChatFormat, run_sync


def _solved(name: str, options: dict, seeds) -> list[bool]:
    solved = []
    for seed in seeds:
        env = make_env(name, **options)
        _, success, _ = run_sync(play(env, reference_player(env, name), seed))
        solved.append(success)
    return solved


@pytest.mark.parametrize("task", ["basic_arithmetic", "leg_counting", "chain_sum"])
def test_the_reasoning_gym_oracle_answers_every_task(task):
    pytest.importorskip("reasoning_gym")
    assert all(_solved("reasoning-gym", {"task": task}, range(8)))


@pytest.mark.parametrize("game, options", [
    ("FrozenLake-v1", {"is_slippery": False}),
    ("FrozenLake-v1", {"is_slippery": False, "map_name": "8x8"}),
    ("Taxi-v4", {}),
    ("CliffWalking-v1", {}),
])
def test_the_planner_solves_deterministic_toy_text_games(game, options):
    pytest.importorskip("gymnasium")
    solved = _solved("gymnasium", {"game": game, **options}, range(6))
    assert all(solved), solved


def test_the_planner_on_slippery_ice_is_near_the_optimum():
    """Slippery FrozenLake 4x4 is stochastic; the optimal policy reaches the goal about 74%
    of the time with no turn limit. Measured: 28 of 40 seeds within 100 turns."""
    pytest.importorskip("gymnasium")
    planned = sum(_solved("gymnasium", {"game": "FrozenLake-v1", "max_turns": 100}, range(40)))
    assert planned >= 20


def test_toy_text_demonstrations_render_for_sft(tiny):
    pytest.importorskip("gymnasium")
    from turnrl.demos.scripted import env_demonstrations

    _, tokenizer = tiny
    demos, failed = env_demonstrations("gymnasium", {"game": "FrozenLake-v1",
                                                     "is_slippery": False}, 4,
                                       ChatFormat(tokenizer), max_turns=30)
    assert len(demos) == 4 and failed == []
    replies = [turn.action for turn in demos[0].episodes[0].turns]
    assert len(replies) >= 6 and set(replies) <= {"left", "down", "right", "up"}
