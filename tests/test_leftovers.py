"""What an env leaves behind never keeps ``turnrl`` running, and the warning names the env.

Each test runs the real program (``turnrl train`` or ``turnrl eval``, the tiny model), or a
script calling ``main(["train", ...])`` or ``train(cfg)`` as examples/*.py and the README do,
as a subprocess with an env from ``leaky_envs`` that leaves something behind. Before
``turnrl.leftovers``, the thread variants never exited (Python waits for non-daemon threads)
and the child variant left its sleeping process running after ``turnrl`` ended (a caller
reading the output through a pipe waited for it too); before ``leftovers.watched_run`` a
script's process never exited.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnrl.metrics import read_metrics

TESTS = Path(__file__).parent
PROGRAM = ("import sys; sys.path.insert(0, {tests!r}); import leaky_envs; "
           "from turnrl.cli import main; sys.exit(main())")
TINY = ["--model.name", "tiny", "--rollout.max_new_tokens", "3", "--run.progress", "false",
        "--run.tensorboard", "false", "--eval.episodes", "2"]
BOUND_S = 150
"""Loose: a run takes ~6 s on an idle 2-core machine, the exit watch 3 s more; a run that
hangs never ends."""


def _turnrl(command: str, env: str, out_dir: Path,
            *more: str) -> tuple[subprocess.CompletedProcess, float]:
    extra = ["--run.steps", "1", "--run.out_dir", str(out_dir)] if command == "train" else []
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", PROGRAM.format(tests=str(TESTS / "helpers")), command,
                               "--env.name", env, *TINY, *extra, *more],
                              capture_output=True, text=True, timeout=BOUND_S,
                              env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"turnrl {command} with env {env} did not exit within {BOUND_S} s")
    return done, time.monotonic() - started


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize(("command", "env", "left"), [
    ("train", "leaky-thread", "1 non-daemon thread(s) running after the run: leaky-poller"),
    ("train", "leaky-event", "1 non-daemon thread(s) running after the run: leaky-waiter"),
    ("train", "leaky-child", "1 child process(es) running after the run"),
    ("train", "leaky-file", "1 file(s) open after the run: /"),
    ("eval", "leaky-event", "1 non-daemon thread(s) running after the run: leaky-waiter"),
    ("eval", "leaky-child", "1 child process(es) running after the run"),
])
def test_turnrl_exits_and_names_the_env_whatever_it_left_behind(tmp_path, command, env, left):
    done, seconds = _turnrl(command, env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"turnrl: warning: env '{env}' left {left}" in done.stderr, done.stderr[-2000:]
    # The run's own output came out whole before the exit (a pipe buffers it).
    assert "held-out" in done.stdout, done.stdout[-2000:]
    if command == "train":
        assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    for pid in map(int, re.findall(r"\(pid (\d+)\)", done.stderr)):
        assert not _alive(pid), f"the env's child {pid} still runs"
    assert seconds < BOUND_S


@pytest.mark.slow
def test_an_env_that_leaves_nothing_gets_no_warning(tmp_path):
    done, _ = _turnrl("train", "tidy", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left" not in done.stderr and "warning" not in done.stderr, done.stderr


SCRIPT = """
import sys, threading, time
sys.path.insert(0, {tests!r})
import leaky_envs
args = {args!r}
if {entry!r} == "main":
    from turnrl.cli import main
    code = main(["train", *args])
else:
    from turnrl.config import load_config
    from turnrl.trainer import train
    train(load_config(None, args))
    code = 0
print("run returned", code, flush=True)

def finish():  # the script's own thread, longer than the exit grace: it is waited for
    time.sleep({own_s})
    print("script thread done", flush=True)

threading.Thread(target=finish, name="script-own").start()
sys.exit(7)
"""


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["main", "train"])
def test_a_script_exits_with_its_code_and_names_what_its_env_left_behind(tmp_path, entry):
    """A script running an env that leaves a polling thread, a child process and an open
    file: the child is stopped and it and the file named at the end of the run; at the
    script's exit its own thread is waited for, the env's named and not, and the exit code
    is the script's."""
    from turnrl.leftovers import EXIT_GRACE_S

    args = ["--env.name", "leaky-all", *TINY, "--run.steps", "1", "--run.out_dir",
            str(tmp_path)]
    program = SCRIPT.format(tests=str(TESTS / "helpers"), args=args, entry=entry, own_s=EXIT_GRACE_S + 2)
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              timeout=BOUND_S, env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"a script calling {entry} with env leaky-all did not exit within {BOUND_S} s")
    assert done.returncode == 7, done.stderr[-2000:]
    assert "run returned 0" in done.stdout and "script thread done" in done.stdout, done.stdout
    for left in ("1 non-daemon thread(s) running after the run: leaky-poller",
                 "1 child process(es) running after the run", "1 file(s) open after the run: /"):
        assert f"turnrl: warning: env 'leaky-all' left {left}" in done.stderr, done.stderr[-2000:]
    assert "script-own" not in done.stderr
    pids = list(map(int, re.findall(r"\(pid (\d+)\)", done.stderr)))
    assert pids and not any(map(_alive, pids)), f"the env's child {pids} still runs"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert time.monotonic() - started < BOUND_S


