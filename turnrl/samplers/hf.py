"""A Hugging Face transformers engine for CPU: batched sampling with a KV cache kept per row.

A call left-pads its prompts into one batch, prefills them, then decodes token by token. Keys
and values outlive the call, *per sequence*: a later call prefills only what is new. Rules:

- After a call each row leaves its sequence (prompt + reply, less the last sampled token,
  which was never fed) with that sequence's keys and values, real positions only.
- A prompt that extends a kept sequence continues from it: only the tokens past it are
  prefilled; others from scratch in the same batch (their past is masked zeros). Rows may come
  and go freely between calls, as in the continuous loop.
- A kept sequence that a call extends is replaced by the longer one; sequences a call does
  not touch stay for later calls. At most ``max_kept_rows`` sequences are kept (or the last
  call's rows, if more: those are never evicted), least recently written evicted first, so
  ended episodes cannot pile up.
- ``load`` (new weights) drops every kept sequence: their keys and values are stale.
  With ``keep_cache_across_versions`` they are kept instead, and later tokens are sampled by
  the new weights attending to keys and values the old ones computed (PipelineRL's in-flight
  weight update: Piché et al. 2025, arXiv:2509.19128, Fig. 7: negligible off-policyness). The
  log-probabilities reported are those each token was drawn from (decoupled PPO corrects the
  difference); 7.7 -> 2.7 ms a generated row (``benchmarks/speed/worker_loop.py``).
- Identical prompts of one call (a GRPO group's first turn) are prefilled once and their keys,
  values and last logits copied to every row (``share_prompts``).

Positions count real tokens only, so rows of any lengths and histories share one batch; keys
and values are written in place into a preallocated buffer; ``compact`` drops stopped rows
once half the batch has stopped. ``matmul="onednn"``: oneDNN's packed products, in a lean pass
for Llama-shaped models (lean.py), else a tree over the same tensors (onednn.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from turnrl.models import cache_kwargs
from turnrl.samplers.base import Completion, SamplingParams, copy_named, sample_tokens
from turnrl.samplers.lean import LeanDecoder, onednn_decoder, unpack
from turnrl.samplers.masks import AS_GIVEN, MaskPlan, mask_plan, prefill_mask
from turnrl.samplers.onednn import resolve_matmul

StepHook = Callable[[list[tuple[int, int, float]]], bool | None]
"""Called after each decode step with ``(prompt index, token id, logprob)`` of each live row;
True ends the call after this step."""


@dataclass
class _Kept:
    """One kept sequence: its tokens and their keys/values ``[layers, 2, kv_heads, len, dim]``."""

    tokens: tuple[int, ...]
    kv: torch.Tensor


END_TOKENS = 4


def _end_key(tokens: Sequence[int], n: int) -> tuple[int, ...]:
    """``tokens[:n]``'s index key: its length and last ``END_TOKENS`` tokens."""
    return (n, *tokens[max(n - END_TOKENS, 0):n])


