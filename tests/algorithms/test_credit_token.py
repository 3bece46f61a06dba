"""The token-level critic (``token_gae``): GAE over policy tokens against hand-computed values,
the clipped value loss, the critic's inputs, the estimator end to end, and a training run."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.helpers.credit_truth_data import key_corridor_dataset
from turnrl.algorithms.credit import gae, token_steps, turn_gae
from turnrl.algorithms.critic import (
    clipped_value_loss,
    extract_token_states,
    extract_turn_features,
)
from turnrl.algorithms.estimators import EstimatorSettings, make_estimator
from turnrl.config import AlgoConfig, ConfigError, CriticConfig, load_config
from turnrl.envs.credit_tasks import key_corridor_values
from turnrl.registry import estimator_level
from turnrl.types import Episode, Turn


@pytest.fixture
def one_thread():
    """A tiny MLP on a shared CPU: thread wake-ups cost more than the maths (30x measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


def two_turn_episode(status: str = "done") -> Episode:
    """ids 0-1 prompt, 2-4 turn 0 (3 policy tokens), 5-6 env reply, 7-8 turn 1, 9 env."""
    ep = Episode(env="toy", seed=0, group=0)
    ep.append([11, 12], policy=False)
    start, end = ep.append([21, 22, 23], policy=True, logprobs=[-1.0] * 3, version=0)
    ep.turns.append(Turn(start, end, "a", "o", 0.0))
    ep.append([31, 32], policy=False)
    start, end = ep.append([41, 42], policy=True, logprobs=[-1.0] * 2, version=0)
    ep.turns.append(Turn(start, end, "b", "o", 1.0))
    ep.append([51], policy=False)
    ep.status = status
    return ep


def test_token_steps_skip_env_tokens_and_discount_per_turn():
    positions, rewards, discounts = token_steps(two_turn_episode(), gamma=0.9)
    assert positions.tolist() == [2, 3, 4, 7, 8]
    close(rewards, [0, 0, 0, 0, 1])
    close(discounts, [1, 1, 0.9, 1, 0.9])


def test_token_gae_on_a_five_token_episode_by_hand():
    # The episode above: steps (policy tokens) 2, 3, 4 | 7, 8; gamma 0.9 when a turn ends,
    # lambda 0.5; V = (0.2, 0.4, 0.5, 0.6, 0.8) and V(after) = 0.3.
    # done: next V = (0.4, 0.5, 0.6, 0.8, 0)
    # delta = (0 + 0.4 - 0.2, 0 + 0.5 - 0.4, 0 + 0.9*0.6 - 0.5, 0 + 0.8 - 0.6, 1 + 0 - 0.8)
    #       = (0.2, 0.1, 0.04, 0.2, 0.2)
    # A4 = 0.2; A3 = 0.2 + 0.5*0.2 = 0.3; A2 = 0.04 + 0.9*0.5*0.3 = 0.175;
    # A1 = 0.1 + 0.5*0.175 = 0.1875; A0 = 0.2 + 0.5*0.1875 = 0.29375; returns = A + V.
    _, rewards, discounts = token_steps(two_turn_episode(), gamma=0.9)
    values = torch.tensor([0.2, 0.4, 0.5, 0.6, 0.8, 0.3])
    adv, ret = gae(rewards, values, discounts, 0.5, done=True)
    close(adv, [0.29375, 0.1875, 0.175, 0.3, 0.2])
    close(ret, [0.49375, 0.5875, 0.675, 0.9, 1.0])
    # Truncated: the last step bootstraps from V(after) = 0.3: delta4 = 1 + 0.27 - 0.8 = 0.47;
    # A3 = 0.2 + 0.235 = 0.435; A2 = 0.04 + 0.45*0.435 = 0.23575; A1 = 0.1 + 0.5*0.23575 =
    # 0.217875; A0 = 0.2 + 0.5*0.217875 = 0.3089375.
    adv, _ = gae(rewards, values, discounts, 0.5, done=False)
    close(adv, [0.3089375, 0.217875, 0.23575, 0.435, 0.47])
    # lambda 1 is the Monte-Carlo return minus V: G = (0.9, 0.9, 0.9, 1, 1).
    adv, _ = gae(rewards, values, discounts, 1.0, done=True)
    close(adv, [0.7, 0.5, 0.4, 0.4, 0.2])


def test_gae_with_one_token_per_turn_is_turn_gae():
    rewards, values = torch.tensor([0.0, 0.5, 1.0]), torch.tensor([0.1, 0.3, 0.2, 0.6])
    for done in (True, False):
        expected = turn_gae(rewards, values, 0.9, 0.7, done=done)
        got = gae(rewards, values, torch.full((3,), 0.9), 0.7, done=done)
        for a, b in zip(got, expected, strict=True):
            close(a, b)
    with pytest.raises(ValueError, match="discounts"):
        gae(rewards, values, torch.ones(2), 0.7)


def test_clipped_value_loss_by_hand_and_its_gradient():
    # V_old = 0.5, target 1.0, clip 0.2. V = 0.9: unclipped (0.9 - 1)^2 = 0.01, clipped V is
    # 0.7 -> 0.09; max = 0.09 (no gradient: the clipped branch is constant in V).
    # V = 0.6: inside the range, both 0.16, gradient 2 (0.6 - 1) = -0.8.
    values = torch.tensor([0.9, 0.6], requires_grad=True)
    loss = clipped_value_loss(values, torch.tensor([0.5, 0.5]), torch.tensor([1.0, 1.0]), 0.2)
    close(loss, (0.09 + 0.16) / 2)
    loss.backward()
    close(values.grad, [0.0, -0.4])
    close(clipped_value_loss(values.detach(), torch.tensor([0.5, 0.5]), torch.ones(2), 0.0),
          (0.01 + 0.16) / 2)


def test_token_states_are_the_hidden_state_before_each_policy_token(tiny):
    model, _ = tiny
    ep = two_turn_episode()
    positions, _, _ = token_steps(ep, 0.9)
    (states,) = extract_token_states(model, [ep], [positions], 0, "cpu")
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=torch.tensor([ep.token_ids])).last_hidden_state[0]
    close(states, hidden[[1, 2, 3, 6, 7, 9]], atol=1e-5)  # p - 1 for each step, then the last
    turn = extract_turn_features(model, [ep], 0, "cpu")[0]  # the shared helper still agrees
    close(turn.states, hidden[[1, 6, 9]], atol=1e-5)
    close(turn.actions, hidden[[4, 8]], atol=1e-5)


