"""Atomic checkpoints: everything a resume needs, never half written.

A checkpoint is built in a temporary directory, every file fsynced, then renamed into
place in one ``os.rename``; so after a ``kill -9`` at any point the run directory holds only
whole checkpoints, and ``latest_checkpoint`` never returns a partial one.

A full fine-tune's weights are ``model.safetensors``; a LoRA run's are its adapter alone, as
PEFT lays it out (``adapter_model.safetensors``, ``adapter_config.json``; ``turnrl.lora``),
with the optimiser state of the adapter's tensors only.

Further weights a resume needs (an opponent pool's frozen past policies, turnrl/selfplay/pool.py)
are ``frozen``: each in its own subdirectory, laid out as the model's own. A name is one set
of weights for the life of a run (``opponent_pool/v000004``: the policy after 4 updates), so
no bytes are written twice: weights equal to the model's own, or held under the same name by
the previous checkpoint, are hard links to those files (a copy where the filesystem has no
hard links).

A checkpoint written by several learner ranks (``learner.world_size`` > 1) holds its model and
optimiser state as one ``torch.distributed.checkpoint`` directory in place of
``model.safetensors`` and ``optimizer.pt`` (``.metadata`` and a ``.distcp`` file per rank;
``turnrl/learner/checkpoints.py``): ``save_checkpoint``'s ``weights`` writes them, every rank
at once, while rank 0 alone writes the rest. It loads at any world size, into one process too
(``turnrl export``, ``turnrl eval``, ``turnrl serve``); today's checkpoints load into a
sharded model as well.

A checkpoint that cannot be used (a file truncated, deleted or overwritten with other bytes;
``state.json`` from another version or missing its keys; weights of another model) is a
``CheckpointError``: one line naming the checkpoint, what is wrong and the fix, never a
traceback or weights loaded from bad bytes. ``state.json`` lists each file's size and CRC-32
(``files``), checked before anything is loaded (checkpoints written before it are loaded
unchecked, as they were).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from turnrl import safe_json
from turnrl.learner.checkpoints import (
    first_nonfinite,
    is_sharded_checkpoint,
    load_sharded,
    load_whole,
)
from turnrl.learner.shard import is_fsdp
from turnrl.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_names,
    is_lora,
    load_adapter,
    published_state,
    save_adapter,
)
from turnrl.metrics import fsync_dir
from turnrl.safe_json import safe_text

PREFIX = "step-"
MODEL_WEIGHTS = "model.safetensors"
WEIGHT_FILES = (MODEL_WEIGHTS, ADAPTER_WEIGHTS)
"""A checkpoint's weights: the whole model's, or a LoRA run's adapter's."""
Frozen = torch.nn.Module | Callable[[], torch.nn.Module]
"""Further weights to save: a model, or a function that builds it (async pools: the members'
weights live in Ray's object store, and only a member not saved before is built)."""


STEP_DIR = re.compile(rf"{PREFIX}\d{{6,}}")
"""A checkpoint's directory name (``step-000004``); ``step-000004.bad`` is not one."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: one line naming it, what is wrong and the fix."""


def unusable(path: Path, what: str) -> CheckpointError:
    """The ``CheckpointError`` for ``path``: ``what`` is wrong; move it aside to resume from the
    checkpoint before it."""
    aside = path.parent.parent / f"bad-{path.name}"
    return CheckpointError(f"checkpoint '{path}' cannot be used: {what}; move it aside "
                           f"(mv '{path}' '{aside}') to resume from the checkpoint before it, "
                           "or start a new run in another run.out_dir")


def _crc(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_manifest(path: Path) -> dict[str, list[int]]:
    """Every file under ``path`` (frozen weights' subdirectories too): relative name ->
    ``[size, crc32]``."""
    return {file.relative_to(path).as_posix(): [file.stat().st_size, _crc(file)]
            for file in sorted(path.rglob("*")) if file.is_file()}


def read_state(path: Path) -> dict:
    """``path/state.json``, checked: a JSON object with a whole ``step`` >= 0, and every file
    it lists there with the size and CRC-32 it was written with. ``CheckpointError`` else."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise unusable(path, f"state.json is unreadable ({type(err).__name__}: "
                       f"{safe_text(err, 200)})") from None
    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise unusable(path, f"state.json has no whole 'step' >= 0 (got "
                       f"{safe_text(state, 200)}): it is not a TurnRL checkpoint of this version")
    files = state.get("files", {})
    if not isinstance(files, dict):
        raise unusable(path, "state.json's 'files' is not a mapping of file -> [size, crc32]")
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise unusable(path, f"{name} is missing")
        if [file.stat().st_size, _crc(file)] != expected:
            raise unusable(path, f"{name} is not the file that was saved (its size or CRC-32 "
                           "differs: truncated or overwritten)")
    return state


def _loading(path: Path, name: str, load: Callable[[], Any]) -> Any:
    """``load()``, any failure as a ``CheckpointError`` naming ``name`` in ``path``."""
    try:
        return load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - torch, safetensors, pickle: each its own type
        text = safe_text(err, 300).splitlines()
        raise unusable(path, f"{name} could not be loaded ({type(err).__name__}: "
                       f"{text[0] if text else ''})") from None


def _fsync_tree(path: Path) -> None:
    for file in path.iterdir():
        if file.is_dir():
            _fsync_tree(file)
            continue
        with open(file, "rb+") as f:
            os.fsync(f.fileno())
    fsync_dir(path)


def save_weights(model: torch.nn.Module, directory: Path) -> None:
    """``model``'s weights into ``directory``: the whole model's, or a LoRA run's adapter."""
    if is_lora(model):
        save_adapter(model, directory)
    else:
        save_model(model, str(directory / MODEL_WEIGHTS))  # handles tied embeddings


def weight_files(directory: Path) -> list[Path]:
    """The files of the weights saved in ``directory`` (``save_weights``), [] if none."""
    names = (MODEL_WEIGHTS,) if (directory / MODEL_WEIGHTS).is_file() else (
        (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if (directory / ADAPTER_WEIGHTS).is_file() else ())
    return [directory / name for name in names]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether ``a`` and ``b`` hold bit-identical published weights (the adapter's for LoRA)."""
    mine, theirs = published_state(a), published_state(b)
    return mine.keys() == theirs.keys() and all(
        t.dtype == theirs[k].dtype and torch.equal(t, theirs[k]) for k, t in mine.items())


def _link_weights(files: list[Path], directory: Path) -> None:
    """Hard links to ``files`` in ``directory``; copies where links are not possible."""
    for file in files:
        try:
            os.link(file, directory / file.name)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(file, directory / file.name)


def _save_frozen(tmp: Path, model: torch.nn.Module, frozen: dict[str, Frozen],
                 previous: Path | None) -> None:
    """Each of ``frozen`` under ``tmp/<name>/``, by the cheapest way that gives its bytes:
    a link to the model's own files, to the previous checkpoint's, or written. A builder
    (a function returning the model) is called only when its bytes must be written. A
    sharded checkpoint has no model files to link to: each is written whole."""
    own = weight_files(tmp)
    for name, weights in frozen.items():
        directory = tmp / name
        directory.mkdir(parents=True)
        earlier = weight_files(previous / name) if previous is not None else []
        if earlier:  # a name is one set of weights for the whole run
            _link_weights(earlier, directory)
            continue
        if not isinstance(weights, torch.nn.Module):  # built now, dropped after writing
            weights = weights()
        if is_fsdp(weights):
            raise ValueError(f"frozen weights '{name}' are FSDP shards: an opponent pool "
                             "cannot be checkpointed under learner.strategy fsdp yet; use "
                             "--learner.strategy ddp or learner.world_size 1")
        if own and same_weights(weights, model):
            _link_weights(own, directory)
        else:
            save_weights(weights, directory)


def rng_state(engine_generator: torch.Generator | None = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if engine_generator is not None:
        state["engine"] = engine_generator.get_state()
        state["engine_device"] = engine_generator.device.type
    return state


def engine_state_fits(state: dict, engine_generator) -> bool:
    """Whether the saved sampler state can go into ``engine_generator``: a CPU generator's
    state (a Mersenne Twister) means nothing to a CUDA one (Philox), and setting it raises.
    Checkpoints written before the device was recorded came from CPU generators."""
    return state.get("engine_device", "cpu") == engine_generator.device.type


def restore_rng(state: dict, engine_generator: torch.Generator | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if engine_generator is None or "engine" not in state:
        return
    if engine_state_fits(state, engine_generator):
        engine_generator.set_state(state["engine"])
    else:  # e.g. a CPU run resumed on a GPU: the run goes on, on another sampling stream
        warnings.warn(f"the checkpoint's sampler state is for a {state['engine_device']} "
                      f"generator, this run samples on {engine_generator.device.type}: sampling "
                      "continues from run.seed's stream, not where the saved run left off",
                      stacklevel=2)


def _require_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A checkpoint is what a resume trusts: refuse to write NaN/inf weights or moments. One
    reduction per tensor (no tensor-sized mask unless the sum is not finite); a sharded
    model's own shards here (``save_sharded`` checks every rank's)."""
    named = [(f"model {name}", t) for name, t in published_state(model).items()]
    named += [(f"optimizer state {key}", t) for state in optimizer.state.values()
              for key, t in state.items()]
    bad = first_nonfinite(named)
    if bad is not None:
        raise FloatingPointError(f"refusing to write a checkpoint: {bad} has non-finite "
                                 "values; resume from the previous checkpoint with a lower "
                                 "optim.lr or a smaller optim.max_grad_norm")


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, *, rng: dict, extra: dict | None = None,
                    components: dict[str, dict] | None = None,
                    frozen: dict[str, Frozen] | None = None, keep: int = 2,
                    weights: Callable[[Path], None] | None = None) -> Path:
    """Write ``checkpoints/step-NNNNNN`` atomically and keep only the newest ``keep``.

    ``components`` are further state dicts a resume needs (a critic, a replay buffer),
    saved as ``<name>.pt`` and read back with ``load_component``. ``frozen`` are further
    weights (name -> model), saved under ``<name>/`` without duplicated bytes (the module
    docstring; a value may be a function building the model, called only if its bytes are
    written) and read back with ``load_frozen``. ``weights(directory)``, when given, writes
    the model's and optimiser's state there in place of ``model.safetensors`` and
    ``optimizer.pt`` (the learner ranks' sharded checkpoint: every rank's ``save_sharded``);
    the manifest then lists its files too.
    """
    _require_finite(model, optimizer)
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_checkpoint(run_dir) if frozen else None
    tmp.mkdir()
    if weights is None:
        save_weights(model, tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    else:
        try:
            weights(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _save_frozen(tmp, model, frozen or {}, previous)
    torch.save(rng, tmp / "rng.pt")
    for name, state in (components or {}).items():
        torch.save(state, tmp / f"{name}.pt")
    state = {"step": step, **(extra or {}), "files": file_manifest(tmp)}
    (tmp / "state.json").write_text(safe_json.dumps(state))
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step after a resume: move the old copy out of sight first
        stale = root / f".tmp-old-{PREFIX}{step:06d}-{os.getpid()}"
        os.rename(final, stale)
        shutil.rmtree(stale)
    os.rename(tmp, final)
    fsync_dir(root)
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest whole checkpoint, or None; leftover temporary directories are removed."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    for tmp in root.glob(f".tmp-{PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)
    found = sorted(p for p in root.glob(f"{PREFIX}*") if STEP_DIR.fullmatch(p.name))
    return found[-1] if found else None


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Restore model and optimiser in place; return (state.json contents, rng state).
    ``CheckpointError`` (one line, the fix) for a checkpoint that cannot be used; its files
    are checked before the model or optimiser is touched.

    Learner ranks: every rank calls it at once with its own share of the model. A sharded
    checkpoint is resharded to this world size; a one-process checkpoint is read whole by
    every rank, each keeping its FSDP shards."""
    path = Path(path)
    state = read_state(path)
    if is_sharded_checkpoint(path):
        _same_kind(path, model)
        _loading(path, "the sharded model and optimizer state",
                 lambda: load_sharded(path, model, optimizer))
    elif is_fsdp(model):
        _same_kind(path, model)
        _loading(path, "the weights and optimizer.pt", lambda: _load_whole(path, model,
                                                                            optimizer))
    else:
        load_weights(path, model)
        _loading(path, "optimizer.pt", lambda: optimizer.load_state_dict(
            torch.load(path / "optimizer.pt", weights_only=False)))
    rng = _loading(path, "rng.pt", lambda: _rng_dict(torch.load(path / "rng.pt",
                                                                weights_only=False)))
    return state, rng


def _load_whole(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A one-process checkpoint (``model.safetensors`` or a LoRA adapter, ``optimizer.pt``)
    into an FSDP-sharded model and its optimiser."""
    from safetensors.torch import load_file

    if holds_adapter(path):
        names = adapter_names(model)
        weights = {names[k]: v for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    else:
        weights = load_file(str(path / MODEL_WEIGHTS))
    load_whole(model, optimizer, weights, torch.load(path / "optimizer.pt", weights_only=False))


def _rng_dict(state: Any) -> dict:
    if not (isinstance(state, dict) and {"python", "numpy", "torch"} <= state.keys()):
        raise ValueError("not the random-number state TurnRL saves")
    return state


def load_component(path: str | Path, name: str) -> dict | None:
    """A state dict saved with ``components={name: ...}``, or None if the checkpoint has none."""
    file = Path(path) / f"{name}.pt"
    if not file.exists():
        return None
    return _loading(Path(path), file.name, lambda: torch.load(file, weights_only=False))


def load_frozen(path: str | Path, name: str, model: torch.nn.Module) -> bool:
    """Weights saved with ``frozen={name: ...}`` into ``model`` in place; False (``model``
    untouched) if the checkpoint has none under ``name``."""
    directory = Path(path) / name
    if not weight_files(directory):
        return False
    load_weights(directory, model)
    return True


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint directory (weights of either kind, or a sharded
    checkpoint's, and state.json)."""
    path = Path(path)
    return (path / "state.json").is_file() and (
        any((path / f).is_file() for f in WEIGHT_FILES) or is_sharded_checkpoint(path))


def holds_adapter(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` holds a LoRA adapter (not the whole model)."""
    path = Path(path)
    return (path / ADAPTER_WEIGHTS).is_file() or (
        is_sharded_checkpoint(path) and (path / ADAPTER_CONFIG).is_file())


def _same_kind(path: Path, model: torch.nn.Module) -> bool:
    """Whether ``path`` holds an adapter; a one-line error unless ``model`` is LoRA alike."""
    adapter = holds_adapter(path)
    if adapter != is_lora(model):
        have = "a LoRA adapter" if adapter else "full model weights"
        need = "model.lora set as in its run" if adapter else "no model.lora"
        raise ValueError(f"checkpoint '{path}' holds {have}: load it with {need}")
    return adapter


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """A checkpoint's weights into ``model`` in place: the whole model, or a LoRA run's
    adapter into ``model``'s adapter. A mismatch (an adapter checkpoint and a model without
    ``model.lora``, or the reverse) is a one-line error. A sharded checkpoint's files are
    checked against its manifest first."""
    path = Path(path)
    adapter = _same_kind(path, model)
    if is_sharded_checkpoint(path):
        read_state(path)
        _loading(path, "the sharded weights", lambda: load_sharded(path, model))
    elif adapter:
        _loading(path, ADAPTER_WEIGHTS, lambda: load_adapter(model, path))
    elif not (path / MODEL_WEIGHTS).is_file():
        raise unusable(path, f"it has no weights ({MODEL_WEIGHTS} or {ADAPTER_WEIGHTS})")
    else:
        _loading(path, MODEL_WEIGHTS, lambda: load_model(model, str(path / MODEL_WEIGHTS)))