@pytest.mark.slow
def test_a_command_whose_env_call_still_runs_in_torch_exits_with_its_code(tmp_path):
    """An env step that overran its timeout still runs torch products when ``turnrl`` exits:
    before ``leftovers.busy``, Python stopped that daemon thread inside torch's C++ frames and
    the process aborted (exit 134, "terminate called without an active exception") after a
    run that went well. Now the exit waits ``EXIT_GRACE_S``, names the call and ends with the
    command's code."""
    done, _ = _turnrl("train", "busy-torch", tmp_path, "--rollout.env_timeout_s", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "env 'busy-torch' step still runs on a daemon thread" in done.stderr, done.stderr
    assert "env 'busy-torch' step still runs after 3 s; ending the process with exit code 0" \
        in done.stderr, done.stderr[-2000:]
    assert "held-out" in done.stdout and "terminate called" not in done.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


BUSY_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import leaky_envs
from turnrl.config import load_config
from turnrl.trainer import train
train(load_config(None, {args!r}))
print("run returned", flush=True)
sys.exit(7)
"""


@pytest.mark.slow
def test_a_script_s_exit_waits_for_an_env_call_still_running_in_torch(tmp_path):
    """As above from a script (``train(cfg)``), with a call that ends 2 s into the exit: the
    exit waits for it, and the script's own exit code stands."""
    args = ["--env.name", "busy-torch-past-exit", *TINY, "--rollout.env_timeout_s", "1",
            "--run.steps", "1", "--run.out_dir", str(tmp_path)]
    try:
        done = subprocess.run([sys.executable, "-c", BUSY_SCRIPT.format(
            tests=str(TESTS / "helpers"), args=args)], capture_output=True, text=True,
            timeout=BOUND_S, env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script did not exit within {BOUND_S} s")
    assert done.returncode == 7, done.stderr[-2000:]
    assert "run returned" in done.stdout
    assert "env 'busy-torch-past-exit' step still runs on a daemon thread" in done.stderr
    assert "still runs after" not in done.stderr, done.stderr[-2000:]


RUN_ONLY = """
import concurrent.futures, sys, threading, time
from turnrl import leftovers

def run():  # what an env might leave: a stuck pool thread, a thread waiting forever
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stuck-pool")
    pool.submit(threading.Event().wait)
    threading.Thread(target=threading.Event().wait, name="stuck-waiter").start()

leftovers.watched_run(run)

def finish():
    time.sleep({own_s})
    print("script thread done", flush=True)

threading.Thread(target=finish, name="script-own").start()
sys.exit(5)
"""


def test_a_watched_run_lets_the_script_exit_with_its_code_past_stuck_threads():
    """No model: the exit watch alone. Python's exit first joins thread pools (an atexit
    hook of concurrent.futures, before the main thread ends), then the other threads."""
    from turnrl.leftovers import EXIT_GRACE_S

    try:
        done = subprocess.run([sys.executable, "-c", RUN_ONLY.format(own_s=EXIT_GRACE_S + 1)],
                              capture_output=True, text=True, timeout=BOUND_S,
                              env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script did not exit within {BOUND_S} s")
    assert done.returncode == 5, done.stderr
    assert done.stdout == "script thread done\n"
    assert re.search(r"left 2 non-daemon thread\(s\) running after the run: (stuck-pool_0 "
                     r"\(running _worker\)|stuck-waiter \(running Event.wait\)), "
                     r"(stuck-pool_0|stuck-waiter)", done.stderr), done.stderr
    assert "script-own" not in done.stderr


def test_a_run_inside_a_watched_one_is_not_watched_again(monkeypatch):
    from turnrl import leftovers

    monkeypatch.setattr(leftovers, "WATCHING", True)  # as inside the command, or train(cfg)
    monkeypatch.setattr(leftovers, "stop_and_name", lambda before: pytest.fail("watched"))
    assert leftovers.watched_run(lambda: 3) == 3


def test_a_python_caller_of_main_keeps_its_process():
    """A command that plays no env, called from Python, returns, watching nothing."""
    import threading

    from turnrl.cli import main

    def watchdogs() -> list:  # an earlier test's watched run in this process may have one
        return [t for t in threading.enumerate() if t.name == "turnrl-exit-watchdog"]

    before = watchdogs()
    assert main(["envs"]) == 0
    assert watchdogs() == before
