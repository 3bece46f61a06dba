"""The sampler/learner mismatch: hand-computed correction weights and KL, the metrics every
step logs, and a correction that really changes (only) the tokens it should."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.trainer.test_step import _batch, _grouped_episodes
from turnrl.algorithms.mismatch import correction_weights, log_weights, mismatch_sums
from turnrl.config import AlgoConfig, ConfigError, OptimConfig, load_config
from turnrl.trainer.step import UpdateSettings, policy_update

LOG = math.log
# Learner vs sampler: token weights w = 4, 1, 0.25 on row 0 (third token padding on row 1).
LEARNER = torch.tensor([[LOG(0.8), LOG(0.5), LOG(0.05)], [LOG(0.3), LOG(0.3), 0.0]])
SAMPLER = torch.tensor([[LOG(0.2), LOG(0.5), LOG(0.2)], [LOG(0.6), LOG(0.15), 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_weights_by_hand():
    w, changed = correction_weights(LEARNER, SAMPLER, MASK, "tis", high=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.25], [0.5, 2.0, 1.0]]))
    assert changed.tolist() == [[True, False, False], [False, False, False]]
    w, changed = correction_weights(LEARNER, SAMPLER, MASK, "mis", low=0.5, high=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0], [0.5, 2.0, 1.0]]))
    assert changed.tolist() == [[True, False, True], [False, False, False]]
    # IcePop is token-level masking with its own band, whatever level is asked for.
    w, _ = correction_weights(LEARNER, SAMPLER, MASK, "icepop", level="sequence", low=0.5,
                              high=5.0)
    assert torch.allclose(w, torch.tensor([[4.0, 1.0, 0.0], [0.5, 2.0, 1.0]]))
    w, changed = correction_weights(LEARNER, SAMPLER, MASK, "off")
    assert torch.equal(w, torch.ones(2, 3)) and not changed.any()


def test_sequence_weights_are_the_geometric_mean_of_the_row():
    # Row 0: 4 * 1 * 0.25 = 1 -> geometric mean 1; row 1: 0.5 * 2 = 1 -> 1 (padding ignored).
    assert torch.allclose(log_weights(LEARNER, SAMPLER, MASK, "sequence"), torch.zeros(2, 3),
                          atol=1e-6)
    sampler = SAMPLER.clone()
    sampler[1, 0] = LOG(0.3 / 8)  # row 1: 8 * 2 = 16 -> geometric mean 4 on both tokens
    w, changed = correction_weights(LEARNER, sampler, MASK, "mis", level="sequence", high=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]), atol=1e-6)
    assert changed.tolist() == [[False, False, False], [True, True, False]]
    w, _ = correction_weights(LEARNER, sampler, MASK, "tis", level="sequence", high=3.0)
    assert torch.allclose(w[1, :2], torch.tensor([3.0, 3.0]))


def test_kl_and_differences_by_hand():
    sums = mismatch_sums(LEARNER, SAMPLER, MASK)
    logw = [LOG(4), 0.0, LOG(0.25), LOG(0.5), LOG(2)]
    assert sums["abs_sum"] == pytest.approx(sum(abs(x) for x in logw))
    assert sums["abs_max"] == pytest.approx(LOG(4))
    assert sums["kl_sum"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logw))
    assert mismatch_sums(LEARNER, LEARNER, MASK) == {"abs_sum": 0.0, "abs_max": 0.0,
                                                     "kl_sum": 0.0}


def test_bad_values_are_refused_with_the_key():
    with pytest.raises(ValueError, match="unknown mismatch correction 'xis'"):
        correction_weights(LEARNER, SAMPLER, MASK, "xis")
    for flags, key in ((["--algo.mismatch_high", "0.9"], "algo.mismatch_high must be > 1"),
                       (["--algo.mismatch_low", "1.5"], "algo.mismatch_low must be in"),
                       (["--algo.mismatch_correction", "foo"], "mismatch_correction")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, flags)


def _update(model, batch, **algo):
    trained = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    settings = UpdateSettings(AlgoConfig(**algo), OptimConfig(), temperature=1.0,
                              agg_constant=16)
    metrics = policy_update(trained, optimizer, batch, settings)
    return torch.cat([p.detach().flatten() for p in trained.parameters()]), metrics


def test_every_update_measures_the_mismatch_and_a_correction_acts_on_it(tiny):
    model, _ = tiny
    episodes = _grouped_episodes(groups=2, size=4)
    batch = _batch(episodes)
    # The sampler's log-probs as the learner computes them: no mismatch.
    exact = _batch(episodes)
    exact.old_logprobs = _proximal(model, batch)
    _, clean = _update(model, exact)
    assert clean["mismatch/kl"] == pytest.approx(0.0, abs=1e-6)
    assert clean["mismatch/logprob_diff_max"] < 1e-4 and clean["warn/mismatch"] == 0.0
    # A sampler off by +-0.6 nats per token: measured, warned, and corrected.
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(3))
    batch.old_logprobs = exact.old_logprobs + 0.6 * noise.sign() * batch.loss_mask
    plain, off = _update(model, batch)
    assert off["mismatch/kl"] > 0.05 and off["warn/mismatch"] == 1.0
    assert off["mismatch/logprob_diff_mean"] == pytest.approx(0.6, abs=1e-4)
    assert off["mismatch/logprob_diff_max"] == pytest.approx(0.6, abs=1e-4)
    assert "mismatch/corrected_fraction" not in off  # plain PPO corrects nothing
    tis, m_tis = _update(model, batch, mismatch_correction="tis", mismatch_high=1.2)
    mis, m_mis = _update(model, batch, mismatch_correction="mis", mismatch_low=0.999,
                         mismatch_high=1.001)
    assert 0.3 < m_tis["mismatch/corrected_fraction"] < 0.7  # the half with w = e^0.6
    assert m_mis["mismatch/corrected_fraction"] == pytest.approx(1.0)  # every token masked
    assert m_mis["grad_norm"] == 0.0
    assert not torch.equal(tis, plain)
    # The measurement is the same whatever the correction does with it.
    assert m_tis["mismatch/kl"] == pytest.approx(off["mismatch/kl"], rel=1e-5)


def test_a_correction_with_no_mismatch_is_plain_ppo(tiny):
    model, _ = tiny
    batch = _batch(_grouped_episodes(groups=2, size=3))
    batch.old_logprobs = _proximal(model, batch)
    plain, _ = _update(model, batch)
    for correction in ("tis", "mis", "icepop"):
        corrected, metrics = _update(model, batch, mismatch_correction=correction)
        assert metrics["mismatch/corrected_fraction"] == 0.0
        torch.testing.assert_close(corrected, plain, atol=2e-6, rtol=1e-4)


def _proximal(model, batch):
    from turnrl.trainer.step import with_proximal_logprobs

    settings = UpdateSettings(AlgoConfig(), OptimConfig(), temperature=1.0, agg_constant=16)
    return with_proximal_logprobs(model, batch, settings).prox_logprobs


def test_a_training_run_logs_the_mismatch_every_step(tmp_path):
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    cfg = load_config(None, [
        "--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "2", "--run.steps", "2",
        "--eval.episodes", "0", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.out_dir", str(tmp_path)])
    train(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        # One process, fp32: the sampler's numbers are the learner's up to float noise.
        assert 0 <= row["mismatch/kl"] < 1e-3 and row["mismatch/logprob_diff_max"] < 0.05
