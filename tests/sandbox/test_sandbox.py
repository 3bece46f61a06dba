"""The sandbox under attack: every attack runs real code in real processes, on both backends.

An attack must be contained (checked from outside: files, processes, sockets) and scored as
a failure with its reason. A backend is tested on a guarantee only where it claims it on
this machine (``Sandbox.guarantees``); docs/sandbox.md lists the claims per backend.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from turnrl.sandbox import GUARANTEES, Limits, Sandbox, workdir
from turnrl.sandbox.backends import bwrap_problem

FAST = Limits(wall_s=2.0, cpu_s=1.0, memory_mb=512, processes=16, output_bytes=10_000,
              file_mb=1)
LOOSE = Limits(wall_s=30.0, cpu_s=10.0, memory_mb=512, processes=16, output_bytes=10_000,
               file_mb=1)
"""For tests where no limit should be reached: a Python start, a sleep or a wait inside can
take seconds beyond what the code asks on a busy machine."""


@pytest.fixture(params=["bwrap", "fallback"])
def sandbox(request) -> Sandbox:
    if request.param == "bwrap" and bwrap_problem():
        pytest.skip(f"bwrap unusable here ({bwrap_problem()}); `make setup` installs it")
    return Sandbox(request.param, FAST)


def needs(sandbox: Sandbox, guarantee: str) -> None:
    """Attack a guarantee only where the backend claims it (docs/sandbox.md says where not)."""
    if guarantee not in sandbox.guarantees:
        pytest.skip(f"{sandbox.backend} does not claim '{guarantee}' here: "
                    f"{GUARANTEES[guarantee]}")


def run(sandbox: Sandbox, code: str, **kwargs):
    return sandbox.run_sync(textwrap.dedent(code), **kwargs)


def processes_with(token: str) -> list[int]:
    """Host pids whose command line contains ``token`` (like ``ps aux | grep``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_plain_code_runs_and_says_which_backend(sandbox):
    result = run(sandbox, "import sys; print(sys.stdin.read().upper()); print(6 * 7)",
                 stdin="hi", files={"data/x.txt": "unused"})
    assert result.ok, result.reason
    assert result.stdout.split() == ["HI", "42"]
    assert result.backend == sandbox.backend and result.exit_code == 0 and result.reason == ""


def test_an_exception_is_an_error_with_its_last_line(sandbox):
    result = run(sandbox, "1 / 0")
    assert result.status == "error" and result.exit_code == 1
    assert "ZeroDivisionError: division by zero" in result.reason


def test_infinite_loop_hits_the_cpu_limit(sandbox):
    loose_wall = Limits(wall_s=30.0, cpu_s=1.0)  # a busy machine still reaches 1 CPU second
    result = sandbox.run_sync("while True: pass", limits=loose_wall)
    assert result.status == "timeout" and "CPU-time limit of 1 s" in result.reason
    # the kernel's CPU accounting is tick-grained: 0.876 s was measured at load 57
    assert 0.8 <= result.cpu_s < 2.5 and result.wall_s < 30


def test_sleeping_forever_hits_the_wall_clock_limit(sandbox):
    started = time.monotonic()
    result = run(sandbox, "import time; time.sleep(60)")
    assert result.status == "timeout" and "wall-clock limit of 2 s" in result.reason
    assert time.monotonic() - started < 30  # stopped, not left to sleep its 60 s


def test_ten_gigabytes_hit_the_memory_cap(sandbox):
    result = run(sandbox, "block = bytearray(10 * 1024**3); print('allocated')")
    assert result.status == "memory" and "memory cap of 512 MB" in result.reason
    assert "allocated" not in result.stdout


def test_fork_bomb_hits_the_process_cap_and_leaves_nothing(sandbox):
    token = uuid.uuid4().hex
    result = run(sandbox, f"""
        import os  # {token}
        while True:
            os.fork()
    """)
    assert result.status == "processes" and "process cap of 16" in result.reason
    assert processes_with(token) == []


def test_fork_bomb_that_ignores_failures_is_stopped_and_cleaned_up(sandbox):
    token = uuid.uuid4().hex
    result = run(sandbox, f"""
        import os  # {token}
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    assert result.status == "timeout"
    assert processes_with(token) == []


def test_printing_gigabytes_is_capped_quickly(sandbox):
    """Endless output is stopped at the cap, not at a limit. (Timed against a trivial run
    before: on a busy machine the two runs' times can vary more than the bound allowed,
    and 4 GB printed take about 3 s, past the 2 s limit that ended such a run anyway.)"""
    started = time.monotonic()
    result = sandbox.run_sync("chunk = 'x' * 2**20\nwhile True: print(chunk)", limits=LOOSE)
    assert result.status == "output_limit" and "output over 10000 bytes" in result.reason
    assert len(result.stdout) + len(result.stderr) == 10_000
    # a run left to print would last until a limit: 30 s, or 10 CPU-s at ~0.3 a second
    assert time.monotonic() - started < 15


def test_a_file_over_the_size_limit_cannot_be_written(sandbox):
    result = run(sandbox, "open('big', 'wb').write(b'x' * 4 * 2**20)")
    assert result.status == "error" and "File too large" in result.reason


def test_double_forked_daemon_is_dead_when_run_returns(sandbox):
    needs(sandbox, "cleanup")
    token = uuid.uuid4().hex
    # Waits until the grandchild has exec'd (a fixed 0.3 s need not be enough on a busy
    # machine), under limits that leave room for that wait.
    result = run(sandbox, f"""
        import os, sys, time
        read, write = os.pipe()
        if os.fork() == 0:
            os.setsid()  # leave the session and the process group too
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c",
                         "import time; time.sleep(60)  # {token}"])
            os.write(write, str(os.getpid()).encode())
            os._exit(0)
        os.read(read, 32)

        def exec_done():
            for p in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if "{token}" in open(f"/proc/{{p}}/cmdline").read():
                        return True
                except OSError:  # a process that ended meanwhile
                    pass
            return False

        deadline = time.monotonic() + 20
        while not exec_done() and time.monotonic() < deadline:
            time.sleep(0.05)
        print("alive" if exec_done() else "dead")
    """, limits=LOOSE)
    assert result.ok, result.reason
    assert result.stdout.strip() == "alive"  # it really outlived its parent inside
    assert processes_with(token) == []


def test_fallback_pid_of_the_daemon_is_gone(tmp_path):
    """The same with a host pid to probe (bwrap's pids are its namespace's)."""
    sandbox = Sandbox("fallback", FAST)
    if "cleanup" not in sandbox.guarantees:
        pytest.skip(GUARANTEES["cleanup_unless_supervisor_killed"])
    result = run(sandbox, """
        import os, time
        read, write = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(write, str(os.getpid()).encode())
                time.sleep(60)
            os._exit(0)
        pid = int(os.read(read, 32))
        os.kill(pid, 0)  # alive after its parent exited
        print(pid)
    """)
    assert result.ok, result.reason
    with pytest.raises(ProcessLookupError):
        os.kill(int(result.stdout), 0)


def test_no_connection_to_the_hosts_loopback(sandbox):
    needs(sandbox, "network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        result = run(sandbox, f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1)
                print("connected")
            except OSError as err:
                print("failed", type(err).__name__)
                raise
        """)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the host's listener
    assert result.status == "error" and result.stdout.startswith("failed")
    # bwrap brings its own loopback up (refused: nobody listens there); the fallback's is down
    assert "ConnectionRefusedError" in result.reason or "Network is unreachable" in result.reason


