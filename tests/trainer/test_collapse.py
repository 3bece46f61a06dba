"""The template-collapse monitor: a policy that ignores its input scores MI 0 while its
entropy holds; a policy that reads it scores a clearly positive MI; the run logs collapse/*."""

import pytest
import torch

from turnrl.config import load_config
from turnrl.metrics import read_metrics
from turnrl.models import tiny_model
from turnrl.trainer import train
from turnrl.trainer.collapse import CollapseMonitor, choose, episode_replies, spread
from turnrl.types import Episode

INPUTS = list(range(10, 18))  # one token per input; reply tokens 100.. depend on it
REPLY = 5


def prompt(k: int) -> list[int]:
    return [1, 5, INPUTS[k], 6]


def input_reading_model():
    """The tiny model trained for a moment to answer input k with REPLY tokens drawn
    uniformly from {100 + 4k, ..., 100 + 4k + 3}: entropy log 4 per token, all of it
    decided by the input."""
    torch.manual_seed(0)
    model, _ = tiny_model(0, hidden_size=32, num_layers=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(25):
        k = torch.randint(0, len(INPUTS), (32,))
        ids = torch.cat([torch.tensor([prompt(int(i)) for i in k]),
                         100 + 4 * k[:, None] + torch.randint(0, 4, (32, REPLY))], dim=1)
        logits = model(input_ids=ids).logits[:, 3:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 ids[:, 4:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def cut_input(model, alpha: float):
    """``model`` with every input token's embedding moved a share ``alpha`` of the way to
    input 0's: at 1 the model cannot tell its inputs apart (it ignores them)."""
    table = model.get_input_embeddings().weight
    table[INPUTS] = (1 - alpha) * table[INPUTS] + alpha * table[INPUTS[0]]
    return model


@torch.no_grad()
def episodes_of(model, per_input: int = 2) -> list[Episode]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for k in range(len(INPUTS)):
        ids = torch.tensor([prompt(k)] * per_input)
        for _ in range(REPLY):
            probs = torch.softmax(model(input_ids=ids).logits[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
        out += [Episode("toy", k, k, token_ids=row, loss_mask=[0] * 4 + [1] * REPLY)
                for row in ids.tolist()]
    return out


def test_mi_falls_to_zero_when_the_policy_ignores_its_input_while_entropy_holds():
    monitor = CollapseMonitor(1, max_prompts=8, max_replies=16)
    model = input_reading_model()
    reading = monitor.metrics(model, episodes_of(model), 1.0, 0)
    half = monitor.metrics(cut_input(model, 0.5), episodes_of(model), 1.0, 0)
    ignoring = monitor.metrics(cut_input(model, 1.0), episodes_of(model), 1.0, 0)
    assert reading["collapse/prompts"] == 8 and reading["collapse/replies"] == 16
    assert reading["collapse/mi"] > 0.5  # the bound is log 8 = 2.08
    assert reading["collapse/retrieval"] > 0.8
    assert reading["collapse/own_logp"] > reading["collapse/cross_logp"]
    assert reading["collapse/mi"] > half["collapse/mi"] > ignoring["collapse/mi"]
    assert ignoring["collapse/mi"] == pytest.approx(0.0, abs=1e-6)
    assert ignoring["collapse/retrieval"] == 0.0
    assert ignoring["collapse/own_logp"] == pytest.approx(ignoring["collapse/cross_logp"])
    # entropy does not see it: still about log 4 nats per token
    assert ignoring["collapse/entropy"] > 0.8 * reading["collapse/entropy"] > 1.0


def test_replies_are_runs_of_policy_tokens_after_their_context():
    ep = Episode("toy", 0, 0, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                 loss_mask=[0, 1, 1, 0, 0, 1, 0, 1])
    replies = episode_replies(ep)
    assert [(r.context, r.reply) for r in replies] == [
        ((1,), (2, 3)), ((1, 2, 3, 4, 5), (6,)), ((1, 2, 3, 4, 5, 6, 7), (8,))]
    assert episode_replies(Episode("toy", 0, 0, token_ids=[1, 2], loss_mask=[1, 1])) == []


def test_choose_caps_contexts_and_takes_replies_round_robin():
    assert spread(list(range(10)), 4) == [0, 2, 5, 7]
    group_a = [Episode("t", 0, 0, token_ids=[1, 9, 20 + i], loss_mask=[0, 0, 1])
               for i in range(4)]
    group_b = [Episode("t", 1, 1, token_ids=[2, 9, 30 + i], loss_mask=[0, 0, 1])
               for i in range(4)]
    contexts, replies, own = choose(group_a + group_b, max_prompts=2, max_replies=3)
    assert contexts == [(1, 9), (2, 9)]
    assert [r.reply for r in replies] == [(20,), (30,), (21,)]
    assert own == [0, 1, 0]
    contexts, replies, own = choose(group_a + group_b, max_prompts=1, max_replies=8)
    assert contexts == [(1, 9)] and len(replies) == 4 and own == [0] * 4


def test_every_n_calls_and_off():
    every3 = CollapseMonitor(3, 8, 8)
    assert [every3.due() for _ in range(7)] == [True, False, False, True, False, False, True]
    off = CollapseMonitor(0, 8, 8)
    assert not any(off.due() for _ in range(3))


def test_a_run_logs_collapse_metrics_every_n_steps(tmp_path):
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "say-digit", "--run.steps",
                             "3", "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
                             "--rollout.groups_per_step", "2", "--eval.episodes", "0",
                             "--run.progress", "false", "--run.tensorboard", "false",
                             "--run.collapse_every", "2", "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = read_metrics(tmp_path)
    assert ["collapse/mi" in r for r in records] == [True, False, True]
    first = records[0]
    # say-digit's prompt is the same for every seed: one context, nothing to compare
    assert first["collapse/prompts"] == 1 and first["collapse/mi"] == 0.0
    assert first["collapse/replies"] == 4 and first["time/collapse_s"] > 0
