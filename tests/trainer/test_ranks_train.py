"""``turnrl train --learner.world_size N`` end to end (issue 52), as a user runs it: real
processes on gloo, the tiny model, sharded checkpoints, resume at another world size, a rank
killed mid-run, torchrun, and the one-line refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

WAIT_S = 900  # loose: a hang fails the test rather than the suite
TINY = ["--model.name", "tiny", "--rollout.group_size", "4", "--rollout.groups_per_step", "2",
        "--rollout.max_turns", "2", "--rollout.max_new_tokens", "6", "--run.threads", "1",
        "--run.progress", "false", "--eval.episodes", "4", "--run.checkpoint_every", "1"]


def turnrl(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turnrl", *args], capture_output=True,
                          text=True, timeout=WAIT_S, **kwargs)


def exported(tmp_path: Path, run: Path, name: str) -> dict:
    """The run's newest (sharded) checkpoint exported as ``turnrl export`` does, in this
    process: a fresh one would pay seconds of imports (the command's own tests are
    tests/test_export.py)."""
    from turnrl.export import export_model

    out = tmp_path / name
    export_model(run, out)
    return load_file(out / "model.safetensors")


def test_two_ranks_train_checkpoint_and_resume_at_one_and_at_two(tmp_path):
    run = tmp_path / "run"
    done = turnrl("train", *TINY, "--run.steps", "2", "--learner.world_size", "2",
                  "--run.out_dir", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    last = run / "checkpoints" / "step-000002"
    assert (last / ".metadata").is_file()  # a torch.distributed.checkpoint directory
    assert "before vs after" in done.stdout
    again = tmp_path / "again"  # the same 2 steps, to resume at world size 2 below
    shutil.copytree(run, again)
    saved = yaml.safe_load((again / "config.yaml").read_text())
    saved["run"]["out_dir"] = str(again)  # a resume keeps the run's directory
    (again / "config.yaml").write_text(yaml.safe_dump(saved))
    resumed = turnrl("train", "--run.out_dir", str(run), "--resume", "--run.steps", "3",
                     "--learner.world_size", "1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout
    assert (run / "checkpoints" / "step-000003").is_dir()
    # the same 3 steps at world size 2 throughout: the resharded resume continued them
    straight = tmp_path / "straight"
    done = turnrl("train", *TINY, "--run.steps", "3", "--learner.world_size", "2",
                  "--run.out_dir", str(straight))
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = exported(tmp_path, run, "a"), exported(tmp_path, straight, "b")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    # resumed at the same world size (one thread a rank): bit for bit the straight run
    resumed = turnrl("train", "--run.out_dir", str(again), "--resume", "--run.steps", "3",
                     "--learner.world_size", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    c = exported(tmp_path, again, "c")
    assert c.keys() == b.keys()
    assert all(torch.equal(c[k], b[k]) for k in b), max(
        float((c[k] - b[k]).abs().max()) for k in b)
    two = exported(tmp_path, again / "checkpoints" / "step-000002", "two")
    assert not all(torch.equal(two[k], b[k]) for k in b)  # step 3 moved the weights


def _running_past_step_1(run: Path, *options: str) -> tuple[subprocess.Popen, int]:
    """A 6-step world-size-2 fsdp run, once its first checkpoint is written (so a rank is hit
    mid-run, not at start), and the pid of its rank 1."""
    proc = subprocess.Popen([sys.executable, "-m", "turnrl", "train", *TINY, "--run.steps",
                             "6", "--learner.world_size", "2", "--learner.strategy", "fsdp",
                             "--run.out_dir", str(run), *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + WAIT_S
    while not (run / "checkpoints" / "step-000001").is_dir():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()  # a bare communicate() would wait for a hung run forever
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"no checkpoint (exit {proc.returncode}): {err[-3000:]}")
        time.sleep(0.2)
    # rank 1, by its command: the run's first child need not be it (a helper process)
    child = next(int(line.split()[0]) for line in subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True,
        text=True).stdout.splitlines() if "turnrl.trainer.ranks" in line)
    return proc, child


def test_a_killed_rank_stops_the_run_in_one_line_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    proc, child = _running_past_step_1(run)
    os.kill(child, signal.SIGKILL)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1
    line = err.strip().splitlines()[-1]
    assert "rank 1" in line and "SIGKILL" in line and "--resume" in line, err[-2000:]
    resumed = turnrl("train", "--run.out_dir", str(run), "--resume", "--learner.world_size",
                     "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run / "checkpoints" / "step-000006").is_dir()


HUNG_TIMEOUT_S = 30  # rank 1's start (imports) must fit in it on a loaded machine


def test_a_hung_rank_stops_the_run_in_one_line_within_the_timeout(tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, its sockets open, never answering) mid-run: rank 0's
    next collective gives up after learner.timeout_s and the run ends naming rank 1. Before
    the fix rank 0 hung for good, sending a step's episodes on the commands' group (which
    waits 30 days) into rank 1's full socket buffer."""
    proc, child = _running_past_step_1(tmp_path / "run", "--learner.timeout_s",
                                       str(HUNG_TIMEOUT_S))
    os.kill(child, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=HUNG_TIMEOUT_S + 120)  # loose: a loaded machine
        took = time.monotonic() - stopped
    finally:
        proc.kill()
        for sig in (signal.SIGCONT, signal.SIGKILL):  # never leave a stopped process behind
            try:
                os.kill(child, sig)
            except ProcessLookupError:
                pass
    assert proc.returncode == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert "rank 1" in line and "learner.timeout_s" in line and "--resume" in line, err[-2000:]
    assert err.strip().count("\n") == 0, err[-2000:]
    assert took < HUNG_TIMEOUT_S + 60, took
    gone = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True,
                          text=True).stdout.strip()
    assert gone in ("", "Z"), gone  # rank 0 killed its stopped child (at most a zombie)


