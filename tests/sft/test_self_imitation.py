"""Filtered self-imitation (``sft.self_rounds``): the model plays, its distinct successes are
kept and trained on, round after round; a round with no success stops cleanly; a run killed
mid-round resumes bit for bit; the config checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnrl.config import ConfigError, load_config
from turnrl.demos.data import DataError
from turnrl.envs import StepResult, register_env
from turnrl.metrics import read_metrics
from turnrl.sft.self_imitation import kept_episodes, round_of, round_seeds, round_start
from turnrl.sft.train import sft
from turnrl.types import Episode, read_episodes

TESTS = Path(__file__).parents[1]
TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false", "--optim.lr", "1e-2"]


@register_env("digit-below-seed")
class DigitBelowSeed:
    """say-digit whose seeds from ``solvable`` on never succeed (a round with no success);
    with ``any_reply`` every reply to a seed below it succeeds (a round that surely finds
    some, whatever the sampler draws). With $TURNRL_TEST_DIE_AT_SEED set, reaching that seed
    SIGKILLs the process (a run killed as it starts a round)."""

    def __init__(self, solvable: int = 1_000_000, any_reply: bool = False):
        self.solvable, self.any_reply, self.seed = solvable, any_reply, 0

    async def reset(self, seed: int) -> str:
        die_at = os.environ.get("TURNRL_TEST_DIE_AT_SEED")
        if die_at is not None and seed >= int(die_at):
            os.kill(os.getpid(), signal.SIGKILL)
        self.seed = seed
        return "Say a digit."

    async def step(self, action: str) -> StepResult:
        ok = (self.any_reply or action[:1].isdigit()) and self.seed < self.solvable
        return StepResult("", float(ok), True, {"success": ok})


def _self_cfg(out, *args):
    return load_config(None, TINY + ["--run.out_dir", str(out), "--sft.self_tasks", "16",
                                     "--sft.self_samples", "8", *args])


def _episode(ids, success=True, reward=1.0, status="done"):
    return Episode("e", 0, 0, token_ids=list(ids), loss_mask=[0] + [1] * (len(ids) - 1),
                   reward=reward, success=success, status=status)


def test_kept_are_the_distinct_successes_and_rounds_split_steps_and_seeds():
    attempts = [_episode([1, 2]), _episode([1, 3], success=False, reward=0.0),
                _episode([1, 2]), _episode([1, 4]), _episode([1, 5], status="truncated"),
                _episode([1, 6], success=False, reward=0.5)]
    assert [ep.token_ids for ep in kept_episodes(attempts, 0.0)] == [[1, 2], [1, 4]]
    # with sft.min_reward the reward decides, not the env's success flag
    assert [ep.token_ids for ep in kept_episodes(attempts, 0.5)] == [[1, 2], [1, 4], [1, 6]]
    assert kept_episodes(attempts[1:2], 0.0) == []
    assert [round_start(k, 10, 3) for k in range(3)] == [0, 3, 6]
    assert [round_of(s, 10, 3) for s in range(10)] == [0] * 3 + [1] * 3 + [2] * 4
    assert round_seeds(1, 3, 2) == [(3, 0), (3, 0), (4, 1), (4, 1), (5, 2), (5, 2)]


def test_a_round_trains_on_its_successes_only_and_two_rounds_raise_held_out_success(tmp_path):
    """Round 1 keeps exactly the distinct successes of its attempts (the files hold every
    attempt; every trained sequence is one of them, none a failure), and two rounds of the
    tiny model's own successes lift its held-out success on say-digit."""
    out = tmp_path / "run"
    result = sft(_self_cfg(out, "--run.steps", "20", "--sft.self_rounds", "2",
                           "--sft.eval_env", "true", "--eval.episodes", "64",
                           "--run.sample_episodes", "8"))
    assert result.stopped_at is None and result.steps == 20
    rounds = [read_episodes(out / "rounds" / f"round-00{k}.jsonl") for k in (1, 2)]
    assert [len(r) for r in rounds] == [128, 128]
    # fresh training seeds each round, never held-out ones
    assert sorted({ep.seed for ep in rounds[0]}) == list(range(16))
    assert sorted({ep.seed for ep in rounds[1]}) == list(range(16, 32))
    records = read_metrics(out / "metrics.jsonl")
    for k, (attempts, first) in enumerate(zip(rounds, (1, 11), strict=True)):
        successes = [ep for ep in attempts if ep.success]
        distinct = {tuple(ep.token_ids) for ep in successes}
        failures = {tuple(ep.token_ids) for ep in attempts if not ep.success}
        logged = next(r for r in records if r["step"] == first)
        assert logged["self/round"] == k + 1 and logged["self/attempts"] == 128
        assert logged["self/successes"] == len(successes) > 0
        assert logged["self/conversations"] == len(distinct)
        trained = {tuple(ep.token_ids) for step in range(first, first + 10)
                   for ep in read_episodes(out / "episodes" / f"step-{step:06d}.jsonl")}
        assert trained <= distinct and not trained & failures
    rates = [r["self/success_rate"] for r in records if "self/success_rate" in r]
    assert rates[1] > rates[0]  # the second round plays the model the first one trained
    assert result.before.success_rate < 0.15
    assert result.after.success_rate > result.before.success_rate + 0.3


