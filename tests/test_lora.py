"""LoRA through PEFT (``model.lora``): only the adapter trains, is optimised, checkpointed and
sent to rollout workers; the base model with the adapter off is the KL reference; a LoRA run
resumes bit for bit, evaluates, serves, reports and exports (merged or adapter alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turnrl.checkpoint import latest_checkpoint, load_weights
from turnrl.config import ConfigError, load_config
from turnrl.export import export_model, probe_logprobs
from turnrl.lora import (
    adapter_disabled,
    adapter_state,
    is_lora,
    load_published,
    published_state,
    state_bytes,
)
from turnrl.models import tiny_model
from turnrl.policy import load_policy
from turnrl.trainer import train
from turnrl.trainer.run import build_learner
from turnrl.trainer.step import policy_update, score_policy_tokens
from turnrl.types import Batch

peft = pytest.importorskip("peft")  # the `peft` extra; `make test` installs it

TESTS = Path(__file__).parent
TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false"]
LORA = ["--model.lora.r", "4"]


def lora_policy(*extra: str):
    cfg = load_config(None, TINY + LORA + ["--optim.lr", "1e-2", *extra])
    return cfg, load_policy(cfg)


def batch_for(model, tokenizer, rows: int = 6) -> Batch:
    """Random token rows, their second half the policy's, scored by ``model`` as behaviour."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (rows, 12), generator=gen)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, 6:] = 1
    attention = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    old = torch.zeros_like(mask)
    old[:, 1:] = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    return Batch(ids, attention, mask, old, torch.linspace(-1, 1, rows))


def base_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.mark.parametrize("extra", [[], ["--model.lora.target_modules", "q_proj,v_proj"]])
def test_the_adapter_state_is_peft_s_own_without_peft_touching_the_weights(extra):
    """TurnRL picks the adapter's tensors by PEFT's names (markers, so PEFT never gathers FSDP
    shards, which peft 0.22 does as a collective): the same keys and the very tensors PEFT's
    ``get_peft_model_state_dict`` gives for a whole model."""
    from peft import get_peft_model_state_dict

    _, policy = lora_policy(*extra)
    ours, theirs = adapter_state(policy.model), get_peft_model_state_dict(policy.model)
    assert ours and ours.keys() == theirs.keys()
    assert all("lora_" in key and ".default" not in key for key in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    named = dict(policy.model.named_parameters())
    assert all(any(v.data_ptr() == p.data_ptr() for p in named.values()) for v in ours.values())


def test_a_step_changes_the_adapter_alone_and_the_optimiser_holds_only_it():
    cfg, policy = lora_policy()
    learner = build_learner(cfg, policy)
    model = learner.model
    assert is_lora(model)
    before_base, before_adapter = base_tensors(model), adapter_state(model)
    before_adapter = {k: v.clone() for k, v in before_adapter.items()}
    batch = batch_for(model, policy.tokenizer)
    policy_update(model, learner.optimizer, batch, learner.settings, learner.ref_model)
    after_base = base_tensors(model)
    assert before_base.keys() == after_base.keys() and len(after_base) > 10
    assert all(torch.equal(before_base[k], after_base[k]) for k in before_base)  # bitwise
    after_adapter = adapter_state(model)
    moved = [k for k in after_adapter if not torch.equal(after_adapter[k], before_adapter[k])]
    assert moved and all(".lora_" in k for k in moved)
    # every linear projection of attention and MLP carries the default 'all-linear' adapter
    targets = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in after_adapter}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"}
    optimised = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    adapter_params = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert optimised == adapter_params
    assert set(learner.optimizer.state) <= {p for n, p in model.named_parameters()
                                            if "lora_" in n}
    assert len(learner.optimizer.state) == len(adapter_params)


