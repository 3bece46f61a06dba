"""FrozenLake's options (turnrl/envs/adapters/frozen_lake.py): slippery moves as gymnasium's,
maps drawn per seed with a path, chained moves, RAGEN's text and the ``protocol ragen`` preset;
without them the game is exactly gymnasium's."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.envs.test_adapters import play
from turnrl.envs import make_env
from turnrl.envs.adapters.frozen_lake import (
    LakeSettings,
    chained_actions,
    has_path,
    ragen_text,
    random_lake,
)
from turnrl.envs.reference import play as play_reference
from turnrl.envs.reference import reference_player
from turnrl.rollout import run_sync

gymnasium = pytest.importorskip("gymnasium")


@pytest.mark.parametrize("options", [{}, {"is_slippery": False}, {"map_name": "8x8"}])
def test_the_default_game_is_gymnasiums_step_for_step(options):
    """Without the new options every observation, reward, end and success is what gymnasium's
    own env gives for the same seed and moves, rendered as before; the prompt is unchanged."""
    from turnrl.envs.adapters.gymnasium_env import plain_text

    names = ["left", "down", "right", "up"]
    moves = ["down", "right", "down", "right", "down", "right", "up", "left"] * 3
    for seed in range(12):
        env = make_env("gymnasium", game="FrozenLake-v1", **options)
        assert env.system_prompt == ("You are playing FrozenLake. @ is you, F frozen, H a hole, "
                                     "G the goal. Reply with one action: left/down/right/up.")
        assert env.max_turns == 30 and env.lake == LakeSettings()
        obs, results = play(env, seed, moves)
        gym = gymnasium.make("FrozenLake-v1", render_mode="ansi", **options)
        state, _ = gym.reset(seed=seed)
        assert obs == plain_text(gym.render()).lstrip("\n")
        for move, got in zip(moves, results, strict=False):
            state, reward, terminated, truncated, _ = gym.step(names.index(move))
            assert got.observation == plain_text(gym.render()).lstrip("\n")
            assert (got.reward, got.done) == (float(reward), bool(terminated or truncated))
            assert got.info == {"success": bool(terminated) and reward > 0,
                                "state_key": str(state)}
            assert type(got.reward) is float


def test_slippery_moves_go_the_intended_way_or_to_either_side_a_third_each():
    """On an open lake the player stands mid-map and moves up once per seed: up, left and
    right each about 1/3 (within 5 standard errors over 3000 seeds), down never."""
    lake = ["FFFFF", "FFFFF", "FFSFF", "FFFFF", "FFFFG"]
    counts = {"up": 0, "left": 0, "right": 0, "down": 0}
    where = {7: "up", 11: "left", 13: "right", 17: "down"}  # row-major cells around 12
    env = make_env("gymnasium", desc=lake, is_slippery=True)
    seeds = 3000
    for seed in range(seeds):
        play(env, seed, ["up"])
        counts[where[int(env.obs)]] += 1
    bound = 5 * math.sqrt((1 / 3) * (2 / 3) / seeds)
    for way in ("up", "left", "right"):
        assert abs(counts[way] / seeds - 1 / 3) < bound, counts
    assert counts["down"] == 0
    steady = make_env("gymnasium", desc=lake, is_slippery=False)
    play(steady, 0, ["up"])
    assert int(steady.obs) == 7  # not slippery: always the intended cell


def test_has_path_finds_a_way_round_holes_and_none_through_them():
    assert has_path(["SFH", "HFH", "HFG"])
    assert not has_path(["SFH", "HHF", "FFG"])  # G walled off by holes
    assert not has_path(["SH", "HG"])  # diagonal steps do not count


@pytest.mark.parametrize("ends", ["corners", "random"])
def test_every_drawn_map_has_a_path_and_one_start_and_goal(ends):
    holes = cells = 0
    for size in (2, 3, 4, 6, 8):
        for seed in range(300):
            rows = random_lake(size, 0.8, seed, ends)
            flat = "".join(rows)
            assert len(rows) == size and all(len(r) == size for r in rows)
            assert flat.count("S") == flat.count("G") == 1 and set(flat) <= set("SFHG")
            assert has_path(rows)
            if ends == "corners":
                assert rows[0][0] == "S" and rows[-1][-1] == "G"
            holes, cells = holes + flat.count("H"), cells + len(flat) - 2
        assert random_lake(size, 0.8, 7, ends) == random_lake(size, 0.8, 7, ends)
    assert 0.08 < holes / cells < 0.2  # p = 0.8 frozen, a little more kept by the path rule
    assert len({tuple(random_lake(4, 0.8, s, ends)) for s in range(50)}) > 40


def test_the_planner_solves_every_drawn_map_without_slipping():
    """A path exists on each seed's map, and the reference player (value iteration on that
    map's own table, not a cached one of another map) walks it."""
    options = {"size": 4, "ends": "random", "is_slippery": False}
    for seed in range(15):
        env = make_env("gymnasium", **options)
        _, success, _ = run_sync(play_reference(env, reference_player(env, "gymnasium"), seed))
        assert success, (seed, env.lake_map)


