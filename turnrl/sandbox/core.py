"""Run untrusted Python (model-written code) under stated limits: ``Sandbox.run(code)``.

One run = a private temporary directory (a capped tmpfs where the trainer may mount one;
removed afterwards whatever the code left in it: ``workdir.py``), a supervisor started in a
new session with a minimal environment, the code as ``python -I -u main.py`` under
rlimits, its stdout/stderr read up to a cap. Everything the run ends with is a
``SandboxResult``: it never raises for anything the code does.

Backends (``backend=``): "bwrap" (bubblewrap namespaces: no network, only system and
interpreter directories visible and read-only, private /tmp, own PID namespace) and
"fallback" (rlimits, a subreaper supervisor, an empty network namespace where the OS allows
it, and, when run as root, a user id of its own). "auto" takes bwrap when it works here.
``Sandbox.guarantees`` lists what the chosen backend enforces on this machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from turnrl.sandbox import backends, sweep, workdir

STATUSES = ("ok", "error", "timeout", "memory", "processes", "output_limit", "files_limit",
            "sandbox_error")

_MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Limits:
    """What one run may use. Small defaults: tool code should be quick."""

    wall_s: float = 10.0
    """wall-clock seconds before the run is killed"""
    cpu_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds)"""
    memory_mb: int = 1024
    """address space per process (RLIMIT_AS); the interpreter itself takes ~30 MB"""
    processes: int = 32
    """processes (threads, on Linux) the code may have at once (RLIMIT_NPROC)"""
    output_bytes: int = 64_000
    """stdout + stderr kept; more stops the run with status "output_limit\""""
    file_mb: int = 16
    """largest file the code may write (RLIMIT_FSIZE)"""
    open_files: int = 64
    """open file descriptors per process (RLIMIT_NOFILE)"""
    tmp_mb: int = 64
    """size of bwrap's private /tmp (in memory); the fallback's /tmp is the host's"""
    files: int = 10_000
    """files, directories, links, fifos the code may create in its directory: a tmpfs's
    inode cap where the trainer may mount (root), else counted after the run"""
    dir_mb: int = 256
    """size of the run's directory where it is a tmpfs (in memory; root only)"""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "output_bytes", "file_mb",
                     "open_files", "tmp_mb", "files", "dir_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox Limits.{name} must be > 0, got {getattr(self, name)}")

    def rlimits(self) -> dict[str, list[int]]:
        cpu = math.ceil(self.cpu_s)
        return {"RLIMIT_CPU": [cpu, cpu + 1],  # SIGXCPU first, SIGKILL a second later
                "RLIMIT_AS": [self.memory_mb << 20] * 2,
                "RLIMIT_NPROC": [self.processes] * 2,
                "RLIMIT_FSIZE": [self.file_mb << 20] * 2,
                "RLIMIT_NOFILE": [self.open_files] * 2,
                "RLIMIT_CORE": [0, 0]}


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """the code's exit status; -N when signal N ended it; None when it never ran"""
    status: str
    """one of STATUSES: ok, error, timeout, memory, processes, output_limit, files_limit,
    sandbox_error"""
    reason: str
    """one line saying why the status is not ok ("" when ok)"""
    backend: str
    wall_s: float
    cpu_s: float = 0.0
    details: dict = field(default_factory=dict)
    """what the supervisor reported (network isolation, processes killed afterwards, ...)"""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox:
    """Runs code under ``limits`` with one backend; safe to share between concurrent runs."""

    def __init__(self, backend: str = "auto", limits: Limits | None = None,
                 python: str | None = None) -> None:
        if backend not in ("auto", "bwrap", "fallback"):
            raise ValueError(f"unknown sandbox backend '{backend}'; use auto, bwrap or fallback")
        if backend == "auto":
            backend = "fallback" if backends.bwrap_problem() else "bwrap"
        elif backend == "bwrap" and (problem := backends.bwrap_problem()):
            raise RuntimeError(f"sandbox backend 'bwrap' unavailable: {problem}; "
                               f"use backend='fallback' (weaker: see docs/sandbox.md)")
        self.backend = backend
        self.limits = limits or Limits()
        self.python = python or backends.default_python(backend)
        if backend == "bwrap":
            backends.interpreter_dirs(self.python)  # fail now, with its reason, if it won't run
        elif backends.is_root() and not backends.reachable_by_others(self.python):
            raise ValueError(f"the fallback sandbox runs code as an unprivileged user, who "
                             f"cannot run {self.python}; pass a python readable by all users")
        self.guarantees = backends.guarantees(backend)

    def run_sync(self, code: str, **kwargs) -> SandboxResult:
        """``run`` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.run(code, **kwargs))

    async def run(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None,
                  limits: Limits | None = None) -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh directory holding ``files`` (relative path
        -> text); ``stdin`` is its standard input."""
        limits = limits or self.limits
        given = {"main.py": code, **(files or {})}
        given_entries = _entry_count(given)  # raises ValueError for a bad name, before any work
        run_id = backends.fresh_id() if backends.is_root() else None
        # the root fallback's code can write to world-writable directories: list them first
        before = (await asyncio.to_thread(sweep.snapshot)
                  if run_id is not None and self.backend == "fallback" else None)
        path, mounted = workdir.make(limits.files + given_entries, limits.dir_mb)
        try:
            try:
                _write_files(Path(path), given, run_id)
            except OSError as err:
                result = SandboxResult("", "", None, "sandbox_error",
                                       f"could not write the run's files: {err} (larger than "
                                       f"Limits.dir_mb={limits.dir_mb}?)", self.backend, 0.0)
            else:
                result = await self._run_in(path, stdin, limits, run_id)
        except BaseException:  # cancelled: still leave nothing behind
            _clean_up(path, mounted, run_id, before)
            raise
        # a thread: removing a large tree must not stall other runs on this event loop
        removal, swept = await asyncio.to_thread(_clean_up, path, mounted, run_id, before)
        result = _with_workdir(result, removal, given_entries, mounted, limits)
        if swept is None:
            return result
        return dataclasses.replace(result, details={**result.details, "world_writable": swept})

    async def _run_in(self, workdir: str, stdin: str, limits: Limits,
                      run_id: int | None) -> SandboxResult:
        inside = backends.SANDBOX_DIR if self.backend == "bwrap" else workdir
        env = {"PATH": _MINIMAL_PATH, "HOME": inside, "LANG": "C.UTF-8",
               "TMPDIR": "/tmp" if self.backend == "bwrap" else inside}
        status_read, status_write = os.pipe()
        cfg = {"argv": [self.python, "-I", "-u", "-B", "main.py"], "env": env, "cwd": inside,
               "rlimits": limits.rlimits(), "wall_s": limits.wall_s, "status_fd": status_write,
               "uid": run_id, "gid": run_id,
               "unshare_net": self.backend == "fallback",
               "nproc_counts_user": self.backend == "fallback" and run_id is None}
        if self.backend == "bwrap":
            cmd = backends.bwrap_command(self.python, workdir, cfg, limits.tmp_mb)
        else:
            cmd = backends.fallback_command(self.python, cfg)
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={"PATH": _MINIMAL_PATH},
                start_new_session=True, pass_fds=(status_write,))
        except OSError as err:
            os.close(status_read)
            return SandboxResult("", "", None, "sandbox_error", f"could not start: {err}",
                                 self.backend, 0.0)
        finally:
            os.close(status_write)
        try:
            out, err, stopped = await self._communicate(proc, stdin.encode(), limits, run_id)
        finally:
            report = _read_report(status_read)
        wall = time.monotonic() - start
        status, reason = _classify(proc.returncode, err, report, stopped, limits)
        stdout, stderr = (b.decode(errors="replace") for b in (out, err))
        return SandboxResult(stdout, stderr, report.get("exit_code", proc.returncode), status,
                             reason, self.backend, wall, report.get("cpu_s", 0.0), report)

    async def _communicate(self, proc, stdin: bytes, limits: Limits, run_id: int | None):
        """Feed stdin, read both streams up to the cap, wait; stop the run at the cap or
        when the supervisor itself overruns its wall-clock limit (by 2 s)."""
        kept = {"out": bytearray(), "err": bytearray()}
        over_cap = asyncio.Event()

        async def read(stream, name):
            while chunk := await stream.read(1 << 16):
                room = limits.output_bytes - len(kept["out"]) - len(kept["err"])
                kept[name] += chunk[:max(room, 0)]
                if len(chunk) > room:
                    over_cap.set()

        async def feed():
            try:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the code did not read its input

        readers = asyncio.gather(read(proc.stdout, "out"), read(proc.stderr, "err"), feed())
        finished = asyncio.ensure_future(proc.wait())
        capped = asyncio.ensure_future(over_cap.wait())
        stopped = None
        try:
            await asyncio.wait({finished, capped}, timeout=limits.wall_s + 2.0,
                               return_when=asyncio.FIRST_COMPLETED)
            if not finished.done():
                stopped = "output" if over_cap.is_set() else "supervisor_overran"
                await self._stop(proc, run_id)
            await proc.wait()
            try:  # EOF comes once every process holding the pipes is gone
                await asyncio.wait_for(readers, 1.0)
            except TimeoutError:  # a survivor holds them (the non-root fallback's gap)
                stopped = stopped or "pipes_held"
                proc._transport.close()  # stop reading; asyncio has no public close
        finally:
            capped.cancel()
            if proc.returncode is None:  # cancelled: leave nothing running
                await self._stop(proc, run_id)
        if over_cap.is_set():
            stopped = "output"
        return bytes(kept["out"]), bytes(kept["err"]), stopped

    async def _stop(self, proc, run_id: int | None) -> None:
        """Stop a run: the fallback's supervisor gets SIGTERM and cleans up; bubblewrap (or a
        supervisor that does not exit in 1 s) gets SIGKILL for its whole process group."""
        if self.backend == "fallback":
            _signal(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 1.0)
                return
            except TimeoutError:
                pass
        _signal(-proc.pid, signal.SIGKILL)  # bwrap's PID namespace dies with it
        if run_id is not None and self.backend == "fallback":
            _kill_all_of(run_id, self.python)
        await proc.wait()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig) if pid > 0 else os.killpg(-pid, sig)
    except ProcessLookupError:
        pass


