"""The trusted prelude that starts model-written code: run as ``python -I -S -c <this file>``.

Standalone on purpose (no turnrl import, stdlib only, so ``-S`` can skip site-packages: ~20 ms
less start-up per call): it runs inside bubblewrap, where only the interpreter's own
directories are visible, and as the first process of the fallback.

It (1) leaves the network in a fresh, empty network namespace when asked (fallback only;
bubblewrap does that itself), (2) becomes a child subreaper, so every process the code
starts, however it detaches (double fork, ``setsid``), is re-parented to it, (3) forks the
code with the resource limits set and, when started as root, as an unprivileged user id of
its own, (4) waits for it under the wall-clock limit, then kills and reaps every descendant
that is left, and (5) writes one JSON status line to the status file descriptor, which the
code never inherits.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def _unshare_network(uid: int, gid: int) -> str:
    """Move this process into an empty network namespace; say how ("" when it could not)."""
    if _libc.unshare(CLONE_NEWNET) == 0:  # root (CAP_SYS_ADMIN)
        return "netns"
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:  # user namespaces restricted
        return ""
    # keep our own ids inside the new user namespace (unprivileged maps allow exactly this)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    return "userns+netns"


def _own_tasks(uid: int) -> int:
    """Threads of all processes of ``uid``: what RLIMIT_NPROC counts outside a namespace."""
    total = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 0").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def _limit_and_exec(cfg: dict) -> None:
    """In the child: limits, then the unprivileged id, then the code. Never returns."""
    try:
        limits = cfg["rlimits"]
        for name, value in limits.items():
            soft, hard = value if isinstance(value, list) else (value, value)
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if cfg.get("uid") is not None:  # root: drop to an id no other process uses
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        os.chdir(cfg["cwd"])
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as err:  # noqa: BLE001 - reported, then the child must exit
        os.write(2, f"turnrl-sandbox: could not start the code: {err}\n".encode())
    os._exit(125)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (re-parented orphans included)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _kill_descendants(uid: int | None) -> int:
    """SIGKILL and reap everything the code left behind; return how many were killed."""
    killed = 0
    if uid is not None:  # a helper with the code's unique id kills all of that id at once
        helper = os.fork()
        if helper == 0:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
            os._exit(0)
        os.waitpid(helper, 0)
    for _ in range(1000):  # orphans of killed processes are re-parented to us: repeat
        children = _children(os.getpid())
        if not children:
            break
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    break
            except ChildProcessError:
                break
        time.sleep(0.001)
    return killed


class _Stop(Exception):
    pass


def _on_term(signum, frame):
    raise _Stop


def main(cfg: dict) -> None:
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)  # the code must not forge its own status
    network = _unshare_network(os.getuid(), os.getgid()) if cfg.get("unshare_net") else ""
    if cfg.get("nproc_counts_user") and "userns" not in network:
        # the cap counts every thread of this user id (the trainer's too): add those
        cfg["rlimits"]["RLIMIT_NPROC"] += _own_tasks(os.getuid())
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _on_term)
    start = time.monotonic()
    child = os.fork()
    if child == 0:
        _limit_and_exec(cfg)
    report = {"network": network, "timed_out": False, "stopped": False}
    finished = False
    try:
        finished = bool(select.select([os.pidfd_open(child)], [], [], cfg["wall_s"])[0])
        report["timed_out"] = not finished
    except _Stop:  # the caller asked us to stop (its output cap was reached)
        report["stopped"] = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the clean-up whatever comes
    if not finished:
        os.kill(child, signal.SIGKILL)
    _, status, usage = os.wait4(child, 0)
    report["wall_s"] = time.monotonic() - start
    report["cpu_s"] = usage.ru_utime + usage.ru_stime
    report["exit_code"] = os.waitstatus_to_exitcode(status)  # -N for signal N
    report["leftover_killed"] = _kill_descendants(cfg.get("uid"))
    os.write(status_fd, (json.dumps(report) + "\n").encode())
    code = report["exit_code"]
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