def test_dead_ranks_names_the_cause_not_the_ranks_that_saw_it_go():
    """Of three children: one stopped (the hung rank), one that exited PEER_LOST_EXIT
    (a follower whose collective timed out on the hung one): the stopped one is named."""
    from turnrl.trainer.ranks import PEER_LOST_EXIT, dead_ranks

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    hung, saw = subprocess.Popen(sleeper), subprocess.Popen(
        [sys.executable, "-c", f"raise SystemExit({PEER_LOST_EXIT})"])
    try:
        saw.wait(timeout=60)
        assert dead_ranks([hung, saw], wait_s=1, timeout_s=7) == ""  # running: no cause yet
        os.kill(hung.pid, signal.SIGSTOP)
        time.sleep(0.2)
        named = dead_ranks([hung, saw], wait_s=1, timeout_s=7)
        assert named.startswith(f"rank 1 (pid {hung.pid}) stopped") and "rank 2" not in named
        assert "learner.timeout_s (7 s)" in named
        os.kill(hung.pid, signal.SIGKILL)
        hung.wait(timeout=60)
        assert dead_ranks([hung, saw]) == f"rank 1 (pid {hung.pid}, signal SIGKILL) died"
    finally:
        hung.kill()
        hung.wait(timeout=60)


def test_torchrun_starts_the_ranks(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.fail("torchrun is missing from the environment that has torch")
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "turnrl", "train",
                           *TINY, "--run.steps", "1", "--run.out_dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / ".metadata").is_file()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["learner"]["world_size"] == 2  # the run says how many ranks trained it


def test_torchrun_refuses_what_ranks_cannot_do_and_a_world_size_it_did_not_start(monkeypatch):
    from turnrl.config import ConfigError, load_config
    from turnrl.launch import launched_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="sft.steps does not work with learner.world_size 2"):
        launched_world_size(load_config(None, TINY + ["--sft.steps", "2"]))
    with pytest.raises(ConfigError, match="torchrun started 2 processes"):
        launched_world_size(load_config(None, TINY + ["--learner.world_size", "3"]))
    assert launched_world_size(load_config(None, TINY)).learner.world_size == 2


