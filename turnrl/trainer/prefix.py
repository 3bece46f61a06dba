"""Running the prompt that a group's rows share once in the update (``optim.shared_prefix``).

Two ways to the same hidden states, to float tolerance:

- packed (``packed_prefix_hidden``): each distinct prefix and the suffixes of the rows that
  share it are laid end to end in one sequence; a block mask lets every suffix see the prefix
  and its own earlier tokens, and position ids restart each suffix where its row cut it. One
  forward pass: every weight meets all the tokens in one matrix product.
- cached (``cached_prefix_hidden``): the prefixes run first, their key/value cache is indexed
  out to the rows, then the suffixes run against it. Two passes, so the backward pass makes
  two gradient products per weight and adds them, and a tied embedding gets two dense
  gradients: on SmolLM2 a GRPO update took 1.24x as long as packed at G=4 and 1.33x at G=16
  (``benchmarks/speed/shared_prefix.py``).

Packed needs a decoder checked to run it (``PACKABLE_MODELS``: attention-only, Llama-shaped)
whose attention takes a custom 4D mask (``sdpa``, ``eager``), and pays only while the
masked-out attention it still computes is small next to the linear layers' work
(``packing_pays``); otherwise the update takes the cached path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from turnrl.devices import cache_kwargs
from turnrl.types import Batch

MASKED_ATTENTION_SHARE = 0.1
"""Packing pays while the attention it computes and then masks out is at most this share of
the linear layers' work (the per-token cost both ways share)."""


@dataclass(frozen=True)
class PrefixSplit:
    """Rows cut where their own tokens begin; rows with the same prompt share its cut.

    ``cut[b]`` tokens of row ``b`` form its prefix: everything before its first policy
    token except the last prompt token, which stays with the suffix because its hidden
    state scores the first policy token. ``owner[b]`` indexes ``prefixes``, the distinct
    prefixes (all equal for the rows of one GRPO group).

    Tree rollouts (rollout/branch.py): the row that trains a fork's shared turns holds its
    siblings' whole prefix, its own policy tokens inside it; it joins that prefix (``cut`` =
    the prefix's length), and its tokens there are scored from the prefix's pass, so the
    prefix runs once for all ``k`` continuations.
    """

    cut: torch.Tensor  # [B]
    owner: torch.Tensor  # [B]
    prefixes: list[list[int]]


def shared_prefix_split(mb: Batch) -> PrefixSplit | None:
    """Find the prompts rows share; None when no two rows share a prefix worth skipping (or
    no row has a policy token)."""
    has_policy = mb.loss_mask.bool().any(dim=1)
    if not bool(has_policy.any()):
        return None
    cut = torch.where(has_policy, mb.loss_mask.argmax(dim=1) - 1, 0).clamp(min=0).tolist()
    ids = mb.input_ids.tolist()
    keys = {tuple(row[:c]) for row, c in zip(ids, cut, strict=True)}
    for b, row in enumerate(ids):  # a fork's first continuation joins its siblings' prefix
        held = [len(key) for key in keys if len(key) > cut[b] and tuple(row[:len(key)]) == key]
        cut[b] = max(held, default=cut[b])
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(tuple(row[:c]), len(index)) for row, c in zip(ids, cut, strict=True)]
    if len(index) == len(owner) or min(cut) == 0:
        return None  # nothing shared, or a row with no prompt to share
    prefixes = [list(key) for key in index]
    return PrefixSplit(torch.tensor(cut), torch.tensor(owner), prefixes)


