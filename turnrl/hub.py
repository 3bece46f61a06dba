"""Hugging Face hub ids (``ORG/NAME``): resolved through the hub's own cache.

A hub id loads from the cache the ``huggingface_hub`` library keeps
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), laid out as
``models--ORG--NAME/{blobs,refs/<revision>,snapshots/<commit>/...}``. Online, a missing model
is downloaded into that cache first; offline (``HF_HUB_OFFLINE=1``) or when the hub cannot be
reached, only the cache is read, and a model that is not there is one error line naming the
id, the cache and the command that pre-downloads it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# ORG/NAME as the hub spells repository ids: letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_TRUE = {"1", "true", "yes", "on"}


class HubModelNotFound(FileNotFoundError):
    """A hub id that is not in the cache and cannot be downloaded; the message says why."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as ``ORG/NAME`` and is not an existing local path."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def near_hub_id(name: str) -> str:
    """Why ``name``, which is neither a model directory nor a hub id, is not one when it nearly
    reads as a hub id, with the fix ('' when it does not look like one)."""
    text = name.strip()
    for prefix in ("https://huggingface.co/", "http://huggingface.co/", "hf.co/"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = text.rstrip("/")
    repo, sep, revision = text.partition("@")
    if sep and _HUB_ID.fullmatch(repo) and revision:
        return (f"a revision is not part of the name: --model.name {repo} "
                f"--model.revision {revision}")
    if not _HUB_ID.fullmatch(text):
        return ""
    if Path(text).expanduser().is_dir():  # a path wins over a hub id of the same name
        return (f"'{text}' is a local directory without config.json (not a model directory), "
                f"and as a path it hides the hub id {text}: run from another directory or "
                "rename it to load the hub model")
    return f"did you mean the hub id '{text}'?" if text != name else ""


def hub_cache_dir() -> Path:
    """The hub cache, read from the environment at call time (the library reads it once, at
    import): ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, or its default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) is set now."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def download_hint(repo_id: str, revision: str = "") -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"`hf download {repo_id}{rev}` (or `huggingface-cli download {repo_id}{rev}`)"


def hub_snapshot(repo_id: str, revision: str = "") -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` ('' = main): from the
    cache, or downloaded into it when the hub is online and reachable."""
    from huggingface_hub import snapshot_download

    cache, offline = hub_cache_dir(), hub_offline()
    try:
        path = snapshot_download(repo_id, revision=revision or None, cache_dir=cache,
                                 local_files_only=offline)
    except Exception as err:  # noqa: BLE001 - offline, unreachable, unknown repo or revision
        raise HubModelNotFound(_not_found(repo_id, revision, cache, offline, err)) from None
    snapshot = Path(path)
    if not (snapshot / "config.json").is_file():
        raise HubModelNotFound(f"hub model '{repo_id}' at {snapshot} has no config.json; it is "
                               f"not a transformers model, or its download is incomplete: "
                               f"run {download_hint(repo_id, revision)}")
    return snapshot


def _not_found(repo_id: str, revision: str, cache: Path, offline: bool,
               err: Exception) -> str:
    at = f" at revision '{revision}'" if revision else ""
    why = "the hub is offline (HF_HUB_OFFLINE=1)" if offline else \
        f"it could not be downloaded ({type(err).__name__})"
    return (f"hub model '{repo_id}'{at} is not in the Hugging Face cache {cache} and {why}; "
            f"pre-download it with {download_hint(repo_id, revision)} where the hub is "
            f"reachable, or point HF_HUB_CACHE/HF_HOME at a cache that has it")
