"""A reward model: a local Hugging Face sequence-classification model with one score that
rates whole transcripts (``reward.model``; docs/reward_models.md).

An episode's transcript is its token ids decoded by the policy's tokenizer: the
conversation exactly as the policy's chat template rendered it. The reward model re-reads
that text with its own tokenizer, so it must render conversations with the same chat template
(``turnrl rm`` trains on pairs rendered by it); a model that does not, or whose head is not a
single score, or whose tokenizer is not the one it was trained with, is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

METADATA = "turnrl_reward_model.json"
"""What ``turnrl rm`` writes beside the weights: the tokenizer's fingerprint, the base model."""

PROBE = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is 2 + 3?"},
         {"role": "assistant", "content": "The answer is 5."}]
"""A conversation both chat templates render, to compare them."""


class RewardModelError(ValueError):
    """A reward model that cannot score this run's episodes; the message is one line."""


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary, special tokens and chat template: equal fingerprints read
    and render text the same way."""
    facts = {"vocab": sorted(tokenizer.get_vocab().items()),
             "special": sorted(map(str, tokenizer.all_special_tokens)),
             "template": tokenizer.chat_template or ""}
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def render_conversation(tokenizer, messages: list[dict]) -> str:
    """``messages`` as the chat template writes them (no generation prompt)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def zscore(scores: torch.Tensor) -> torch.Tensor:
    """(s - mean) / std over the step's scores [N] -> [N] (sample std; 0 when N < 2 or all
    equal): scale-free scores, as in the per-batch reward normalisation of Ouyang et al.
    2022 (arXiv:2203.02155, reward model bias set so the mean is 0)."""
    if scores.numel() < 2:
        return torch.zeros_like(scores)
    std = scores.std()
    return (scores - scores.mean()) / std if std > 0 else torch.zeros_like(scores)


NORMALISERS = {"none": lambda s: s, "zscore": zscore, "sigmoid": torch.sigmoid}
"""``reward.normalise`` -> a function of the step's scores [N] -> [N]."""


def check_head(config, where: str) -> None:
    """Refuse a model (its config) whose head is not one score."""
    labels = getattr(config, "num_labels", None)
    if labels != 1:
        raise RewardModelError(f"reward.model {where}: its head gives {labels} scores "
                               "(num_labels), not one; give a model trained with num_labels 1 "
                               "(turnrl rm writes one)")


def check_tokenizer(tokenizer, where: str, policy_tokenizer) -> None:
    """Refuse a tokenizer that differs from the one the model was trained with (its
    metadata's fingerprint) or that renders conversations otherwise than the policy."""
    meta = Path(where) / METADATA
    if meta.is_file():
        saved = json.loads(meta.read_text()).get("tokenizer")
        if saved and saved != tokenizer_fingerprint(tokenizer):
            raise RewardModelError(f"reward.model {where}: its tokenizer differs from the one it "
                                   f"was trained with (fingerprint in {METADATA}); put the "
                                   "training tokenizer back or retrain with turnrl rm")
    if not tokenizer.chat_template:
        raise RewardModelError(f"reward.model {where}: its tokenizer has no chat template, so it "
                               "cannot read the policy's conversations; train it from the "
                               "policy's base model (turnrl rm --model.name ...)")
    if policy_tokenizer is not None and (render_conversation(tokenizer, PROBE)
                                         != render_conversation(policy_tokenizer, PROBE)):
        raise RewardModelError(f"reward.model {where}: its chat template renders conversations "
                               "differently from the policy's, so its scores of the policy's "
                               "transcripts mean nothing; train it from the policy's base "
                               "model (turnrl rm --model.name ...)")


class RewardModel:
    """A frozen sequence-classification model scoring texts in batches."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, max_tokens: int = 2048
                 ) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_tokens = batch_size, max_tokens
        if tokenizer.pad_token_id is None:
            raise RewardModelError("reward.model: its tokenizer has no pad token; set one "
                                   "(tokenizer.pad_token) and save it again")
        model.config.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def load(cls, where: str, *, policy_tokenizer=None, device: str = "cpu",
             batch_size: int = 8, max_tokens: int = 2048) -> RewardModel:
        """The model in directory ``where``, checked (``check_head``, ``check_tokenizer``)."""
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
        path = Path(where).expanduser()
        if not (path / "config.json").is_file():
            raise RewardModelError(f"reward.model '{where}' is not a Hugging Face model "
                                   "directory (no config.json); give one turnrl rm wrote")
        config = AutoConfig.from_pretrained(path)
        check_head(config, where)
        tokenizer = AutoTokenizer.from_pretrained(path)
        check_tokenizer(tokenizer, str(path), policy_tokenizer)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        return cls(model.to(device), tokenizer, batch_size=batch_size, max_tokens=max_tokens)

    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Right-padded ids and mask of ``texts`` (each cut to its last ``max_tokens``)."""
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"][-self.max_tokens:]
                for t in texts]
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        device = next(self.model.parameters()).device
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}

    def forward(self, texts: list[str]) -> torch.Tensor:
        """Scores [len(texts)] of one batch, with gradients (training)."""
        return self.model(**self.encode(texts)).logits[:, 0].float()

    @torch.no_grad()
    def score(self, texts: list[str]) -> torch.Tensor:
        """Scores [len(texts)] on the CPU, ``batch_size`` texts a forward pass."""
        self.model.eval()
        parts = [self.forward(texts[i:i + self.batch_size]).cpu()
                 for i in range(0, len(texts), self.batch_size)]
        scores = torch.cat(parts) if parts else torch.zeros(0)
        if not all(math.isfinite(s) for s in scores.tolist()):
            raise RewardModelError("reward.model gave a score that is not a finite number; "
                                   "its weights are broken (retrain it)")
        return scores