def _kill_all_of(uid: int, python: str) -> None:
    """kill(-1) under the run's own id: every process with that id, wherever it went."""
    subprocess.run([python, "-I", "-c", "import os; os.kill(-1, 9)"], user=uid, group=uid,
                   extra_groups=[], env={}, timeout=10)


def _entry_count(files: dict[str, str]) -> int:
    """Entries ``files`` make in the run's directory (files and their parent directories);
    a name that is not a relative path inside it is a ValueError."""
    entries = set()
    for name in files:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"sandbox file name '{name}' must be a relative path inside the "
                             f"run's directory (no '..', not absolute)")
        entries |= {rel, *list(rel.parents)[:-1]}
    return len(entries)


def _with_workdir(result: SandboxResult, removal: workdir.Removal, given: int, mounted: bool,
                  limits: Limits) -> SandboxResult:
    """The result with what the code left in its directory: a run that filled its directory
    (or, where nothing capped it, left more entries than the cap) fails with "files_limit"."""
    made = removal.entries - given
    details = {**result.details, "workdir": {"path": removal.path, "entries": made,
                                             "tmpfs": mounted, "left": removal.left}}
    reason = ""
    if removal.full == "files" or (not mounted and made > limits.files):
        how = "" if mounted else f" ({made} counted after the run)"
        reason = f"file-count cap of {limits.files} reached in the run's directory{how}"
    elif removal.full == "bytes":
        reason = f"size cap of {limits.dir_mb} MB reached in the run's directory"
    if reason and result.status in ("ok", "error"):
        return dataclasses.replace(result, status="files_limit", reason=reason, details=details)
    return dataclasses.replace(result, details=details)


