"""Tree rollouts (turnrl/rollout/branch.py): forks share their prefix's tokens exactly, the
prefix is trained once, envs that do not replay are refused, and a tree run trains."""

import asyncio
import json
import random
from functools import partial

import pytest
import torch

from turnrl.config.branch import BranchPlan
from turnrl.envs import StepResult, make_env
from turnrl.rollout import ChatFormat, run_episodes
from turnrl.rollout.branch import NotReplayable
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.trainer.prefix import scored_in_prefix, shared_prefix_split
from turnrl.types import Batch

GUESS = partial(make_env, "guess-number", low=1, high=1000, max_turns=3)


class Recording:
    """The engine, with the prompts of every generate call kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        return self.engine.generate(prompts, params)


def play(tiny, plan, seeds=((0, 0), (1, 0), (2, 1)), make=GUESS):
    model, tok = tiny
    engine = Recording(HFEngine(model, tok.pad_token_id, seed=0))
    episodes = asyncio.run(run_episodes(make, list(seeds), engine, ChatFormat(tok),
                                        SamplingParams(max_new_tokens=4), env_name="guess",
                                        max_turns=3, branch=plan))
    return episodes, engine.calls


def test_siblings_share_the_prefix_tokens_and_only_the_first_trains_them(tiny):
    episodes, calls = play(tiny, BranchPlan((1,), 3))
    assert len(episodes) == 9  # 3 roots x 3 leaves (1..1000 is not guessed in one turn)
    for root in range(3):
        leaves = episodes[3 * root:3 * root + 3]
        tree = leaves[0].info["branch"]["tree"]
        assert [ep.info["branch"] for ep in leaves] == [
            {"root": root, "tree": tree, "path": [[1, child]]} for child in range(3)]
        fork = leaves[0].turns[1].start  # the first token of turn 2: the prefix ends here
        assert all(ep.token_ids[:fork] == leaves[0].token_ids[:fork] for ep in leaves)
        assert all(ep.turns[1].start == fork for ep in leaves)
        assert sum(leaves[0].loss_mask[:fork]) == leaves[0].turns[0].end - leaves[0].turns[0].start
        assert all(sum(ep.loss_mask[:fork]) == 0 for ep in leaves[1:])
        assert all(sum(ep.loss_mask[fork:]) > 0 for ep in leaves)
        # turn 2 of the three leaves was asked for in one generate call, with equal prompts:
        # the HF sampler prefills equal prompts of a call once (samplers/hf.py)
        prompt = leaves[0].token_ids[:fork]
        assert any(call.count(prompt) == 3 for call in calls)


def test_two_fork_levels_grow_k_squared_leaves(tiny):
    episodes, _ = play(tiny, BranchPlan((1, 2), 2), seeds=((5, 0),))
    assert [ep.info["branch"]["path"] for ep in episodes] == [
        [[1, 0], [2, 0]], [[1, 1], [2, 0]], [[1, 0], [2, 1]], [[1, 1], [2, 1]]]
    # leaves 00, 10 (turn 2's two continuations), 01, 11 (turn 3's, of 00 and of 10)
    trains = [[sum(ep.loss_mask[t.start:t.end]) > 0 for t in ep.turns] for ep in episodes]
    assert trains == [[True, True, True], [False, True, True], [False, False, True],
                      [False, False, True]]  # every turn of the tree is trained once


def test_the_update_runs_a_fork_s_prefix_once_for_all_its_leaves(tiny):
    """All k rows of a fork share one prefix in the update (trainer/prefix.py): the siblings
    cut where their own tokens begin, the first leaf joins them, its shared turn scored from
    the prefix."""
    episodes, _ = play(tiny, BranchPlan((1,), 3), seeds=((0, 0),))
    mb = Batch.from_episodes(episodes, torch.zeros(len(episodes)), 0)
    split = shared_prefix_split(mb)
    assert split is not None and split.owner.tolist() == [0, 0, 0]
    assert split.cut.tolist() == [episodes[1].turns[1].start - 1] * 3
    rows, _ = scored_in_prefix(mb, split)
    turn = episodes[0].turns[0]
    assert rows.tolist() == [0] * (turn.end - turn.start)


class Unreplayable:
    """Guess-number whose target also depends on a hidden counter: a replay differs."""

    calls = 0

    async def reset(self, seed):
        Unreplayable.calls += 1
        self.target = random.Random(seed * 100 + Unreplayable.calls).randint(1, 1000)
        return "Guess a number between 1 and 1000."

    async def step(self, action):
        return StepResult(f"Not it (the target is {self.target}).", 0.0, False, {})


def test_an_env_that_does_not_replay_is_refused(tiny):
    with pytest.raises(NotReplayable, match="deterministic given its seed and actions"):
        play(tiny, BranchPlan((1,), 2), seeds=((0, 0),), make=Unreplayable)


def test_a_tree_run_trains_end_to_end(tmp_path):
    from turnrl.cli import main

    args = ["train", "--model.name", "tiny", "--env.name", "guess-number",
            "--rollout.max_turns", "3", "--rollout.max_new_tokens", "3",
            "--rollout.group_size", "2", "--rollout.groups_per_step", "2",
            "--rollout.branch.turns", "1", "--rollout.branch.k", "2",
            "--algo.advantage", "tree_grpo", "--eval.episodes", "0", "--run.steps", "2",
            "--run.progress", "false", "--run.out_dir", str(tmp_path)]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "tree/leaves_per_root" in row]
    assert len(steps) == 2
    assert all(1 < row["tree/leaves_per_root"] <= 2 for row in steps)


def test_trees_from_two_plays_of_one_group_stay_apart(tiny):
    """Guidance's hinted attempts play a failed group's seed again in a second turn loop
    (trainer/guidance.py): their trees must not merge with the group's own, whose roots were
    numbered from 0 in the first loop too (a merged node would average both trees' returns)."""
    from turnrl.algorithms.estimators import TreeGRPO

    first, _ = play(tiny, BranchPlan((1,), 3), seeds=((0, 0),))
    again, _ = play(tiny, BranchPlan((1,), 3), seeds=((0, 0),))
    estimator = TreeGRPO()
    estimator.advantages(first + again)
    assert estimator.metrics()["tree/leaves_per_root"] == 3  # two trees of 3 leaves, not one of 6
