"""CTranslate2 rollout workers (``--rollout.sampler ct2``): each new weight version is converted in a
background thread while the worker samples with the previous one, the swap happens between
generate calls, and every token carries the version of the model that sampled it.

A worker built in process (no Ray) with a gate on its conversions shows the staleness books
exactly: groups finished while a conversion is held are the previous version's, token for
token (float32 CTranslate2 reproduces the HF model's log-probs, so each token's log-prob names
the weights that drew it). A local Ray cluster then trains a few steps with int8 workers and
a slowed conversion (the ``TURNRL_CT2_CONVERT_DELAY_S`` hook).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import groups_within
from turnrl.config import ConfigError, load_config
from turnrl.config.precision import MISSING_CT2, cpu_has_bf16
from turnrl.models import tiny_model

ctranslate2 = pytest.importorskip("ctranslate2", reason="the ct2 extra is not installed")

from turnrl.distributed.refresh_stats import refresh_metrics  # noqa: E402
from turnrl.distributed.worker_engines import without_tied_weights  # noqa: E402
from turnrl.distributed.workers import RolloutWorker  # noqa: E402
from turnrl.samplers.ct2_refresh import DELAY_ENV  # noqa: E402

TINY_ASYNC = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens",
              "3", "--run.progress", "false", "--run.tensorboard", "false", "--run.mode",
              "async", "--optim.lr", "1e-3", "--ray.num_workers", "1",
              "--rollout.group_size", "4", "--rollout.groups_per_step", "2",
              "--rollout.sampler", "ct2"]


def sent(model: torch.nn.Module) -> dict:
    """What the learner publishes for ``model`` (a tied matrix once)."""
    return without_tied_weights({k: v.detach().clone() for k, v in model.state_dict().items()})


def token_logprobs_of(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """log p(token_i | tokens before it) under ``model``, at temperature 1 (index 0: 0)."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])


def assert_sampled_by_labelled_version(groups, models: dict[int, torch.nn.Module]) -> None:
    """Every policy token's log-prob is its labelled version's model's own, and not another
    version's: no token carries a version it was not sampled with."""
    for episode in (ep for g in groups for ep in g.episodes):
        sampled = torch.tensor(episode.logprobs)
        for version, model in models.items():
            at = torch.tensor([v == version for v in episode.versions])
            if not at.any():
                continue
            ours = token_logprobs_of(model, episode.token_ids)[at]
            assert torch.allclose(ours, sampled[at], atol=2e-3), (version, episode.versions)
            for other_version, other in models.items():
                if other_version != version:
                    theirs = token_logprobs_of(other, episode.token_ids)[at]
                    assert not torch.allclose(theirs, sampled[at], atol=1e-2), version


def worker_of(*args: str, pool_size: int = 8) -> RolloutWorker:
    return RolloutWorker(load_config(None, TINY_ASYNC + list(args)), pool_size=pool_size)


def test_groups_played_during_a_held_conversion_carry_the_previous_version():
    """Version 1's conversion is held at a gate: the worker keeps sampling version 0 (and
    labels it so) meanwhile; once released, the swap happens between generate calls, and
    every token's log-prob is that of the weights its label names."""
    models = {v: tiny_model(seed=seed)[0].eval() for v, seed in ((0, 1), (1, 2))}
    worker = worker_of("--rollout.sampler_dtype", "float32", "--env.options.turns", "2")
    gate, entered = threading.Event(), threading.Event()
    fetch = worker.refresh.fetch

    def held_fetch(payload):
        if worker.refresh._taken >= 1:  # version 1 and later wait at the gate
            entered.set()
            assert gate.wait(120)
        return fetch(payload)

    worker.refresh.fetch = held_fetch
    try:
        worker.set_weights(0, sent(models[0]))
        worker.assign([(0, 100)])
        first = groups_within(worker, 120)
        worker.set_weights(1, sent(models[1]))
        assert entered.wait(60)  # version 1 is being converted now
        worker.assign([(a, 100 + a) for a in range(1, 4)])
        during, deadline = [], time.monotonic() + 120
        while len(during) < 3 and time.monotonic() < deadline:
            report = worker.take_groups(wait_s=1.0)
            during += report.groups
        assert len(during) == 3, "no sampling while version 1 was converting"
        assert report.version == 0 and report.weights_version == 1
        assert {v for g in during for ep in g.episodes for v in ep.versions} == {-1, 0}
        gate.set()
        worker.assign([(a, 100 + a) for a in range(4, 8)])
        after, deadline = [], time.monotonic() + 120
        while len(after) < 4 and time.monotonic() < deadline:
            report = worker.take_groups(wait_s=1.0)
            after += report.groups
        assert len(after) == 4
        versions = [set(ep.versions) - {-1} for g in after for ep in g.episodes]
        assert {1} in versions  # swapped in
        assert all(v <= {0, 1} for v in versions)
        assert_sampled_by_labelled_version(first + during + after, models)
        stats = worker.take_groups().stats
        assert stats["refresh_conversions"] == 2 and stats["refresh_swaps"] == 2
        # Sampling never waited on the held conversion (held for several generate calls):
        # the waits after the first version are the swaps alone.
        assert stats["refresh_wait_s"] < stats["refresh_convert_max_s"]
        assert stats["refresh_convert_s"] > 0 and stats["refresh_convert_cpu_s"] > 0
    finally:
        gate.set()
        worker.stop()


