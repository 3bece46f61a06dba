"""``rollout.branch`` (turnrl/config/branch.py): a plan from the command line, nonsense refused
in one line."""

import pytest

from turnrl.config import ConfigError, load_config
from turnrl.config.branch import BranchPlan

TREE = ["--algo.advantage", "tree_grpo"]


def test_the_plan_from_the_command_line():
    cfg = load_config(None, ["--rollout.branch.turns", "1", "--rollout.branch.k", "3", *TREE])
    assert cfg.rollout.branch_plan() == BranchPlan((1,), 3)
    cfg = load_config(None, ["--rollout.branch.turns", "[3, 1]", *TREE])
    assert cfg.rollout.branch_plan() == BranchPlan((1, 3), 2)  # k defaults to 2
    assert load_config(None, []).rollout.branch_plan() is None  # off by default


@pytest.mark.parametrize("args, message", [
    (["--rollout.branch.turns", "0"], "must be turn numbers >= 1"),
    (["--rollout.branch.turns", "[]"], "must be turn numbers >= 1"),
    (["--rollout.branch.turns", "one"], "must be turn numbers >= 1"),
    (["--rollout.branch.turns", "[1, 1]"], "names a turn twice"),
    (["--rollout.branch.turns", "8"], "leaves no turn after it"),
    (["--rollout.branch.turns", "1", "--rollout.branch.k", "1"], "k must be an int >= 2"),
    (["--rollout.branch.turns", "1", "--rollout.branch.k", "2.5"], "k must be an int >= 2"),
    (["--rollout.branch.k", "2"], "must be turn numbers"),
    (["--rollout.branch.turn", "1"], "did you mean 'turns'"),
    (["--rollout.branch.turns", "[1, 2, 3]", "--rollout.branch.k", "7"], "at most 256"),
])
def test_nonsense_is_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [*args, *TREE])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--algo.advantage", "grpo"], "needs --algo.advantage tree_grpo"),
])
def test_what_tree_rollouts_cannot_run_with_is_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--rollout.branch.turns", "1", *args])


def test_async_runs_fork_too():
    cfg = load_config(None, ["--rollout.branch.turns", "1", *TREE, "--run.mode", "async"])
    assert cfg.rollout.branch_plan().turns == (1,)
