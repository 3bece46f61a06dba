"""Turn-level credit: GiGPO, turn GAE and ArCHer against hand-computed values, the critic on a
toy chain, and the turn-level estimators end to end on the tiny model."""

import io
import math
from dataclasses import replace

import pytest
import torch

from turnrl.algorithms import grpo_advantages
from turnrl.algorithms.credit import (
    anchor_fraction,
    anchor_group_ids,
    archer_advantages,
    discounted_returns,
    gigpo_advantages,
    td_targets,
    turn_anchor_ids,
    turn_gae,
    turn_to_token_advantages,
    value_targets,
    whiten_masked,
)
from turnrl.algorithms.critic import (
    Transitions,
    TurnCritic,
    TurnFeatures,
    archer_critic_step,
    episode_transitions,
    extract_turn_features,
    value_regression_step,
)
from turnrl.algorithms.estimators import ESTIMATORS, EstimatorSettings, Outcome, make_estimator
from turnrl.config import AlgoConfig, CriticConfig
from turnrl.types import Batch, Episode, Turn


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


def episode(group, turns, *, reward=None, status="done", prompt=3, action=2, obs=2, seed=0):
    """An episode of ``prompt`` env tokens, then per turn ``action`` policy tokens and ``obs``
    env tokens (none after the last turn). ``turns``: (state key, reward) pairs."""
    ep = Episode(env="toy", seed=seed, group=group, status=status)
    ep.append([5 + i for i in range(prompt)], policy=False)
    for n, (state, r) in enumerate(turns):
        start, end = ep.append([20 + n + i for i in range(action)], policy=True,
                               logprobs=[-1.0] * action, version=0)
        ep.turns.append(Turn(start, end, "a", "o", r, state=state))
        if n + 1 < len(turns):
            ep.append([40 + i for i in range(obs)], policy=False)
    ep.reward = sum(r for _, r in turns) if reward is None else reward
    return ep


def test_discounted_returns():
    close(discounted_returns([0.0, 0.0, 1.0], 0.5), [0.25, 0.5, 1.0])
    close(discounted_returns([1.0, 2.0], 1.0), [3.0, 2.0])
    assert discounted_returns([], 0.9).numel() == 0


def test_anchor_groups_split_by_episode_group_and_unknown_state():
    ids = anchor_group_ids([0, 0, 1, 0, 0, 0], ["s", "t", "s", "s", "", ""])
    # (0, s) twice; (1, s) is another task; empty keys are singletons even in one group.
    assert ids[0] == ids[3]
    assert len({int(i) for i in ids}) == 5
    assert anchor_fraction(ids) == pytest.approx(2 / 6)


# Group 0: three episodes of one task, gamma = 0.5. B revisits s1; s2, s3, s4 are singletons.
# Group 1: one episode whose state key equals group 0's s0 (a different task: no grouping).
GAMMA = 0.5
GROUPS = [
    episode(0, [("s0", 0.0), ("s1", 0.0), ("s2", 1.0)]),              # A: returns .25, .5, 1
    episode(0, [("s0", 0.0), ("s1", 0.0), ("s1", 0.0), ("s3", 0.0)]),  # B: returns 0, 0, 0, 0
    episode(0, [("s0", 0.0), ("s4", 1.0)]),                            # C: returns .5, 1
    episode(1, [("s0", 1.0)]),                                         # D
]