def _settings(model, **critic):
    return EstimatorSettings(AlgoConfig(advantage="token_gae"),
                             CriticConfig(**{"scale": "none", **critic}),
                             model.config.hidden_size, seed=0)


def test_estimator_gives_gae_of_its_critic_before_the_update(tiny, one_thread):
    """The advantages are GAE with V as it was before this batch's critic steps, placed on the
    policy tokens (zero on env tokens); then the critic trains."""
    model, _ = tiny
    episodes = [two_turn_episode("done"), two_turn_episode("truncated")]
    episodes[1].turns[1].reward = 0.0
    estimator = make_estimator(_settings(model, gamma=0.9, token_lambda=0.8))
    assert estimator_level("token_gae") == "token"
    before = copy.deepcopy(estimator.critic)
    adv = estimator.advantages(episodes, model, pad_id=0)
    assert adv.shape == (2, 10)
    for b, ep in enumerate(episodes):
        positions, rewards, discounts = token_steps(ep, 0.9)
        (states,) = extract_token_states(model, [ep], [positions], 0, "cpu")
        with torch.no_grad():
            expected, _ = gae(rewards, before.value(states), discounts, 0.8,
                              done=ep.status == "done")
        close(adv[b, positions], expected, atol=1e-5)
        off = torch.ones(10, dtype=torch.bool)
        off[positions] = False
        assert (adv[b, off] == 0).all()
    metrics = estimator.metrics()
    assert metrics["credit/critic_updates"] == 8 and metrics["credit/critic_in_use"] == 1.0
    assert any((p - q).abs().max() > 0 for p, q in zip(estimator.critic.parameters(),
                                                       before.parameters(), strict=True))