def _write_files(root: Path, files: dict[str, str], owner: int | None) -> None:
    os.chmod(root, 0o700)
    for name, text in files.items():
        path = root / PurePosixPath(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if owner is not None:  # the code's own id must be able to write its directory
        for path in [root, *root.rglob("*")]:
            os.chown(path, owner, owner)


def _clean_up(path: str, mounted: bool, run_id: int | None,
              before: sweep.Snapshot | None) -> tuple[workdir.Removal, dict | None]:
    """Remove the run's directory and, for the root fallback (``before`` given), what its
    code left in the world-writable directories (``sweep.py``); never raises."""
    removal = workdir.remove(path, mounted)
    if run_id is None or before is None:
        return removal, None
    try:
        removed, left = sweep.sweep(run_id, before)
    except Exception as err:  # noqa: BLE001 - the host must carry on, and say what is left
        removed, left = 0, f"{type(err).__name__}: {err}"
    return removal, {"removed": removed, "left": left}


def _read_report(fd: int) -> dict:
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 1 << 16)
    except (BlockingIOError, OSError):
        data = b""
    finally:
        os.close(fd)
    try:
        return json.loads(data.decode().splitlines()[0]) if data else {}
    except (ValueError, IndexError):
        return {}


def _last_line(text: bytes) -> str:
    lines = [line for line in text.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def _last_mention(lines: list[str], *markers: str) -> str:
    """The last line naming one of ``markers`` ("" when none does)."""
    return next((line.strip()[:300] for line in reversed(lines)
                 if any(m in line for m in markers)), "")


def _classify(returncode: int | None, stderr: bytes, report: dict, stopped: str | None,
              limits: Limits) -> tuple[str, str]:
    """(status, reason) from what the supervisor saw; first match wins."""
    last = _last_line(stderr)
    if stopped == "output":
        return "output_limit", f"output over {limits.output_bytes} bytes; the run was stopped"
    if stopped == "pipes_held":
        return "error", "a process the code started outlived it and kept its output open"
    if report.get("timed_out") or stopped == "supervisor_overran":
        return "timeout", f"wall-clock limit of {limits.wall_s:g} s reached"
    if not report:
        detail = last or f"exit code {returncode}"
        return "sandbox_error", f"the sandbox failed before reporting: {detail}"
    code = report["exit_code"]
    if code == 125 and last.startswith("turnrl-sandbox:"):
        return "sandbox_error", last
    # SIGXCPU comes from RLIMIT_CPU's soft limit, SIGKILL from its hard one (a second later);
    # rusage may read a few ticks under the limit, hence the margin
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and report["cpu_s"] >= math.ceil(
            limits.cpu_s) - 0.2):
        return "timeout", f"CPU-time limit of {math.ceil(limits.cpu_s)} s reached"
    if code == 0:
        return "ok", ""
    # Many processes may print at once (a fork bomb's children): their tracebacks interleave,
    # so look for the cause in the whole tail of stderr, not only its last line.
    tail = stderr[-8192:].decode(errors="replace").splitlines()
    if said := _last_mention(tail, "MemoryError", "Cannot allocate memory"):
        return "memory", f"memory cap of {limits.memory_mb} MB reached ({said})"
    if said := _last_mention(tail, "BlockingIOError", "Resource temporarily unavailable"):
        return "processes", f"process cap of {limits.processes} reached ({said})"
    if code < 0:
        return "error", f"killed by signal {signal.Signals(-code).name}"
    return "error", f"exit code {code}: {last}" if last else f"exit code {code}"