class _KeptRows:
    """Kept sequences of one policy version, in least-recently-written-first order.

    Indexed by length and last few tokens, so that finding a prompt's past tries a short key
    per kept length and compares a whole prefix only on a hit: hashing ``prompt[:n]`` for
    every kept length cost O(kept rows x length) per prompt and per released episode (a pool
    of 1000 rows of 200-2000 tokens: 0.28 -> 0.03 ms a prompt, 4.5 -> 0.29 ms a release).
    """

    def __init__(self, version: int):
        self.version = version
        self.rows: dict[tuple[int, ...], _Kept] = {}
        self._ends: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self._lengths: dict[int, int] = {}  # kept length -> how many rows have it

    def find(self, sequence: Sequence[int], n: int) -> _Kept | None:
        """The kept sequence equal to ``sequence[:n]``, if any."""
        for tokens in self._ends.get(_end_key(sequence, n), ()):
            if tokens == tuple(sequence[:n]):
                return self.rows[tokens]
        return None

    def match(self, prompts: Sequence[Sequence[int]]) -> list[_Kept | None]:
        """The longest kept sequence each prompt strictly extends (None: prefill it all)."""
        lengths = sorted(self._lengths)
        return [self._longest_prefix(prompt, lengths) for prompt in prompts]

    def _longest_prefix(self, prompt: Sequence[int], lengths: list[int]) -> _Kept | None:
        for n in reversed(lengths[:bisect.bisect_left(lengths, len(prompt))]):
            if (row := self.find(prompt, n)) is not None:
                return row
        return None

    def drop_prefixes_of(self, sequence: Sequence[int]) -> None:
        """Forget every kept sequence that ``sequence`` starts with."""
        for n in [n for n in self._lengths if n <= len(sequence)]:
            if (row := self.find(sequence, n)) is not None:
                self._remove(row.tokens)

    def replace(self, extended: list[_Kept], new: list[_Kept], max_rows: int) -> None:
        """Swap the sequences a call extended for its new ones; evict beyond ``max_rows``."""
        for row in extended:
            self._remove(row.tokens)
        for row in new:
            self._remove(row.tokens)  # re-inserted last: most recently written
            self._add(row)
        # The call's own rows are never evicted: the next call most likely continues them.
        excess = len(self.rows) - max(max_rows, len(new))
        for tokens in list(self.rows)[:max(excess, 0)]:
            self._remove(tokens)

    def _add(self, row: _Kept) -> None:
        n = len(row.tokens)
        self.rows[row.tokens] = row
        self._ends.setdefault(_end_key(row.tokens, n), []).append(row.tokens)
        self._lengths[n] = self._lengths.get(n, 0) + 1

    def _remove(self, tokens: tuple[int, ...]) -> None:
        if self.rows.pop(tokens, None) is None:
            return
        n, key = len(tokens), _end_key(tokens, len(tokens))
        self._ends[key].remove(tokens)
        if not self._ends[key]:
            del self._ends[key]
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]


class _InPlaceLayer(DynamicLayer):
    """One layer's view of the batch buffer: the model's update writes the new keys and values
    in place and gets views back, instead of concatenating a new tensor at every step."""

    def __init__(self, kv: torch.Tensor, length: int):
        super().__init__()
        self.kv, self.length, self.is_initialized = kv, length, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.kv[0, :, :, self.length:end] = key_states
        self.kv[1, :, :, self.length:end] = value_states
        self.length = end
        return self.kv[0, :, :, :end], self.kv[1, :, :, :end]

    def get_seq_length(self) -> int:
        return self.length


