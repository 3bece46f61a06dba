"""What environments leave behind never keeps ``turnrl`` running, and is named.

Env code is user code: it may start a thread without ``daemon=True`` (Python then waits for
it at exit, forever if it loops or waits on an event nobody sets), spawn a child process
and never reap it (whoever reads ``turnrl``'s output through a pipe then waits for that
child too, since it holds the pipe), or open files and never close them. At the end of a
``turnrl train`` or ``turnrl eval`` process (``turnrl.cli``) this module:

- stops child processes started during the run that are still running (SIGTERM, then
  SIGKILL after ``CHILD_GRACE_S``), with a warning naming them and the env;
- warns about regular files opened during the run and still open;
- lets Python exit as usual, watched: if exit has not finished ``EXIT_GRACE_S`` later and
  non-daemon threads are what it waits for, it warns with their names and the env's, and
  ends the process with the run's exit code (``os._exit``, output flushed first). Threads
  that end by themselves, and the framework's idle worker threads, exit in time and are
  not reported.

Work still running on a daemon thread when Python exits (an env call that overran its
timeout and was abandoned: a model user still generating) is waited for at the exit, after
the exit handlers the run registers (``end_busy_work_at_exit``): Python 3.11-3.13 end a daemon thread
that wakes during finalization with ``pthread_exit``, which inside torch's C++ frames aborts
the process (SIGABRT, exit 134, "terminate called without an active exception") after a run
that went well. Still running ``EXIT_GRACE_S`` later (a script's: ``BUSY_GRACE_S``, since
Python does not tell exit handlers a script's exit code, and ending it then exits with 1), it
is named and the process ends with the command's exit code.

A script's run (``turnrl.launch.train(cfg)``, ``turnrl.cli.main(["train" | "eval", ...])``:
``watched_run``) gets the same at the end of each run: child processes started during it are
stopped and named, files it opened and left open named; and the non-daemon threads it
started and left running are watched at the script's exit: once the main thread has ended
and only such threads keep the process for ``EXIT_GRACE_S``, they are named and Python's
exit stops waiting for them (``let_go``), so the script exits with its own exit code, its
``atexit`` handlers run. Threads the script starts itself, outside a run, are waited for as
Python always does.

The env is named by the names the turn loops of this process played (``ENVS_PLAYED``): a
leftover cannot be traced to the code that made it, only to the run. Child processes and
open files are found through ``/proc`` (Linux); elsewhere only the threads are watched.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

EXIT_GRACE_S = 3.0
"""How long Python's own exit may wait on non-daemon threads before ``os._exit``."""
BUSY_GRACE_S = 30.0
"""How long a script's exit waits for ``busy`` work on daemon threads before ``os._exit(1)``
(a command's waits ``EXIT_GRACE_S``, then ends with its own exit code)."""
CHILD_GRACE_S = 2.0
"""How long a leftover child process gets to end after SIGTERM before SIGKILL."""
FRAMEWORK_CHILDREN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                      "raylet", "gcs_server", "ray::", "ray/_private")
"""Command-line marks of child processes that runtimes the framework uses start and stop."""

FRAMEWORK_FILES = ("/ray/session_", "/wandb/")
"""Path marks of files that runtimes the framework uses keep open to the end (Ray's driver
logs, Weights & Biases)."""

CLOSE_AT_END: list = []
"""Closers of what the framework itself keeps running for envs (shared MCP servers): run
before leftover child processes are looked for, so those are not reported as the env's."""

ENVS_PLAYED: set[str] = set()
"""Names of the envs the turn loops of this process played (``TurnLoop`` adds them)."""


@dataclass
class Snapshot:
    """What the process had when the command started."""

    children: set[int] = field(default_factory=set)
    files: set[str] = field(default_factory=set)
    threads: set[threading.Thread] = field(default_factory=set)


def snapshot() -> Snapshot:
    return Snapshot(set(child_processes()), set(open_files().values()),
                    set(threading.enumerate()))


def envs_text() -> str:
    names = sorted(ENVS_PLAYED)
    if not names:
        return "no env played"
    return ("env " if len(names) == 1 else "envs ") + ", ".join(repr(n) for n in names)


def warn(message: str) -> None:
    print(f"turnrl: warning: {message}", file=sys.stderr, flush=True)


