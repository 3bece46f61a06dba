"""The ``critic`` section: critic warm-up (by updates and by fit error), the advantage scale,
GiGPO's episode weight, and the refusal of options an estimator would ignore."""

import copy
import io
import math

import pytest
import torch

from tests.algorithms.test_credit import _batch_episodes, close, episode
from tests.helpers.credit_truth_data import key_corridor_dataset
from turnrl.algorithms.credit import (
    discounted_returns,
    gigpo_advantages,
    gigpo_step_advantages,
    relative_fit_error,
    turn_anchor_ids,
    turn_to_token_advantages,
    whiten_masked,
)
from turnrl.algorithms.critic import extract_turn_features
from turnrl.algorithms.estimators import (
    RUNNING_DECAY,
    EstimatorSettings,
    grpo_per_turn,
    make_estimator,
)
from turnrl.config import AlgoConfig, Config, ConfigError, CriticConfig, load_config
from turnrl.metrics import read_metrics
from turnrl.trainer import train


def _make(advantage: str, hidden_size: int, critic: CriticConfig | None = None):
    return make_estimator(EstimatorSettings(AlgoConfig(advantage=advantage),
                                            critic or CriticConfig(), hidden_size))


def test_relative_fit_error_is_one_minus_explained_variance():
    returns = torch.tensor([0.0, 1.0, 0.5, 0.5])
    assert relative_fit_error(returns, returns) == 0.0
    assert relative_fit_error(torch.full((4,), 0.5), returns) == pytest.approx(1.0)
    assert relative_fit_error(returns + 0.1, returns) == pytest.approx(0.01 / 0.125)
    # nothing to explain: any error is infinite, an exact fit is 0; no turns at all is inf
    assert relative_fit_error(torch.tensor([0.2, 0.3]), torch.tensor([0.3, 0.3])) == math.inf
    assert relative_fit_error(torch.tensor([0.3, 0.3]), torch.tensor([0.3, 0.3])) == 0.0
    assert relative_fit_error(torch.zeros(0), torch.zeros(0)) == math.inf


def _corridor_group():
    """Four 3-turn key-corridor episodes of one group: two right keys (reward 1), two wrong."""
    return [episode(0, [("start", 0.0), (f"t1:k{k}", 0.0), (f"t2:k{k}", float(k))])
            for k in (1, 0, 1, 0)]


def test_gigpo_episode_weight_zero_leaves_only_the_anchor_state_term():
    eps = _corridor_group()
    step_only = gigpo_advantages(eps, 0.9, step_weight=1.0, episode_weight=0.0)
    returns = torch.cat([discounted_returns([t.reward for t in ep.turns], 0.9) for ep in eps])
    expected = gigpo_step_advantages(returns, turn_anchor_ids(eps)).split(3)
    for got, want in zip(step_only, expected, strict=True):
        close(got, want)
        close(got[1:], [0.0, 0.0])  # corridor anchors share one return: no signal there
        assert abs(float(got[0])) > 0.8  # the key turn carries it all
    both = gigpo_advantages(eps, 0.9, step_weight=1.0)
    assert all(abs(float(b[1])) > 0.8 for b in both)  # A_E reaches every corridor turn


def _grpo_tokens(eps):
    width = max(len(ep.token_ids) for ep in eps)
    return turn_to_token_advantages(eps, grpo_per_turn(eps), width)


@pytest.mark.parametrize("name", ["turn_gae", "archer"])
def test_warmup_updates_give_grpo_until_the_critic_has_taken_k_steps(tiny, name):
    model, tok = tiny
    critic = CriticConfig(updates=3, warmup_updates=6,
                          **({"replay_episodes": 8} if name == "archer" else {}))
    estimator = _make(name, model.config.hidden_size, critic)
    eps = _batch_episodes()
    before = [p.clone() for p in estimator.critic.online.parameters()]
    in_use = []
    for _ in range(3):
        adv = estimator.advantages(eps, model, tok.pad_token_id)
        in_use.append(estimator.metrics()["credit/critic_in_use"])
        if not in_use[-1]:
            close(adv, _grpo_tokens(eps), atol=0)
    # turn_gae scores before its steps (0, 3, 6 taken), archer after (3, 6, 9)
    assert in_use == ([0.0, 0.0, 1.0] if name == "turn_gae" else [0.0, 1.0, 1.0])
    assert estimator.updates == 9
    assert any((a != b).any() for a, b in zip(before, estimator.critic.online.parameters(),
                                               strict=True))  # the critic trained meanwhile
    assert not torch.equal(adv, _grpo_tokens(eps))
    assert estimator.state_dict()["updates"] == 9


def test_fit_error_gate_switches_to_the_critic_once_it_fits_the_returns(tiny):
    """Key-corridor episodes (horizon 4, half right keys): the start state's return is a coin
    flip no critic can predict, so the best reachable error is about 0.21 (measured); a fresh
    critic's is above 1."""
    model, tok = tiny
    eps = key_corridor_dataset(tok, horizon=4, p_right=0.5, groups=2, group_size=4)
    estimator = _make("turn_gae", model.config.hidden_size,
                      CriticConfig(gae_lambda=1.0, lr=3e-3, updates=25, warmup_max_error=0.5))
    errors, in_use = [], []
    for _ in range(5):
        adv = estimator.advantages(eps, model, tok.pad_token_id)
        metrics = estimator.metrics()
        errors.append(metrics["credit/critic_fit_error"])
        in_use.append(metrics["credit/critic_in_use"])
        if not in_use[-1]:
            close(adv, _grpo_tokens(eps), atol=0)
    assert errors[0] > 1.0 and in_use[0] == 0.0, errors
    assert errors[-1] < 0.35 and in_use[-1] == 1.0, errors
    assert in_use == [float(e <= 0.5) for e in errors]