def scored_in_prefix(mb: Batch, split: PrefixSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, columns)`` of the prefix positions whose hidden state scores a policy token
    of that row (only a fork's first continuation has any): column ``c`` scores token
    ``c + 1``, which is in the prefix or is the suffix's first token."""
    columns = torch.arange(mb.input_ids.shape[1], device=mb.input_ids.device)
    following = mb.loss_mask.bool().roll(-1, dims=1)
    following[:, -1] = False
    inside = following & (columns[None, :] < split.cut.to(columns.device)[:, None])
    return inside.nonzero(as_tuple=True)


def _in_row_order(prefix_part: torch.Tensor, prefix_keys: torch.Tensor,
                  suffix_part: torch.Tensor, suffix_keys: torch.Tensor) -> torch.Tensor:
    """Hidden states scored in the prefix and in the suffixes, row-major (keys: row x width +
    column), as a plain pass gives them."""
    if not len(prefix_keys):
        return suffix_part[suffix_keys.argsort()]
    order = torch.cat([prefix_keys, suffix_keys]).argsort()
    return torch.cat([prefix_part, suffix_part])[order]


def shared_prefix_hidden(model: nn.Module, mb: Batch, split: PrefixSplit) -> torch.Tensor:
    """Hidden states ``[N, H]`` at the positions that score policy tokens (row-major, as
    ``hidden[:, :-1][loss_mask[:, 1:]]`` of a plain pass), each prefix run once."""
    decoder = model.get_decoder()
    if _mask_format(decoder) is not None:
        layout = PackedLayout.of(mb, split)
        if packing_pays(decoder.config, layout, split, mb):
            return packed_prefix_hidden(decoder, mb, layout, split)
    return cached_prefix_hidden(decoder, mb, split)


@dataclass(frozen=True)
class PackedLayout:
    """Where each token of the packed sequences comes from. Packed row ``u`` holds prefix
    ``u`` then, in batch order, the suffix of every row that shares it; tensors are ``[U, W]``.
    """

    piece: torch.Tensor
    """-1 on prefix tokens, ``b`` on row ``b``'s suffix, -2 on the padding after a short row."""
    source: torch.Tensor
    """The batch row the token is read from (for a prefix, the first row that shares it)."""
    column: torch.Tensor
    """The token's column in that row, which is also its position id."""

    @classmethod
    def of(cls, mb: Batch, split: PrefixSplit) -> PackedLayout:
        lengths = mb.attention_mask.sum(dim=1).tolist()
        cuts, owners = split.cut.tolist(), split.owner.tolist()
        pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in split.prefixes]
        for b, u in enumerate(owners):
            if not pieces[u]:
                pieces[u].append((-1, b, 0, cuts[b]))
            pieces[u].append((b, b, cuts[b], lengths[b]))
        width = max(sum(end - start for *_, start, end in p) for p in pieces)
        piece = torch.full((len(pieces), width), -2, dtype=torch.long)
        source = torch.zeros_like(piece)
        column = torch.zeros_like(piece)
        for u, packed in enumerate(pieces):
            at = 0
            for name, b, start, end in packed:
                span = slice(at, at + end - start)
                piece[u, span], source[u, span] = name, b
                column[u, span] = torch.arange(start, end)
                at += end - start
        return cls(piece, source, column)

    def attended(self) -> torch.Tensor:
        """``[U, W, W]`` booleans: query ``i`` may attend to key ``j``. Causal within the
        prefix and within each suffix, every suffix sees its prefix whole; a padding query
        sees only itself, so no query has nothing to attend to (kernels differ on what such a
        row gives, and a NaN there would reach every weight gradient)."""
        query, key = self.piece[:, :, None], self.piece[:, None, :]
        width = self.piece.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same_piece = (key == query) | ((key == -1) & (query >= 0))
        itself = torch.eye(width, dtype=torch.bool)
        return (causal & same_piece & (query != -2)) | itself


def packing_pays(config, layout: PackedLayout, split: PrefixSplit, mb: Batch) -> bool:
    """Whether packed attention's wasted work (query-key pairs it computes and masks out)
    stays under ``MASKED_ATTENTION_SHARE`` of the linear layers' work on the same tokens.

    Per layer and token a linear layer costs 2 FLOPs a weight; each query-key pair costs
    4 x heads x head size (scores and the weighted sum). Counts only, no machine constant."""
    sliding = getattr(config, "sliding_window", None)
    if sliding and int(layout.column.max()) >= sliding:
        return False  # one 4D mask for every layer would drop the sliding window
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    layer_weights = hidden * (2 * heads * head_dim + 2 * kv + 3 * inner)  # a gated MLP
    tokens = int((layout.piece != -2).sum())
    packed_pairs = layout.piece.shape[0] * layout.piece.shape[1] ** 2
    prefix_lengths = torch.tensor([len(p) for p in split.prefixes])
    suffix_lengths = mb.attention_mask.sum(dim=1) - split.cut
    needed = int((prefix_lengths**2).sum() + (suffix_lengths * (split.cut + suffix_lengths)).sum())
    wasted = 4 * heads * head_dim * (packed_pairs - needed)
    return wasted <= MASKED_ATTENTION_SHARE * 2 * layer_weights * tokens