def test_the_kl_reference_is_the_base_model_with_the_adapter_off_and_no_copy():
    cfg, policy = lora_policy("--algo.kl_coef", "0.1", "--algo.epochs", "1")
    learner = build_learner(cfg, policy)
    model = learner.model
    assert learner.ref_model is model  # the same weights: no second copy of the base
    batch = batch_for(model, policy.tokenizer)
    first = policy_update(model, learner.optimizer, batch, learner.settings, learner.ref_model)
    second = policy_update(model, learner.optimizer, batch, learner.settings, learner.ref_model)
    assert abs(first["kl"]) < 1e-6 < second["kl"]  # B = 0 at first: the adapter adds nothing
    fresh_base, _ = tiny_model(0)
    with torch.no_grad():
        expected, _ = score_policy_tokens(fresh_base, batch, 1.0)
        with adapter_disabled(model):
            reference, _ = score_policy_tokens(model, batch, 1.0)
        trained, _ = score_policy_tokens(model, batch, 1.0)
    assert torch.allclose(reference, expected, atol=1e-6)
    assert float((trained - expected).abs().max()) > 1e-4  # the adapter on: the trained policy


def test_a_worker_receives_the_adapter_alone_and_then_samples_the_learners_policy():
    cfg, learner_policy = lora_policy()
    learner = build_learner(cfg, learner_policy)
    model = learner.model
    batch = batch_for(model, learner_policy.tokenizer)
    policy_update(model, learner.optimizer, batch, learner.settings)
    sent = published_state(model)
    assert sent and all(".lora_" in k for k in sent)
    full = {k: v for k, v in tiny_model(0)[0].state_dict().items() if k != "lm_head.weight"}
    assert state_bytes(sent) < 0.15 * state_bytes(full)
    worker = load_policy(cfg).model  # its own fresh adapter (another A draw)
    load_published(worker, sent)
    with torch.no_grad():
        ours, _ = score_policy_tokens(model, batch, 1.0)
        theirs, _ = score_policy_tokens(worker, batch, 1.0)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="model.lora"):  # another rank does not fit
        load_published(load_policy(load_config(None, TINY + ["--model.lora.r", "2"])).model,
                       sent)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run on the tiny model: 2 steps, a checkpoint after each, 2 held-out episodes
    (an entropy bonus moves the adapter whatever the few episodes' rewards)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = load_config(None, TINY + LORA + [
        "--optim.lr", "5e-2", "--algo.entropy_coef", "0.05", "--run.steps", "2",
        "--run.checkpoint_every", "1",
        "--eval.episodes", "2", "--rollout.groups_per_step", "2", "--rollout.group_size", "2",
        "--run.out_dir", str(out)])
    train(cfg)
    return out


def test_a_lora_checkpoint_holds_the_adapter_and_its_moments_only(lora_run, tmp_path):
    checkpoint = latest_checkpoint(lora_run)
    names = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    assert "model.safetensors" not in names
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert adapter and all(".lora_" in k for k in adapter)
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # trained
    moments = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]
    assert len(moments) == len(adapter)
    assert sorted(t.numel() for t in adapter.values()) == sorted(
        s["exp_avg"].numel() for s in moments.values())
    full = tmp_path / "full"
    train(load_config(None, TINY + ["--run.steps", "1", "--eval.episodes", "0",
                                     "--rollout.groups_per_step", "2",
                                     "--rollout.group_size", "2", "--run.out_dir", str(full)]))
    size = lambda d: sum(p.stat().st_size for p in d.iterdir()  # noqa: E731
                         if p.name in {"model.safetensors", "adapter_model.safetensors",
                                       "optimizer.pt"})
    lora_bytes, full_bytes = size(checkpoint), size(latest_checkpoint(full))
    print(f"checkpoint weights+moments: LoRA r=4 {lora_bytes} B, full {full_bytes} B")
    assert lora_bytes < 0.2 * full_bytes