def test_more_ranks_than_cores_is_refused_in_one_line(tmp_path):
    too_many = (os.cpu_count() or 1) + 1
    done = turnrl("train", *TINY, "--learner.world_size", str(too_many), "--run.out_dir",
                  str(tmp_path / "run"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert f"learner.world_size {too_many}" in done.stderr and "cores" in done.stderr


def test_ray_rollout_workers_feed_rank_0_of_two_fsdp_ranks(tmp_path):
    """``--mode async``: Ray workers sample, rank 0 gathers the shards to publish to them."""
    pytest.importorskip("ray")
    run = tmp_path / "run"
    done = turnrl("train", *TINY, "--mode", "async", "--run.steps", "2", "--ray.num_workers",
                  "1", "--learner.world_size", "2", "--run.out_dir", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "checkpoints" / "step-000002" / ".metadata").is_file()
    assert "before vs after" in done.stdout


FIRST_DIGIT = '''
from turnrl.envs import StepResult, register_env


@register_env("first-digit")
class FirstDigit:
    async def reset(self, seed):
        return "Say a digit."

    async def step(self, action):
        ok = action[:1].isdigit()
        return StepResult("", float(ok), True, {"success": ok})
'''


@pytest.mark.slow
def test_a_task_learns_on_two_fsdp_ranks(tmp_path):
    """What a user runs: ``turnrl train --learner.world_size 2`` on a task of their own module;
    the held-out success rises as it does in one process (tests/trainer/test_train.py)."""
    module = tmp_path / "digits.py"
    module.write_text(FIRST_DIGIT)
    run = tmp_path / "run"
    done = turnrl("train", "--model.name", "tiny", "--env.module", f"{module}:first-digit",
                  "--rollout.max_new_tokens", "3", "--optim.lr", "2e-2", "--run.steps", "20",
                  "--optim.micro_batch_size", "32", "--eval.episodes", "64",
                  "--run.progress", "false", "--learner.world_size", "2",
                  "--run.out_dir", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = (json.loads((run / f"eval_{when}.json").read_text())["success_rate"]
                     for when in ("before", "after"))
    assert before < 0.3 and after > 0.9, (before, after)
    # the last (sharded, fsdp) checkpoint evaluated in one process reads the trained weights
    report = tmp_path / "eval.json"
    done = turnrl("eval", "--checkpoint", str(run / "checkpoints" / "step-000020"),
                  "--eval.episodes", "64", "--run.threads", "1", "--out", str(report))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "checkpoints" / "step-000020" / ".metadata").is_file()
    assert json.loads(report.read_text())["result"]["pass_at_k"]["1"]["value"] > 0.9, done.stdout


def test_a_learner_port_in_use_is_refused_in_one_line(tmp_path):
    import socket

    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        done = turnrl("train", *TINY, "--learner.world_size", "2", "--learner.port", str(port),
                      "--run.out_dir", str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0
    assert f"learner.port {port} is in use" in done.stderr


class NoLayers(torch.nn.Module):
    """A model built in code that FSDP cannot wrap layer by layer: no decoder ModuleList."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)


REFUSED = {  # options -> what the one line says (the cause, then the fix)
    "nccl-on-cpu": (["--learner.world_size", "2", "--learner.backend", "nccl",
                     "--model.device", "cpu"], "nccl needs CUDA GPUs", "--learner.backend gloo"),
    "offload-on-cpu": (["--learner.world_size", "2", "--learner.cpu_offload", "true",
                        "--model.device", "cpu"], "on the CPU already", "drop --learner.cpu_offload"),
    "unwrappable-model": (["--learner.world_size", "2"], "NoLayers has no repeated decoder layers",
                          "use --learner.strategy ddp"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_learner_input_is_one_line_before_any_rank_starts(case, tmp_path, monkeypatch,
                                                              capsys):
    """In this process (no command to launch): ``turnrl train`` refuses it with exit 2 and
    one line, and never reaches the launcher that would start ranks 1..N-1."""
    import importlib

    from turnrl import cli, models

    def started(cfg):
        raise AssertionError(f"{case}: ranks started")

    monkeypatch.setattr(importlib.import_module("turnrl.trainer.ranks"), "child_ranks", started)
    monkeypatch.setattr(models, "tiny_model", lambda *a, **k: (NoLayers(), None))
    options, cause, fix = REFUSED[case]
    code = cli.main(["train", *TINY, *options, "--run.out_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2, err[-2000:]
    assert err.count("\n") == 0 and cause in err and fix in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory, too


def test_fsdp_options_at_world_size_one_shard_over_one_rank(tmp_path):
    """``--learner.param_dtype`` (or reduce_dtype, cpu_offload) at world size 1: FSDP2's
    fully_shard on this process alone (a process group of one; trained in this process),
    its checkpoint a DCP directory; plain world size 1 stays the one-process learner."""
    from turnrl.config import load_config
    from turnrl.launch import train

    assert not load_config(None, TINY).learner.ranked()  # the default: one process, unchanged
    run = tmp_path / "run"
    cfg = load_config(None, [*TINY, "--run.steps", "1", "--eval.episodes", "0",
                             "--learner.param_dtype", "float32", "--run.out_dir", str(run)])
    assert cfg.learner.world_size == 1 and cfg.learner.ranked()
    train(cfg)
    assert (run / "checkpoints" / "step-000001" / ".metadata").is_file()


def test_without_ranks_nccl_is_not_refused_and_no_child_is_waited_for():
    """A config saved with ``learner.backend nccl`` still loads at world size 1 on a CPU (an
    evaluation or a one-process resume never joins a group); with no children there is
    nothing to wait for when a step fails."""
    from turnrl.config import load_config
    from turnrl.trainer.ranks import dead_ranks

    assert load_config(None, ["--learner.backend", "nccl"]).learner.backend == "nccl"
    started = time.monotonic()
    assert dead_ranks([], wait_s=30, timeout_s=30) == ""
    assert time.monotonic() - started < 5