class _Batch:
    """Keys/values of the rows being decoded, in a buffer preallocated to the call's length.

    ``kv`` is ``[layers, 2, rows, kv_heads, capacity, dim]``, of which the first ``length``
    columns are filled; ``mask`` marks the real ones and ``positions`` holds each row's count of
    real tokens, which is the position of its next token.
    """

    def __init__(self, kv: torch.Tensor, mask: torch.Tensor, length: int,
                 positions: torch.Tensor, masks: MaskPlan = AS_GIVEN):
        self.kv, self.mask, self.length, self.positions = kv, mask, length, positions
        self.masks = masks  # what the model's attention needs of the boolean masks

    def _forward(self, model: PreTrainedModel, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | dict[str, torch.Tensor],
                 position_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last input column; the inputs' keys/values land in the buffer."""
        if isinstance(model, LeanDecoder):
            logits = model.last_logits(input_ids, attention_mask, position_ids, self.kv,
                                       self.length)
        else:
            cache = Cache(layers=[_InPlaceLayer(layer, self.length) for layer in self.kv])
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, **cache_kwargs(model, cache),
                           use_cache=True, logits_to_keep=1).logits[:, -1]
        self.length += input_ids.shape[1]
        return logits

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor,
                new_mask: torch.Tensor) -> torch.Tensor:
        """Feed the left-padded new tokens of every row after its past."""
        start, width = self.length, input_ids.shape[1]
        self.mask[:, start:start + width] = new_mask
        position_ids = self.positions[:, None] + (new_mask.cumsum(dim=1) - 1).clamp(min=0)
        real = self.mask[:, :start + width]
        self.positions = self.positions + new_mask.sum(dim=1)
        return self._forward(model, input_ids, self.masks(prefill_mask(real, start), position_ids,
                                                          real), position_ids)

    def step(self, model: PreTrainedModel, tokens: torch.Tensor, real: torch.Tensor
             ) -> torch.Tensor:
        """Feed one token per row; rows where ``real`` is False are fed masked-out padding."""
        self.mask[:, self.length] = real
        seen, positions = self.mask[:, :self.length + 1], self.positions[:, None]
        logits = self._forward(model, tokens[:, None], self.masks(seen[:, None, None], positions,
                                                                  seen), positions)
        self.positions = self.positions + real
        return logits

    def select(self, index: torch.Tensor) -> None:
        """Keep (or repeat) the rows ``index``, in that order. Whole rows are copied, the
        unfilled room too: a row's block is contiguous, so this is a few large copies, where
        copying only the filled columns is a strided copy ~3x slower (tiny model, 80 rows)."""
        self.kv = self.kv.index_select(2, index)
        self.mask, self.positions = self.mask[index], self.positions[index]

    def copy_rows(self, rows: torch.Tensor, start: int) -> None:
        """Rows ``start`` onwards become copies of ``rows`` (one each, in order)."""
        self.kv[:, :, start:] = self.kv.index_select(2, rows)
        self.mask[start:], self.positions[start:] = self.mask[rows], self.positions[rows]

    def row(self, i: int) -> torch.Tensor:
        """Keys/values of row ``i``'s real tokens: ``[layers, 2, kv_heads, tokens, dim]``."""
        return self.kv[:, :, i, :, :self.length][:, :, :, self.mask[i, :self.length]]


Streams = torch.Generator | Sequence[torch.Generator]
"""One random stream for the whole batch, or one per row (``generate``'s ``generators``)."""


def _sample(logits: torch.Tensor, params: SamplingParams, generator: Streams
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens``, but plain sampling (top_p 1) draws by inverting the CDF: the same
    distribution from one uniform number per row, where ``torch.multinomial`` draws one per
    vocabulary entry (about 20x slower on CPU for SmolLM2's 49k tokens). With a stream per
    row, each row is sampled as a batch of one on its own stream: it takes exactly the random
    numbers it would take alone, whatever rows share the batch."""
    if not isinstance(generator, torch.Generator):
        drawn = [_sample(logits[i:i + 1], params, g) for i, g in enumerate(generator)]
        return torch.cat([t for t, _ in drawn]), torch.cat([lp for _, lp in drawn])
    if params.temperature == 0 or params.top_p < 1:
        return sample_tokens(logits, params.temperature, params.top_p, generator)
    logprobs = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    cdf = logprobs.exp().cumsum(dim=-1, dtype=torch.float64)  # float64: exact enough at 49k
    draw = torch.rand((len(cdf), 1), generator=generator, dtype=torch.float64,
                      device=cdf.device) * cdf[:, -1:]
    # right=True never lands on a zero-probability token (its CDF step is empty).
    tokens = torch.searchsorted(cdf, draw, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _left_padded(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, mask of real tokens), ``[rows, longest]``, left-padded, on the host."""
    width = max(len(tokens) for tokens in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(rows), width), dtype=torch.bool, device="cpu")
    for row, tokens in enumerate(rows):
        input_ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long,
                                                            device="cpu")
        mask[row, width - len(tokens):] = True
    return input_ids, mask


MIN_SPLIT_TOKENS = 64