# ---- child processes -------------------------------------------------------------------------


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc (empty where there is none)."""
    parents = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses: fields follow the last ')'.
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # a zombie has ended; reaping it is its parent's business
            parents[int(entry)] = int(fields[1])
    return parents


def child_processes() -> list[int]:
    """Live descendants of this process (children, their children, ...)."""
    parents, found, frontier = _parents(), [], [os.getpid()]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, ppid in parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "?"


def stop_children(before: Snapshot) -> list[str]:
    """Stop descendants started since ``before`` (the framework's runtimes aside); return
    their command lines."""
    left = {pid: _command_line(pid) for pid in child_processes() if pid not in before.children}
    left = {pid: cmd for pid, cmd in left.items()
            if not any(mark in cmd for mark in FRAMEWORK_CHILDREN)}
    _signal(left, signal.SIGTERM)
    deadline = time.monotonic() + CHILD_GRACE_S
    while left and time.monotonic() < deadline:
        _reap()
        alive = set(child_processes())
        if not alive & set(left):
            break
        time.sleep(0.05)
    _signal({pid: cmd for pid, cmd in left.items() if pid in set(child_processes())},
            signal.SIGKILL)
    _reap()
    return [f"{cmd[:80]} (pid {pid})" for pid, cmd in left.items()]


def _signal(pids: dict[int, str], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # ended meanwhile
            pass


def _reap() -> None:
    """Collect ended children of this process, so they do not stay as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ---- open files ---------------------------------------------------------------------------


def open_files() -> dict[int, str]:
    """Descriptor -> path of the regular files this process has open (Linux)."""
    files = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for fd in fds:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if stat.S_ISREG(os.fstat(int(fd)).st_mode):
                files[int(fd)] = path
        except (OSError, ValueError):
            continue
    return files


def new_files(before: Snapshot) -> list[str]:
    """Regular files opened since ``before`` and still open (Python's own imports aside)."""
    return sorted({path for path in open_files().values()
                   if path not in before.files and not path.endswith((".py", ".pyc", ".so"))
                   and not any(mark in path for mark in FRAMEWORK_FILES)})


# ---- threads ------------------------------------------------------------------------------


def blocking_threads() -> list[threading.Thread]:
    """Non-daemon threads other than the main one: Python's exit waits for each."""
    main = threading.main_thread()
    return [t for t in threading.enumerate()
            if t is not main and not t.daemon and t.is_alive()]


def describe(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    where = getattr(target, "__qualname__", None) or type(thread).__qualname__
    return f"{thread.name} (running {where})"


def watch_exit(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Let the process exit normally; if after ``grace_s`` it still waits on non-daemon
    threads, name them and the env, and end it with ``code`` (``os._exit``)."""

    def watchdog() -> None:
        time.sleep(grace_s)
        while True:
            stuck = blocking_threads()
            if stuck:
                _name_and_exit(stuck, code)
            time.sleep(0.5)  # in atexit handlers (threads all ended): let them finish

    threading.Thread(target=watchdog, name="turnrl-exit-watchdog", daemon=True).start()


def _name(stuck: list[threading.Thread]) -> None:
    warn(f"{envs_text()} left {len(stuck)} non-daemon thread(s) running after the run: "
         f"{', '.join(describe(t) for t in stuck)}; exiting without waiting for them (start "
         "env threads with daemon=True, or stop them when the episode ends)")


def _name_and_exit(stuck: list[threading.Thread], code: int) -> None:
    _name(stuck)
    _exit(code)


def _exit(code: int) -> None:
    """Flush the output and end the process now."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    os._exit(code)


def settle(before: Snapshot, code: int) -> None:
    """At the end of a command: stop and name leftover child processes, name leftover open
    files, and watch the exit (``watch_exit``)."""
    COMMAND_CODE[:] = [code]
    try:
        stop_and_name(before)
    finally:
        watch_exit(code)


def stop_and_name(before: Snapshot) -> None:
    """Close what the framework keeps for envs, stop and name the child processes started
    since ``before``, name the files opened since and still open."""
    for close in CLOSE_AT_END:
        try:
            close()
        except Exception as err:  # noqa: BLE001 - the check below still runs
            warn(f"closing {getattr(close, '__name__', close)} failed: {err}")
    if children := stop_children(before):
        warn(f"{envs_text()} left {len(children)} child process(es) running after the "
             f"run: {'; '.join(children)}; stopped them (wait for or kill the processes "
             "an env starts before its episode ends)")
    if files := new_files(before):
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5
                                        else "")
        warn(f"{envs_text()} left {len(files)} file(s) open after the run: {shown} "
             "(close what an env opens, e.g. with a with-block)")


# ---- busy daemon threads ----------------------------------------------------------------

BUSY: dict[int, str] = {}
"""What runs now on daemon threads and may be in native code (``busy``), by a key each."""
_busy_keys = itertools.count()
_busy_lock = threading.Lock()
_busy_watched = False
COMMAND_CODE: list[int] = []
"""The exit code of the command this process runs (``settle``); empty in a script."""


@contextlib.contextmanager
def busy(what: str):
    """Mark the work inside as running on a daemon thread (``what`` names it, e.g. "env
    'x' step"): the process's exit waits for it (``end_busy_work_at_exit``)."""
    key = next(_busy_keys)
    with _busy_lock:
        BUSY[key] = what
    try:
        yield
    finally:
        with _busy_lock:
            BUSY.pop(key, None)


def end_busy_work_at_exit() -> None:
    """Have the exit wait for ``busy`` work (once a process): call before the run starts, so
    that this exit handler runs after those the run registers (Ray's, trackers')."""
    global _busy_watched
    if not _busy_watched:
        _busy_watched = True
        atexit.register(_wait_for_busy_work)


def _wait_for_busy_work() -> None:
    """The exit handler: wait for ``busy`` work, saying so; past the grace, name what still
    runs and end the process (``os._exit``, output flushed)."""
    if not BUSY:
        return
    grace_s = EXIT_GRACE_S if COMMAND_CODE else BUSY_GRACE_S
    with _busy_lock:
        running = ", ".join(sorted(set(BUSY.values())))
    warn(f"{running} still runs on a daemon thread (an env call past its timeout is left "
         f"running; so is a conversion under way): the exit waits up to {grace_s:.0f} s for "
         "it, since Python would abort the process stopping it inside native code")
    deadline = time.monotonic() + grace_s
    while BUSY and time.monotonic() < deadline:
        time.sleep(0.05)
    if BUSY:
        code = COMMAND_CODE[0] if COMMAND_CODE else 1
        warn(f"{running} still runs after {grace_s:.0f} s; ending the process with exit code "
             f"{code} without waiting for it")
        _exit(code)


# ---- a script's runs --------------------------------------------------------------------------

WATCHING = False
"""True while a run or the command is watched: a run inside it is not watched again."""
RUN_THREADS: weakref.WeakSet = weakref.WeakSet()
"""Non-daemon threads the script's runs started and left running (``watched_run``)."""
_script_watch: threading.Thread | None = None
_exiting = threading.Event()
"""Set as Python's exit starts, before it joins threads (``concurrent.futures`` pools too)."""


def watched_run(run: Callable[[], object]) -> object:
    """``run()`` from a script, its leftovers dealt with at its end (module docstring); inside
    the command or another watched run, just ``run()``."""
    global WATCHING
    if WATCHING:
        return run()
    WATCHING, before = True, snapshot()
    end_busy_work_at_exit()
    try:
        return run()
    finally:
        WATCHING = False
        try:
            stop_and_name(before)
        finally:
            RUN_THREADS.update(t for t in blocking_threads() if t not in before.threads)
            _watch_script_exit()


def _watch_script_exit() -> None:
    """Start (once) the daemon thread that watches the script's exit for ``RUN_THREADS``."""
    global _script_watch
    if _script_watch is None or not _script_watch.is_alive():
        # Private, but the hook concurrent.futures itself uses (CPython 3.9+); registered
        # after it, so it runs first: the watch starts even if a pool's join then blocks.
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            threading.Thread(target=lambda: (threading.main_thread().join(), _exiting.set()),
                             daemon=True, name="turnrl-exit-wait").start()
        else:
            register(_exiting.set)
        _script_watch = threading.Thread(target=_script_exit_watchdog, daemon=True,
                                         name="turnrl-exit-watchdog")
        _script_watch.start()


def _script_exit_watchdog(grace_s: float = EXIT_GRACE_S) -> None:
    """After the main thread ends: once only run-started threads have kept the process for
    ``grace_s``, name them and ``let_go`` of them."""
    _exiting.wait()
    since = None
    while stuck := blocking_threads():
        if not all(t in RUN_THREADS for t in stuck):
            since = None  # the script's own threads: Python waits for them, and so do we
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since >= grace_s:
            _name(stuck)
            if not let_go(stuck):  # a Python whose exit let_go cannot reach
                _exit(1)
            return
        time.sleep(0.1)


def let_go(threads: list[threading.Thread]) -> bool:
    """Make Python's exit stop waiting for ``threads``, as for daemon threads (it waits on
    each one's state lock, CPython 3.11-3.12, or handle, 3.13+); they are then stopped with
    the interpreter. False if this Python has neither."""
    for thread in threads:
        try:
            if hasattr(thread, "_tstate_lock"):
                if (lock := thread._tstate_lock) is not None:  # None: it has ended
                    lock.release()
            elif hasattr(getattr(thread, "_handle", None), "_set_done"):
                thread._handle._set_done()
            else:
                return False
        except RuntimeError:  # ended meanwhile (an unlocked lock)
            pass
    return True
