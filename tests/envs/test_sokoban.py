"""``sokoban`` (envs/sokoban.py): rooms solvable by construction, the push rules, RAGEN's text,
the solver through the turn loop, a training step on the tiny model, and RAGEN's protocol
(carved rooms, chained moves, the move budget)."""

from __future__ import annotations

import asyncio
import random

import pytest

from turnrl.envs import make_env
from turnrl.envs.reference import play
from turnrl.envs.sokoban import Sokoban, farthest_pull, parse_move, parse_moves, push, solve


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


def test_the_ragen_protocol_sets_ragens_simple_sokoban_and_given_options_win():
    env = make_env("sokoban", protocol="ragen")
    assert (env.size, env.n_boxes, env.room, env.search_depth) == (6, 1, "carved", 300)
    assert (env.max_turns, env.per_turn, env.max_actions) == (5, 5, 10)
    assert "up to 5 moves" in env.system_prompt and "||" in env.system_prompt
    mine = make_env("sokoban", protocol="ragen", max_turns=3, room="open")
    assert (mine.max_turns, mine.room, mine.per_turn) == (3, "open", 5)
    plain = make_env("sokoban")  # no protocol: one move a turn on open floor, as before
    assert (plain.size, plain.room, plain.max_turns, plain.per_turn, plain.max_actions) == (
        6, "open", 10, 1, 0)
    assert plain.system_prompt == Sokoban.system_prompt
    with pytest.raises(ValueError, match="unknown sokoban protocol"):
        make_env("sokoban", protocol="boxoban")
    with pytest.raises(ValueError, match="room open|carved"):
        make_env("sokoban", room="maze")


def test_the_farthest_pull_drags_the_box_to_the_end_of_a_corridor():
    corridor = frozenset((1, c) for c in range(1, 5))  # #____# one row
    boxes, player = farthest_pull(corridor, ((1, 1),), (1, 2), 300, random.Random(0))
    assert boxes == ((1, 3),) and player == (1, 4)  # pulled right twice: displacement 2
    boxes, player = farthest_pull(corridor, ((1, 1),), (1, 2), 1, random.Random(0))
    assert boxes == ((1, 2),) and player == (1, 3)  # one reverse move deep: one pull


def test_carved_rooms_are_seeded_walled_and_start_with_a_box_off_target():
    env = make_env("sokoban", protocol="ragen")
    shapes = set()
    for seed in range(80):
        text = asyncio.run(env.reset(seed))
        rows = text.splitlines()[:6]
        assert rows[0] == rows[-1] == "######" and all(r[0] == r[-1] == "#" for r in rows)
        assert env.boxes != env.targets and env.player not in env.boxes
        assert env.boxes <= env.floor and env.targets <= env.floor and env.player in env.floor
        assert solve(env.floor, env.targets, env.boxes, env.player) is not None
        shapes.add(env.floor)
    assert len(shapes) > 60  # a new room shape almost every seed, unlike the open rooms
    again = make_env("sokoban", protocol="ragen")
    assert asyncio.run(again.reset(11)) == asyncio.run(env.reset(11))


def test_a_turn_chains_moves_spends_blocked_ones_and_the_budget_ends_the_episode():
    env = make_env("sokoban", protocol="ragen")
    asyncio.run(env.reset(0))
    env.floor = frozenset((r, c) for r in range(1, 5) for c in range(1, 5))
    env.targets, env.boxes, env.player = frozenset({(1, 4)}), frozenset({(2, 3)}), (2, 1)
    first = asyncio.run(env.step("<think>hmm</think><answer>Left || Up || Right</answer>"))
    assert env.moves == 3 and env.player == (1, 2) and not first.done  # left was blocked
    assert "blocked" not in first.observation and "7 left in all" in first.observation
    assert parse_moves("Down || Right || Right || Up || Up || Left", 5) == [
        "down", "right", "right", "up", "up"]
    second = asyncio.run(env.step("Down || Left || Right || Left || Right || Left"))
    assert env.moves == 8 and not second.done  # five of the six, the sixth beyond the turn
    third = asyncio.run(env.step("up || up || up"))
    assert env.moves == 10 and third.done and not third.info["success"]  # out of moves
    solved = make_env("sokoban", protocol="ragen")
    asyncio.run(solved.reset(0))
    solved.floor, solved.targets = env.floor, frozenset({(2, 4)})
    solved.boxes, solved.player = frozenset({(2, 3)}), (2, 1)
    last = asyncio.run(solved.step("Right || Right || Down"))
    assert last.done and last.info["success"] and last.reward == 1.0 and solved.moves == 2


def test_the_solver_chains_its_plan_and_solves_exactly_the_rooms_within_ten_moves():
    env = make_env("sokoban", protocol="ragen")
    within, solved = 0, 0
    for seed in range(60):
        asyncio.run(env.reset(seed))
        within += len(solve(env.floor, env.targets, env.boxes, env.player)) <= 10
        _, success, _ = asyncio.run(play(env, env.reference_player(), seed))
        solved += success
    assert solved == within and 30 < within < 60  # an optimal player; some rooms need > 10
    asyncio.run(env.reset(3))
    reply = env.reference_player().act("")
    assert 1 <= len(reply.split(" || ")) <= 5 and reply.split(" || ")[0] in (
        "Up", "Down", "Left", "Right")
