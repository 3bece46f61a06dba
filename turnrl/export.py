"""``turnrl export CHECKPOINT_DIR|RUN_DIR OUT_DIR``: a checkpoint as a plain Hugging Face model.

A TurnRL checkpoint holds weights only (``model.safetensors``) plus optimiser and sampler
state; the model it was trained from is named in its run's ``config.yaml``. Export loads that
model with the checkpoint's weights, puts on its tokenizer the chat template the run used
(``model.chat_template`` when the run replaced it), and writes a directory that
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and ``AutoTokenizer.from_pretrained(OUT_DIR)``
load with nothing of TurnRL. The directory is built aside and renamed into place, then read
back and checked: the reloaded model's log-probabilities on a probe conversation against the
checkpoint's (the largest absolute difference is printed and recorded).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from turnrl.checkpoint import latest_checkpoint
from turnrl.config import ConfigError, load_run_config
from turnrl.models import load_model
from turnrl.policy import use_chat_template

EXPORT_RECORD = "turnrl_export.json"
ADAPTER_FILE = "adapter_model.safetensors"
# Exported weights must reproduce the checkpoint's log-probs to this; a wrong weight moves
# them by far more (whole nats), float32 rounding by ~1e-6. In bfloat16 the in-process model
# may hold its rotary frequencies in bfloat16 (the tiny model is cast with .to()) where a
# fresh load keeps them in float32: ~2e-3 on the tiny model.
MAX_LOGPROB_DIFF = {"float32": 1e-4, "bfloat16": 5e-2}
PROBE = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is 12 times 7? Answer with the number."},
         {"role": "assistant", "content": "12 times 7 is 84."}]


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    checkpoint: Path
    base_model: str
    max_logprob_diff: float


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or a run directory's newest checkpoint."""
    path = Path(path).expanduser()
    if (path / "model.safetensors").is_file() and (path / "state.json").is_file():
        return path
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"run directory '{path}' has no checkpoint yet; train until "
                                    "one is written (run.checkpoint_every) and export again")
        return found
    raise FileNotFoundError(f"'{path}' is neither a TurnRL checkpoint (model.safetensors, "
                            "state.json) nor a run directory (config.yaml, checkpoints/)")


def export_model(source: str | Path, out_dir: str | Path, *, adapter_only: bool = False
                 ) -> ExportResult:
    """Write the checkpoint at ``source`` (or a run's newest) to ``out_dir`` as a Hugging Face
    model directory with its tokenizer and chat template; ``out_dir`` must not hold files."""
    checkpoint = resolve_checkpoint(source)
    saved = checkpoint.parent.parent / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"checkpoint '{checkpoint}' has no run config at {saved}; "
                                "export needs the run directory the checkpoint was written in")
    cfg = load_run_config(str(saved))  # checks model.chat_template, the file still exists
    if adapter_only:
        export_adapter(checkpoint, Path(out_dir))
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export target '{out}' exists and is not empty; name a new "
                              "directory or remove it first")
    model, tokenizer = load_model(str(checkpoint), dtype=cfg.model.dtype,
                                  cache_dir=cfg.model.cache_dir or None)
    use_chat_template(tokenizer, cfg.model.chat_template)
    model.eval()
    step = json.loads((checkpoint / "state.json").read_text()).get("step")
    record = {"checkpoint": str(checkpoint.resolve()), "step": step,
              "base_model": cfg.model.name, "revision": cfg.model.revision,
              "dtype": cfg.model.dtype, "chat_template_file": cfg.model.chat_template}
    _write_atomically(out, model, tokenizer, record)
    diff = reload_difference(model, tokenizer, out, cfg.model.trust_remote_code)
    record["max_logprob_diff"] = diff
    (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if diff > MAX_LOGPROB_DIFF[cfg.model.dtype]:
        raise ValueError(f"the exported model in '{out}' does not reproduce the checkpoint: "
                         f"log-probs differ by up to {diff:.3g}")
    return ExportResult(out, checkpoint, cfg.model.name, diff)


def export_adapter(checkpoint: Path, out: Path) -> None:
    """``--adapter-only``: the LoRA adapter alone. Runs without one say so; adapter export
    itself comes with LoRA training (the checkpoint's ``adapter_model.safetensors``)."""
    if not (checkpoint / ADAPTER_FILE).is_file():
        raise ConfigError(f"--adapter-only: this run has no LoRA adapter (checkpoint "
                          f"'{checkpoint}' holds full weights); export without --adapter-only")
    raise ConfigError("--adapter-only: exporting a LoRA adapter is not supported yet; export "
                      "without --adapter-only for the merged model")


def _write_atomically(out: Path, model, tokenizer, record: dict) -> None:
    """Build the directory beside ``out`` and rename it into place: an export that fails
    half-way leaves no directory that looks complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.config.name_or_path = ""  # the exported directory is its own source
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def probe_logprobs(model, tokenizer) -> torch.Tensor:
    """Log-probability of each token of the probe conversation given those before it."""
    text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


def reload_difference(model, tokenizer, out: Path, trust_remote_code: bool = False) -> float:
    """Largest |log-prob difference| between ``model`` and the one plain transformers loads
    from ``out`` (with ``out``'s own tokenizer and template), on the probe conversation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=model.dtype, **local)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out, **local)
    if reloaded_tokenizer.chat_template != tokenizer.chat_template:
        raise ValueError(f"the tokenizer saved in '{out}' lost the run's chat template")
    ours, theirs = probe_logprobs(model, tokenizer), probe_logprobs(reloaded, reloaded_tokenizer)
    if ours.shape != theirs.shape:
        raise ValueError(f"the tokenizer saved in '{out}' encodes the probe differently")
    return float((ours - theirs).abs().max())
