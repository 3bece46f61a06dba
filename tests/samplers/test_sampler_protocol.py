"""Every sampler takes new weights through ``load`` (no property with side effects), frees
what it holds with ``close``, and every source publishes through ``turnrl.policy.publish``."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from turnrl.config import load_config
from turnrl.lora import adapter_state
from turnrl.policy import load_policy, publish
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.samplers.copy import HFCopyEngine

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3"]
PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0)


def _engines(model, tok):
    yield HFEngine(model, tok.pad_token_id, seed=0)
    yield HFCopyEngine(model, torch.bfloat16, tok.pad_token_id, seed=0)
    if importlib.util.find_spec("ctranslate2") is not None:
        from turnrl.samplers.ct2 import CT2Engine

        yield CT2Engine(model, compute_type="float32", seed=0)


def _version_is_plain(engine) -> bool:
    return not any(isinstance(vars(cls).get("version"), property) for cls in type(engine).__mro__)


def test_every_engine_loads_releases_and_closes_explicitly(tiny):
    model, tok = tiny
    prompt = tok("Say a digit.")["input_ids"]
    for engine in _engines(model, tok):
        assert _version_is_plain(engine), type(engine)
        out = engine.generate([prompt], PARAMS)
        engine.load({k: v.clone() for k, v in model.state_dict().items()}, 3)
        assert engine.version == 3
        engine.release([prompt + out[0].token_ids])
        assert len(engine.generate([prompt], PARAMS)[0].token_ids) >= 1
        engine.close()


def test_loading_the_learners_own_tensors_drops_the_stale_keys(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    engine.generate([tok("Say a digit.")["input_ids"]], PARAMS)
    assert engine.kept_rows == 1
    engine.load(None, 1)  # the learner's tensors changed where they are
    assert (engine.version, engine.kept_rows) == (1, 0)


def test_a_copy_refuses_a_load_without_weights_in_one_line(tiny):
    model, tok = tiny
    engine = HFCopyEngine(model, torch.bfloat16, tok.pad_token_id, seed=0)
    with pytest.raises(ValueError, match="give it the learner's weights"):
        engine.load(None, 1)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        engine.load({"nope": torch.zeros(1)}, 1)


def test_publish_copies_the_learner_into_a_sampler_with_weights_of_its_own(tiny):
    model, tok = tiny
    engine = HFCopyEngine(model, torch.bfloat16, tok.pad_token_id, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    publish(engine, model, 4)
    assert engine.version == 4
    assert torch.equal(engine.model.model.norm.weight, model.model.norm.weight.bfloat16())


class RecordingSampler:
    """A sampler with weights of its own (as vLLM's, which needs a GPU): keeps what it got."""

    def __init__(self):
        self.version, self.loaded = 0, None

    def load(self, weights, version):
        self.loaded, self.version = dict(weights), version


def test_a_lora_run_publishes_the_adapter_merged_policy_everywhere(capsys):
    pytest.importorskip("peft")
    policy = load_policy(load_config(None, TINY + ["--model.lora.r", "2"]))
    model = policy.model
    with torch.no_grad():  # an update of the adapter alone
        for name, tensor in model.named_parameters():
            if "lora_B" in name:
                tensor.add_(0.5)
    publish(policy.engine, model, 1)  # the HF engine: the adapter applied where it is
    other = RecordingSampler()
    publish(other, model, 1)  # any other: the adapter alone (vLLM loads it as an adapter)
    assert other.loaded.keys() == adapter_state(model).keys() and other.version == 1
    prompt = policy.tokenizer("Say a digit.")["input_ids"]
    [reply] = policy.engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0))
    merged = copy.deepcopy(model).merge_and_unload().eval()
    ids = torch.tensor([prompt + reply.token_ids])
    with torch.no_grad():
        logits = merged(ids).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    assert torch.allclose(torch.tensor(reply.logprobs), expected, atol=1e-4)


def test_no_engine_version_assignment_is_left_in_the_library():
    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"engine\.version\s*(=|\+=)(?!=)")
    found = {str(p.relative_to(root)) for p in (root / "turnrl").rglob("*.py")
             if pattern.search(p.read_text())}
    assert not found, found
