"""Temporary model directories for vLLM, which loads a model only from a directory: the tiny
model, built in code, is saved to one first (``turnrl.samplers.chooser.vllm_engine``, for a
rollout worker and the learner's process alike).

Each is named after the process that made it (``turnrl-vllm-<label>-p<pid>-<random>``) and
removed when the engine reading it is collected, when its worker stops, or when the process
exits normally (``remove_with``). A process that ends without either (a worker Ray kills,
restarts after a crash, or stops with ``ray.kill``: no exit handler runs) leaves its directory;
the next one made on the machine removes every such directory whose process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "turnrl-vllm-"
_OWNER = re.compile(r"-p(\d+)-[a-z0-9_]+$")
"""The pid in a directory's name (``mkdtemp``'s random suffix has no '-')."""


def save_model_dir(label: str, save: Callable[[Path], None],
                   parent: str | os.PathLike | None = None) -> Path:
    """A new temporary directory that ``save(path)`` fills (removed again if it raises),
    under ``parent`` (default: the system's temporary directory); directories there whose
    process is gone are removed first."""
    parent = Path(parent or tempfile.gettempdir())
    for orphan in orphaned_model_dirs(parent):
        shutil.rmtree(orphan, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{label}-p{os.getpid()}-", dir=parent))
    try:
        save(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def remove_with(owner: Any, path: Path) -> weakref.finalize:
    """Remove ``path`` once: when ``owner`` is collected, when the returned finalizer is
    called (a worker's ``stop``), or at this process's normal exit, whichever comes first."""
    return weakref.finalize(owner, shutil.rmtree, path, ignore_errors=True)


def orphaned_model_dirs(parent: str | os.PathLike) -> list[Path]:
    """Directories ``save_model_dir`` made under ``parent``, owned by this user, whose process
    is no longer running."""
    found = []
    for path in sorted(Path(parent).glob(f"{PREFIX}*")):
        owner = _OWNER.search(path.name)
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile (another process's sweep)
            continue
        if owner and mine and not process_alive(int(owner[1])):
            found.append(path)
    return found


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