def test_value_clip_holds_the_critic_nearer_the_values_the_advantages_used(tiny, one_thread):
    """Clipping stops the gradient of a token whose V left the range, so one step's 8 critic
    updates move V less (measured: max move 0.27 clipped at 0.02 vs 0.79 unclipped at this lr).
    It is no hard bound: Adam's momentum carries V on after the gradient stops
    (docs/credit_assignment.md)."""
    model, _ = tiny
    episodes = [two_turn_episode() for _ in range(4)]
    positions, _, _ = token_steps(episodes[0], 0.95)
    (states,) = extract_token_states(model, episodes[:1], [positions], 0, "cpu")
    moved = {}
    for clip in (0.02, 0.0):
        estimator = make_estimator(_settings(model, lr=1e-2, value_clip=clip))
        with torch.no_grad():
            start = estimator.critic.value(states[:-1])
        estimator.advantages(episodes, model, pad_id=0)
        with torch.no_grad():
            moved[clip] = float((estimator.critic.value(states[:-1]) - start).abs().max())
        if clip:
            assert estimator.metrics()["credit/value_clip_fraction"] > 0.5
    assert moved[0.02] < 0.5 * moved[0.0]


def test_critic_options_are_token_gaes_own():
    with pytest.raises(ConfigError, match="critic.value_clip is not read by"):
        load_config(None, ["--algo.advantage", "turn_gae", "--critic.value_clip", "0.1"])
    with pytest.raises(ConfigError, match="token_lambda"):
        CriticConfig(token_lambda=1.5)
    cfg = load_config(None, ["--algo.advantage", "token_gae", "--critic.token_lambda", "0.9"])
    assert cfg.critic.token_lambda == 0.9


def test_value_head_recovers_the_key_corridor_values(tiny, one_thread):
    """On scripted key-corridor data (half the episodes take the right key) V at the first
    token of each turn approaches the closed-form V^pi of that turn's state. The policy does not
    change, so the features are computed once and the estimator's critic steps are taken on
    them (token_lambda 1: the targets are the Monte-Carlo returns)."""
    model, tokenizer = tiny
    horizon, gamma = 4, 0.95
    episodes = key_corridor_dataset(tokenizer, horizon, 0.5, groups=4, group_size=8)
    estimator = make_estimator(_settings(model, gamma=gamma, lr=1e-3))
    steps = [token_steps(ep, gamma) for ep in episodes]
    states = extract_token_states(model, episodes, [p for p, _, _ in steps],
                                  tokenizer.pad_token_id, "cpu")
    flat = torch.cat([st[:-1] for st in states])
    targets = torch.cat([gae(r, torch.zeros(len(r) + 1), d, 1.0)[1] for _, r, d in steps])
    for _ in range(60):
        with torch.no_grad():
            old = estimator.critic.value(flat)
        estimator.train_values(flat, old, targets)
    truth = key_corridor_values(horizon, 0.5, gamma)
    errors = []
    with torch.no_grad():
        for ep, (positions, _, _), st in zip(episodes, steps, states, strict=True):
            first = [positions.tolist().index(t.start) for t in ep.turns]
            true = [truth.value(t, None if t == 0 else ep.success) for t in range(horizon)]
            errors.append((estimator.critic.value(st[first]) - torch.tensor(true)).abs())
    errors = torch.cat(errors)
    print(f"token_gae V error: mean {errors.mean():.4f} max {errors.max():.4f}")
    assert errors.mean() < 0.06 and errors.max() < 0.2


def test_a_training_run_with_token_gae(tmp_path):
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    args = ["--model.name", "tiny", "--env.name", "key-corridor", "--env.options",
            "{horizon: 3}", "--rollout.max_new_tokens", "2", "--rollout.group_size", "4",
            "--rollout.groups_per_step", "2", "--run.steps", "2", "--algo.advantage",
            "token_gae", "--eval.episodes", "0", "--run.progress", "false", "--run.threads", "1",
            "--run.tensorboard", "false", "--run.out_dir", str(tmp_path)]
    train(load_config(None, args))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["credit/critic_updates"] == 16
    assert all(math.isfinite(r["credit/v_loss"]) and r["update/skipped"] == 0 for r in rows)
