"""The reward model: batched scores equal one forward pass each, normalisers by hand, and
the one-line refusals (a head that is not one score, a tokenizer that reads or renders
otherwise)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from turnrl.models import tiny_model, tiny_tokenizer
from turnrl.rewards.model import (
    METADATA,
    RewardModel,
    RewardModelError,
    render_conversation,
    zscore,
)


def save_rm(path, num_labels=1, template=None, seed=0):
    """A tiny sequence-classification model (random head) saved with the tiny tokenizer."""
    _, tokenizer = tiny_model()
    if template is not None:
        tokenizer.chat_template = template
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_batched_scores_equal_a_direct_forward(tmp_path):
    rm = RewardModel.load(str(save_rm(tmp_path)), policy_tokenizer=tiny_tokenizer(),
                          batch_size=2)
    texts = [render_conversation(rm.tokenizer, [{"role": "user", "content": t}])
             for t in ("hi", "a longer message here", "mid size")]
    scores = rm.score(texts)
    for text, score in zip(texts, scores.tolist(), strict=True):
        ids = torch.tensor([rm.tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            direct = float(rm.model(input_ids=ids).logits[0, 0])
        assert score == pytest.approx(direct, abs=1e-5)
    assert len(set(scores.tolist())) == 3  # the texts are told apart


def test_long_texts_keep_their_end(tmp_path):
    rm = RewardModel.load(str(save_rm(tmp_path)), max_tokens=5)
    batch = rm.encode(["0123456789"])
    assert rm.tokenizer.decode(batch["input_ids"][0]) == "56789"


def test_normalisers_by_hand():
    z = zscore(torch.tensor([1.0, 2.0, 3.0]))
    assert z.tolist() == pytest.approx([-1.0, 0.0, 1.0])  # sample std of 1, 2, 3 is 1
    assert zscore(torch.tensor([4.0])).tolist() == [0.0]
    assert zscore(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]


def test_a_head_of_two_scores_is_refused(tmp_path):
    with pytest.raises(RewardModelError, match=r"gives 2 scores \(num_labels\), not one"):
        RewardModel.load(str(save_rm(tmp_path, num_labels=2)))


def test_a_template_unlike_the_policys_is_refused(tmp_path):
    other = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    path = save_rm(tmp_path, template=other)
    RewardModel.load(str(path))  # alone, it is a fine model
    with pytest.raises(RewardModelError) as err:
        RewardModel.load(str(path), policy_tokenizer=tiny_tokenizer())
    assert "renders conversations differently from the policy's" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_tokenizer_changed_since_training_is_refused(tmp_path):
    path = save_rm(tmp_path)
    (path / METADATA).write_text(json.dumps({"tokenizer": "0123456789abcdef"}))
    with pytest.raises(RewardModelError, match="differs from the one it was trained with"):
        RewardModel.load(str(path))


def test_not_a_model_directory(tmp_path):
    with pytest.raises(RewardModelError, match="is not a Hugging Face model directory"):
        RewardModel.load(str(tmp_path))


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    path = save_rm(tmp_path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(RewardModelError, match="has no chat template"):
        RewardModel.load(str(path))
