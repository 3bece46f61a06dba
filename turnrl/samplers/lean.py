"""A lean forward pass for sampling Llama-shaped decoders on CPU (``sampler.matmul onednn``).

Why: a decode step at a few rows is short arithmetic spread over many small calls. On SmolLM2
(30 layers, 4 rows, 2 cores) a step took about 45 ms, of which about 24 ms were the products
and about 21 ms transformers' per-layer Python, the ``PackedLinear`` modules and small kernels
(docs/benchmarks.md, stop 48). This pass is the same arithmetic written as one loop over the
layers: q, k and v in one packed product, gate and up in another, keys and values written
straight into the engine's buffer, the learner's modules never called or changed.

Which models: ``config.model_type`` in ``LEAN_MODELS`` (llama, mistral, qwen2, qwen3:
attention-only, Llama-shaped), plain ``nn.Linear`` projections, RMS norms, and a start-up
self-check: the lean pass's logits must match transformers' on a short batch. Any other model
(a LoRA wrapper among them) samples through the ``PackedLinear`` tree (onednn.py). It takes
the engine's masks as transformers' pass does (masks.py): one for every layer, or one per
layer type (a Qwen2 with sliding layers), so sliding windows apply here too.

Arithmetic: oneDNN's products on the concatenated weights sum in another order than the
learner's ``nn.Linear``, so sampled log-probabilities differ from the learner's by about 1e-5
nats in float32 (the ``mismatch/*`` metrics report it every step).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from turnrl.samplers import onednn
from turnrl.samplers.masks import mask_plan, prefill_mask
from turnrl.samplers.onednn import _pack, _product

LEAN_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class _FusedWeight:
    """The packed concatenation of some linear layers' weights and a copy of their biases,
    made again when any of those tensors moved (storage or version counter) or after
    ``drop_trainable``."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.packed: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def _tensors(self) -> list[torch.Tensor]:
        return [t for m in self.linears for t in (m.weight, m.bias) if t is not None]

    def _source(self) -> tuple:
        return tuple((id(t), t.data_ptr(), t._version) for t in self._tensors())

    def drop_trainable(self) -> None:
        """Forget the copies if any of the tensors takes a gradient now: fused AdamW writes
        them without moving their version counters."""
        if any(t.requires_grad for t in self._tensors()):
            self.packed = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        source, packed = self._source(), self.packed
        if packed is None or packed[0] != source:
            self.packed = None  # the old copy freed before the new one is made
            weights = [m.weight.detach() for m in self.linears]
            weight = weights[0] if len(weights) == 1 else torch.cat(weights)
            biases = [m.bias for m in self.linears]
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            self.packed = packed = (source, _pack(weight), bias)
        return packed[1], packed[2]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        weight, bias = self.get()
        return _product(rows, weight, bias)


class _Layer:
    def __init__(self, layer: nn.Module):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm
        self.qkv = _FusedWeight([attention.q_proj, attention.k_proj, attention.v_proj])
        self.out = _FusedWeight([attention.o_proj])
        self.q_norm = getattr(attention, "q_norm", None)
        self.k_norm = getattr(attention, "k_norm", None)
        self.scaling = getattr(attention, "scaling", None)  # None: sdpa's 1/sqrt(head_dim)
        self.post_norm = layer.post_attention_layernorm
        self.gate_up = _FusedWeight([mlp.gate_proj, mlp.up_proj])
        self.down = _FusedWeight([mlp.down_proj])
        self.act = mlp.act_fn

    def weights(self) -> list[_FusedWeight]:
        return [self.qkv, self.out, self.gate_up, self.down]


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMS norm (float32 statistics, weight applied in the input dtype)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The layers transformers runs: the first ``num_hidden_layers``."""
    return list(model.model.layers[:model.config.num_hidden_layers])


def lean_unusable(model: nn.Module) -> str | None:
    """Why the lean pass cannot run ``model`` (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODELS:
        return f"model type {model_type!r} is not one of {sorted(LEAN_MODELS)}"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds)} are not attention-only"
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
        return "no model.layers / lm_head"
    for layer in _decoder_layers(model):
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in linears):
            return "a projection is not a plain nn.Linear (LoRA or another wrapper)"
        for fused in (linears[:3], linears[4:6]):  # concatenated: all with a bias or none
            if len({m.bias is None for m in fused}) > 1:
                return "some of q/k/v or gate/up have a bias and some not"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attention, n) for n in ("q_norm", "k_norm") if hasattr(attention, n)]
        if any(not hasattr(n, "variance_epsilon") for n in norms):
            return "a norm is not an RMS norm"
    if type(model.lm_head) is not nn.Linear:
        return "lm_head is not a plain nn.Linear"
    return None


