"""The CTranslate2 engine (``rollout.sampler ct2``): completions, log-probs against a float32
forward pass, weight refresh, start-up checks, and a lock-step run with the mismatch logged.

Run on a real tiny Llama (CTranslate2 has a Llama loader) made *peaked*: the random tiny
model's logits are nearly uniform (every log-prob about -5.9), where int8 rounding could hardly
show and greedy decoding tells nothing; scaling its tied embedding spreads them over tens of
nats.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import torch

from turnrl.algorithms.losses import token_logprobs
from turnrl.config import ConfigError, load_config
from turnrl.config.precision import MISSING_CT2, cpu_has_bf16, resolve_ct2_dtype
from turnrl.models import tiny_model
from turnrl.samplers import SamplingParams
from turnrl.samplers.copy import HFCopyEngine
from turnrl.samplers.ct2 import check_architecture

ctranslate2 = pytest.importorskip("ctranslate2", reason="the ct2 extra is not installed")

from turnrl.samplers.ct2 import CT2Engine  # noqa: E402 - after the extra's check

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 50, 51], [1, 60, 61, 62, 63]]
"""Rows of different lengths, two identical (a GRPO group's first turn)."""


def peaked_model(seed: int = 0, scale: float = 6.0) -> torch.nn.Module:
    model, _ = tiny_model(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)  # tied: the output layer too
    return model.eval()


def recomputed(model, prompt, tokens, temperature):
    """Log-probs of ``tokens`` after ``prompt`` from a float32 forward pass of ``model``."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    return token_logprobs(logits, ids[:, 1:], temperature or 1.0)[0, len(prompt) - 1:]


def drift(model, prompts, completions, temperature) -> torch.Tensor:
    """|sampler log-prob - float32 log-prob| of every sampled token."""
    return torch.cat([(recomputed(model, p, c.token_ids, temperature)
                       - torch.tensor(c.logprobs)).abs()
                      for p, c in zip(prompts, completions, strict=True)])


@pytest.fixture(scope="module")
def model():
    return peaked_model()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.0, 1.0)])
def test_float32_logprobs_equal_a_forward_pass(model, temperature, top_p):
    """float32: the reported log-prob is log_softmax(logits / T) before top-p, as HFEngine's,
    at temperatures other than 1 too (CTranslate2 itself reports temperature-1 values)."""
    engine = CT2Engine(model, compute_type="float32")
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p)
    completions = engine.generate(PROMPTS, params)
    assert [len(c.token_ids) for c in completions] == [6] * len(PROMPTS)
    assert drift(model, PROMPTS, completions, temperature).max() < 1e-3
    if temperature not in (0.0, 1.0):  # the temperature-1 numbers would be far off
        ones = torch.cat([recomputed(model, p, c.token_ids, 1.0) - torch.tensor(c.logprobs)
                          for p, c in zip(PROMPTS, completions, strict=True)])
        assert ones.abs().max() > 0.1


@pytest.mark.parametrize("compute_type", ["int8", "int8_float32"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_int8_logprobs_are_close_to_float32(model, compute_type, temperature):
    """int8 weights: a rounding mismatch, small (SmolLM2 measures ~0.2 nats a token in
    benchmarks/speed/ct2_sampling.py; here the peaked tiny model)."""
    engine = CT2Engine(model, compute_type=compute_type)
    completions = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8,
                                                          temperature=temperature))
    diffs = drift(model, PROMPTS, completions, temperature)
    assert diffs.mean() < 0.1 and diffs.max() < 1.0, diffs
    assert diffs.max() > 1e-5  # int8 is not float32: the test sees the rounding


def test_greedy_is_the_argmax_of_the_model(model):
    engine = CT2Engine(model, compute_type="float32")
    completions = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0))
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        ids = list(prompt)
        for token in completion.token_ids:
            with torch.no_grad():
                assert token == int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)


@pytest.mark.parametrize("max_new_tokens", [1, 3, 12])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_stop_tokens_and_max_new_tokens(model, max_new_tokens, temperature):
    """A row ends at its first stop token (kept, finish 'stop') or after max_new_tokens
    (finish 'length') with no stop token in it; the model's own eos never stops a row."""
    engine = CT2Engine(model, compute_type="int8", seed=3)
    for stop in [tuple(range(0, 355, 3)), tuple(range(100, 300)), ()]:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                stop_token_ids=stop)
        completions = engine.generate(PROMPTS * 4, params)
        for c in completions:
            assert 1 <= len(c.token_ids) <= max_new_tokens
            assert len(c.logprobs) == len(c.token_ids)
            assert not set(c.token_ids[:-1]) & set(stop)
            if c.token_ids[-1] in stop:
                assert c.finish_reason == "stop"
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == max_new_tokens
        if stop and max_new_tokens > 1 and temperature:
            # with a third of the vocabulary as stops, some rows stop early, not all
            reasons = {c.finish_reason for c in completions}
            assert "stop" in reasons, reasons