def test_no_route_to_an_external_address(sandbox):
    """Checks the routing table first, so a broken sandbox still sends nothing out."""
    needs(sandbox, "network")
    result = run(sandbox, """
        import socket, sys
        routes = open("/proc/net/route").read().splitlines()[1:]
        devices = [line.split(":")[0].strip() for line in open("/proc/net/dev")][2:]
        print("routes", len(routes), "devices", devices)
        if routes or devices != ["lo"]:
            sys.exit("a route out exists: not connecting")
        socket.create_connection(("192.0.2.1", 80), timeout=1)  # TEST-NET-1
    """)
    assert result.stdout.strip() == "routes 0 devices ['lo']"
    assert result.status == "error" and "Network is unreachable" in result.reason


def test_no_write_outside_the_private_directory(sandbox, tmp_path):
    needs(sandbox, "writes") if sandbox.backend == "bwrap" else needs(
        sandbox, "writes_except_world_writable")
    home = Path.home() / f"turnrl-sandbox-{uuid.uuid4().hex}"
    targets = [tmp_path / "escaped.txt", home]
    result = run(sandbox, f"""
        import os
        open("inside.txt", "w").write("fine")  # its own directory is writable
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, "w").write("escaped")
                print("wrote", path)
            except OSError as err:
                print("refused", type(err).__name__)
        raise SystemExit(1)
    """)
    assert "wrote" not in result.stdout and result.stdout.count("refused") == 2
    assert not any(t.exists() for t in targets)
    assert result.status == "error"


