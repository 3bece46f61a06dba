"""The update's two ways of running a shared prompt once give what a plain pass gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from tests.trainer.test_step import _batch, _grouped_episodes
from turnrl.trainer import prefix
from turnrl.trainer.prefix import (
    PackedLayout,
    cached_prefix_hidden,
    packed_prefix_hidden,
    packing_pays,
    shared_prefix_split,
)
from turnrl.types import Batch, Episode


def _plain_hidden(model, mb):
    hidden = model.get_decoder()(input_ids=mb.input_ids,
                                 attention_mask=mb.attention_mask).last_hidden_state
    return hidden[:, :-1][mb.loss_mask[:, 1:].bool()]


def _with_grads(model, fn):
    model.zero_grad()
    hidden = fn()
    (hidden * torch.linspace(0.5, 2.0, hidden.shape[-1])).sum().backward()
    return hidden.detach(), [p.grad.clone() for p in model.get_decoder().parameters()]


def _tiny_of(model_type: str, attention: str):
    """A 2-layer model of ``model_type`` with grouped-query attention (4 heads, 2 key/value)."""
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _interleaved(mb):
    """The rows reordered so the two groups alternate: the packed order is not batch order."""
    rows = torch.tensor([0, 3, 1, 4, 2, 5])
    return mb.select(rows)


@pytest.mark.parametrize("model_type", sorted(prefix.PACKABLE_MODELS))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_and_cached_prefixes_give_the_plain_hidden_states_and_gradients(model_type,
                                                                              attention):
    """Each model type the packed path runs on, on both attention kernels: two groups with
    prompts of different lengths (so one packed row is padded) whose rows alternate in the
    batch, multi-turn suffixes (environment tokens between policy turns), gradients included:
    a padding query with nothing to attend to would put NaN into every weight gradient."""
    model = _tiny_of(model_type, attention)
    mb = _interleaved(_batch(_grouped_episodes(groups=2, size=3, seed=4)))
    split = shared_prefix_split(mb)
    assert split.owner.tolist() == [0, 1, 0, 1, 0, 1]
    assert prefix._mask_format(model.get_decoder()) is not None
    layout = PackedLayout.of(mb, split)
    assert layout.piece.shape[0] == 2 and bool((layout.piece == -2).any())  # a padded row
    _assert_both_paths_match_the_plain_pass(model, mb, split, layout)


def _assert_both_paths_match_the_plain_pass(model, mb, split, layout) -> None:
    """The packed and the cached prefix pass give the plain pass's hidden states and gradients."""
    decoder = model.get_decoder()
    plain, plain_grads = _with_grads(model, lambda: _plain_hidden(model, mb))
    for fn in (lambda: packed_prefix_hidden(decoder, mb, layout, split),
               lambda: cached_prefix_hidden(decoder, mb, split)):
        hidden, grads = _with_grads(model, fn)
        torch.testing.assert_close(hidden, plain, atol=1e-5, rtol=1e-5)
        for a, b in zip(plain_grads, grads, strict=True):
            assert (b - a).norm() <= 1e-5 * a.norm() + 1e-6, float((b - a).norm() / a.norm())