def test_max_new_tokens_zero_and_empty_calls(model):
    engine = CT2Engine(model, compute_type="int8")
    assert engine.generate([], SamplingParams()) == []
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=0))
    assert [c.token_ids for c in out] == [[]] * len(PROMPTS)


@pytest.mark.parametrize("prompts,needle", [
    ([[1, 2, 355]], "token id 355 is outside"),
    ([[1, -1]], "token id -1 is outside"),
    ([[1, 2], []], "empty prompt"),
])
def test_bad_prompts_fail_in_one_line(model, prompts, needle):
    engine = CT2Engine(model, compute_type="int8")
    with pytest.raises(ValueError, match=needle):
        engine.generate(prompts, SamplingParams())


def test_the_same_seed_draws_the_same_tokens(model):
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    first = CT2Engine(model, compute_type="int8", seed=5).generate(PROMPTS, params)
    again = CT2Engine(model, compute_type="int8", seed=5).generate(PROMPTS, params)
    other = CT2Engine(model, compute_type="int8", seed=6).generate(PROMPTS, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


@pytest.mark.parametrize("compute_type", ["int8", "float32"])
def test_converting_leaves_the_learner_untouched(compute_type):
    """CTranslate2's quantisation rewrites the arrays it is given in place: handed the
    learner's tensors, int8 conversion corrupted them (log-probs off by hundreds of nats)."""
    model = peaked_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = CT2Engine(model, compute_type=compute_type)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=1.0))
    engine.load(model.state_dict(), 1)  # converts T=1 again, at once
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=0.7))  # T=0.7 model
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert model.model.embed_tokens.weight is model.lm_head.weight  # still tied


@pytest.mark.parametrize("as_pairs", [False, True])
def test_refreshed_weights_change_the_samples(as_pairs):
    """After an update the engine samples from the new weights (its log-probs are the new
    model's, not the old one's), at each temperature in use, and adopts the version. The
    update may come as named parameters (the tied output layer then named once)."""
    model = peaked_model()
    engine = CT2Engine(model, compute_type="float32")
    params = {t: SamplingParams(max_new_tokens=6, temperature=t) for t in (1.0, 0.7)}
    for p in params.values():
        engine.generate(PROMPTS, p)  # both temperatures converted for version 0
    old = copy.deepcopy(model)
    with torch.no_grad():  # an "update": every weight moves
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    stale = engine.generate(PROMPTS, params[1.0])
    assert drift(old, PROMPTS, stale, 1.0).max() < 1e-3  # not refreshed yet: the old weights
    weights = list(model.named_parameters()) if as_pairs else model.state_dict()
    engine.load(weights, 7)
    assert engine.version == 7
    for temperature, p in params.items():
        fresh = engine.generate(PROMPTS, p)
        assert drift(model, PROMPTS, fresh, temperature).max() < 1e-3
        assert drift(old, PROMPTS, fresh, temperature).max() > 0.1
    # An engine updated before it ever sampled (a run's first publish) samples the update.
    unused = CT2Engine(old, compute_type="float32")
    unused.load(weights, 1)
    fresh = unused.generate(PROMPTS, params[1.0])
    assert drift(model, PROMPTS, fresh, 1.0).max() < 1e-3


def test_unsupported_architecture_and_dtypes_fail_in_one_line():
    from transformers import BertConfig, MambaConfig, T5Config

    for config in (BertConfig(), T5Config(), MambaConfig()):  # encoder, enc-dec, no loader
        with pytest.raises(ValueError, match=f"cannot convert {type(config).__name__} models"):
            check_architecture(config)
    with pytest.raises(ValueError, match="not a ct2 compute type"):
        resolve_ct2_dtype("float16")
    assert resolve_ct2_dtype("auto") == "int8"  # auto never assumes bf16
    supported = ctranslate2.get_supported_compute_types("cpu")
    if cpu_has_bf16() and "bfloat16" in supported:
        assert resolve_ct2_dtype("bfloat16") == "bfloat16"
    else:
        with pytest.raises(ValueError, match="bf16|cannot compute it on CPU"):
            resolve_ct2_dtype("bfloat16")