def test_versions_sent_during_a_conversion_collapse_into_the_newest():
    """Three versions sent while one converts: the converter takes only the newest next (the
    others are never fetched) and the worker ends on it."""
    models = {v: tiny_model(seed=10 + v)[0] for v in range(5)}
    worker = worker_of()
    fetched, gate = [], threading.Event()
    fetch = worker.refresh.fetch

    def counting_fetch(payload):
        fetched.append(worker.refresh._taken)
        if worker.refresh._taken == 1:
            assert gate.wait(120)
        return fetch(payload)

    worker.refresh.fetch = counting_fetch
    try:
        worker.set_weights(0, sent(models[0]))
        worker.assign([(0, 1)])
        groups_within(worker, 120)
        worker.set_weights(1, sent(models[1]))
        deadline = time.monotonic() + 60
        while fetched[-1:] != [1] and time.monotonic() < deadline:
            time.sleep(0.02)
        for version in (2, 3, 4):
            worker.set_weights(version, sent(models[version]))
        gate.set()
        deadline, assignment = time.monotonic() + 120, 1
        while worker.take_groups().version != 4 and time.monotonic() < deadline:
            worker.assign([(assignment, 1)])  # a generate call: the swap happens before it
            assignment += 1
            time.sleep(0.2)
        assert worker.take_groups().version == 4
        assert fetched == [0, 1, 4]
    finally:
        gate.set()
        worker.stop()


@pytest.mark.parametrize("bad, reason", [
    (lambda state: {k: v for k, v in state.items() if "q_proj" not in k}, "Missing key"),
    (lambda state: {**state, "model.norm.weight": torch.zeros(3)}, "size mismatch"),
    (lambda state: {**state, "model.extra.weight": torch.zeros(3)}, "Unexpected key"),
])
@pytest.mark.parametrize("at_version", [0, 1])
def test_a_failed_conversion_stops_the_worker_with_its_version_and_reason(bad, reason,
                                                                         at_version):
    """A version that cannot be converted (first or later) is reported by the worker's next
    answer with the version and torch's reason, not a hang nor an old version sampled on."""
    model, _ = tiny_model(seed=3)
    worker = worker_of()
    try:
        if at_version:
            worker.set_weights(0, sent(model))
            worker.assign([(0, 1)])
            groups_within(worker, 120)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        worker.set_weights(at_version, bad(state))
        worker.assign([(1, 2)])  # version 0: the loop waits for it in its swap
        deadline = time.monotonic() + 120
        with pytest.raises(RuntimeError) as failure:
            while time.monotonic() < deadline:
                worker.take_groups(wait_s=1.0)
        message = str(failure.value)
        assert f"ct2 conversion of weights version {at_version} failed" in message
        assert reason in message and "\n" not in message
        if at_version == 0:  # the loop met the failure too: it stopped, not hung
            worker._thread.join(60)
            assert str(worker.rollout.error) == message
    finally:
        worker.stop()


