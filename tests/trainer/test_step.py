"""The update's speed paths compute the same thing as the plain path."""

from __future__ import annotations

import copy

import pytest
import torch

from turnrl.config import AlgoConfig, OptimConfig
from turnrl.trainer.step import (
    UpdateSettings,
    micro_batches,
    policy_update,
    score_policy_tokens,
    shared_prefix_split,
    with_proximal_logprobs,
)
from turnrl.types import Batch, Episode


def _grouped_episodes(groups: int = 2, size: int = 3, seed: int = 0) -> list[Episode]:
    """Multi-turn-shaped episodes: a prompt shared by each group, then policy/env turns."""
    rng = torch.Generator().manual_seed(seed)
    episodes = []
    for g in range(groups):
        prompt = torch.randint(3, 60, (5 + 3 * g,), generator=rng).tolist()
        for _ in range(size):
            ep = Episode(env="toy", seed=g, group=g)
            ep.append(prompt, policy=False)
            for _turn in range(1 + int(torch.randint(0, 3, (1,), generator=rng))):
                n = 1 + int(torch.randint(0, 4, (1,), generator=rng))
                action = torch.randint(3, 60, (n,), generator=rng).tolist()
                ep.append(action, policy=True, logprobs=[-1.5] * n, version=0)
                ep.append(torch.randint(3, 60, (2,), generator=rng).tolist(), policy=False)
            episodes.append(ep)
    return episodes


def _batch(episodes, per_token: bool = False) -> Batch:
    advantages = torch.linspace(-1, 1, len(episodes))
    batch = Batch.from_episodes(episodes, advantages, pad_id=0)
    if per_token:
        batch.advantages = torch.randn(batch.input_ids.shape, generator=torch.Generator()
                                       .manual_seed(1))
    return batch


def test_split_finds_each_groups_prompt():
    batch = _batch(_grouped_episodes())
    split = shared_prefix_split(batch)
    assert split is not None
    assert split.owner.tolist() == [0, 0, 0, 1, 1, 1]
    # The last prompt token stays with the suffix: it scores the first policy token.
    assert split.cut.tolist() == [4, 4, 4, 7, 7, 7]
    assert [len(p) for p in split.prefixes] == [4, 7]


def test_split_declines_when_nothing_is_shared():
    episodes = _grouped_episodes(groups=3, size=1)
    assert shared_prefix_split(_batch(episodes)) is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_scores_and_gradients_equal_naive(tiny, temperature):
    model, _ = tiny
    batch = _batch(_grouped_episodes())
    results = []
    for shared in (False, True):
        model.zero_grad()
        logprobs, entropy = score_policy_tokens(model, batch, temperature, entropy=True,
                                                shared_prefix=shared)
        (logprobs * torch.linspace(0.5, 2, logprobs.shape[1])).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((logprobs.detach(), entropy, grads))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    assert (lp_a != 0).sum() == batch.loss_mask[:, 1:].sum()  # every policy token scored
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_micro_batches_keep_groups_together_and_respect_token_budget():
    batch = _batch(_grouped_episodes(groups=2, size=4))
    chunks = micro_batches(batch, size=4)
    assert len(chunks) == 2
    for mb in chunks:  # each micro-batch is one group: one shared prompt
        split = shared_prefix_split(mb)
        assert split is not None and len(split.prefixes) == 1
    width = int(batch.attention_mask.sum(dim=1).max())
    budgeted = micro_batches(batch, size=8, token_budget=2 * width)
    assert all(mb.input_ids.numel() <= 2 * width for mb in budgeted)
    assert sum(len(mb) for mb in budgeted) == len(batch)
    alone = micro_batches(batch, size=8, token_budget=1)  # over budget: one row each
    assert [len(mb) for mb in alone] == [1] * len(batch)


