"""Decoding on CPU through oneDNN's packed matrix products (``sampler.matmul``, issue 36).

Why: a decode step multiplies a few rows by every weight matrix, so it is bound by reading
the weights. torch's ``linear`` on CPU read them at 6-19 GB/s on the 2-core test machine
(SmolLM2-135M, 4 rows; the 113 MB LM head slowest), against 42 GB/s of measured bandwidth.
oneDNN's product on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the kernel PyTorch's own compiler emits on CPU)
was 1.0-4.7x faster per product at 4 rows (the LM head most) and 1.2-1.4x at 256 (docs/samplers.md).

What: ``packed_decoder(model)`` is a second module tree over the *same* tensors in which
every ``nn.Linear`` is a ``PackedLinear``. A ``PackedLinear`` packs its weight at its first
call and again after ``unpack(decoder)`` (weights that take a gradient), which the HF engine
calls whenever its version is set (every new version of the weights sets it:
``policy.publish``), so the first
generate after an update repacks (0.14-0.26 s for SmolLM2's 135M float32 parameters on 2
cores). It also repacks when the weight's storage or version counter moved; the counter alone
is not enough: fused AdamW writes the weights without bumping it. The learner's modules are
never touched: training, autograd and other threads keep plain ``nn.Linear``. The packed
weights take the linear weights' memory again.

Arithmetic: the same products summed in another order, so sampled log-probabilities differ
from the learner's by about 1e-5 nats (the ``mismatch/*`` metrics report it), where torch's
kernels reproduce them bit for bit.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
from torch.nn import functional

from turnrl.config.types import ConfigError
from turnrl.devices import available_memory_bytes

PACK_ROWS = 32
"""oneDNN's hint of the rows a product will see; 4, 32 and 128 timed the same from 4 rows up
(SmolLM2 shapes; 1 was slower)."""


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear``'s product through oneDNN on a packed copy of its weight, repacked when
    the weight changed. Falls back to ``functional.linear`` where the packed product does not
    apply: a gradient is wanted, the input's dtype is not the weight's, or it is empty."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear  # shares the Parameter: no copy until packed
        self.packed: tuple[tuple[int, int, int], torch.Tensor] | None = None
        """(what it was packed from, the packed weight), one attribute so that another
        thread's ``unpack`` never leaves half of it."""

    @property
    def weight(self) -> torch.nn.Parameter:  # read by code that inspects layers (PEFT)
        return self.linear.weight

    @property
    def bias(self) -> torch.nn.Parameter | None:
        return self.linear.bias

    def packed_weight(self) -> torch.Tensor:
        weight = self.linear.weight
        source = (id(weight), weight.data_ptr(), weight._version)
        packed = self.packed
        if packed is None or packed[0] != source:
            self.packed = packed = None  # the old one freed first: no third copy at the peak
            self.packed = packed = (source, _pack(weight))
        return packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.linear.weight
        if x.dtype != weight.dtype or x.numel() == 0 or (torch.is_grad_enabled()
                                                        and x.requires_grad):
            return functional.linear(x, weight, self.linear.bias)
        rows = x.reshape(-1, x.shape[-1])
        out = _product(rows if rows.is_contiguous() else rows.contiguous(),
                       self.packed_weight(), self.linear.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def unpack(decoder: torch.nn.Module) -> None:
    """Drop the packed weights of ``decoder`` that training may have changed, those that take
    a gradient: the next pass packs them as they are. A frozen weight (a LoRA run's base
    model) stays packed, as long as its storage and version counter stay (a checkpoint load
    moves the counter), so LoRA packs the base once."""
    for module in decoder.modules():
        if isinstance(module, PackedLinear) and module.linear.weight.requires_grad:
            module.packed = None


def packed_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """A module tree over ``model``'s own tensors (parameters and buffers shared, not copied)
    with every ``nn.Linear`` a ``PackedLinear``, in eval mode; ``model`` is left as it was."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    decoder = copy.deepcopy(model, shared)
    for module in list(decoder.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, PackedLinear(child))
    return decoder.eval()


def onednn_unusable(model: torch.nn.Module) -> str | None:
    """Why oneDNN's packed products cannot decode ``model`` here (None: they can): the model is
    not on the CPU, torch was built without oneDNN, the dtype is neither float32 nor bfloat16
    (bfloat16 also needs native bf16, read from the CPU), or a self-check of one product
    against torch's fails."""
    from turnrl.config.precision import cpu_has_bf16

    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device}, and oneDNN's products are for the CPU"
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no oneDNN (mkldnn) linear"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"the model is {param.dtype}; oneDNN's products here take float32 or bfloat16"
    if param.dtype == torch.bfloat16 and not cpu_has_bf16():
        return "the model is bfloat16 and this CPU has no native bf16"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).to(param.dtype)
    rows = torch.randn(3, 32, generator=generator).to(param.dtype)
    try:
        got = _product(rows, _pack(weight), None)
    except RuntimeError as err:
        return f"oneDNN's linear failed: {str(err).splitlines()[0]}"
    tolerance = 1e-4 if param.dtype == torch.float32 else 5e-2
    if not torch.allclose(got.float(), functional.linear(rows, weight).float(),
                          rtol=tolerance, atol=tolerance):
        return "oneDNN's product disagreed with torch's on a self-check"
    return None


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s distinct ``nn.Linear`` weights: what packing them adds."""
    weights = {id(m.weight): m.weight for m in model.modules() if type(m) is torch.nn.Linear}
    return sum(w.numel() * w.element_size() for w in weights.values())


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest CPU cache (sysfs: ``index*/size`` files such as ``32768K``), None where
    none can be read."""
    sizes = []
    for entry in root.glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
                         .get(text[-1], 1))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=None)


def resolve_matmul(requested: str, model: torch.nn.Module) -> str:
    """``sampler.matmul`` for the engine on ``model``: ``torch`` or ``onednn``. ``auto`` is
    onednn where it is usable, the weights do not fit in the CPU's largest cache (where they
    do, a decode step is not bound by reading them and the packed products' overhead lost:
    the tiny test model, 0.6 MB, sampled 1.5x slower) and the packed copy fits in half the
    memory available now. An explicit ``onednn`` that is unusable fails in one line."""
    if requested == "torch":
        return "torch"
    reason = onednn_unusable(model)
    if requested == "onednn":
        if reason:
            raise ConfigError(f"sampler.matmul onednn: {reason}; use --sampler.matmul torch")
        return "onednn"
    weights, cache, available = (linear_weight_bytes(model), last_level_cache_bytes(),
                                 available_memory_bytes())
    streams = cache is None or weights > cache
    fits = available == 0 or 2 * weights <= available  # 0: unknown
    return "onednn" if reason is None and streams and fits else "torch"
