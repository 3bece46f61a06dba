"""LoRA through PEFT: the adapter a ``model.lora`` run trains instead of the whole model.

One model holds both policies: the adapter on is the policy trained, the adapter off is the
base model, which is the KL reference (``adapter_disabled``), so a LoRA run with a KL term
keeps no second copy of the model. Only the adapter's tensors are optimised, checkpointed
(PEFT's own ``adapter_model.safetensors`` + ``adapter_config.json``, which
``PeftModel.from_pretrained`` reads) and sent to rollout workers (``published_state``).

Everything here that touches PEFT imports it lazily: a run without ``model.lora`` never needs
it, and a run with it fails at start-up with one line naming the extra (``require_peft``).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from turnrl import safe_json
from turnrl.config import ConfigError, LoraSpec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MISSING_PEFT = ("model.lora.r > 0 trains a LoRA adapter, which needs PEFT (not installed): "
                "pip install 'turnrl[peft]'")


def require_peft() -> None:
    """Fail in one line, before any model loads, when PEFT is missing."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError(MISSING_PEFT) from None


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (its trainable state is the adapter). PEFT not yet
    imported means no PEFT model exists: a full fine-tune never pays for importing it."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_module_names(model: nn.Module) -> list[str]:
    """The last name of each distinct linear layer kind (q_proj, down_proj, lm_head ...)."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, nn.Linear)}
    return sorted(names)


def check_target_modules(model: nn.Module, spec: LoraSpec) -> None:
    """Each named target must end the dotted path of a linear layer of ``model``; a name
    that matches none (a typo, another architecture's name) fails in one line."""
    if isinstance(spec.target_modules, str):  # 'all-linear'
        return
    paths = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for target in spec.target_modules:
        if not any(p == target or p.endswith(f".{target}") for p in paths):
            raise ConfigError(
                f"model.lora.target_modules: '{target}' is no linear layer of this model; its "
                f"linear layers are {', '.join(linear_module_names(model))} (or use "
                "'all-linear')")


def add_adapter(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """``model`` wrapped in a fresh LoRA adapter (B = 0: it starts as the base model), only
    the adapter trainable. A's initialisation draws from torch's global generator (seeded
    by the run)."""
    require_peft()
    from peft import LoraConfig, get_peft_model

    check_target_modules(model, spec)
    targets = spec.target_modules
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=targets if isinstance(targets, str) else list(targets),
                        bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # PEFT asks transformers a since-renamed question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        return get_peft_model(model, config)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimiser updates: all of a full fine-tune, the adapter of LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (no adapter name in them)."""
    return {k: v.detach() for k, v in get_peft_model_state(model).items()}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``adapter_state``'s tensors into ``model``'s adapter; a missing or unexpected
    adapter tensor (another rank, other targets) is an error, not a silent partial load."""
    from peft import set_peft_model_state_dict

    expected = {k: tuple(v.shape) for k, v in adapter_state(model).items()}
    given = {k: tuple(v.shape) for k, v in state.items()}
    if given != expected:
        wrong = sorted(k for k in expected.keys() ^ given.keys()) or sorted(
            k for k in expected if expected[k] != given[k])
        raise ValueError(f"the adapter weights do not fit this run's model.lora (another "
                         f"rank or other target modules: {wrong[0]}); load them with the "
                         "model.lora section they were trained with")
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"the adapter weights have tensors this model lacks: {unexpected[:3]}")


def published_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a new policy version sends to rollout workers: the adapter alone for LoRA,
    otherwise every weight (a model sharded over learner ranks: ``turnrl.learner.weights``)."""
    if is_lora(model):
        return adapter_state(model)
    return {k: v.detach() for k, v in model.state_dict().items()}


def get_peft_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names, as ``model.state_dict()`` holds them:
    FSDP shards stay shards. PEFT 0.22+ gathers shards itself, a collective every rank must
    enter, and here rank 0 alone asks (``turnrl.learner.weights`` gathers in step)."""
    state = model.state_dict()
    return {saved: state[name] for saved, name in adapter_names(model, state).items()}


def adapter_names(model: nn.Module, state: dict | None = None) -> dict[str, str]:
    """PEFT's saved name of each adapter tensor (``adapter_model.safetensors``'s keys) ->
    its parameter name in ``model`` (``state``: its state dict, if already taken). PEFT is
    shown one-element markers, never the weights: it neither copies nor gathers them."""
    from peft import get_peft_model_state_dict

    markers = {name: torch.zeros(1) for name in (model.state_dict() if state is None else state)}
    by_id = {id(marker): name for name, marker in markers.items()}
    return {saved: by_id[id(marker)] for saved, marker in
            get_peft_model_state_dict(model, state_dict=markers).items()}


def load_published(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of ``published_state`` on a worker's copy of the policy."""
    if is_lora(model):
        load_adapter_state(model, state)
    else:
        model.load_state_dict(state)


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors in ``state`` (what a publication ships)."""
    return sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))


@contextlib.contextmanager
def adapter_disabled(model: nn.Module | None) -> Iterator[None]:
    """Inside: ``model`` (a LoRA policy) computes the base model, the KL reference. Other
    models are left as they are (a full fine-tune's reference is its own frozen copy)."""
    if model is not None and is_lora(model):
        with model.disable_adapter():
            yield
    else:
        yield


def adapter_config_dict(model: nn.Module) -> dict:
    """``adapter_config.json``'s contents, as ``PeftModel.save_pretrained`` writes them."""
    config = model.peft_config["default"].to_dict()
    for key, value in config.items():  # sets (target_modules) are not JSON
        if isinstance(value, set):
            config[key] = sorted(value)
    return config


def save_adapter(model: nn.Module, directory: Path, base_model: str = "") -> None:
    """The adapter as PEFT lays it out: ``adapter_model.safetensors`` and
    ``adapter_config.json`` (``base_model_name_or_path`` = ``base_model``)."""
    from safetensors.torch import save_file

    state = {k: v.contiguous().cpu() for k, v in adapter_state(model).items()}
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {**adapter_config_dict(model), "base_model_name_or_path": base_model}
    (directory / ADAPTER_CONFIG).write_text(safe_json.dumps(config, indent=2) + "\n")


def load_adapter(model: nn.Module, directory: Path) -> None:
    """``save_adapter``'s weights into ``model``'s adapter."""
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    load_adapter_state(model, load_file(str(directory / ADAPTER_WEIGHTS), device=str(device)))


def vllm_lora_config(spec: LoraSpec | None) -> dict | None:
    """The ``adapter_config.json`` fields a vLLM engine needs for ``spec`` (None: no LoRA);
    the target modules are read off the tensors it is sent."""
    if spec is None:
        return None
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.r,
            "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none"}


def base_copy(model: nn.Module) -> nn.Module:
    """The base model of a LoRA policy as a separate plain model (to save for an engine that
    loads its own copy); a plain model as it is."""
    if not is_lora(model):
        return model
    import copy

    return copy.deepcopy(model).unload()


def merged(model: nn.Module) -> nn.Module:
    """A plain transformers model with the adapter folded into its weights (W + s B A)."""
    return model.merge_and_unload() if is_lora(model) else model