def _prefill_buckets(new_lengths: list[int]) -> list[list[int]]:
    """Rows to prefill together: longest first, a bucket closed when the next row is under
    half its longest and the longest is over ``MIN_SPLIT_TOKENS`` (below that, one more
    forward pass costs more than the padding). One batch pads every row to the longest new
    segment, so a fresh episode's prompt in a call of continuing episodes would multiply the
    prefill (tiny model, 20 continuing rows and a fresh group of 8: 228 ms, 115 bucketed)."""
    order = sorted(range(len(new_lengths)), key=lambda i: -new_lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        longest = new_lengths[buckets[-1][0]] if buckets else 0
        if buckets and (2 * new_lengths[i] >= longest or longest <= MIN_SPLIT_TOKENS):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return [sorted(bucket) for bucket in buckets]  # one bucket: the call's own row order


def _unique(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in order of first appearance, and the index of each prompt's one."""
    first: dict[tuple[int, ...], int] = {}
    index = [first.setdefault(tuple(prompt), len(first)) for prompt in prompts]
    return [list(prompt) for prompt in first], index


class HFEngine:
    """Samples from the very model object the trainer updates, so weight sync is free on CPU.

    All prompts of a call are left-padded into one batch, prefilled once, then decoded token
    by token from the KV cache. A row that samples a stop token is finished (it is fed
    padding, masked out, from then on, or leaves the batch with ``compact``); the call ends
    when every row is finished or ``max_new_tokens`` is reached (kept between calls: above).
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, seed: int = 0,
                 reuse_cache: bool = True, *, max_kept_rows: int = 64,
                 share_prompts: bool = True, compact: bool = True,
                 keep_cache_across_versions: bool = False, matmul: str = "torch"):
        self.model = model
        self.masks = mask_plan(model)  # a window, eager attention; refuses what is not exact
        self.matmul = resolve_matmul(matmul, model)  # onednn: lean.py, else onednn.py
        self.decoder, self.forward_pass = (onednn_decoder(model) if self.matmul == "onednn"
                                           else (model, "transformers' pass"))
        self.pad_token_id, self.reuse_cache = pad_token_id, reuse_cache
        self.max_kept_rows, self.share_prompts, self.compact = max_kept_rows, share_prompts, compact
        self.keep_cache_across_versions = keep_cache_across_versions
        self.version, self._kept = 0, _KeptRows(0)
        self.generator = torch.Generator(model.device).manual_seed(seed)

    def describe(self) -> str:
        """What samples, for the ``sampler:`` start-up line: engine, dtype, forward pass."""
        return f"hf {str(self.model.dtype)[6:]} on {self.model.device.type} ({self.forward_pass})"

    def load(self, weights=None, version: int = 0) -> None:
        """Sample as ``version``: ``weights`` copied into the model in place (None: the
        model's own tensors changed, an update or a checkpoint load); stale keys dropped."""
        copy_named(self.model, weights or {})
        self.version = version
        unpack(self.decoder)  # new weights: the packed copies are stale (none: a no-op)
        self._kept = self._kept if self.keep_cache_across_versions else _KeptRows(version)
        self._kept.version = version

    def close(self) -> None:
        self._kept = _KeptRows(self.version)  # the keys and values; the model is the caller's

    def release(self, sequences: Sequence[Sequence[int]]) -> None:
        """Forget the kept keys/values of sequences that will never be continued (ended
        episodes): the bound then evicts rows of finished episodes first, not the row of an
        episode that waits long on a tool (the least recently written one)."""
        for sequence in sequences:
            self._kept.drop_prefixes_of(sequence)

    @property
    def kept_rows(self) -> int:
        """Number of sequences whose keys/values are kept for later calls."""
        return len(self._kept.rows)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_step: StepHook | None = None,
                 generators: Sequence[torch.Generator | None] | None = None
                 ) -> list[Completion]:
        """``on_step`` (optional) is called after every decode step with the tokens just
        sampled, ``[(prompt index, token id, logprob), ...]`` for the rows still going, on
        this thread (a server streams them to its clients as they come). When it returns
        True the call ends after that step: unfinished rows come back cut short (finish
        reason "length"), with their keys and values kept, so a later call that continues
        them (prompt + tokens so far) prefills one token each.

        ``generators`` (optional, one per prompt; None: the engine's own): each row draws its
        random numbers from its own stream only, so it samples what it would in a call of its
        own (frozen opponents batch the moves of games with a stream each: selfplay/opponents.py)."""
        if not prompts:
            return []
        self.masks.check_lengths(prompts, params.max_new_tokens)
        if generators is not None and len(generators) != len(prompts):
            raise ValueError(f"generate: {len(generators)} generators for {len(prompts)} "
                             "prompts (one per prompt, or none)")
        was_training = self.decoder.training
        self.decoder.eval()
        try:
            return self._generate(prompts, params, on_step, generators)
        finally:
            self.decoder.train(was_training)

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  on_step: StepHook | None = None,
                  generators: Sequence[torch.Generator | None] | None = None
                  ) -> list[Completion]:
        if self._kept.version != self.version or not self.reuse_cache:
            self._kept = _KeptRows(self.version)
        if self.share_prompts:
            unique, index = _unique(prompts)
        else:
            unique, index = [list(p) for p in prompts], list(range(len(prompts)))
        pasts = self._kept.match(unique)
        news = [prompt[len(past.tokens) if past else 0:]
                for prompt, past in zip(unique, pasts, strict=True)]
        buckets = _prefill_buckets([len(tokens) for tokens in news])
        # Buffer rows: the distinct prompts bucket by bucket, then the other rows that share
        # one (a GRPO group's first turn), copied from it once it is prefilled.
        copies: list[list[int]] = [[] for _ in unique]
        for row, u in enumerate(index):
            copies[u].append(row)
        in_buffer = [u for bucket in buckets for u in bucket]
        rows_of = [copies[u][0] for u in in_buffer] + [r for u in in_buffer for r in copies[u][1:]]
        batch, parts = self._batch(buckets, pasts, news, len(prompts), params.max_new_tokens)
        logits = []
        for bucket, (rows, part) in zip(buckets, parts, strict=True):
            input_ids, new_mask = _left_padded([news[u] for u in bucket], self.pad_token_id)
            logits.append(part.prefill(self.decoder, input_ids.to(batch.kv.device),
                                       new_mask.to(batch.kv.device)))
            batch.positions[rows] = part.positions
        logits = torch.cat(logits)
        if len(unique) < len(prompts):
            shared = torch.tensor([row for row, u in enumerate(in_buffer) for _ in copies[u][1:]],
                                  device=batch.kv.device)
            batch.copy_rows(shared, len(unique))
            logits = torch.cat([logits, logits[shared]])
        hook = on_step and (lambda rows: on_step([(rows_of[k], *rest) for k, *rest in rows]))
        streams = None if generators is None else [
            self.generator if generators[row] is None else generators[row] for row in rows_of]
        decoded, decoded_kvs = self._decode(batch, logits, len(prompts), params, hook, streams)
        completions, kvs = [Completion()] * len(prompts), [None] * len(prompts)
        for row, completion, kv in zip(rows_of, decoded, decoded_kvs, strict=True):
            completions[row], kvs[row] = completion, kv  # back in the caller's order
        if self.reuse_cache:
            new = [_Kept(tuple(prompt) + tuple(c.token_ids[:-1]), kv)
                   for prompt, c, kv in zip(prompts, completions, kvs, strict=True)]
            self._kept.replace([p for p in pasts if p is not None], new, self.max_kept_rows)
        return completions

    def _batch(self, buckets: list[list[int]], pasts: list[_Kept | None],
               news: list[list[int]], rows: int, max_new_tokens: int
               ) -> tuple[_Batch, list[tuple[slice, _Batch]]]:
        """The call's one buffer, with room for the whole call, and (its rows, a view of
        them) per bucket.

        Bucket ``b`` (its distinct prompts ``buckets[b]``, in buffer rows one after the
        other) is right-aligned: its columns are the last ``past_b + new_b``, each kept past
        right-aligned to where the bucket's new tokens start. A view prefills its bucket in
        place, reading only its own columns; rows past the buckets are for shared prompts.
        """
        config = self.model.config.get_text_config()
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        past_lengths = [len(past.tokens) if past else 0 for past in pasts]
        shapes = [(max(past_lengths[u] for u in bucket), max(len(news[u]) for u in bucket))
                  for bucket in buckets]
        width = max(past + new for past, new in shapes)
        capacity = width + max(max_new_tokens - 1, 0)
        kv = torch.empty((config.num_hidden_layers, 2, rows, heads, capacity, head_dim),
                         dtype=self.model.dtype, device=self.model.device)
        kv[:, :, :, :, :width] = 0  # masked, but must be finite: 0 * NaN would leak
        mask = torch.zeros((rows, capacity), dtype=torch.bool, device=kv.device)
        positions = torch.zeros(rows, dtype=torch.long, device=kv.device)
        views, at = [], 0
        for bucket, (past_width, new_width) in zip(buckets, shapes, strict=True):
            left, end = width - past_width - new_width, width - new_width  # its pasts' columns
            for row, u in enumerate(bucket, start=at):
                if pasts[u] is not None:
                    kv[:, :, row, :, end - past_lengths[u]:end] = pasts[u].kv
                    mask[row, end - past_lengths[u]:end] = True
            rows_of_bucket = slice(at, at + len(bucket))
            lengths = torch.tensor([past_lengths[u] for u in bucket], device=kv.device)
            views.append((rows_of_bucket, _Batch(kv[:, :, rows_of_bucket, :, left:],
                                                 mask[rows_of_bucket, left:], past_width, lengths,
                                                 self.masks)))
            at += len(bucket)
        return _Batch(kv, mask, width, positions, self.masks), views

    def _decode(self, batch: _Batch, logits: torch.Tensor, rows: int, params: SamplingParams,
                on_step: StepHook | None = None, streams: list[torch.Generator] | None = None
                ) -> tuple[list[Completion], list[torch.Tensor]]:
        """Sample up to ``max_new_tokens`` per row (on ``streams[row]``, one per buffer row,
        if given); returns the completions and, if the cache is reused, each row's keys/values
        (prompt and reply, less the last sampled token)."""
        completions = [Completion() for _ in range(rows)]
        kvs: list[torch.Tensor | None] = [None] * rows
        live = list(range(rows))  # completion of each batch row
        stop = torch.tensor(params.stop_token_ids or [-1], dtype=torch.long, device=logits.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=logits.device)
        for step in range(params.max_new_tokens):
            tokens, logprobs = _sample(logits, params, self.generator if streams is None
                                       else [streams[row] for row in live])
            newly_stopped = torch.isin(tokens, stop) & ~finished
            # One device-to-host copy per decode step, not one per row.
            was_done = finished.tolist()
            for row, token, logprob, done, stops in zip(
                    live, tokens.tolist(), logprobs.tolist(), was_done,
                    newly_stopped.tolist(), strict=True):
                if not done:
                    completions[row].token_ids.append(token)
                    completions[row].logprobs.append(logprob)
                if stops:
                    completions[row].finish_reason = "stop"
            if on_step is not None and on_step(
                    [(row, completions[row].token_ids[-1], completions[row].logprobs[-1])
                     for row, done in zip(live, was_done, strict=True) if not done]):
                break  # the caller continues the rows later (their keys/values are kept)
            finished |= newly_stopped
            if finished.all() or step == params.max_new_tokens - 1:
                break
            if self.compact and 2 * int(finished.sum()) >= len(live):
                for i in finished.nonzero()[:, 0].tolist():
                    kvs[live[i]] = batch.row(i) if self.reuse_cache else None
                active = (~finished).nonzero()[:, 0]
                batch.select(active)
                live = [live[i] for i in active.tolist()]
                tokens, finished = tokens[active], finished[active]
            logits = batch.step(self.decoder, tokens.masked_fill(finished, self.pad_token_id),
                                ~finished)
        for i, row in enumerate(live):
            kvs[row] = batch.row(i) if self.reuse_cache else None
        return completions, kvs
