"""``sokoban`` (envs/sokoban.py): rooms solvable by construction, the push rules, RAGEN's text,
the solver through the turn loop, and a training step on the tiny model."""

from __future__ import annotations

import asyncio

import pytest

from turnrl.envs import make_env
from turnrl.envs.reference import play
from turnrl.envs.sokoban import parse_move, push, solve


def test_every_room_starts_unsolved_and_is_solvable_within_its_pulls():
    env = make_env("sokoban", size=6, boxes=2, pulls=15)
    for seed in range(60):
        asyncio.run(env.reset(seed))
        assert env.boxes != env.targets and len(env.boxes) == 2
        plan = solve(env.floor, env.targets, env.boxes, env.player)
        assert plan is not None and 1 <= len(plan) <= 15
    again = make_env("sokoban", size=6, boxes=2, pulls=15)
    assert asyncio.run(again.reset(7)) == asyncio.run(env.reset(7))  # seeded


def test_pushes_stop_at_walls_and_at_a_second_box():
    floor = frozenset((r, c) for r in range(1, 4) for c in range(1, 5))
    boxes = frozenset({(2, 2)})
    assert push(floor, boxes, (2, 1), "right") == (frozenset({(2, 3)}), (2, 2))
    assert push(floor, boxes, (2, 1), "left") is None  # a wall
    assert push(floor, frozenset({(2, 2), (2, 3)}), (2, 1), "right") is None  # box behind box
    assert push(floor, frozenset({(2, 4)}), (2, 3), "right") is None  # box against the wall
    assert parse_move("I will go Left.") == "left" and parse_move("hmm") is None


def test_the_room_reads_as_ragen_renders_it_and_a_bad_reply_wastes_a_turn():
    env = make_env("sokoban", size=5, boxes=1, pulls=10, max_turns=3)
    text = asyncio.run(env.reset(0))
    grid = text.splitlines()[:5]
    assert grid[0] == "#####" and sum(row.count("P") + row.count("S") for row in grid) == 1
    assert sum(row.count("X") for row in grid) == 1
    before = (env.boxes, env.player)
    wasted = asyncio.run(env.step("no idea"))
    assert (env.boxes, env.player) == before and "Name one move" in wasted.observation
    assert not wasted.done and wasted.reward == 0.0
    asyncio.run(env.step("stay"))
    assert asyncio.run(env.step("stay")).done  # out of turns


def test_the_solver_solves_every_seed_through_the_env():
    env = make_env("sokoban", size=6, boxes=1, pulls=20, max_turns=20)
    results = [asyncio.run(play(env, env.reference_player(), seed)) for seed in range(40)]
    assert all(success for _, success, _ in results)
    assert all(reward == 1.0 for reward, _, _ in results)


@pytest.mark.slow
def test_the_tiny_model_trains_a_step_and_the_env_is_listed(tmp_path, capsys):
    from turnrl.cli import main

    assert main(["train", "--model.name", "tiny", "--env.name", "sokoban", "--run.steps", "1",
                 "--rollout.group_size", "2", "--rollout.groups_per_step", "2",
                 "--rollout.max_new_tokens", "3", "--eval.episodes", "2",
                 "--run.progress", "false", "--run.out_dir", str(tmp_path / "run")]) == 0
    assert main(["envs"]) == 0
    assert "sokoban" in capsys.readouterr().out