def _policy_mask(eps):
    width = max(len(ep.token_ids) for ep in eps)
    return turn_to_token_advantages(eps, [torch.ones(len(ep.turns)) for ep in eps],
                                    width).bool()


def _critic_pair(tiny, scale):
    model, _ = tiny
    return [_make("turn_gae", model.config.hidden_size, CriticConfig(updates=2, scale=s))
            for s in ("none", scale)]


def test_scale_batch_whitens_and_none_is_raw(tiny):
    model, tok = tiny
    eps = _batch_episodes()
    raw, whitened = (e.advantages(eps, model, tok.pad_token_id) for e in _critic_pair(tiny,
                                                                                      "batch"))
    mask = _policy_mask(eps)
    close(whitened, whiten_masked(raw, mask))
    assert float(raw[mask].std()) < 0.9  # raw GAE values, not unit-std ones


def test_scale_running_divides_by_a_bias_corrected_running_rms(tiny):
    model, tok = tiny
    eps = _batch_episodes()
    raw_estimator, running_estimator = _critic_pair(tiny, "running")
    mask = _policy_mask(eps)
    squares = []
    for step in range(1, 3):
        raw = raw_estimator.advantages(eps, model, tok.pad_token_id)
        scaled = running_estimator.advantages(eps, model, tok.pad_token_id)
        squares.append(float(raw[mask].pow(2).mean()))
        ema = sum((1 - RUNNING_DECAY) * RUNNING_DECAY ** (len(squares) - 1 - i) * s
                  for i, s in enumerate(squares))
        rms = math.sqrt(ema / (1 - RUNNING_DECAY ** step))
        close(scaled, raw / (rms + 1e-6), atol=1e-5)
    assert float(scaled[mask].pow(2).mean()) != pytest.approx(1.0, abs=1e-3)  # not per batch


def test_critic_options_an_estimator_would_ignore_are_refused():
    for advantage, critic, word in [
            ("grpo", CriticConfig(warmup_updates=4), "critic.warmup_updates"),
            ("gigpo", CriticConfig(scale="none"), "critic.scale"),
            ("rloo", CriticConfig(features="frozen"), "critic.features"),
            ("rloo", CriticConfig(gamma=0.5), "critic.gamma"),
            ("archer", CriticConfig(gae_lambda=0.5), "critic.gae_lambda"),
            ("turn_gae", CriticConfig(tau=0.5), "critic.tau"),
            ("turn_gae", CriticConfig(gigpo_episode_weight=0.0), "critic.gigpo_episode_weight")]:
        with pytest.raises(ConfigError, match=word):
            _make(advantage, 8, critic)
        with pytest.raises(ConfigError, match=word):  # the config refuses it too
            Config(algo=AlgoConfig(advantage=advantage), critic=critic)
    with pytest.raises(ConfigError, match="critic.scale"):
        CriticConfig(scale="whiten")
    with pytest.raises(ConfigError, match="critic.warmup_max_error"):
        CriticConfig(warmup_max_error=-1)


def test_critic_section_reaches_the_estimator_in_a_training_run(tmp_path):
    cfg = load_config(None, [
        "--model.name", "tiny", "--env.name", "key-corridor", "--env.options", "{horizon: 3}",
        "--rollout.max_new_tokens", "2", "--rollout.max_turns", "3",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "1",
        "--algo.advantage", "turn_gae", "--critic.updates", "2",
        "--critic.warmup_updates", "4", "--eval.episodes", "0", "--run.steps", "3",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["credit/critic_in_use"] for r in records] == [0.0, 0.0, 1.0]
    assert [r["credit/critic_updates"] for r in records] == [2.0, 4.0, 6.0]


def test_frozen_critic_features_ignore_policy_updates_and_survive_a_resume(tiny):
    """``critic.features: frozen`` reads the starting policy's hidden states, even after the
    policy has moved and after a checkpoint round trip; ``policy`` follows the live model."""
    model, tok = tiny
    policy = copy.deepcopy(model)
    eps = _batch_episodes()
    frozen = _make("turn_gae", model.config.hidden_size, CriticConfig(updates=1, features="frozen"))
    live = _make("turn_gae", model.config.hidden_size, CriticConfig(updates=1))
    frozen.advantages(eps, policy, tok.pad_token_id)  # freezes the starting weights
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the policy trains
    start = extract_turn_features(model, eps, tok.pad_token_id, "cpu")
    moved = extract_turn_features(policy, eps, tok.pad_token_id, "cpu")
    assert not torch.allclose(start[0].states, moved[0].states, atol=1e-3)
    close(frozen.features(eps, policy, tok.pad_token_id)[0].states, start[0].states, atol=1e-6)
    close(live.features(eps, policy, tok.pad_token_id)[0].states, moved[0].states, atol=1e-6)

    buffer = io.BytesIO()
    torch.save(frozen.state_dict(), buffer)
    buffer.seek(0)
    restored = _make("turn_gae", model.config.hidden_size,
                     CriticConfig(updates=1, features="frozen"))
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    close(restored.features(eps, policy, tok.pad_token_id)[0].states, start[0].states,
          atol=1e-6)