def test_a_round_with_no_success_stops_with_one_line_and_a_usable_checkpoint(tmp_path, capsys):
    """Round 2 of digit-below-seed (seeds 4..7, never solvable) has nothing to imitate: the
    run stops after round 1's steps with the line, a checkpoint of the model as it is, and no
    empty training; from the start (nothing ever succeeds) it stops before any step."""
    args = ["--env.name", "digit-below-seed", "--env.options",
            '{"solvable": 4, "any_reply": true}', "--sft.self_tasks", "4",
            "--sft.self_samples", "16", "--sft.self_rounds", "3", "--run.steps", "9"]
    out = tmp_path / "stops"
    result = sft(load_config(None, TINY + args + ["--run.out_dir", str(out)]))
    lines = [line for line in capsys.readouterr().out.splitlines() if "nothing to train" in line]
    assert lines == ["sft: round 2 of 3: 0 of 64 attempts succeeded on digit-below-seed: "
                     "nothing to train on; stopping the self-imitation rounds here (a model "
                     "that never succeeds has nothing to imitate: add demonstrations with "
                     "sft.data or sft.env_demos, guidance, or start from an easier task)"]
    assert result.stopped_at == result.steps == 3
    assert json.loads((out / "stopped.json").read_text()) == {"step": 3}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]

    never = tmp_path / "never"
    result = sft(load_config(None, TINY + args + ["--run.out_dir", str(never),
                                                  "--env.options", '{"solvable": 0}']))
    assert result.stopped_at == 0 and not (never / "checkpoints").exists()
    assert "round 1 of 3: 0 of 64 attempts succeeded" in capsys.readouterr().out


def test_a_warm_up_that_stops_early_hands_rl_the_model_as_it_stopped(tmp_path, capsys):
    from turnrl.launch import train

    base = TINY + ["--env.name", "digit-below-seed", "--sft.self_tasks", "4",
                   "--sft.self_samples", "16", "--sft.self_rounds", "2", "--sft.steps", "6",
                   "--sft.lr", "1e-2", "--run.steps", "1", "--eval.episodes", "4"]
    out = tmp_path / "run"
    train(load_config(None, base + ["--env.options", '{"solvable": 4, "any_reply": true}',
                                    "--run.out_dir", str(out)]))
    assert "RL starts from its step-3 checkpoint" in capsys.readouterr().out
    saved = (out / "config.yaml").read_text()
    assert str(out / "sft" / "checkpoints" / "step-000003") in saved
    assert (out / "checkpoints" / "step-000001").is_dir()
    # resumed: the stopped warm-up is not run again, RL goes on from its checkpoint
    train(load_config(str(out / "config.yaml"), ["--run.steps", "2"]), resume=True)
    assert (out / "checkpoints" / "step-000002").is_dir()
    assert [r["step"] for r in read_metrics(out / "sft" / "metrics.jsonl")] == [1, 2, 3]

    never = tmp_path / "never"
    train(load_config(None, base + ["--env.options", '{"solvable": 0}', "--run.out_dir",
                                    str(never)]))
    assert "RL starts from the model given" in capsys.readouterr().out
    assert "name: tiny" in (never / "config.yaml").read_text()