def test_gigpo_hand_computed():
    # Episode level, group 0: R = (1, 0, 1), mean 2/3, sample std sqrt(1/3) = .57735
    #   -> A_E = (.57735, -1.15470, .57735); group 1 is a singleton -> 0.
    # Anchor s0: returns (.25, 0, .5), mean .25, sample std .25 -> A_S = (0, -1, 1).
    # Anchor s1: returns (A .5, B 0, B 0), mean 1/6, sample std sqrt(1/12) = .28868
    #   -> A_S = (1.15470, -.57735, -.57735). Singletons s2, s3, s4 and D's s0 -> 0.
    e, s = 1 / math.sqrt(3), 2 / math.sqrt(3)
    adv = gigpo_advantages(GROUPS, GAMMA, step_weight=1.0)
    close(adv[0], [e + 0, e + s, e + 0])
    close(adv[1], [-s - 1, -s - e, -s - e, -s])
    close(adv[2], [e + 1, e])
    close(adv[3], [0.0])
    # 6 of 10 turns sit in an anchor group of more than one (s0 x3, s1 x3).
    assert anchor_fraction(turn_anchor_ids(GROUPS)) == pytest.approx(0.6)


def test_gigpo_step_weight_and_no_std_variant():
    adv = gigpo_advantages(GROUPS, GAMMA, step_weight=0.5)
    e, s = 1 / math.sqrt(3), 2 / math.sqrt(3)
    close(adv[1], [-s - 0.5, -s - 0.5 * e, -s - 0.5 * e, -s])
    # F_norm = 1: A_E = R - mean = (1/3, -2/3, 1/3); s0: returns - .25 = (0, -.25, .25).
    plain = gigpo_advantages(GROUPS, GAMMA, std_normalize=False)
    close(plain[0][0], 1 / 3)
    close(plain[1][0], -2 / 3 - 0.25)
    close(plain[2][0], 1 / 3 + 0.25)


def test_gigpo_without_step_term_is_grpo():
    rewards = torch.tensor([ep.reward for ep in GROUPS])
    grpo = grpo_advantages(rewards, torch.tensor([ep.group for ep in GROUPS]))
    for b, adv in enumerate(gigpo_advantages(GROUPS, GAMMA, step_weight=0.0)):
        close(adv, torch.full((len(GROUPS[b].turns),), float(grpo[b])))


def test_turn_gae_hand_computed():
    # gamma = lam = .5, r = (0, 0, 1), V = (.5, .2, .1 | .8).
    # Truncated (bootstrap .8): deltas (0 + .1 - .5, 0 + .05 - .2, 1 + .4 - .1) = (-.4, -.15, 1.3)
    #   A2 = 1.3, A1 = -.15 + .25 * 1.3 = .175, A0 = -.4 + .25 * .175 = -.35625
    rewards, values = [0.0, 0.0, 1.0], [0.5, 0.2, 0.1, 0.8]
    adv, ret = turn_gae(rewards, values, 0.5, 0.5)
    close(adv, [-0.35625, 0.175, 1.3])
    close(ret, [0.14375, 0.375, 1.4])
    # Done: V(s_3) counts as 0 -> delta2 = .9, A1 = -.15 + .225 = .075, A0 = -.4 + .01875
    adv, ret = turn_gae(rewards, values, 0.5, 0.5, done=True)
    close(adv, [-0.38125, 0.075, 0.9])
    close(ret, [0.11875, 0.275, 1.0])
    # lam = 1: returns are the Monte Carlo returns whatever V is.
    _, ret = turn_gae(rewards, values, 0.5, 1.0, done=True)
    close(ret, [0.25, 0.5, 1.0])
    with pytest.raises(ValueError, match=r"\[T\+1\]"):
        turn_gae(rewards, values[:3], 0.5, 0.5)


def test_archer_targets_and_advantages():
    # Q target = r + gamma (1 - done) V'(s'): .0 + .9 * .5 = .45; 1 + 0 = 1; .5 + .9 * -1 = -.4
    close(td_targets(torch.tensor([0.0, 1.0, 0.5]), torch.tensor([0.5, 0.7, -1.0]),
                     torch.tensor([0.0, 1.0, 0.0]), 0.9), [0.45, 1.0, -0.4])
    close(value_targets(torch.tensor([0.3, 0.8]), torch.tensor([0.4, 0.6])), [0.3, 0.6])
    close(archer_advantages(torch.tensor([1.0, 0.2]), torch.tensor([0.5, 0.4]),
                            torch.tensor([0.25, 0.5])), [0.25, -0.3])


