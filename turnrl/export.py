"""``turnrl export CHECKPOINT_DIR|RUN_DIR OUT_DIR``: a checkpoint as a plain Hugging Face model.

A TurnRL checkpoint holds weights only (``model.safetensors``) plus optimiser and sampler
state; the model it was trained from is named in its run's ``config.yaml``. Export loads that
model with the checkpoint's weights, puts on its tokenizer the chat template the run used
(``model.chat_template`` when the run replaced it), and writes a directory that
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and ``AutoTokenizer.from_pretrained(OUT_DIR)``
load with nothing of TurnRL. The directory is built aside and renamed into place, then read
back and checked: the reloaded model's log-probabilities on a probe conversation against the
checkpoint's (the largest absolute difference is printed and recorded).

A LoRA run's checkpoint (the adapter alone) exports merged by default: the adapter folded into
the base weights, a plain model like any other. ``--adapter-only`` writes the PEFT adapter
(``adapter_model.safetensors``, ``adapter_config.json``, whose ``base_model_name_or_path`` is
the hub id or local directory of the base) with the tokenizer; it is checked through
``PeftModel.from_pretrained`` on a freshly loaded base.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from turnrl import safe_json
from turnrl.checkpoint import holds_adapter, is_checkpoint, latest_checkpoint, load_weights
from turnrl.config import ConfigError, load_run_config
from turnrl.hub import is_hub_id
from turnrl.lora import ADAPTER_WEIGHTS, add_adapter, merged, save_adapter
from turnrl.models import load_model, model_directory
from turnrl.policy import use_chat_template

EXPORT_RECORD = "turnrl_export.json"
ADAPTER_FILE = ADAPTER_WEIGHTS
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
    if is_checkpoint(path):
        return path
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"run directory '{path}' has no checkpoint yet; train until "
                                    "one is written (run.checkpoint_every) and export again")
        return found
    raise FileNotFoundError(f"'{path}' is neither a TurnRL checkpoint (model.safetensors, "
                            "adapter_model.safetensors or a sharded .metadata, state.json) nor "
                            "a run directory (config.yaml, checkpoints/)")


def export_model(source: str | Path, out_dir: str | Path, *, adapter_only: bool = False
                 ) -> ExportResult:
    """Write the checkpoint at ``source`` (or a run's newest) to ``out_dir`` as a Hugging Face
    model directory with its tokenizer and chat template; ``out_dir`` must not hold files.

    A LoRA run's checkpoint is written merged (the adapter folded into the base weights: a
    plain model) or, with ``adapter_only``, as the PEFT adapter alone, which
    ``PeftModel.from_pretrained(base, OUT_DIR)`` puts on the base model. Either is read back
    and compared with the checkpoint as trained (base + adapter, unmerged)."""
    checkpoint = resolve_checkpoint(source)
    saved = checkpoint.parent.parent / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"checkpoint '{checkpoint}' has no run config at {saved}; "
                                "export needs the run directory the checkpoint was written in")
    cfg = load_run_config(str(saved))  # checks model.chat_template, the file still exists
    lora = holds_adapter(checkpoint)
    if adapter_only and not lora:
        raise ConfigError(f"--adapter-only: this run has no LoRA adapter (checkpoint "
                          f"'{checkpoint}' holds full weights); export without --adapter-only")
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export target '{out}' exists and is not empty; name a new "
                              "directory or remove it first")
    if lora:
        model, tokenizer = trained_policy(checkpoint, cfg)
    else:
        model, tokenizer = load_model(str(checkpoint), dtype=cfg.model.dtype,
                                      cache_dir=cfg.model.cache_dir or None)
    use_chat_template(tokenizer, cfg.model.chat_template)
    model.eval()
    expected = probe_logprobs(model, tokenizer)  # the checkpoint as trained
    step = json.loads((checkpoint / "state.json").read_text()).get("step")
    record = {"checkpoint": str(checkpoint.resolve()), "step": step,
              "base_model": cfg.model.name, "revision": cfg.model.revision,
              "dtype": cfg.model.dtype, "chat_template_file": cfg.model.chat_template,
              "lora": dict(cfg.model.lora) if lora else None, "adapter_only": adapter_only}
    if adapter_only:
        _write_atomically(out, partial(save_adapter, model, base_model=adapter_base(cfg)),
                          tokenizer, record)
        reloaded = reload_adapter(out, cfg)
    else:
        model = merged(model)  # LoRA: W + (alpha / r) B A, a plain transformers model
        _write_atomically(out, model.save_pretrained, tokenizer, record)
        reloaded = reload_plain(out, model.dtype, cfg.model.trust_remote_code)
    diff = logprob_difference(expected, tokenizer, reloaded, out)
    record["max_logprob_diff"] = diff
    (out / EXPORT_RECORD).write_text(safe_json.dumps(record, indent=2) + "\n")
    if diff > MAX_LOGPROB_DIFF[cfg.model.dtype]:
        raise ValueError(f"the exported model in '{out}' does not reproduce the checkpoint: "
                         f"log-probs differ by up to {diff:.3g}")
    return ExportResult(out, checkpoint, cfg.model.name, diff)


def trained_policy(checkpoint: Path, cfg):
    """A LoRA checkpoint as training ran it: the base model with the adapter on top."""
    base, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype,
                                 cache_dir=cfg.model.cache_dir or None,
                                 revision=cfg.model.revision,
                                 trust_remote_code=cfg.model.trust_remote_code)
    with torch.random.fork_rng(devices=[]):  # A's fresh draw is overwritten
        model = add_adapter(base, cfg.model.lora_plan())
    load_weights(checkpoint, model)  # today's adapter files, or a sharded checkpoint's
    return model, tokenizer


def adapter_base(cfg) -> str:
    """``base_model_name_or_path`` of an exported adapter: a hub id as such, else the local
    directory the base was read from ('tiny', built in code, has none)."""
    if is_hub_id(cfg.model.name) and not Path(cfg.model.name).expanduser().exists():
        return cfg.model.name
    path = model_directory(cfg.model.name, cfg.model.cache_dir or None, cfg.model.revision)
    return str(path.resolve()) if path is not None else cfg.model.name


def reload_adapter(out: Path, cfg):
    """The exported adapter as PEFT loads it onto a freshly loaded base model."""
    from peft import PeftModel

    base, _ = load_model(cfg.model.name, dtype=cfg.model.dtype,
                         cache_dir=cfg.model.cache_dir or None, revision=cfg.model.revision,
                         trust_remote_code=cfg.model.trust_remote_code)
    return PeftModel.from_pretrained(base, out).eval()


def _write_atomically(out: Path, save_weights, tokenizer, record: dict) -> None:
    """Build the directory beside ``out`` (``save_weights(directory)`` writes the weights) and
    rename it into place: an export that fails half-way leaves no directory that looks
    complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        config = getattr(getattr(save_weights, "__self__", None), "config", None)
        if config is not None:
            config.name_or_path = ""  # the exported directory is its own source
        save_weights(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_RECORD).write_text(safe_json.dumps(record, indent=2) + "\n")
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


def reload_plain(out: Path, dtype: torch.dtype, trust_remote_code: bool = False):
    """The exported model as plain transformers loads it."""
    from transformers import AutoModelForCausalLM

    local = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype, **local).eval()


def logprob_difference(expected: torch.Tensor, tokenizer, reloaded, out: Path) -> float:
    """Largest |log-prob difference| between ``expected`` (the checkpoint's, on the probe)
    and ``reloaded`` read with ``out``'s own tokenizer and template."""
    from transformers import AutoTokenizer

    reloaded_tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if reloaded_tokenizer.chat_template != tokenizer.chat_template:
        raise ValueError(f"the tokenizer saved in '{out}' lost the run's chat template")
    theirs = probe_logprobs(reloaded, reloaded_tokenizer)
    if expected.shape != theirs.shape:
        raise ValueError(f"the tokenizer saved in '{out}' encodes the probe differently")
    return float((expected - theirs).abs().max())
