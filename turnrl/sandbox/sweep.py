"""What the root fallback's code leaves in the host's world-writable directories, removed.

There the code runs under a user id of its own, so besides its private directory it can
write only to world-writable directories: ``TOPS`` and every world-writable directory below
them (Ray's session directories are). Before the code starts, ``snapshot`` lists the entries
(name and inode) of each; after every process of the run's id is dead, ``sweep`` removes:

- every entry owned by the run's id (a file, symlink, fifo or socket; a directory with its
  whole tree, hard links to other users' files inside it included);
- every new name of a non-directory with more than one link (a name absent from the
  snapshot, or naming another inode than it did): a hard link, which carries its target's
  owner, not the run's id. Removing it drops a name, never the file, which keeps its others.

Kept: every entry that existed before the run, and new entries of other users with one
link: what other processes create meanwhile. So a hard link that another process makes in
these directories while a run is going is removed too (its file stays under its other
names). Only directories in the snapshot get the hard-link rule (an old link is never taken
for a new one): in a world-writable directory another user makes during the run, or one
past ``MAX_DIRS``, only the run's own entries are removed.

Every directory is opened relative to its parent, never through a link, and entries are
removed relative to it: another user swapping a directory for a link cannot redirect the
removal.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

from turnrl.sandbox import workdir

TOPS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""The world-writable directories searched (with every world-writable directory below)."""

MAX_DIRS = 1000
"""Directories walked at most (a huge world-writable tree of another user is not listed
whole on every run); the docs name the limit."""

Snapshot = dict[str, frozenset[tuple[str, int]]]
"""directory -> {(entry name, inode)}"""


def snapshot() -> Snapshot:
    """The entries of every world-writable directory under ``TOPS`` now."""
    return {path: frozenset((e.name, e.inode()) for e in entries)
            for path, _, entries in _world_writable_dirs(skip_uid=None)}


def sweep(uid: int, before: Snapshot) -> tuple[int, str]:
    """Remove what user ``uid`` (now without processes) left since ``before``; return (how
    many entries went, why something stayed or "")."""
    removed, problems = 0, []
    for path, fd, entries in _world_writable_dirs(skip_uid=uid):
        old = before.get(path)
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == uid:
                    problem = _remove(fd, entry.name, info)
                elif old is not None and _new_hard_link(entry.name, info, old):
                    os.unlink(entry.name, dir_fd=fd)
                    problem = ""
                else:
                    continue
            except FileNotFoundError:
                continue
            except OSError as err:
                problem = f"{path}/{entry.name[:60]}: {err.strerror}"
            removed += not problem
            problems += [problem] if problem else []
    return removed, "; ".join(problems[:3])


def _new_hard_link(name: str, info: os.stat_result, old: frozenset) -> bool:
    return (not stat.S_ISDIR(info.st_mode) and info.st_nlink > 1
            and (name, info.st_ino) not in old)


def _remove(fd: int, name: str, info: os.stat_result) -> str:
    """Unlink one entry of directory ``fd`` (a directory: with its tree); why it stayed."""
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=fd)
        return ""
    # through the descriptor's own /proc link: no path component another user could swap
    return workdir.remove(f"/proc/self/fd/{fd}/{name}", mounted=False).left


def _world_writable_dirs(skip_uid: int | None) -> Iterator[tuple[str, int, list]]:
    """(path, descriptor, entries) of each world-writable directory under ``TOPS``, breadth
    first, at most ``MAX_DIRS``; directories of ``skip_uid`` are not entered."""
    pending = [(top, fd) for top in TOPS if (fd := _open_dir(top, None)) is not None]
    walked = 0
    try:
        while pending and walked < MAX_DIRS:
            path, fd = pending.pop(0)
            walked += 1
            try:
                with os.scandir(fd) as listing:
                    entries = list(listing)
                yield path, fd, entries
                for entry in entries:
                    if _enter(entry, skip_uid):
                        child = _open_dir(entry.name, fd)
                        if child is not None:
                            pending.append((f"{path}/{entry.name}", child))
            finally:
                os.close(fd)
    finally:
        for _, fd in pending:
            os.close(fd)


def _enter(entry: os.DirEntry, skip_uid: int | None) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and bool(info.st_mode & stat.S_IWOTH)
            and info.st_uid != skip_uid)


def _open_dir(name: str, parent: int | None) -> int | None:
    """A descriptor of world-writable directory ``name``; None when it is not one (or a link)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
    except OSError:
        return None
    if not os.fstat(fd).st_mode & stat.S_IWOTH:
        os.close(fd)
        return None
    return fd