@pytest.mark.parametrize("per_token", [False, True])
def test_optimisations_on_and_off_reach_the_same_parameters(tiny, per_token):
    model, _ = tiny
    batch = _batch(_grouped_episodes(groups=2, size=4), per_token=per_token)
    finals = []
    for shared, budget, rows in ((False, 0, 8), (True, 0, 4), (True, 40, 8)):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        settings = UpdateSettings(AlgoConfig(), OptimConfig(shared_prefix=shared,
                                                            micro_batch_size=rows),
                                  temperature=1.0, agg_constant=16, token_budget=budget)
        policy_update(trained, optimizer, batch, settings)
        finals.append(torch.cat([p.detach().flatten() for p in trained.parameters()]))
    moved = (finals[0] - torch.cat([p.detach().flatten() for p in model.parameters()])).abs()
    assert moved.max() > 1e-4  # the step did something
    for other in finals[1:]:
        torch.testing.assert_close(other, finals[0], atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_one_epoch_decoupled_update_takes_the_proximal_policy_from_its_own_pass(tiny,
                                                                               compute_dtype):
    """Skipping the separate proximal pass (one epoch) changes neither the step nor the ESS,
    in either update precision: the proximal pass runs in the update's own precision."""
    model, _ = tiny
    batch = _batch(_grouped_episodes(groups=2, size=4))
    # Behaviour log-probs that differ from the model's, as with stale episodes.
    batch.old_logprobs = batch.old_logprobs + 0.3 * batch.loss_mask * torch.randn(
        batch.old_logprobs.shape, generator=torch.Generator().manual_seed(2))
    settings = UpdateSettings(AlgoConfig(decoupled=True, epochs=1),
                              OptimConfig(compute_dtype=compute_dtype),
                              temperature=1.0, agg_constant=16)
    finals, metrics = [], []
    for precomputed in (True, False):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        given = with_proximal_logprobs(trained, batch, settings) if precomputed else batch
        metrics.append(policy_update(trained, optimizer, given, settings))
        finals.append(torch.cat([p.detach().flatten() for p in trained.parameters()]))
    torch.testing.assert_close(finals[1], finals[0], atol=2e-6, rtol=1e-4)
    assert metrics[0]["offpolicy/ess"] < 0.99  # the behaviour policy differs
    assert metrics[1]["offpolicy/ess"] == pytest.approx(metrics[0]["offpolicy/ess"], abs=1e-5)
    assert metrics[1]["loss/policy"] == pytest.approx(metrics[0]["loss/policy"], abs=1e-6)


def test_one_training_step_is_the_same_with_speedups_on_and_off(tmp_path):
    """KV reuse across turns and the shared-prompt update change speed, not the result."""
    from safetensors.torch import load_file

    from turnrl.checkpoint import latest_checkpoint
    from turnrl.config import load_config
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train
    from turnrl.types import read_episodes

    base = ["--model.name", "tiny", "--env.name", "say-digit", "--env.options", "{turns: 3}",
            "--rollout.max_new_tokens", "3", "--rollout.group_size", "4",
            "--rollout.groups_per_step", "2", "--optim.lr", "1e-2", "--run.steps", "1",
            "--eval.episodes", "0", "--run.progress", "false", "--run.tensorboard", "false"]
    weights = []
    for name, flags in (("on", []), ("off", ["--sampler.reuse_cache", "false",
                                              "--optim.shared_prefix", "false"])):
        train(load_config(None, base + flags + ["--run.out_dir", str(tmp_path / name)]))
        weights.append(load_file(latest_checkpoint(tmp_path / name) / "model.safetensors"))
    on, off = ([ep.token_ids for ep in read_episodes(tmp_path / n / "episodes" / "step-000001.jsonl")]
               for n in ("on", "off"))
    assert on == off  # the same samples
    (m_on,), (m_off,) = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("on", "off"))
    for key in ("loss/policy", "grad_norm", "entropy"):
        assert m_on[key] == pytest.approx(m_off[key], rel=1e-4, abs=1e-6)
    # Adam's first step moves each weight by about lr * sign(gradient): a gradient that is
    # float noise may flip sign, so allow 2% of lr on a handful of elements.
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], atol=2e-4, rtol=0)