def test_turn_to_token_puts_each_advantage_on_its_span():
    eps = [episode(0, [("a", 0.0), ("b", 1.0)]), episode(0, [("a", 0.0)], prompt=1)]
    # ep0: prompt 0-2, turn 3-4, obs 5-6, turn 7-8; ep1: prompt 0, turn 1-2.
    tokens = turn_to_token_advantages(eps, [torch.tensor([0.5, -2.0]), [3.0]], width=10)
    close(tokens[0], [0, 0, 0, 0.5, 0.5, 0, 0, -2.0, -2.0, 0])
    close(tokens[1], [0, 3.0, 3.0, 0, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="2 turns but 1"):
        turn_to_token_advantages(eps, [[1.0], [1.0]], width=10)
    with pytest.raises(ValueError, match="width"):
        turn_to_token_advantages(eps, [[1.0, 1.0], [1.0]], width=8)


def test_whiten_masked_ignores_unmasked_entries():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = whiten_masked(values, mask)
    # masked values (1, 3, 5): mean 3, sample std 2
    close(out, [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


def test_episode_transitions_done_only_when_terminated():
    feats_states, feats_actions = torch.arange(3.0)[:, None], torch.arange(10.0, 12.0)[:, None]
    features = TurnFeatures(feats_states, feats_actions)
    done = episode_transitions(episode(0, [("a", 0.0), ("b", 1.0)]), features)
    close(done.dones, [0.0, 1.0])
    close(done.next_states[:, 0], [1.0, 2.0])
    close(done.rewards, [0.0, 1.0])
    cut = episode_transitions(episode(0, [("a", 0.0), ("b", 0.0)], status="truncated"), features)
    close(cut.dones, [0.0, 0.0])  # a truncated episode bootstraps from h(s_T)


# A deterministic chain s0 -> s1 -> s2 -> end, reward 1 on the last step, one-hot features.
CHAIN_GAMMA = 0.9
CHAIN_STATES = torch.eye(4)  # s0, s1, s2 and the state after the last action
CHAIN_ACTIONS = torch.eye(4)[[1, 2, 3]] * 0.5
CHAIN_VALUES = [CHAIN_GAMMA ** 2, CHAIN_GAMMA, 1.0]


@pytest.fixture
def one_thread():
    """A tiny MLP on a shared CPU: thread wake-ups cost more than the maths (about 20x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _critic():
    torch.manual_seed(0)
    critic = TurnCritic(hidden_size=4, width=32)
    return critic, torch.optim.Adam(critic.online.parameters(), lr=3e-3)


def test_value_head_learns_chain_values_from_lambda_returns(one_thread):
    critic, optimizer = _critic()
    for _ in range(200):  # on-policy: recompute the lambda-returns with the current V each time
        with torch.no_grad():
            _, returns = turn_gae([0.0, 0.0, 1.0], critic.value(CHAIN_STATES), CHAIN_GAMMA, 0.5,
                                  done=True)
        value_regression_step(critic, optimizer, CHAIN_STATES[:3], returns)
    close(critic.value(CHAIN_STATES[:3]).detach(), CHAIN_VALUES, atol=0.02)


def test_archer_critic_learns_chain_values_by_td(one_thread):
    critic, optimizer = _critic()
    batch = Transitions(CHAIN_STATES[:3], CHAIN_ACTIONS, torch.tensor([0.0, 0.0, 1.0]),
                        CHAIN_STATES[1:], torch.tensor([0.0, 0.0, 1.0]))
    for _ in range(200):  # values propagate back one turn per few target updates
        archer_critic_step(critic, optimizer, batch, CHAIN_GAMMA, tau=0.1)
    with torch.no_grad():
        q1, q2 = critic.q(batch.states, batch.actions)
        v = critic.value(batch.states)
    for estimate in (q1, q2, v):
        close(estimate, CHAIN_VALUES, atol=0.02)


def test_outcome_estimators_give_one_advantage_per_episode_from_rewards_and_groups():
    eps = _batch_episodes()  # rewards 1, 0 (group 0) and 0, 0 (group 1)
    rloo = make_estimator(EstimatorSettings(AlgoConfig(advantage="rloo"), hidden_size=8))
    close(rloo.advantages(eps, None, 0), [1.0, -1.0, 0.0, 0.0])  # r - mean of the others
    assert isinstance(make_estimator(EstimatorSettings(AlgoConfig(advantage="grpo"))), Outcome)


def _batch_episodes():
    """Two groups of two: terminated, truncated and failed episodes of different lengths."""
    return [
        episode(0, [("s", 0.0), ("t", 0.0), ("u", 1.0)], seed=1),
        episode(0, [("s", 0.0), ("t", 0.0)], status="truncated", seed=1),
        episode(1, [("s", 0.0)], action=3, seed=2),
        episode(1, [("s", 0.0), ("v", 0.0)], status="error", prompt=4, seed=2),
    ]


def test_extract_turn_features_match_unbatched_forward(tiny):
    model, _ = tiny
    eps = _batch_episodes()
    feats = extract_turn_features(model, eps, pad_id=0, device="cpu", batch_size=3)
    ep = eps[1]
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=torch.tensor([ep.token_ids])).last_hidden_state[0]
    starts = [t.start - 1 for t in ep.turns] + [len(ep.token_ids) - 1]
    close(feats[1].states, hidden[starts], atol=1e-4)
    close(feats[1].actions, hidden[[t.end - 1 for t in ep.turns]], atol=1e-4)
    assert [f.states.shape[0] for f in feats] == [4, 3, 2, 3]


@pytest.mark.parametrize("name", ["gigpo", "turn_gae", "archer"])
def test_turn_credit_end_to_end(tiny, name):
    model, tok = tiny
    options = {"gigpo": {}, "turn_gae": {"updates": 3},
               "archer": {"updates": 3, "replay_episodes": 3}}[name]
    settings = EstimatorSettings(AlgoConfig(advantage=name), CriticConfig(**options),
                                 model.config.hidden_size)
    credit = ESTIMATORS[name].factory(settings)
    eps = _batch_episodes()
    adv = credit.advantages(eps, model if name != "gigpo" else None, tok.pad_token_id)
    batch = Batch.from_episodes(eps, adv, tok.pad_token_id)
    assert adv.shape == batch.input_ids.shape
    assert torch.isfinite(adv).all() and adv.abs().sum() > 0
    assert (adv[batch.loss_mask == 0] == 0).all()  # off the policy tokens (and padding)
    metrics = credit.metrics()
    assert metrics and all(math.isfinite(v) for v in metrics.values())
    expected = {"gigpo": "credit/anchor_fraction", "turn_gae": "credit/v_loss",
                "archer": "credit/q_loss"}[name]
    assert expected in metrics and "credit/adv_abs_mean" in metrics
    if name != "gigpo":
        # whitened over policy tokens: mean 0, std 1
        on = adv[batch.loss_mask.bool()]
        assert abs(float(on.mean())) < 1e-4 and float(on.std()) == pytest.approx(1.0, abs=1e-3)

    # Round trip through torch.save: a restored copy continues exactly like the original.
    buffer = io.BytesIO()
    torch.save(credit.state_dict(), buffer)
    buffer.seek(0)
    restored = ESTIMATORS[name].factory(replace(settings, seed=123))
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    again = credit.advantages(eps, model, tok.pad_token_id)
    close(restored.advantages(eps, model, tok.pad_token_id), again, atol=0)
    if name == "archer":
        assert len(restored.replay) == len(credit.replay) == 5  # last 3 episodes: 2 + 1 + 2 turns