PACKABLE_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""``config.model_type`` of the decoders the packed path runs on: attention-only Llama-shaped
stacks, each checked against a plain pass in tests/trainer/test_prefix.py. Others (hybrid recurrent or
convolutional layers would carry state from one packed suffix into the next; per-layer inputs,
shared key/value layers, older mask code) keep the cached path until they are checked."""


def _mask_format(decoder: nn.Module) -> str | None:
    """How this decoder's attention takes a custom 4D mask: booleans (sdpa), an additive float
    mask (eager), or not at all (None): flash attention and other kernels, and any model type
    not in ``PACKABLE_MODELS``."""
    config = decoder.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "model_type", None) not in PACKABLE_MODELS \
            or not kinds <= {"full_attention", "sliding_attention"}:
        return None
    return {"sdpa": "bool", "eager": "float"}.get(getattr(config, "_attn_implementation", None))


def packed_prefix_hidden(decoder: nn.Module, mb: Batch, layout: PackedLayout,
                         split: PrefixSplit) -> torch.Tensor:
    """One forward pass over the packed sequences (see the module docstring)."""
    device = mb.input_ids.device
    piece, source, column = (t.to(device) for t in (layout.piece, layout.source, layout.column))
    allowed = layout.attended().to(device)[:, None]
    if _mask_format(decoder) == "bool":
        mask = allowed
    else:
        dtype = next(decoder.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    hidden = decoder(input_ids=mb.input_ids[source, column], attention_mask=mask,
                     position_ids=column, use_cache=False).last_hidden_state
    # Suffix token (b, c) scores token c + 1 of row b when the policy wrote that one.
    lengths = mb.attention_mask.sum(dim=1)
    width = mb.input_ids.shape[1]
    following = (column + 1).clamp(max=width - 1)
    scores = (piece >= 0) & mb.loss_mask.bool()[source, following] & (column + 1 < lengths[source])
    rows, columns = scored_in_prefix(mb, split)  # a prefix's column c sits at packed place c
    return _in_row_order(hidden[split.owner.to(device)[rows], columns], rows * width + columns,
                         hidden[scores], (source * width + column)[scores])


def cached_prefix_hidden(decoder: nn.Module, mb: Batch, split: PrefixSplit) -> torch.Tensor:
    """The prefixes through the decoder once (with gradients), their key/value cache indexed
    out to every row that shares it (indexing is differentiable: the backward pass sums each
    row's gradient into the one prefix computation), then each row's suffix attends to its
    prefix through that cache. Prefixes are padded on the right; the attention mask hides
    the padding and explicit positions skip it."""
    device = mb.input_ids.device
    width = max(len(p) for p in split.prefixes)
    prefix_ids = torch.full((len(split.prefixes), width), int(mb.input_ids[0, 0]),
                            dtype=torch.long, device=device)
    prefix_mask = torch.zeros_like(prefix_ids)
    for u, prefix in enumerate(split.prefixes):
        prefix_ids[u, :len(prefix)] = torch.tensor(prefix, device=device)
        prefix_mask[u, :len(prefix)] = 1
    cache = DynamicCache()
    prefix_hidden = decoder(input_ids=prefix_ids, attention_mask=prefix_mask,
                            **cache_kwargs(decoder, cache), use_cache=True).last_hidden_state
    owner = split.owner.to(device)
    cache.batch_select_indices(owner)

    cut = split.cut.to(device)
    lengths = mb.attention_mask.sum(dim=1)
    suffix_width = int((lengths - cut).max())
    columns = cut[:, None] + torch.arange(suffix_width, device=device)[None, :]
    in_row = columns < lengths[:, None]
    columns = columns.clamp(max=mb.input_ids.shape[1] - 1)
    suffix_ids = mb.input_ids.gather(1, columns).masked_fill(~in_row, int(mb.input_ids[0, 0]))
    attention_mask = torch.cat([prefix_mask[owner], in_row.long()], dim=1)
    hidden = decoder(input_ids=suffix_ids, attention_mask=attention_mask, position_ids=columns,
                     **cache_kwargs(decoder, cache), use_cache=True).last_hidden_state
    # Suffix position k holds token cut + k; it scores token cut + k + 1.
    scores_next = mb.loss_mask.gather(1, (columns + 1).clamp(max=mb.input_ids.shape[1] - 1))
    scores_next = scores_next.bool() & ((columns + 1) < lengths[:, None])
    rows, at = scored_in_prefix(mb, split)
    row_of = torch.arange(len(cut), device=device)[:, None].expand_as(columns)
    return _in_row_order(prefix_hidden[owner[rows], at], rows * mb.input_ids.shape[1] + at,
                         hidden[scores_next],
                         (row_of * mb.input_ids.shape[1] + columns)[scores_next])