def test_on_the_ragen_protocol_the_planner_spreads_its_ten_moves_over_five_turns():
    """Two moves a turn (10 over 5), chained as RAGEN's replies are; without slipping that
    solves every map, and on slippery ice it is a guess the next turn corrects, so it
    solves some (45% of seeds 0-299 when written)."""
    solved, chains = [], []
    for slippery in (False, True):
        wins = 0
        for seed in range(40):
            env = make_env("gymnasium", protocol="ragen", is_slippery=slippery)
            transcript: list[tuple[str, str]] = []
            _, success, turns = run_sync(play_reference(env, reference_player(env, "gymnasium"),
                                                        seed, transcript))
            wins += success
            chains += [len(reply.split(" || ")) for _, reply in transcript]
            assert env.moves <= 10 and turns <= 5
        solved.append(wins)
    assert set(chains) == {1, 2} and chains.count(2) > len(chains) / 2  # 1: the goal is next
    assert solved[0] == 40 and 8 <= solved[1] <= 32, solved


def test_with_moves_uncapped_the_planner_chains_a_turns_whole_allowance():
    """``actions_per_turn`` 3, no ``max_actions``: three moves a turn (the lake's own
    planner, never one a turn until the last), so a six-move path takes two turns."""
    env = make_env("gymnasium", size=4, ends="corners", is_slippery=False, actions_per_turn=3,
                   max_turns=2)
    transcript: list[tuple[str, str]] = []
    for seed in range(10):
        transcript.clear()
        _, success, turns = run_sync(play_reference(env, reference_player(env, "gymnasium"),
                                                    seed, transcript))
        assert success and turns <= 2, (seed, env.lake_map, transcript)
        assert len(transcript[0][1].split(" || ")) == 3


def test_the_ragen_protocol_sets_what_ragen_runs():
    env = make_env("gymnasium", protocol="ragen")
    assert env.lake == LakeSettings(size=4, frozen=0.8, ends="random", actions_per_turn=5,
                                    max_actions=10, render="ragen", max_turns=5)
    assert env.make_options == {"is_slippery": True} and env.max_turns == 5
    assert env.env.unwrapped.spec.kwargs["is_slippery"] is True
    assert "Left || Up" in env.system_prompt and "slippery" in env.system_prompt
    mine = make_env("gymnasium", protocol="ragen", max_turns=3, is_slippery=False)
    assert (mine.max_turns, mine.make_options) == (3, {"is_slippery": False})  # given wins
    with pytest.raises(ValueError, match="unknown FrozenLake protocol"):
        make_env("gymnasium", protocol="raegn")
    with pytest.raises(ValueError, match="FrozenLake-v1 option"):
        make_env("gymnasium", game="Taxi-v4", protocol="ragen")
    with pytest.raises(ValueError, match="drop 'desc'"):
        make_env("gymnasium", size=4, map_name="8x8")


def test_a_ragen_episode_draws_its_map_from_the_seed_in_ragens_text():
    env = make_env("gymnasium", protocol="ragen")
    first = asyncio.run(env.reset(3))
    rows = env.lake_map.split("/")
    assert first == ragen_text(rows, int(env.obs)) and len(first.splitlines()) == 4
    assert first.count("P") == 1 and first.count("G") == 1 and set(first) <= set("P_OG\n")
    assert asyncio.run(env.reset(3)) == first
    assert {asyncio.run(env.reset(s)) for s in range(20)} != {first}
    assert ragen_text(["SH", "FG"], 1) == "_X\n_G" and ragen_text(["SH", "FG"], 3) == "_O\n_√"


def test_chained_moves_play_in_order_and_the_move_budget_ends_the_episode():
    """Not slippery on a fixed open map: five moves a turn, ten in all."""
    env = make_env("gymnasium", protocol="ragen", is_slippery=False, size=0,
                   desc=["SFFFF", "FFFFF", "FFFFF", "FFFFF", "FFFFG"])
    reply = "<think>go</think><answer>Right || right || Down || up || left</answer>"
    _, results = play(env, 0, [reply, "<answer>Left || Left</answer>", "nothing", "Down"])
    # right right down up left, then left left (held at the edge), a wasted turn, down
    assert env.moves == 8 and int(env.obs) == 5
    assert results[2].observation.startswith("Reply with one of") and not results[2].done
    _, results = play(env, 0, ["Down || Down || Down || Down || Right",
                               "Right || Right || Left || Left || Left || Left"])
    assert results[0].reward == 0.0 and not results[0].done  # at the bottom row, col 1
    assert results[1].done and env.moves == 10 and not results[1].info["success"]
    assert chained_actions("up || ?? || <b>LEFT</b>", ["left", "down", "right", "up"], 5) == [3, 0]
    assert chained_actions("<answer>up</answer> <answer>down||down</answer>",
                           ["left", "down", "right", "up"], 1) == [1]