def _cli(*args):
    return [sys.executable, "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import tests.conftest, tests.sft.test_self_imitation; "
            "from turnrl.cli import main; sys.exit(main(sys.argv[2:]))",
            str(TESTS.parent), "sft", *TINY, *args]


def test_a_run_killed_mid_round_resumes_bit_for_bit(tmp_path):
    """Killed as round 3 starts (its first seed SIGKILLs the process), the last checkpoint is
    step 6, in the middle of round 2 (steps 4-7): the resumed run reads round 2's attempts
    back, plays round 3 and ends with the weights, moments and losses of a run never killed."""
    from safetensors.torch import load_file

    args = ["--env.name", "digit-below-seed", "--env.options", '{"any_reply": true}',
            "--sft.self_rounds", "3", "--sft.self_tasks",
            "4", "--sft.self_samples", "8", "--run.steps", "12", "--run.checkpoint_every",
            "3", "--sft.batch_size", "4"]
    out, straight = tmp_path / "cut", tmp_path / "straight"
    killed = subprocess.run(_cli(*args, "--run.out_dir", str(out)), capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "TURNRL_TEST_DIE_AT_SEED": "8"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003",
                                                                       "step-000006"]
    done = subprocess.run(_cli(*args, "--run.out_dir", str(out), "--resume"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "from step 6" in done.stdout and "round 3 of 3" in done.stdout
    assert "round 2 of 3" in done.stdout  # read back from rounds/round-002.jsonl, not replayed
    sft(load_config(None, TINY + args + ["--run.out_dir", str(straight)]))
    last = "checkpoints/step-000012"
    a, b = (load_file(d / last / "model.safetensors") for d in (out, straight))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    moments = [torch.load(d / last / "optimizer.pt", weights_only=False)["state"]
               for d in (out, straight)]
    assert all(torch.equal(x[k], y[k]) for x, y in [(moments[0][i], moments[1][i])
                                                    for i in moments[0]] for k in x)
    logged = [[{k: v for k, v in r.items() if not k.startswith("time")}
               for r in read_metrics(d / "metrics.jsonl")] for d in (out, straight)]
    assert logged[0] == logged[1] and len(logged[0]) == 12
    for k in (1, 2, 3):
        name = f"rounds/round-00{k}.jsonl"
        assert (out / name).read_text() == (straight / name).read_text()


@pytest.mark.parametrize("args, error, message", [
    (["--sft.self_samples", "0"], ConfigError, "sft.self_samples must be"),
    (["--sft.self_tasks", "0"], ConfigError, "sft.self_tasks must be"),
    (["--sft.self_rounds", "-1"], ConfigError, "sft.self_rounds must be"),
    (["--sft.self_rounds", "3", "--sft.self_tasks", "40", "--eval.seed_offset", "100"],
     ConfigError, r"3 x sft.self_tasks 40 = 120 training seeds reach the held-out ones"),
    (["--sft.self_rounds", "5", "--run.steps", "4"], DataError,
     "sft.self_rounds 5 is more than the 4 steps of the run"),
])
def test_bad_self_imitation_options_are_one_line_errors(tmp_path, args, error, message):
    with pytest.raises(error, match=message):
        sft(load_config(None, TINY + ["--run.out_dir", str(tmp_path / "r"), *args]))
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_turnrl_train_refuses_rounds_without_warm_up_steps_or_with_too_few(tmp_path):
    from turnrl.launch import train

    args = TINY + ["--run.out_dir", str(tmp_path / "r"), "--sft.self_rounds", "2"]
    with pytest.raises(ConfigError, match="give it steps with --sft.steps N"):
        train(load_config(None, args))
    with pytest.raises(DataError, match="more than the 1 steps of the warm-up"):
        train(load_config(None, args + ["--sft.steps", "1"]))