def test_refresh_metrics_sum_the_steps_growth_and_count_a_restart_from_zero():
    before = {0: {"refresh_conversions": 2, "refresh_convert_s": 4.0, "refresh_wait_s": 0.01,
                  "refresh_convert_max_s": 2.5},
              1: {"refresh_conversions": 5, "refresh_convert_s": 5.0, "refresh_wait_s": 0.5}}
    now = {0: {"refresh_conversions": 4, "refresh_convert_s": 7.0, "refresh_wait_s": 0.02,
               "refresh_convert_max_s": 2.5, "refresh_first_wait_s": 1.0},
           1: {"refresh_conversions": 1, "refresh_convert_s": 1.0, "refresh_wait_s": 0.0},
           2: {"generated_rows": 10}}  # an hf worker: no refresh
    metrics = refresh_metrics(now, before)
    assert metrics["async/refresh_conversions"] == 2 + 1  # worker 1 restarted: from zero
    assert metrics["async/refresh_convert_s"] == pytest.approx((3.0 + 1.0) / 3)
    assert metrics["async/refresh_wait_s"] == pytest.approx(0.01)
    assert metrics["async/refresh_convert_max_s"] == 2.5
    assert refresh_metrics({0: {"generated_rows": 1}}, {}) == {}
    assert math.isnan(refresh_metrics(before, before)["async/refresh_convert_s"])


@pytest.mark.parametrize("args, needle", [
    (["--rollout.sampler", "auto"], "need one named: --rollout.sampler hf, ct2 or vllm"),
    (["--rollout.sampler", "hf", "--rollout.sampler_dtype", "int8"], "use it with --rollout.sampler ct2"),
    (["--rollout.sampler_dtype", "float16"], "float16 is for vllm"),
    (["--ray.worker_gpus", "1"], "rollout.sampler ct2 samples on CPU"),
    (["--model.lora.r", "4"], "rollout.sampler ct2 with sampler_dtype auto samples from a converted copy"),
])
def test_what_ct2_workers_cannot_do_is_refused_at_start_up(args, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, TINY_ASYNC + args)


def test_ct2_worker_precisions_follow_the_machine():
    for dtype in ("auto", "int8", "float32"):
        assert load_config(None, TINY_ASYNC + ["--rollout.sampler_dtype", dtype]).rollout.sampler == "ct2"
    args = TINY_ASYNC + ["--rollout.sampler_dtype", "bfloat16"]
    if not cpu_has_bf16():
        with pytest.raises(ConfigError, match="rollout.sampler_dtype bfloat16: this CPU has no"):
            load_config(None, args)


def test_an_architecture_ct2_cannot_convert_names_the_workers_option():
    from transformers import BertConfig

    from turnrl.samplers.ct2 import check_architecture

    with pytest.raises(ValueError, match="rollout.sampler ct2 cannot convert BertConfig.*"
                                         "use --rollout.sampler hf"):
        check_architecture(BertConfig(), "rollout.sampler")


def test_without_ctranslate2_ct2_workers_fail_at_start_up_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['ctranslate2'] = None; from turnrl.cli import main; "
            f"sys.exit(main(['train', *{TINY_ASYNC!r}, '--run.out_dir', "
            f"{str(tmp_path / 'run')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and MISSING_CT2 in lines[0], lines
    assert "rollout.sampler ct2" in lines[0] and "turnrl[ct2]" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_async_run_with_ct2_workers_trains_and_logs_its_refreshes(ray_cluster, tmp_path):
    """Three steps with int8 workers whose every conversion takes 1 s longer (the test hook):
    the run trains, logs the int8 mismatch and what the refreshes cost, and sampling never
    waited a conversion out."""
    from turnrl.distributed import LEDGER_FILE
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    delay = 1.0
    cfg = load_config(None, TINY_ASYNC + [
        "--run.steps", "3", "--eval.episodes", "0", "--run.checkpoint_every", "0",
        f"--ray.runtime_env.env_vars.{DELAY_ENV}", str(delay), "--run.out_dir", str(tmp_path)])
    result = train_async(cfg)

    records = read_metrics(tmp_path / "metrics.jsonl")
    ledger = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and len(result.trained) == 3 * 2
    assert all(len(line["trained"]) == 2 for line in ledger)
    for r in records:
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["grad_norm"])
        assert 0 < r["mismatch/logprob_diff_mean"] < 5 and math.isfinite(r["mismatch/kl"])
        assert r["async/refresh_convert_max_s"] >= delay  # every conversion was slowed
        assert r["async/refresh_wait_s"] < delay  # ... and never waited for
        assert r["async/refresh_first_wait_s"] > 0
    assert sum(r["async/refresh_conversions"] for r in records) >= 1