@pytest.mark.parametrize("flags,native", [
    ({"avx2", "avx512f"}, False), ({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True),
    ({"fp", "asimd", "bf16"}, True), (set(), False),
])
def test_bf16_detection_reads_the_flags(flags, native):
    assert cpu_has_bf16(flags) is native


def _cfg(*args):
    return load_config(None, ["--model.name", "tiny", *args])


@pytest.mark.parametrize("args,needle", [
    (["--rollout.sampler_dtype", "int8"], "is CTranslate2's"),
    (["--rollout.sampler_dtype", "int8_float32", "--rollout.sampler", "vllm"], "CTranslate2's"),
    (["--rollout.sampler", "ct2", "--run.mode", "async", "--ray.worker_gpus", "1"],
     "samples on CPU: drop ray.worker_gpus"),
    (["--rollout.sampler", "ct2", "--rollout.sampler_dtype", "bfloat16"]
     if not cpu_has_bf16() or "bfloat16" not in ctranslate2.get_supported_compute_types("cpu")
     else ["--rollout.sampler", "ct2", "--rollout.sampler_dtype", "float16"],
     "bf16|cannot compute it on CPU|float16 is for vllm"),
])
def test_config_refuses_what_cannot_run(args, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(*args)


def test_hf_bfloat16_is_refused_exactly_where_the_cpu_lacks_it():
    args = ["--rollout.sampler_dtype", "bfloat16", "--model.device", "cpu"]
    if cpu_has_bf16():
        assert _cfg(*args).rollout.sampler_dtype == "bfloat16"
    else:
        with pytest.raises(ConfigError, match="no native bf16"):
            _cfg(*args)


def test_a_missing_extra_fails_at_start_up_naming_it(tmp_path):
    """Without CTranslate2 (hidden from the import system) `turnrl train --rollout.sampler
    ct2` stops before loading anything, with one line naming the extra."""
    code = ("import sys; sys.modules['ctranslate2'] = None; from turnrl.cli import main; "
            "sys.exit(main(['train', '--model.name', 'tiny', '--rollout.sampler', 'ct2', "
            f"'--run.out_dir', {str(tmp_path / 'run')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and MISSING_CT2 in lines[0] and "turnrl[ct2]" in lines[0]
    assert not (tmp_path / "run").exists()


def test_hf_copy_engine_samples_from_a_refreshed_bf16_copy():
    """``rollout.sampler hf`` with ``engine_dtype bfloat16``: the learner stays float32, the
    sampler is a bf16 copy with log-probs near the learner's, refreshed by load."""
    model = peaked_model()
    engine = HFCopyEngine(model, torch.bfloat16, pad_token_id=0, seed=0)
    assert model.dtype == torch.float32 and engine.model.dtype == torch.bfloat16
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    diffs = drift(model, PROMPTS, engine.generate(PROMPTS, params), 1.0)
    assert 1e-4 < diffs.max() < 1.0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    engine.load(model.state_dict(), 3)
    assert engine.version == 3
    diffs = drift(model, PROMPTS, engine.generate(PROMPTS, params), 1.0)
    assert diffs.mean() < 0.2
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        engine.load({"nope": torch.zeros(1)}, 4)


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_a_lock_step_run_samples_with_ct2_and_logs_the_mismatch(tmp_path, dtype):
    """`--rollout.sampler ct2`: every step's tokens come from CTranslate2 (int8: a mismatch
    above float noise, still small; float32: float noise), each update is converted
    (time/publish_s) and the loop's mismatch metrics are logged."""
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    cfg = load_config(None, [
        "--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "2", "--run.steps", "3",
        "--rollout.sampler", "ct2", "--rollout.sampler_dtype", dtype,
        "--eval.episodes", "4", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.out_dir", str(tmp_path)])
    train(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["time/publish_s"] > 0
        if dtype == "int8":  # the tiny model's near-uniform logits: small but visible
            assert 1e-5 < row["mismatch/logprob_diff_mean"] < 0.05
            assert row["mismatch/kl"] < 1e-2
        else:
            assert row["mismatch/logprob_diff_max"] < 1e-3


def test_auto_times_the_candidates_and_keeps_the_fastest(capsys):
    """`rollout.sampler auto` on this machine: every sampler it can run is timed (ct2 int8
    here; hf bf16 where the CPU has it), sampling and one refresh each; the printed choice
    is the cheapest step by the margin rule on the printed figures, and the engine returned;
    its seed and version start fresh."""
    from turnrl.policy import load_policy
    from turnrl.samplers.hf import HFEngine

    cfg = _cfg("--rollout.sampler", "auto", "--rollout.group_size", "4",
               "--rollout.groups_per_step", "2", "--rollout.max_new_tokens", "4")
    policy = load_policy(cfg)
    line = [x for x in capsys.readouterr().out.splitlines() if "rollout.sampler auto" in x]
    assert len(line) == 1, line
    assert "hf float32" in line[0] and "ct2 int8" in line[0]
    assert ("hf bfloat16" in line[0]) is cpu_has_bf16()
    chosen = line[0].split("auto: ")[1].split(" (")[0]
    assert "sampling 8 rows x 8 turns x 4 tokens + one weight refresh" in line[0]
    figures = {name: (float(step), float(sampling), float(refresh))  # step = sampling + refresh
               for name, step, sampling, refresh in re.findall(
                   r"(\w+ \w+) ([\d.]+) s = ([\d.]+) \+ ([\d.]+)", line[0])}
    assert set(figures) == {"hf float32", "ct2 int8"} | ({"hf bfloat16"} if cpu_has_bf16()
                                                          else set())
    for step_s, sampling_s, refresh_s in figures.values():
        assert step_s == pytest.approx(sampling_s + refresh_s, abs=0.011)  # 2 decimals each
    assert figures["hf float32"][2] == 0  # the learner's own tensors: nothing to refresh
    assert figures["ct2 int8"][2] > 0  # a conversion
    hf_s, best = figures["hf float32"][0], min(figures, key=lambda name: figures[name][0])
    if chosen == "hf float32":  # the margin rule on the printed (rounded) figures
        assert figures[best][0] * 1.15 >= hf_s - 0.02
    else:
        assert chosen == best and figures[best][0] * 1.15 <= hf_s + 0.02
    engine = policy.engine
    kind = {CT2Engine: "ct2 int8", HFCopyEngine: "hf bfloat16", HFEngine: "hf float32"}
    assert kind[type(engine)] == chosen
    assert engine.version == 0
    fresh = torch.Generator().manual_seed(cfg.run.seed)
    assert torch.equal(engine.generator.get_state(), fresh.get_state())


@pytest.mark.parametrize("args,needle", [
    (["--rollout.sampler", "auto", "--rollout.sampler_dtype", "int8"], "picks the precision"),
    (["--rollout.sampler", "auto", "--run.mode", "async"], "need one named"),
])
def test_auto_config_errors(args, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(*args)


def test_served_training_refreshes_the_ct2_engine(tmp_path):
    """`train_agent` (agent code behind the server) with `--rollout.sampler ct2`: each update
    reaches the served engine, so step 2's sampler log-probs are the updated learner's (in
    float32, up to float noise; a stale engine would be off by the update, lr 1e-2)."""
    from tests.serve.test_train import rollout
    from turnrl.metrics import read_metrics
    from turnrl.serve.train import train_agent

    cfg = load_config(None, [
        "--model.name", "tiny", "--run.out_dir", str(tmp_path / "run"), "--run.steps", "2",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "2", "--serve.port", "0",
        "--rollout.sampler", "ct2", "--rollout.sampler_dtype", "float32",
        "--run.progress", "false", "--optim.lr", "1e-2", "--run.tensorboard", "false"])
    train_agent(rollout, ["Say a digit.", "Name a number."], cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    assert all(row["mismatch/logprob_diff_max"] < 1e-3 for row in rows), rows


def test_turnrl_eval_gives_each_checkpoint_to_the_ct2_engine(tmp_path):
    """`turnrl eval` swaps checkpoints into one loaded model; the ct2 engine, with weights of
    its own, must sample each checkpoint (before, it kept the first weights it converted)."""
    from safetensors.torch import save_model

    from turnrl.checkpoint_eval import Evaluator

    cfg = _cfg("--rollout.sampler", "ct2", "--rollout.sampler_dtype", "float32",
               "--eval.episodes", "2", "--rollout.max_turns", "1")
    evaluator = Evaluator(cfg)
    policy = evaluator.policy
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    evaluator.run(None, 1)  # the base weights, converted
    trained = copy.deepcopy(policy.model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    (tmp_path / "ckpt").mkdir()
    save_model(trained, str(tmp_path / "ckpt" / "model.safetensors"))
    evaluator.run(tmp_path / "ckpt", 1)
    completions = policy.engine.generate(PROMPTS, params)
    assert drift(trained, PROMPTS, completions, 1.0).max() < 1e-3
    evaluator.run(None, 1)  # and back to the base
    base = copy.deepcopy(policy.model)
    completions = policy.engine.generate(PROMPTS, params)
    assert drift(base, PROMPTS, completions, 1.0).max() < 1e-3
    assert drift(trained, PROMPTS, completions, 1.0).max() > 0.1


def test_the_scratch_folder_goes_with_the_engine(tmp_path):
    """Converted models are written to a scratch folder (in /dev/shm): removed on close, and
    at interpreter exit for an engine never closed (a run's)."""
    import os

    closed = CT2Engine(peaked_model(), compute_type="int8")
    closed.generate(PROMPTS, SamplingParams(max_new_tokens=1))
    assert os.path.isdir(closed._root)
    closed.close()
    assert not os.path.exists(closed._root)
    code = ("from turnrl.models import tiny_model; from turnrl.samplers import SamplingParams; "
            "from turnrl.samplers.ct2 import CT2Engine; "
            "engine = CT2Engine(tiny_model()[0]); engine.generate([[1, 2]], SamplingParams()); "
            "print(engine._root)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    root = done.stdout.strip().splitlines()[-1]
    assert "turnrl-ct2-" in root and not os.path.exists(root)
