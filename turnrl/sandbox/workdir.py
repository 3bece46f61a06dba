"""A run's private directory on the host: made with caps where the kernel can enforce them,
removed whatever tree the code left in it.

Where the trainer may mount (root), the directory is a tmpfs of its own: the kernel caps its
entries (``nr_inodes``) and bytes (``size``), and removing it is one unmount, however deep or
strange the tree. Elsewhere it is a plain directory: its entries are counted as it is removed
(the cap is then checked after the run, not enforced during it).

Removal never follows a symlink, never opens a fifo or socket, works relative to directory
descriptors (no path grows with the depth), holds one descriptor at a time (no limit on depth
from open files), recurses nowhere (no limit from the stack), and makes directories the code
closed (mode 000, read-only) writable again before emptying them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import tempfile
from dataclasses import dataclass

MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Removal:
    """What removing a run's directory found."""

    path: str
    entries: int
    """files, directories, links, fifos, sockets the code left (the top directory excluded)"""
    full: str = ""
    """"files" or "bytes" when a capped tmpfs was found full, else \"\""""
    left: str = ""
    """why something could not be removed ("" when the directory is gone)"""


@functools.cache
def can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN), probed once."""
    if os.geteuid() != 0:
        return False
    probe = tempfile.mkdtemp(prefix="turnrl-sandbox-probe-")
    try:
        if not _mount_tmpfs(probe, 1, 16):
            return False
        _libc.umount2(probe.encode(), MNT_DETACH)
        return True
    finally:
        os.rmdir(probe)


def _mount_tmpfs(path: str, size_mb: int, inodes: int) -> bool:
    options = f"size={size_mb}m,nr_inodes={inodes},mode=0700".encode()
    return _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, options) == 0


def make(files: int, size_mb: int) -> tuple[str, bool]:
    """(path, mounted): a fresh private directory; a tmpfs of ``files`` entries and
    ``size_mb`` MB where this process may mount one, else a plain directory."""
    path = tempfile.mkdtemp(prefix="turnrl-sandbox-")
    # one inode is the tmpfs's own root: the code may create ``files`` more
    mounted = can_mount_tmpfs() and _mount_tmpfs(path, size_mb, files + 1)
    return path, mounted


def remove(path: str, mounted: bool) -> Removal:
    """Remove a run's directory and everything in it; never raises."""
    if mounted:
        return _unmount(path)
    try:
        return _remove_tree(path)
    except Exception as err:  # noqa: BLE001 - the host must carry on, and say what is left
        return Removal(path, 0, left=f"{type(err).__name__}: {err}")


def _unmount(path: str) -> Removal:
    try:
        usage = os.statvfs(path)
        entries = usage.f_files - usage.f_ffree - 1
        full = "files" if usage.f_ffree == 0 else "bytes" if usage.f_bavail == 0 else ""
    except OSError:
        entries, full = 0, ""
    if _libc.umount2(path.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        return Removal(path, entries, full, f"could not unmount {path}: {os.strerror(err)}")
    try:
        os.rmdir(path)
    except OSError as err:
        return Removal(path, entries, full, f"could not remove {path}: {err}")
    return Removal(path, entries, full)


def _open_dir(name: str, parent: int | None) -> int | None:
    """A descriptor of directory ``name`` (relative to ``parent``), made searchable, readable
    and writable first when the code closed it; None when it is not a directory any more."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:  # mode 000 and not root: reopen after a chmod through O_PATH
        try:
            handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=parent)
        except OSError:
            return None
        try:
            os.chmod(f"/proc/self/fd/{handle}", 0o700)
        finally:
            os.close(handle)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except (NotADirectoryError, FileNotFoundError):
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:  # a symlink: the caller unlinks it
            return None
        raise
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)  # a read-only directory: its entries could not be unlinked
    return fd


def _empty_files(fd: int, problems: list[str]) -> tuple[int, list[str]]:
    """Unlink every non-directory in ``fd``; return (how many, the subdirectories' names).
    What cannot be unlinked is added to ``problems`` and the rest goes on."""
    removed, subdirs = 0, []
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as err:
                problems.append(f"{entry.name[:60]}: {err.strerror}")
    return removed, subdirs


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _remove_tree(path: str) -> Removal:
    """Depth-first with one open descriptor: descend by name, climb by "..", remember only
    the names still to visit on the current path (no recursion, no long paths)."""
    if os.path.islink(path):  # the code replaced its directory with a link: drop the link
        os.unlink(path)
        return Removal(path, 0)
    fd = _open_dir(path, None)
    if fd is None:
        return Removal(path, 0, left="" if not os.path.lexists(path) else f"{path} is not a dir")
    entries, problems = 0, []
    try:
        removed, subdirs = _empty_files(fd, problems)
        entries += removed
        # (name in its parent, subdirectories still to visit, its identity to climb back to)
        stack: list[tuple[str, list[str], tuple[int, int]]] = [("", subdirs, _identity(fd))]
        while stack:
            name, pending, _ = stack[-1]
            if pending:
                child_name = pending.pop()
                child = _open_dir(child_name, fd)
                if child is None:  # became something else: unlink it as a file
                    try:
                        os.unlink(child_name, dir_fd=fd)
                        entries += 1
                    except OSError as err:
                        problems.append(str(err))
                    continue
                os.close(fd)
                fd = child
                removed, subdirs = _empty_files(fd, problems)
                entries += removed
                stack.append((child_name, subdirs, _identity(fd)))
                continue
            stack.pop()
            if not stack:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _identity(fd) != stack[-1][2]:  # moved under us (a surviving process)
                problems.append("the tree changed while it was removed; stopped")
                break
            try:
                os.rmdir(name, dir_fd=fd)
                entries += 1
            except OSError as err:
                problems.append(f"{name[:60]}: {err.strerror}")
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError as err:
        problems.append(str(err))
    return Removal(path, entries, left="; ".join(problems[:3]))