def test_world_writable_tmp_is_private_or_swept(sandbox):
    name = f"/tmp/turnrl-sandbox-{uuid.uuid4().hex}"
    result = run(sandbox, f"open('{name}', 'w').write('left behind'); print('written')")
    assert result.ok and result.stdout.strip() == "written"  # a private /tmp (bwrap) or /tmp
    assert not os.path.exists(name)  # never seen outside (bwrap), or deleted afterwards


def test_bwraps_private_tmp_is_size_capped():
    if bwrap_problem():
        pytest.skip(f"bwrap unusable here ({bwrap_problem()}); `make setup` installs it")
    sandbox = Sandbox("bwrap", Limits(wall_s=2.0, cpu_s=1.0, file_mb=64, tmp_mb=8))
    result = run(sandbox, "open('/tmp/fill', 'wb').write(b'x' * 16 * 2**20)")
    assert result.status == "error" and "No space left on device" in result.reason


def test_only_system_and_interpreter_directories_are_visible(sandbox):
    needs(sandbox, "reads")
    this_file = Path(__file__).resolve()
    result = run(sandbox, f"print(open('{this_file}').read()[:10])")
    assert result.status == "error" and "FileNotFoundError" in result.reason


def test_the_trainers_environment_variables_are_not_passed(sandbox, monkeypatch):
    monkeypatch.setenv("TURNRL_TEST_SECRET", "hunter2")
    result = run(sandbox, "import json, os; print(json.dumps(dict(os.environ)))")
    assert result.ok, result.reason
    seen = json.loads(result.stdout)
    assert "TURNRL_TEST_SECRET" not in seen and "hunter2" not in result.stdout
    assert set(seen) <= {"PATH", "HOME", "LANG", "LC_CTYPE", "TMPDIR"}