class LeanDecoder:
    """The lean pass over ``model``'s own tensors (nothing copied but the packed weights and
    the biases beside them).

    ``last_logits`` feeds ``input_ids`` ``[rows, new]`` after the ``length`` filled columns of
    the engine's buffer ``kv`` ``[layers, 2, rows, kv_heads, capacity, head_dim]``, writes their
    keys and values there, and returns the logits of the last column. Not an ``nn.Module``:
    it borrows the learner's modules, and the engine's ``eval()``/``train()`` around a call
    must not switch them (the pass has no dropout, so it has no mode of its own)."""

    training = False

    def eval(self) -> LeanDecoder:
        return self

    def train(self, mode: bool = True) -> LeanDecoder:
        return self

    def __init__(self, model: nn.Module):
        config = model.config
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        self.layers = [_Layer(layer) for layer in _decoder_layers(model)]
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers)
        self.kinds = list(kinds[:len(self.layers)])  # picks a layer's mask from a mapping
        self.head = _FusedWeight([model.lm_head])
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)

    def unpack(self) -> None:
        """Drop the copies of tensors that take a gradient (new weights are coming)."""
        for fused in [w for layer in self.layers for w in layer.weights()] + [self.head]:
            fused.drop_trainable()

    def last_logits(self, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | dict[str, torch.Tensor],
                    position_ids: torch.Tensor, kv: torch.Tensor, length: int) -> torch.Tensor:
        rows, new = input_ids.shape
        end = length + new
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)  # [rows, new, dim]
        cos, sin = cos[:, :, None], sin[:, :, None]
        hidden = hidden.reshape(rows * new, -1)
        for index, (layer, kind) in enumerate(zip(self.layers, self.kinds, strict=True)):
            mask = attention_mask[kind] if isinstance(attention_mask, dict) else attention_mask
            x = _rms_norm(layer.input_norm, hidden)
            qkv = layer.qkv(x).view(rows, new, heads + 2 * kv_heads, dim)
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
            if layer.q_norm is not None:
                q, k = _rms_norm(layer.q_norm, q), _rms_norm(layer.k_norm, k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            cache = kv[index]
            cache[0, :, :, length:end] = k.transpose(1, 2)
            cache[1, :, :, length:end] = v.transpose(1, 2)
            attended = functional.scaled_dot_product_attention(
                q.transpose(1, 2), cache[0, :, :, :end], cache[1, :, :, :end],
                attn_mask=mask, scale=layer.scaling, enable_gqa=kv_heads != heads)
            hidden = hidden + layer.out(attended.transpose(1, 2).reshape(rows * new, heads * dim))
            x = _rms_norm(layer.post_norm, hidden)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(layer.act(gate) * up)
        last = hidden.view(rows, new, -1)[:, -1]
        return self.head(_rms_norm(self.norm, last))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def self_check(model: nn.Module, lean: LeanDecoder) -> str | None:
    """Why ``lean`` disagrees with ``model``'s own forward pass (None: it agrees): the logits
    of the next token after a 5-token prefill into an empty buffer and after one more token
    fed from that buffer, 2 rows, against transformers' pass on the same tokens, the largest
    gap in standard deviations of transformers' logits. The masks are the engine's (masks.py),
    so a window under 6 tokens is checked too."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=generator)
    kv = torch.zeros((config.num_hidden_layers, 2, 2, lean.kv_heads, 6, lean.head_dim),
                     dtype=model.dtype)
    plan, real = mask_plan(model), torch.ones(2, 6, dtype=torch.bool)
    positions = torch.arange(6).expand(2, 6)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids).logits[:, -2:].float()
            got = [lean.last_logits(ids[:, :5], plan(prefill_mask(real[:, :5], 0), positions[:, :5],
                                                     real[:, :5]), positions[:, :5], kv, 0),
                   lean.last_logits(ids[:, 5:], plan(real[:, None, None], positions[:, 5:], real),
                                    positions[:, 5:], kv, 5)]
    finally:
        model.train(was_training)
    # The gap relative to the logits' spread: a random tiny model's logits are all near 0.
    gap = float((torch.stack(got, dim=1).float() - expected).abs().max() / expected.std())
    bound = SELF_CHECK_BOUND.get(model.dtype, 0.0)
    return None if gap <= bound else f"its logits differ from transformers' by {gap:.3g} sd"


SELF_CHECK_BOUND = {torch.float32: 1e-3, torch.bfloat16: 0.05}
"""The largest gap the self-check accepts, in standard deviations of the logits: float rounding
is far below these (tests/samplers/test_lean.py), a wrong formula (rotary, norm) far above."""


def onednn_decoder(model: nn.Module) -> tuple[LeanDecoder | nn.Module, str]:
    """The engine's decoder for ``sampler.matmul onednn`` and its name for the start-up line:
    the lean pass where it runs the model and passes its self-check, else the
    ``PackedLinear`` tree (onednn.py), named with why the lean pass did not run."""
    why = lean_unusable(model)
    if why is None:
        try:
            lean = LeanDecoder(model)
            why = self_check(model, lean)
            if why is None:
                return lean, "lean pass"
        except Exception as err:  # noqa: BLE001 (a model the checks above missed: the tree runs it)
            why = f"the lean pass raised {type(err).__name__}: {err}"
    return onednn.packed_decoder(model), f"PackedLinear tree; no lean pass: {one_line(why)}"


def one_line(text: str, limit: int = 160) -> str:
    """``text`` on one line, cut to ``limit`` characters (a start-up line, not a traceback)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def unpack(decoder: LeanDecoder | nn.Module) -> None:
    """New weights: drop the packed copies of those that take a gradient, either decoder's."""
    if isinstance(decoder, LeanDecoder):
        decoder.unpack()
    else:
        onednn.unpack(decoder)
