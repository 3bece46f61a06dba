"""``optim.compute_dtype bfloat16``: the update's matmuls under bf16 autocast, everything it
keeps (weights, gradients, Adam moments) in float32, and the mismatch metrics seeing it."""

from __future__ import annotations

import copy

import pytest
import torch

from turnrl.config import AlgoConfig, ConfigError, OptimConfig, load_config
from turnrl.config.precision import cpu_has_bf16
from turnrl.sft.train import sft_update
from turnrl.trainer.step import UpdateSettings, policy_update, score_policy_tokens, update_autocast
from turnrl.types import Batch, Episode


def _episodes(count: int = 6, seed: int = 0) -> list[Episode]:
    rng = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 60, (6,), generator=rng).tolist()
    episodes = []
    for _ in range(count):
        ep = Episode(env="toy", seed=0, group=0)
        ep.append(prompt, policy=False)
        action = torch.randint(3, 60, (5,), generator=rng).tolist()
        ep.append(action, policy=True, logprobs=[0.0] * 5, version=0)
        episodes.append(ep)
    return episodes


def _batch_with_fp32_sampler(model) -> Batch:
    """A batch whose behaviour log-probs are the fp32 model's own, as the HF sampler's are."""
    batch = Batch.from_episodes(_episodes(), torch.linspace(-1, 1, 6), pad_id=0)
    with torch.no_grad():
        logprobs, _ = score_policy_tokens(model, batch, 1.0)
    batch.old_logprobs = torch.zeros_like(batch.old_logprobs)
    batch.old_logprobs[:, 1:] = logprobs
    return batch


def _settings(compute_dtype: str, **algo) -> UpdateSettings:
    return UpdateSettings(AlgoConfig(**algo), OptimConfig(compute_dtype=compute_dtype),
                          temperature=1.0, agg_constant=16)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_bf16_scoring_is_engaged_and_close(tiny):
    model, _ = tiny
    batch = _batch_with_fp32_sampler(model)
    with torch.no_grad(), update_autocast(model, "bfloat16"):
        bf16, _ = score_policy_tokens(model, batch, 1.0)
    assert bf16.dtype == torch.float32  # log-probs are taken in float32 either way
    diff = (bf16 - batch.old_logprobs[:, 1:]).abs()
    assert diff.max() > 1e-4  # the matmuls really ran in bf16
    assert diff.max() < 0.1


def test_bf16_update_keeps_float32_state_and_follows_the_fp32_step(tiny):
    model, _ = tiny
    batch = _batch_with_fp32_sampler(model)
    start = _flat(model)
    moved, metrics = {}, {}
    for dtype in ("float32", "bfloat16"):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        metrics[dtype] = policy_update(trained, optimizer, batch, _settings(dtype))
        assert all(p.dtype == torch.float32 for p in trained.parameters())
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trained.parameters())
        for state in optimizer.state.values():
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        moved[dtype] = _flat(trained) - start
    assert moved["bfloat16"].abs().max() > 1e-4
    cosine = torch.nn.functional.cosine_similarity(moved["float32"], moved["bfloat16"], dim=0)
    assert cosine > 0.9  # Adam's first step is ~lr*sign(g): the signs mostly agree
    # the sampler (fp32) and the learner (bf16) now differ, and the metrics say so
    assert metrics["float32"]["mismatch/kl"] < 1e-9
    assert metrics["bfloat16"]["mismatch/kl"] > 100 * max(metrics["float32"]["mismatch/kl"], 1e-12)
    assert metrics["bfloat16"]["mismatch/logprob_diff_max"] > 1e-4


def test_a_correction_weighs_tokens_by_the_bf16_learner(tiny):
    """With IcePop masking (ratios outside [0.999, 1.001] masked) under a bf16
    learner some tokens are masked, under fp32 none (the sampler is the same fp32 model)."""
    model, _ = tiny
    batch = _batch_with_fp32_sampler(model)
    fractions = {}
    for dtype in ("float32", "bfloat16"):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        result = policy_update(trained, optimizer, batch,
                               _settings(dtype, mismatch_correction="icepop",
                                         mismatch_low=0.999, mismatch_high=1.001))
        fractions[dtype] = result["mismatch/corrected_fraction"]
    assert fractions["float32"] == 0.0
    assert fractions["bfloat16"] > 0.0


def test_bf16_warm_up_step_tracks_the_fp32_loss(tiny):
    model, _ = tiny
    episodes = _episodes(seed=3)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        losses[dtype] = sft_update(trained, optimizer, episodes, pad_id=0, micro_batch_size=4,
                                   token_budget=0, max_grad_norm=1.0,
                                   compute_dtype=dtype)["sft/loss"]
        assert all(p.dtype == torch.float32 for p in trained.parameters())
    assert losses["bfloat16"] != losses["float32"]
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.02)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_update_is_refused_exactly_where_the_cpu_lacks_it(monkeypatch, native):
    monkeypatch.setattr("turnrl.config.checks.cpu_has_bf16", lambda: native)
    args = ["--model.name", "tiny", "--model.device", "cpu", "--optim.compute_dtype", "bfloat16"]
    if native:
        assert load_config(None, args).optim.compute_dtype == "bfloat16"
    else:
        with pytest.raises(ConfigError, match="no native bf16.*--optim.compute_dtype float32"):
            load_config(None, args)


def test_a_bf16_update_run_trains_and_checkpoints_float32(tmp_path):
    """`turnrl train --optim.compute_dtype bfloat16`: two steps, float32 checkpoints, and the
    fp32 sampler's mismatch to the bf16 learner logged. Where the CPU lacks bf16 the same
    command is refused at start-up (the other branch of the test above)."""
    from safetensors.torch import load_file

    from turnrl.checkpoint import latest_checkpoint
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    args = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
            "--rollout.group_size", "4", "--rollout.groups_per_step", "2", "--run.steps", "2",
            "--eval.episodes", "0", "--run.progress", "false", "--run.tensorboard", "false",
            "--optim.compute_dtype", "bfloat16", "--run.out_dir", str(tmp_path / "run")]
    if not cpu_has_bf16():
        with pytest.raises(ConfigError, match="no native bf16"):
            load_config(None, args)
        return
    train(load_config(None, args))
    weights = load_file(latest_checkpoint(tmp_path / "run") / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 2
    assert all(m["update/skipped"] == 0 and m["mismatch/kl"] > 1e-9 for m in metrics)