def test_a_resumed_lora_run_is_the_uninterrupted_one_bit_for_bit(lora_run, tmp_path):
    cut = load_config(None, TINY + LORA + [
        "--optim.lr", "5e-2", "--algo.entropy_coef", "0.05", "--run.steps", "1",
        "--run.checkpoint_every", "1",
        "--eval.episodes", "2", "--rollout.groups_per_step", "2", "--rollout.group_size", "2",
        "--run.out_dir", str(tmp_path / "cut")])
    train(cut)
    from dataclasses import replace

    train(replace(cut, run=replace(cut.run, steps=2)), resume=True)
    for name in ("adapter_model.safetensors", "optimizer.pt"):
        a = (lora_run / "checkpoints" / "step-000002" / name).read_bytes()
        b = (tmp_path / "cut" / "checkpoints" / "step-000002" / name).read_bytes()
        if name.endswith(".pt"):  # torch.save's archive names differ; compare the tensors
            a = torch.load(lora_run / "checkpoints" / "step-000002" / name, weights_only=False)
            b = torch.load(tmp_path / "cut" / "checkpoints" / "step-000002" / name,
                           weights_only=False)
            assert all(torch.equal(a["state"][i][k], b["state"][i][k])
                       for i in a["state"] for k in a["state"][i])
        else:
            assert a == b


def checkpoint_logprobs(checkpoint: Path) -> torch.Tensor:
    """The probe's log-probs under the checkpoint, as training saw them (adapter on top)."""
    cfg = load_config(None, TINY + LORA)
    policy = load_policy(cfg)
    load_weights(checkpoint, policy.model)
    return probe_logprobs(policy.model.eval(), policy.tokenizer)