def _tree_episodes(k: int = 3, seed: int = 5) -> list[Episode]:
    """One fork (rollout/branch.py): a prompt, a shared turn (trained in the first leaf only)
    and the env's answer, then each leaf's own turns; and a plain group of two beside it."""
    rng = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.randint(3, 60, (n,), generator=rng).tolist()

    trunk = Episode(env="toy", seed=0, group=0)
    trunk.append(draw(6), policy=False)
    trunk.append(draw(3), policy=True, logprobs=[-1.0] * 3, version=0)
    trunk.append(draw(4), policy=False)
    leaves = []
    for child in range(k):
        leaf = Episode(env="toy", seed=0, group=0, token_ids=list(trunk.token_ids),
                       loss_mask=[m if child == 0 else 0 for m in trunk.loss_mask],
                       logprobs=list(trunk.logprobs), versions=list(trunk.versions))
        for _turn in range(1 + child % 2):
            leaf.append(draw(2 + child), policy=True, logprobs=[-1.0] * (2 + child), version=0)
            leaf.append(draw(2), policy=False)
        leaves.append(leaf)
    plain = _grouped_episodes(groups=1, size=2, seed=seed + 1)  # its own prompt
    return [plain[0], *leaves, plain[1]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_fork_s_prefix_runs_once_its_shared_turn_scored_from_it(attention):
    """Tree rollouts: the first leaf trains the shared turn, its siblings do not; all k rows
    share the prefix up to the siblings' first own token, and both paths give the plain
    pass's hidden states and gradients (the shared turn's tokens scored from the prefix)."""
    model = _tiny_of("llama", attention)
    mb = _batch(_tree_episodes())
    split = shared_prefix_split(mb)
    assert split.owner.tolist() == [0, 1, 1, 1, 0]
    assert split.cut[1] == split.cut[2] == 6 + 3 + 4 - 1
    assert len(prefix.scored_in_prefix(mb, split)[0]) == 3  # the shared turn, in row 1 only
    _assert_both_paths_match_the_plain_pass(model, mb, split, PackedLayout.of(mb, split))


def test_the_layout_puts_each_prefix_once_before_the_suffixes_that_share_it():
    mb = _batch(_grouped_episodes(groups=2, size=3, seed=4))
    split = shared_prefix_split(mb)
    layout = PackedLayout.of(mb, split)
    lengths = mb.attention_mask.sum(dim=1)
    for u, prompt in enumerate(split.prefixes):
        rows = (split.owner == u).nonzero().flatten().tolist()
        expected = [-1] * len(prompt) + [b for b in rows for _ in range(int(lengths[b] -
                                                                            split.cut[b]))]
        got = layout.piece[u][layout.piece[u] != -2].tolist()
        assert got == expected
        tokens = mb.input_ids[layout.source[u], layout.column[u]][:len(prompt)]
        assert tokens.tolist() == prompt
    allowed = layout.attended()
    first_suffix = (layout.piece[0] >= 0).nonzero()[0].item()
    last_row = layout.piece[0][layout.piece[0] >= 0][-1]
    second_suffix = (layout.piece[0] == last_row).nonzero()[0].item()
    assert allowed[0, second_suffix, :len(split.prefixes[0])].all()  # sees its prompt
    assert not allowed[0, second_suffix, first_suffix]  # not another episode's tokens
    assert not allowed[0, first_suffix, first_suffix + 1]  # causal


def _layout(rows: int, prompt: int, suffix: int):
    ids = torch.arange(prompt + suffix).repeat(rows, 1) + 10
    ids[:, prompt:] += torch.arange(rows)[:, None] * 1000  # distinct completions
    mask = torch.ones_like(ids)
    loss = torch.zeros(ids.shape)
    loss[:, prompt:] = 1
    mb = Batch(ids, mask, loss, torch.zeros(loss.shape), torch.zeros(rows))
    split = shared_prefix_split(mb)
    return mb, split, PackedLayout.of(mb, split)


SMOLLM2_SHAPE = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, num_hidden_layers=30)


def test_packing_pays_for_short_groups_and_not_for_long_episodes_or_sliding_windows():
    mb, split, layout = _layout(rows=4, prompt=44, suffix=16)  # the GRPO step benchmark
    assert packing_pays(SMOLLM2_SHAPE, layout, split, mb)
    mb, split, layout = _layout(rows=8, prompt=44, suffix=16)
    assert packing_pays(SMOLLM2_SHAPE, layout, split, mb)
    # Long multi-turn episodes: packed attention would compute mostly masked-out pairs.
    mb, split, layout = _layout(rows=8, prompt=200, suffix=2000)
    assert not packing_pays(SMOLLM2_SHAPE, layout, split, mb)
    mb, split, layout = _layout(rows=4, prompt=44, suffix=16)
    windowed = LlamaConfig(**SMOLLM2_SHAPE.to_dict())
    windowed.sliding_window = 32  # positions reach 59: one 4D mask would ignore the window
    assert not packing_pays(windowed, layout, split, mb)
    windowed.sliding_window = 4096
    assert packing_pays(windowed, layout, split, mb)


def test_a_model_type_not_checked_for_packing_takes_the_cached_path_and_agrees():
    model = _tiny_of("gemma", "sdpa")
    assert prefix._mask_format(model.get_decoder()) is None
    mb = _interleaved(_batch(_grouped_episodes(groups=2, size=3, seed=4)))
    torch.testing.assert_close(prefix.shared_prefix_hidden(model, mb, shared_prefix_split(mb)),
                               _plain_hidden(model, mb), atol=1e-5, rtol=1e-5)


def test_the_update_packs_only_where_the_attention_takes_a_4d_mask(tiny, monkeypatch):
    model, _ = tiny
    mb = _batch(_grouped_episodes(groups=2, size=3))
    split = shared_prefix_split(mb)
    taken = []
    for name in ("packed_prefix_hidden", "cached_prefix_hidden"):
        real = getattr(prefix, name)
        monkeypatch.setattr(prefix, name,
                            lambda *a, _real=real, _name=name: taken.append(_name) or _real(*a))
    plain = _plain_hidden(model, mb)
    for attention in ("sdpa", "eager"):
        model.set_attn_implementation(attention)
        torch.testing.assert_close(prefix.shared_prefix_hidden(model, mb, split), plain,
                                   atol=1e-5, rtol=1e-5)
    assert taken == ["packed_prefix_hidden"] * 2
    decoder = model.get_decoder()
    decoder.config.layer_types = ["full_attention", "linear_attention"]  # a hybrid model
    assert prefix._mask_format(decoder) is None
    decoder.config.layer_types = ["full_attention", "sliding_attention"]
    assert prefix._mask_format(decoder) == "float"
    decoder.config._attn_implementation = "flash_attention_2"  # no 4D masks there
    assert prefix._mask_format(decoder) is None
