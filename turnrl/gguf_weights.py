"""Reading a llama GGUF file into a Hugging Face model: its weights, dequantised with the
``gguf`` package, and its special tokens (``turnrl.models`` converts the bundled SmolLM2 with
these once and caches the result)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def gguf_special_token_ids(gguf_path: Path) -> dict[str, int]:
    """The GGUF's own bos/eos token ids (``tokenizer.ggml.*_token_id``).

    transformers' reading of a GGUF tokenizer varies by version: 5.17 maps SmolLM2's eos to
    <|im_start|> (id 1) although the file says 2, which 5.24 reads right. The file is the truth.
    """
    import gguf

    fields = gguf.GGUFReader(gguf_path).fields
    ids = {}
    for role in ("bos", "eos"):
        field = fields.get(f"tokenizer.ggml.{role}_token_id")
        if field is not None:
            ids[role] = int(field.parts[field.data[0]][0])
    return ids


def set_special_tokens(tokenizer: PreTrainedTokenizerBase, ids: dict[str, int]) -> None:
    """Point the tokenizer's bos/eos at the given token ids."""
    for role, token_id in ids.items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


def copy_gguf_weights(gguf_path: Path, model: PreTrainedModel) -> None:
    """Dequantise every tensor of a llama GGUF into ``model`` (a ``LlamaForCausalLM`` of the
    GGUF's config); a shape that differs or a parameter the file lacks is an error."""
    import gguf

    config = model.config
    reader = gguf.GGUFReader(gguf_path)
    layer_names = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    top_names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
    filled: set[int] = set()
    with torch.no_grad():
        for tensor in reader.tensors:
            stem, _, suffix = tensor.name.rpartition(".")
            if stem.startswith("blk."):
                _, layer, part = stem.split(".", 2)
                name = f"model.layers.{layer}.{layer_names[part]}.{suffix}"
            else:
                name = f"{top_names[stem]}.{suffix}"
            weights = gguf.dequantize(tensor.data, tensor.tensor_type)
            # llama.cpp interleaves q/k rows for its rotary layout; undo it for HF's half-split.
            if stem.endswith("attn_q"):
                weights = _unpermute_rotary(weights, config.num_attention_heads)
            elif stem.endswith("attn_k"):
                weights = _unpermute_rotary(weights, config.num_key_value_heads)
            param = model.get_parameter(name)
            if tuple(weights.shape) != tuple(param.shape):
                raise ValueError(f"{tensor.name}: shape {weights.shape} != {tuple(param.shape)}")
            param.copy_(torch.from_numpy(weights.copy()))
            filled.add(id(param))
    missing = [n for n, p in model.named_parameters() if id(p) not in filled]
    if missing:
        raise ValueError(f"GGUF has no weights for: {', '.join(missing[:5])}")


def _unpermute_rotary(weights, n_heads: int):
    rows = weights.shape[0]
    return (weights.reshape(n_heads, rows // n_heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