def test_export_merged_and_adapter_only_reproduce_the_checkpoint(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = latest_checkpoint(lora_run)
    expected = checkpoint_logprobs(checkpoint)
    base = probe_logprobs(tiny_model(0)[0].eval(), tiny_model(0)[1])
    assert float((expected - base).abs().max()) > 1e-4  # the adapter moved the policy

    merged = export_model(lora_run, tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert not any("lora" in n for n, _ in model.named_parameters())
    got = probe_logprobs(model.eval(), tokenizer)
    print(f"merged export: max |log-prob diff| {float((got - expected).abs().max()):.3g}")
    assert torch.allclose(got, expected, atol=1e-5) and merged.max_logprob_diff <= 1e-5

    adapter = export_model(lora_run, tmp_path / "adapter", adapter_only=True)
    out = tmp_path / "adapter"
    assert (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    reloaded = PeftModel.from_pretrained(tiny_model(0)[0], out)  # tiny: built in code
    got = probe_logprobs(reloaded.eval(), tokenizer)
    print(f"adapter export: max |log-prob diff| {float((got - expected).abs().max()):.3g}")
    assert torch.allclose(got, expected, atol=1e-5) and adapter.max_logprob_diff <= 1e-5
    record = json.loads((out / "turnrl_export.json").read_text())
    assert record["adapter_only"] is True and record["base_model"] == "tiny"


def test_eval_serve_and_report_take_a_lora_run(lora_run, tmp_path, capsys):
    from turnrl.cli import main
    from turnrl.serve.server import load_server

    assert main(["eval", str(lora_run), "--eval.episodes", "2"]) == 0
    checkpoint = latest_checkpoint(lora_run)
    server = load_server(load_config(None, TINY + ["--serve.checkpoint", str(checkpoint)]))
    assert is_lora(server.model) and server.engine.version == 2  # the run's model.lora
    served = probe_logprobs(server.model.eval(), server.tokenizer)
    assert torch.allclose(served, checkpoint_logprobs(checkpoint), atol=1e-6)
    assert main(["report", str(lora_run), "--out", str(tmp_path / "r.png"),
                 "--html", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 0 and (tmp_path / "r.html").is_file()
    capsys.readouterr()


@pytest.mark.parametrize("args, message", [
    (["--model.lora.r", "-1"], "model.lora.r must be a whole number >= 0"),
    (["--model.lora.r", "1.5"], "model.lora.r must be a whole number >= 0"),
    (["--model.lora.r", "four"], "model.lora.r must be a whole number >= 0"),
    (["--model.lora.rank", "4"], "model.lora: unknown key 'rank'; valid keys: r, alpha"),
    (["--model.lora.r", "4", "--model.lora.alpha", "0"], "model.lora.alpha must be"),
    (["--model.lora.r", "4", "--model.lora.dropout", "1"], "model.lora.dropout must be"),
    (["--model.lora.r", "4", "--model.lora.target_modules", "[]"],
     "model.lora.target_modules must be"),
    # samplers that convert or copy the whole model would never see the adapter
    (["--model.lora.r", "4", "--rollout.sampler", "ct2"], "model.lora trains an adapter"),
    (["--model.lora.r", "4", "--rollout.sampler", "auto"], "model.lora trains an adapter"),
    (["--model.lora.r", "4", "--rollout.sampler_dtype", "bfloat16"],
     "model.lora trains an adapter"),
])
def test_bad_lora_settings_fail_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, TINY + args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("targets", ["qproj", "q_proj,attention", "c_attn"])
def test_a_target_module_the_model_lacks_fails_at_start_up_naming_its_layers(targets):
    cfg = load_config(None, TINY + LORA + ["--model.lora.target_modules", targets])
    with pytest.raises(ConfigError, match="is no linear layer of this model; its linear layers "
                                          "are down_proj, gate_proj, k_proj, lm_head") as err:
        load_policy(cfg)
    assert "\n" not in str(err.value)


def test_named_targets_adapt_those_layers_alone():
    _, policy = lora_policy("--model.lora.target_modules", "q_proj,v_proj")
    targets = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter_state(policy.model)}
    assert targets == {"q_proj", "v_proj"}


def run_cli(prelude: str, *args: str) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import conftest; {prelude}; "
            "from turnrl.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, cwd=TESTS.parent)


def test_the_cli_says_in_one_line_what_is_wrong(tmp_path):
    # PEFT missing (a None entry in sys.modules makes `import peft` fail, as uninstalled)
    missing = run_cli("sys.modules['peft'] = None", "train", *TINY, *LORA,
                      "--run.out_dir", str(tmp_path / "a"))
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    assert "pip install 'turnrl[peft]'" in lines[0]
    bad = run_cli("pass", "train", *TINY, *LORA, "--model.lora.target_modules", "qkv",
                  "--run.out_dir", str(tmp_path / "b"))
    lines = [ln for ln in bad.stderr.strip().splitlines() if "Warning" not in ln
             and not ln.startswith("  ")]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert "'qkv' is no linear layer" in lines[0]


@pytest.mark.slow
def test_an_async_lora_run_ships_the_adapter_alone(ray_cluster, tmp_path):
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    cfg = load_config(None, TINY + LORA + [
        "--run.mode", "async", "--optim.lr", "1e-2", "--ray.num_workers", "1",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.steps", "3",
        "--eval.episodes", "0", "--run.out_dir", str(tmp_path)])
    train_async(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    adapter = load_file(latest_checkpoint(tmp_path) / "adapter_model.safetensors")
    full = {k: v for k, v in tiny_model(0)[0].state_dict().items() if k != "lm_head.weight"}
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # what was put in Ray's object store for the workers, per version
        assert r["async/weight_bytes_per_version"] == state_bytes(adapter)
        assert r["async/weight_bytes_per_version"] < 0.15 * state_bytes(full)
    # the worker sampled with the adapter it was sent: the learner's proximal log-probs of
    # fresh episodes (same version) match the sampled ones
    assert records[0]["mismatch/logprob_diff_max"] < 1e-3



@pytest.mark.slow
@pytest.mark.parametrize("lr", ["5e-2"])
def test_a_lora_adapter_alone_learns_the_toy_task(tmp_path, lr):
    """The adapter is not just trained but learns: the task test_train's full fine-tuning
    learns (say a digit), with rank 8 and a higher learning rate (LoRA's usual). The tiny
    model's random output layer is near zero after its final norm (every logit ~0, entropy
    ln(vocab)), so adapters on the blocks alone cannot peak it: lm_head is a target too."""
    targets = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]"
    cfg = load_config(None, TINY + ["--model.lora.r", "8", "--optim.lr", lr,
                                    "--model.lora.target_modules", targets,
                                    "--run.steps", "20", "--optim.micro_batch_size", "32",
                                    "--run.out_dir", str(tmp_path)])
    result = train(cfg)
    assert result.before.success_rate < 0.3
    assert result.after.success_rate > 0.8, (result.before, result.after)