def test_the_trainers_proc_environ_cannot_be_read(sandbox):
    """A trainer *started* with a secret (so /proc/<pid>/environ holds it) runs the sandbox;
    the code reads every /proc/*/environ it can."""
    needs(sandbox, "trainer_environ")
    secret = uuid.uuid4().hex
    code = ("import os\nfor p in os.listdir('/proc'):\n    try: print(open(f'/proc/{p}/environ',"
            " 'rb').read())\n    except OSError: pass\nprint('read', os.getppid())")
    trainer = (f"from turnrl.sandbox import Sandbox; import sys\n"
               f"r = Sandbox({sandbox.backend!r}).run_sync({code!r})\n"
               f"print(r.status, r.stdout)")
    env = {**os.environ, "TURNRL_TEST_SECRET": secret,
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", trainer], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.startswith("ok ") and "read" in done.stdout, done.stderr
    assert secret not in done.stdout


def test_concurrent_runs_overlap(sandbox):
    """Four runs gathered at once sleep at the same time: each prints when its sleep began and
    ended, and run one after the other no two of those spans could overlap. Judged on the
    spans themselves, not on a wall-clock bound a busy machine can miss (nor FAST's 2 s: four
    starts at once beside a 1 s sleep left under 1 s of slack)."""
    code = "import time; a = time.time(); time.sleep(1.0); print(a, time.time())"

    async def four():
        return await asyncio.gather(*(sandbox.run(code, limits=LOOSE) for _ in range(4)))

    results = asyncio.run(four())
    assert all(r.ok for r in results), [r.stderr for r in results]
    spans = sorted(tuple(map(float, r.stdout.split())) for r in results)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans


def test_bad_arguments_fail_with_a_named_problem():
    with pytest.raises(ValueError, match="unknown sandbox backend 'docker'"):
        Sandbox("docker")
    with pytest.raises(ValueError, match="Limits.wall_s must be > 0"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="must be a relative path"):
        Sandbox("fallback", FAST).run_sync("pass", files={"../x": ""})


def test_interleaved_tracebacks_of_many_processes_still_name_the_process_cap():
    # A fork bomb's children print at once: the last line of stderr is often a fragment of
    # someone's traceback (CI saw "os.fork()"), not the BlockingIOError line.
    from turnrl.sandbox.core import Limits, _classify
    stderr = (b"Traceback (most recent call last):\n    os.fork()\n"
              b"BlockingIOError: [Errno 11] Resource temporarily unavailable\n"
              b"Traceback (most recent call last):\n  File \"main.py\", line 3, in <module>\n")
    report = {"exit_code": 1, "cpu_s": 0.1, "timed_out": False}
    status, reason = _classify(1, stderr, report, None, Limits(processes=16))
    assert status == "processes" and "BlockingIOError" in reason
    status, _ = _classify(1, b"ValueError: bad\n", report, None, Limits())
    assert status == "error"


# ---- whatever tree the code leaves, the host removes it and run() returns (issue 31) --------

TREE_ATTACKS = {
    "deep": """
        import os
        for _ in range(3000):
            os.mkdir("d"); os.chdir("d")
        print("made")
    """,
    "long_names_past_path_max": """
        import os
        for i in range(40):  # 40 x 255 chars: far past PATH_MAX (4096)
            name = str(i % 10) * 255
            os.mkdir(name); os.chdir(name)
            open("f" * 200, "w").write("x")
        print("made")
    """,
    "fifos_sockets_and_links": """
        import os, socket
        os.mkfifo("fifo")
        s = socket.socket(socket.AF_UNIX); s.bind("sock")
        os.symlink("loop_b", "loop_a"); os.symlink("loop_a", "loop_b")
        os.symlink(".", "self"); os.symlink("/", "root")
        os.mkdir("sub"); os.symlink("..", "sub/up")
        print("made")
    """,
    "closed_modes": """
        import os
        for mode in (0o000, 0o100, 0o400, 0o500, 0o200):
            d = f"closed_{mode:o}"
            os.makedirs(f"{d}/inner/deeper")
            open(f"{d}/inner/file", "w").write("x")
            os.chmod(f"{d}/inner/file", 0)
            os.chmod(f"{d}/inner", mode)
            os.chmod(d, mode)
        os.chmod(".", 0o500)  # its own directory too
        print("made")
    """,
    "wide": """
        import os
        for d in range(20):
            os.mkdir(f"d{d}")
            for f in range(100):
                open(f"d{d}/f{f}", "w").close()
        print("made")
    """,
}


# creating thousands of entries on a busy machine's disk takes CPU seconds: loose limits
TREE_LIMITS = Limits(wall_s=30.0, cpu_s=10.0, memory_mb=512, processes=16, file_mb=1)


@pytest.fixture(params=["tmpfs", "plain"])
def workdir_kind(request, monkeypatch):
    """The run's directory as a capped tmpfs (where the trainer may mount) or as a plain
    directory (where it may not): both removal paths run for every backend."""
    from turnrl.sandbox import workdir
    if request.param == "tmpfs" and not workdir.can_mount_tmpfs():
        pytest.skip("this process may not mount a tmpfs (not root)")
    if request.param == "plain":
        monkeypatch.setattr(workdir, "can_mount_tmpfs", lambda: False)
    return request.param


@pytest.mark.parametrize("attack", sorted(TREE_ATTACKS))
def test_any_tree_the_code_leaves_is_removed_and_run_returns(sandbox, workdir_kind, attack):
    result = run(sandbox, TREE_ATTACKS[attack], limits=TREE_LIMITS)
    assert result.ok, result.reason
    assert result.stdout.strip() == "made"
    where = result.details["workdir"]
    assert where["tmpfs"] == (workdir_kind == "tmpfs") and where["left"] == ""
    assert where["entries"] > 1
    assert not os.path.lexists(where["path"])


def test_a_link_out_of_the_directory_is_removed_not_followed(sandbox, workdir_kind, tmp_path):
    """A link to a host directory the code may not touch: removing the run's directory
    removes the link, never what it points to."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("kept")
    keep.chmod(0o755)
    tmp_path.chmod(0o755)
    result = run(sandbox, f"""
        import os
        os.symlink({str(keep)!r}, "host_dir")
        os.symlink({str(keep / 'precious')!r}, "host_file")
        os.mkdir("d"); os.symlink({str(keep)!r}, "d/inner_link")
        print("made")
    """)
    assert result.ok, result.reason
    assert (keep / "precious").read_text() == "kept"
    assert not os.path.lexists(result.details["workdir"]["path"])


def test_replacing_its_own_directory_with_a_link_leaves_nothing(workdir_kind, tmp_path):
    """The root fallback's code owns its directory: it may move it away and leave a link to a
    host directory in its place. The link goes, the host directory stays, the moved
    directory is swept with the rest of the run's id."""
    sandbox = Sandbox("fallback", FAST)
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("kept")
    result = run(sandbox, f"""
        import os
        here = os.getcwd()
        try:
            os.rename(here, here + "-moved")
            os.symlink({str(keep)!r}, here)
            print("replaced")
        except OSError as err:
            print("refused", err.strerror)
    """)
    assert result.ok, result.reason
    path = result.details["workdir"]["path"]
    # a tmpfs is a mount point: it cannot be renamed; a plain directory can
    assert result.stdout.split()[0] == ("refused" if workdir_kind == "tmpfs" else "replaced")
    assert (keep / "precious").read_text() == "kept"
    assert not os.path.lexists(path)
    if backends_is_root():
        assert not os.path.lexists(path + "-moved")


def backends_is_root() -> bool:
    from turnrl.sandbox.backends import is_root
    return is_root()


def test_the_file_count_cap_fails_the_run_with_its_reason(sandbox, workdir_kind):
    limits = Limits(wall_s=10.0, cpu_s=5.0, files=300)
    result = sandbox.run_sync(textwrap.dedent("""
        import os
        made = 0
        try:
            for i in range(2000):
                open(f"f{i}", "w").close(); made += 1
        except OSError as err:
            print("stopped", made, err.strerror)
        else:
            print("made", made)
    """), limits=limits)
    assert result.status == "files_limit"
    assert "file-count cap of 300 reached in the run's directory" in result.reason
    words = result.stdout.split()
    if workdir_kind == "tmpfs":  # enforced by the kernel during the run
        assert words[:2] == ["stopped", "300"] and "No space left" in result.stdout
    else:  # counted after it
        assert words == ["made", "2000"] and "2000 counted after the run" in result.reason
    assert not os.path.lexists(result.details["workdir"]["path"])


def test_the_tmpfs_directory_is_size_capped(workdir_kind):
    if workdir_kind != "tmpfs":
        pytest.skip("a plain directory has no size cap (RLIMIT_FSIZE per file only)")
    sandbox = Sandbox("fallback", Limits(wall_s=10.0, cpu_s=5.0, file_mb=8, dir_mb=4))
    result = run(sandbox, "for i in range(3): open(f'f{i}', 'wb').write(b'x' * 3 * 2**20)")
    assert result.status == "files_limit"
    assert "size cap of 4 MB reached" in result.reason


def test_removal_copes_with_closed_modes_as_an_unprivileged_user():
    """Root reads and writes any mode; an unprivileged trainer (the non-root backends) must
    reopen what the code closed. Runs ``workdir.remove`` as user 65534 on a tree it built."""
    from turnrl.sandbox import backends, workdir
    if not backends.is_root():
        pytest.skip("needs root to start a process as another user")
    python = next((p for p in ("/usr/bin/python3", sys.executable)
                   if os.path.exists(p) and backends.reachable_by_others(p)), None)
    if python is None:
        pytest.skip("no python that user 65534 can run")
    top = Path(tempfile.mkdtemp(prefix="turnrl-test-"))  # pytest's tmp_path is root's alone
    os.chown(top, 65534, 65534)
    source = Path(workdir.__file__).read_text()
    build = textwrap.dedent(f"""
        import os, sys
        os.chdir({str(top)!r})
        os.mkdir("run"); os.chdir("run")
        for mode in (0o000, 0o100, 0o400, 0o500):
            d = f"closed_{{mode:o}}"
            os.makedirs(f"{{d}}/inner"); open(f"{{d}}/inner/file", "w").close()
            os.chmod(f"{{d}}/inner", mode); os.chmod(d, mode)
        os.mkfifo("fifo"); os.symlink("loop", "loop")
        for _ in range(1500):
            os.mkdir("d"); os.chdir("d")
        os.chmod(".", 0)
        os.chdir({str(top)!r}); os.chmod("run", 0o500)
        space = {{}}
        exec({source!r}, space)
        removal = space["remove"]({str(top / "run")!r}, False)
        print(removal.left or "removed", removal.entries, os.path.lexists("run"))
    """)
    try:
        done = subprocess.run([python, "-I", "-c", build], user=65534, group=65534,
                              extra_groups=[], capture_output=True, text=True, timeout=120)
    finally:
        workdir.remove(str(top), mounted=False)  # as root: whatever the test left
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["removed", str(4 * 3 + 2 + 1500), "False"]


def test_the_code_reward_survives_tree_attacks(workdir_kind):
    from turnrl.rewards import code_tests
    box = Sandbox("bwrap" if not bwrap_problem() else "fallback", TREE_LIMITS)
    for attack in TREE_ATTACKS.values():
        program = textwrap.dedent(attack) + "\ndef add(a, b):\n    return a + b\n"
        reply = f"```python\n{program}```"
        assert code_tests(reply, ["assert add(2, 3) == 5", "assert add(1, 1) == 3"], box) == 0.5


def test_the_python_tool_survives_tree_attacks_through_the_tool_env(workdir_kind):
    from turnrl.envs.tool_env import Task, ToolEnv
    from turnrl.rewards import integer_match
    from turnrl.tools import python_tool
    box = Sandbox("bwrap" if not bwrap_problem() else "fallback", TREE_LIMITS)
    for attack in TREE_ATTACKS.values():
        env = ToolEnv(lambda seed: Task("Make a tree.", 1), [python_tool(box)],
                      lambda reply, answer: integer_match(reply, answer), call_timeout_s=60.0)
        asyncio.run(env.reset(0))
        action = ('<tool_call>' + json.dumps({"name": "python", "arguments": {
            "code": textwrap.dedent(attack)}}) + '</tool_call>')
        step = asyncio.run(env.step(action))
        assert not step.done
        assert step.info["tool_results"] == [{"name": "python", "content": "made\n"}]


# ---- a failed python tool call says why, to the model and to the record ------------------

FAILURES = {
    "SIGKILL": ("import os, signal; print('before'); os.kill(os.getpid(), signal.SIGKILL)",
                "[error] killed by signal SIGKILL"),
    "SIGSEGV": ("import ctypes; ctypes.string_at(0)", "[error] killed by signal SIGSEGV"),
    "SIGTERM": ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
                "[error] killed by signal SIGTERM"),
    "exit code": ("import sys; sys.exit(3)", "[error] exit code 3"),
    "exception": ("raise KeyError('missing')", "KeyError: 'missing'"),
    "wall clock": ("import time; time.sleep(60)", "[timeout] wall-clock limit of 2 s"),
    "memory": ("x = bytearray(10 * 1024**3)", "[memory] memory cap of 512 MB"),
    "output": ("print('x' * 10**6)", "[output_limit] output over 10000 bytes"),
    "files": ("for i in range(500): open(f'f{i}', 'w').close()",
              "[files_limit] file-count cap of 100"),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_python_call_carries_its_reason(sandbox, failure):
    from turnrl.envs.tool_env import Task, ToolEnv
    from turnrl.rewards import integer_match
    from turnrl.tools import python_tool
    sandbox.limits = Limits(**{**FAST.__dict__, "files": 100})
    code, said = FAILURES[failure]
    env = ToolEnv(lambda seed: Task("Run it.", 1), [python_tool(sandbox)],
                  lambda reply, answer: integer_match(reply, answer))
    asyncio.run(env.reset(0))
    step = asyncio.run(env.step(
        '<tool_call>' + json.dumps({"name": "python", "arguments": {"code": code}})
        + '</tool_call>'))
    [record] = step.info["tool_results"]
    assert set(record) == {"name", "error"} and said in record["error"], record
    shown = json.loads(step.observation.split("\n")[1])  # the model's <tool_response> body
    assert shown == record
    if failure == "SIGKILL":
        assert "stdout:\nbefore" in record["error"]  # what it printed before it died


def test_removal_of_a_very_deep_and_wide_tree_holds_one_descriptor(tmp_path):
    """Depth 30,000 and 5,000 files, built here (faster than through a run): removed with no
    recursion and no descriptor per level (the open-file limit is lowered to prove it)."""
    import resource

    from turnrl.sandbox import workdir
    # in memory where there is /dev/shm: this disk takes ~1 ms per entry created or removed
    top = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path))
    for i in range(5):
        (top / f"w{i}").mkdir()
        for j in range(1000):
            (top / f"w{i}" / f"f{j}").touch()
    deep = os.open(top, os.O_RDONLY)
    for _ in range(30_000):
        os.mkdir("d", dir_fd=deep)
        below = os.open("d", os.O_RDONLY, dir_fd=deep)
        os.close(deep)
        deep = below
    os.close(deep)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        removal = workdir.remove(str(top), mounted=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert removal.left == "" and not top.exists()
    assert removal.entries == 5 + 5_000 + 30_000


def test_given_files_over_the_directory_cap_are_a_named_sandbox_error(workdir_kind):
    if workdir_kind != "tmpfs":
        pytest.skip("a plain directory has no size cap")
    sandbox = Sandbox("fallback", Limits(wall_s=2.0, dir_mb=1))
    result = sandbox.run_sync("print('ran')", files={"data.txt": "x" * (2 << 20)})
    assert result.status == "sandbox_error" and "Limits.dir_mb=1" in result.reason
    assert result.stdout == "" and not os.path.lexists(result.details["workdir"]["path"])


def test_a_deep_closed_tree_in_tmp_is_swept_after_a_root_fallback_run():
    """The root fallback's code may write in /tmp: what its id leaves there, however deep or
    closed, is removed with its private directory."""
    sandbox = Sandbox("fallback", TREE_LIMITS)
    if "writes_except_world_writable" not in sandbox.guarantees:
        pytest.skip("the fallback sweeps /tmp only as root (its code has an id of its own)")
    name = f"/tmp/turnrl-sandbox-test-{uuid.uuid4().hex}"
    result = run(sandbox, f"""
        import os
        os.mkdir({name!r}); os.chdir({name!r})
        os.mkfifo("fifo"); os.symlink("/", "root")
        for _ in range(2000):
            os.mkdir("d"); os.chdir("d")
        os.chmod(".", 0)
        os.chdir({name!r}); os.chmod(".", 0o500)
        print("made")
    """)
    assert result.ok and result.stdout.strip() == "made", result.reason
    assert not os.path.lexists(name)


# ---- whatever the code makes in world-writable directories goes, whoever owns it (issue 58) ---

def world_writable_dirs() -> list[str]:
    return [d for d in ("/tmp", "/var/tmp", "/dev/shm")
            if os.path.isdir(d) and os.stat(d).st_mode & 0o002]


def other_users_file(path: str, mode: int = 0o666) -> None:
    """A file of another user (nobody, where the test may chown) that any user may write."""
    Path(path).write_text("original")
    os.chmod(path, mode)
    if backends_is_root():
        os.chown(path, 65534, 65534)


def needs_world_writable_containment(sandbox: Sandbox) -> None:
    needs(sandbox, "writes") if sandbox.backend == "bwrap" else needs(
        sandbox, "writes_except_world_writable")


LINK_ATTACK = """
    import os
    made = []
    def attempt(what, op):
        try:
            op()
            made.append(what)
        except OSError as err:
            print("refused", what, err.strerror)
    for d, target in {targets!r}.items():
        attempt(f"link {{d}}", lambda: os.link(target, f"{{d}}/link-{token}"))
        attempt(f"symlink {{d}}", lambda: os.symlink(target, f"{{d}}/sym-{token}"))
        attempt(f"file {{d}}", lambda: open(f"{{d}}/file-{token}", "w").write("x"))
        attempt(f"fifo {{d}}", lambda: os.mkfifo(f"{{d}}/fifo-{token}"))
        attempt(f"nested {{d}}", lambda: (os.makedirs(f"{{d}}/dir-{token}/a/b"),
                                          os.link(target, f"{{d}}/dir-{token}/a/b/link")))
    attempt("link in another user's dir", lambda: os.link(
        {tmp_target!r}, f"{shared}/link-{token}"))
    print(len(made), "made")
"""


def test_links_and_files_in_world_writable_dirs_are_removed_and_targets_kept(sandbox):
    """Hard links to another user's world-writable file (which carry that user as owner),
    symlinks, files, fifos and nested directories, at the top of /tmp, /var/tmp, /dev/shm
    and inside another user's world-writable directory: all gone after the run; the
    targets, their older links and the other user's directory stay as they were."""
    needs_world_writable_containment(sandbox)
    token = uuid.uuid4().hex
    dirs = world_writable_dirs()
    targets = {d: f"{d}/target-{token}" for d in dirs}
    shared = f"/tmp/shared-{token}"  # another user's world-writable directory, kept
    made_before = [*targets.values(), shared, f"/tmp/old-link-{token}"]
    try:
        os.mkdir(shared)
        os.chmod(shared, 0o1777)
        os.chown(shared, 65534, 65534) if backends_is_root() else None
        for target in targets.values():
            other_users_file(target)
        os.link(targets["/tmp"], f"/tmp/old-link-{token}")  # a link older than the run
        code = LINK_ATTACK.format(targets=targets, token=token, shared=shared,
                                  tmp_target=targets["/tmp"])
        result = run(sandbox, code)
        assert result.ok, result.reason
        if sandbox.backend == "fallback":  # the host's directories: every attack worked
            assert result.stdout.split()[-2:] == [str(5 * len(dirs) + 1), "made"], result.stdout
        left = sorted(f"{d}/{n}" for d in [*dirs, shared] for n in os.listdir(d) if token in n)
        assert left == sorted(made_before), left
        for target in targets.values():
            assert Path(target).read_text() == "original"
            assert os.stat(target).st_nlink == (2 if target.startswith("/tmp/") else 1)
            assert os.stat(target).st_uid == (65534 if backends_is_root() else os.getuid())
        assert os.listdir(shared) == []
        if sandbox.backend == "fallback":
            assert result.details["world_writable"] == {"removed": 5 * len(dirs) + 1,
                                                        "left": ""}
    finally:
        for path in made_before:
            if os.path.isdir(path) and not os.path.islink(path):
                workdir.remove(path, mounted=False)
            elif os.path.lexists(path):
                os.unlink(path)


def test_entries_other_users_make_during_a_run_stay():
    """The sweep removes new names only where the run made them (its id's entries, new hard
    links): a file another user creates in /tmp while the run is going stays."""
    import threading
    sandbox = Sandbox("fallback", Limits(wall_s=20.0, cpu_s=5.0))
    needs_world_writable_containment(sandbox)
    token = uuid.uuid4().hex
    started, meanwhile = f"/tmp/started-{token}", f"/tmp/meanwhile-{token}"
    code = f"""
        import os, time
        open({started!r}, "w").close()
        deadline = time.monotonic() + 15
        while not os.path.exists({meanwhile!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("saw" if os.path.exists({meanwhile!r}) else "never saw")
    """
    results = []
    runner = threading.Thread(target=lambda: results.append(run(sandbox, code)))
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(started), "the run never started"
        other_users_file(meanwhile, mode=0o644)
        runner.join(30)
        assert results and results[0].stdout.strip() == "saw", results
        assert Path(meanwhile).read_text() == "original"  # another user's, made meanwhile
        assert not os.path.lexists(started)  # the run's own
    finally:
        runner.join(30)
        for path in (started, meanwhile):
            if os.path.lexists(path):
                os.unlink(path)
