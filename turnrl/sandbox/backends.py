"""The two ways the sandbox starts code: bubblewrap, and a fallback of rlimits and a supervisor.

Both run ``launcher.py`` first (limits, an unprivileged id, clean-up; see its docstring).
What each enforces is listed in ``GUARANTEES`` and docs/sandbox.md; tests/sandbox/test_sandbox.py
attacks every entry.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from turnrl.sandbox.workdir import can_mount_tmpfs

LAUNCHER = (Path(__file__).with_name("launcher.py")).read_text()

SANDBOX_DIR = "/sandbox"
"""Where the private working directory appears inside bubblewrap."""

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
"""Mounted read-only into bubblewrap (with the interpreter's prefixes): nothing else is seen."""

GUARANTEES = {
    "wall_clock": "the supervisor kills the code at the wall-clock limit",
    "cpu_time": "RLIMIT_CPU per process",
    "memory": "RLIMIT_AS per process (address space)",
    "processes": "RLIMIT_NPROC for an id used by nothing else (root) or in a user namespace",
    "file_size": "RLIMIT_FSIZE per file written",
    "output": "stdout + stderr read up to the cap, then the run is stopped",
    "environment": "a minimal environment: the trainer's variables are not passed",
    "trainer_environ": "the trainer's /proc/<pid>/environ cannot be read",
    "network": "an empty network namespace (loopback only, its own)",
    "writes": "no write outside the private directory (and a private /tmp)",
    "writes_except_world_writable": "writes only to the private directory and to world-"
                                    "writable directories (/tmp, /var/tmp, /dev/shm: swept)",
    "reads": "only the system directories and the interpreter are visible",
    "cleanup": "no process the code started is alive after run() returns",
    "workdir_removed": "the run's directory is removed whatever tree the code leaves in it "
                       "(any depth, names, modes, fifos, sockets, link loops)",
    "file_count": "the run's directory is a tmpfs of its own: its entries (nr_inodes) and "
                  "bytes are capped by the kernel during the run",
    "file_count_after_run": "the entries the code leaves in its directory are counted after "
                            "the run: over the cap fails it (files_limit), nothing stops it "
                            "during the run",
    "cleanup_unless_supervisor_killed": "clean-up by a subreaper supervisor, which code of "
                                        "the same user id could kill first",
}


def is_root() -> bool:
    return os.geteuid() == 0


def fresh_id() -> int:
    """A user/group id for one run (root only): no other process has it, so the process cap
    counts only this run's processes and one ``kill(-1)`` under it ends exactly them."""
    return 1_000_000_000 + secrets.randbelow(1_000_000_000)


@functools.cache
def bwrap_problem() -> str:
    """Why bubblewrap cannot be used here ("" when it can), probed once per process."""
    path = shutil.which("bwrap")
    if path is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    probe = [path, *_namespace_flags(), "--ro-bind", "/", "/", "--proc", "/proc", "--dev",
             "/dev", "true"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=10, env={})
    if done.returncode != 0:
        return f"bwrap cannot create namespaces here: {done.stderr.strip()[:200]}"
    return ""


@functools.cache
def unshare_network_works() -> bool:
    """Whether the fallback can leave the network (root, or unprivileged user namespaces)."""
    if is_root():
        return True
    probe = "import ctypes,os; os._exit(ctypes.CDLL(None).unshare(0x50000000) != 0)"
    return subprocess.run([sys.executable, "-I", "-c", probe], env={}, timeout=10).returncode == 0


def guarantees(backend: str) -> frozenset[str]:
    """What ``backend`` enforces on this machine, as ``GUARANTEES`` keys."""
    always = {"wall_clock", "cpu_time", "memory", "processes", "file_size", "output",
              "environment", "workdir_removed",
              "file_count" if can_mount_tmpfs() else "file_count_after_run"}
    if backend == "bwrap":
        return frozenset(always | {"trainer_environ", "network", "writes", "reads", "cleanup"})
    extra = {"network"} if unshare_network_works() else set()
    if is_root():  # the code runs under an id of its own
        extra |= {"trainer_environ", "writes_except_world_writable", "cleanup"}
    else:
        extra |= {"cleanup_unless_supervisor_killed"}
    return frozenset(always | extra)


@functools.cache
def interpreter_dirs(python: str) -> tuple[str, ...]:
    """The directories an interpreter needs (its prefix, base prefix and real location)."""
    src = ("import os,sys; print(sys.prefix); print(sys.base_prefix); "
           "print(os.path.dirname(os.path.realpath(sys.executable)))")
    done = subprocess.run([python, "-I", "-c", src], capture_output=True, text=True, timeout=30,
                          env={})
    if done.returncode != 0:
        raise ValueError(f"sandbox python '{python}' does not run: {done.stderr.strip()[:200]}")
    dirs = sorted(set(done.stdout.split()))
    return tuple(d for d in dirs if not any(d.startswith(o + "/") for o in dirs))


def reachable_by_others(path: str) -> bool:
    """Whether an unprivileged, unrelated user id can execute ``path`` (every parent
    directory searchable by others, the file readable and executable by others)."""
    real = Path(os.path.realpath(path))
    for parent in real.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(real).st_mode
    return bool(mode & stat.S_IROTH and mode & stat.S_IXOTH)


def default_python(backend: str) -> str:
    """The trainer's own interpreter, except where the fallback's unprivileged id cannot run
    it (e.g. a pyenv under /root): then the system python3."""
    if backend == "bwrap" or not is_root() or reachable_by_others(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and reachable_by_others(candidate):
            return candidate
    raise ValueError(f"the fallback sandbox runs code as an unprivileged user, who cannot run "
                     f"{sys.executable}; pass python='/path/to/python3' readable by all users")


def _namespace_flags() -> list[str]:
    flags = ["--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid",
             "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if is_root():  # no user namespace: the launcher drops to a fresh id itself
        return flags + ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return flags + ["--unshare-user"]


def bwrap_command(python: str, workdir: str, launcher_cfg: dict, tmp_mb: int) -> list[str]:
    """bwrap ... python -I -S -c LAUNCHER CONFIG: the system and interpreter read-only, the
    private directory read-write at /sandbox, a private /tmp of ``tmp_mb`` MB (RAM), /proc
    and /dev of its own, no environment."""
    cmd = [shutil.which("bwrap") or "bwrap", *_namespace_flags()]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):  # merged /usr: /bin -> usr/bin
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    # The private /tmp first: an interpreter living under /tmp (a venv there) is then bound
    # over it, not hidden by it.
    cmd += ["--size", str(tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
    made = {"/tmp"}  # exists already, as the private tmpfs (mode 1777 kept)
    for d in interpreter_dirs(python):
        if any(d == s or d.startswith(s + "/") for s in SYSTEM_DIRS):
            continue
        for parent in reversed(Path(d).parents[:-1]):  # searchable by the code's id
            if str(parent) not in made:
                cmd += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        cmd += ["--ro-bind", d, d]
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
            "--bind", workdir, SANDBOX_DIR, "--chdir", SANDBOX_DIR,
            "--proc", "/proc", "--dev", "/dev", "--clearenv"]
    return cmd + [python, "-I", "-S", "-c", LAUNCHER, json.dumps(launcher_cfg)]


def fallback_command(python: str, launcher_cfg: dict) -> list[str]:
    return [python, "-I", "-S", "-c", LAUNCHER, json.dumps(launcher_cfg)]
