"""TicTacToe and Kuhn Poker: exact rules, reference players, illegal moves, and Kuhn Poker's
exploitability against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from turnrl.envs import ENVS, make_env
from turnrl.envs.kuhn import (
    GAME_VALUE,
    UNIFORM,
    best_response_values,
    expected_value,
    exploitability,
    infosets,
    nash_strategy,
    payoff,
)
from turnrl.envs.reference import play, reference_player
from turnrl.envs.tictactoe import best_moves, minimax_value, render, winner
from turnrl.rollout import run_sync


def test_the_games_are_listed_by_name():
    assert any("tictactoe" in name for name in ENVS) and any("kuhn" in name for name in ENVS)


# ---- TicTacToe ------------------------------------------------------------------------------

def test_minimax_by_hand():
    assert minimax_value(".........") == 0  # a draw under perfect play
    assert winner("XXX.OO...") == "X" and winner("XOXOXOOXO") is None
    # X to move with two in a row: the win is the only best move
    assert best_moves("XX.OO....") == [2]
    # O to move must block X's row
    assert best_moves("XX..O....") == [2]
    assert render("X.O......").splitlines()[0] == " X | 2 | O"


def _play_reference(options: dict, seeds: range) -> list[dict]:
    infos = []
    for seed in seeds:
        env = make_env("tictactoe", **options)

        async def one(env=env, seed=seed):
            observation = await env.reset(seed)
            player = reference_player(env, "tictactoe")
            player.reset(observation)
            while True:
                result = await env.step(player.act(observation))
                if result.done:
                    return result.info
                observation = result.observation
        infos.append(run_sync(one()))
    return infos


def test_perfect_play_never_loses_and_draws_against_itself():
    against_random = _play_reference({"skill": 0.0}, range(40))
    assert {i["outcome"] for i in against_random} <= {"win", "draw"}
    assert sum(i["outcome"] == "win" for i in against_random) >= 30
    assert {i["role"] for i in against_random} == {"X", "O"}  # role both: by seed parity
    against_perfect = _play_reference({"skill": 1.0}, range(10))
    assert {i["outcome"] for i in against_perfect} == {"draw"}
    assert {i["opponent"] for i in against_perfect} == {"minimax"}


@pytest.mark.parametrize("reply, reason", [("I pass", "no cell number"),
                                           ("10", "no cell number"),
                                           ("5", "cell 5 is taken")])
def test_an_illegal_move_loses_with_its_reason(reply, reason):
    env = make_env("tictactoe", role="o", skill=1.0)

    async def one():
        observation = await env.reset(0)
        assert "X (your opponent) played" in observation
        env.board = "....X...."  # X took the centre
        return await env.step(reply)
    result = run_sync(one())
    assert result.done and result.reward == -1.0
    assert result.info["outcome"] == "illegal" and reason in result.info["reason"]


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="role must be x, o or both"):
        make_env("tictactoe", role="z")
    with pytest.raises(ValueError, match="skill must be in"):
        make_env("tictactoe", skill=2)
    with pytest.raises(ValueError, match="opponent must be nash or random"):
        make_env("kuhn-poker", opponent="minimax")


# ---- Kuhn Poker -----------------------------------------------------------------------------

def test_payoffs_by_hand():
    J, Q, K = 0, 1, 2
    assert payoff((K, J), "pp") == 1 and payoff((J, K), "pp") == -1
    assert payoff((J, K), "bp") == 1  # the second player folded
    assert payoff((K, J), "pbp") == -1  # the first player folded
    assert payoff((Q, J), "bb") == 2 and payoff((Q, K), "pbb") == -2


def test_equilibrium_value_and_zero_exploitability():
    assert len(infosets(0) + infosets(1)) == 12
    for alpha in (0.0, 1 / 6, 1 / 3):
        nash = nash_strategy(alpha)
        assert expected_value(nash, nash) == pytest.approx(GAME_VALUE)
        br_first, br_second = best_response_values(nash, nash)
        # against an equilibrium no strategy does better than the game value
        assert br_first == pytest.approx(-1 / 18) and br_second == pytest.approx(1 / 18)
        assert exploitability(nash) == pytest.approx(0.0, abs=1e-12)


def test_exploitability_of_always_betting_by_hand():
    # Always bet/call, in either seat. Against it as first player, the second calls with K
    # (+2), calls with Q (J or K: +2 or -2, 0; folding loses 1), folds J (-1): 1/3. Against it
    # as second player, the first bets K (+2), bets Q (0; checking then folding to its bet
    # loses 1, calling is 0), checks and folds J (-1): 1/3. Exploitability (1/3 + 1/3) / 2.
    always = {key: 1.0 for key in UNIFORM}
    assert best_response_values(always, always) == pytest.approx((1 / 3, 1 / 3))
    assert exploitability(always) == pytest.approx(1 / 3)
    assert exploitability(UNIFORM) > 0.1


def test_a_hand_in_the_env_pays_what_the_rules_say():
    for seed in range(12):
        env = make_env("kuhn-poker", opponent="random")

        async def one(env=env, seed=seed):
            observation = await env.reset(seed)
            assert "your card is" in observation
            while True:
                result = await env.step("bet" if "bet" in observation.split("(")[-1]
                                        else "call")
                if result.done:
                    return result
                observation = result.observation
        result = run_sync(one())
        info = result.info
        sign = 1 if info["role"] == "first" else -1
        cards = tuple("JQK".index(c) for c in info["cards"])
        assert info["chips"] == sign * payoff(cards, info["history"])
        assert result.reward == info["chips"] / 2 and info["success"] == (info["chips"] > 0)


def test_an_illegal_poker_reply_loses_the_most_a_hand_can():
    env = make_env("kuhn-poker", role="first")

    async def one():
        await env.reset(3)
        return await env.step("raise!")
    result = run_sync(one())
    assert result.done and result.info["chips"] == -2 and result.reward == -1.0
    assert result.info["reason"] == "illegal action: expected check or bet"


def test_the_nash_reference_player_holds_the_game_value():
    """Played through the env in both seats against the Nash opponent, the reference player's
    mean chips come out near 0 (the seats' values are -1/18 and +1/18)."""
    total = 0.0
    for seed in range(600):
        env = make_env("kuhn-poker")
        player = reference_player(env, "kuhn-poker")
        reward, _, _ = run_sync(play(env, player, seed))
        total += 2 * reward
    assert abs(total / 600) < 0.2


# ---- RAE ------------------------------------------------------------------------------------

def test_rae_by_hand():
    import torch

    from turnrl.algorithms.advantages import rae_advantages

    rewards = torch.tensor([1.0, -1.0, 0.5, 1.0])
    keys = ["kuhn/first", "kuhn/second", "kuhn/first", "ttt/X"]
    adv, b = rae_advantages(rewards, keys, {"kuhn/first": 0.2}, decay=0.5)
    # A = r - b (before the batch): first 0.2, second and ttt new (0)
    assert adv.tolist() == pytest.approx([0.8, -1.0, 0.3, 1.0])
    # first seen twice: 0.25 * 0.2 + 0.75 * mean(1, 0.5) = 0.05 + 0.5625
    assert b == pytest.approx({"kuhn/first": 0.6125, "kuhn/second": -0.5, "ttt/X": 0.5})
    # order does not matter
    _, again = rae_advantages(rewards.flip(0), keys[::-1], {"kuhn/first": 0.2}, decay=0.5)
    assert again == pytest.approx(b)
    with pytest.raises(ValueError, match="one key per reward"):
        rae_advantages(rewards, keys[:2], {})


def test_rae_trains_on_kuhn_poker_and_its_baselines_survive_a_resume(tmp_path):
    from turnrl.checkpoint import latest_checkpoint
    from turnrl.config import load_config
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    def cfg(steps):
        return load_config(None, [
            "--model.name", "tiny", "--env.name", "kuhn-poker", "--algo.advantage", "rae",
            "--rollout.max_new_tokens", "3", "--rollout.group_size", "4",
            "--rollout.groups_per_step", "2", "--run.steps", str(steps), "--eval.episodes", "0",
            "--run.progress", "false", "--run.tensorboard", "false", "--run.checkpoint_every",
            "1", "--run.out_dir", str(tmp_path)])
    train(cfg(2))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    keys = {k for k in rows[-1] if k.startswith("rae/baseline/")}
    # the tiny model's replies are illegal: every hand loses 2 chips, reward -1, both seats
    assert keys == {"rae/baseline/kuhn-poker/first", "rae/baseline/kuhn-poker/second"}
    assert all(-1 <= rows[-1][k] < 0 for k in keys)
    state = latest_checkpoint(tmp_path)
    assert state is not None
    train(cfg(3), resume=True)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    # resumed with its baselines: a fresh one would restart near 0, above step 2's
    assert rows[2]["rae/baseline/kuhn-poker/first"] < rows[1]["rae/baseline/kuhn-poker/first"]


def test_kuhn_exploitability_is_read_from_the_policy_s_log_probs(tiny):
    from turnrl.envs.kuhn import KuhnPoker, conversation
    from turnrl.evaluation import reply_scorer
    from turnrl.rollout import ChatFormat

    env = KuhnPoker()
    # a scorer that plays the equilibrium exactly: its exploitability is 0
    nash = nash_strategy()

    def nash_score(messages, reply):
        """Log-probabilities of a player who follows the equilibrium exactly."""
        text = messages[-1]["content"]
        card = text.split("your card is ")[1][0]
        if text.startswith("You are player 1"):
            history = "pb" if len(messages) > 2 else ""
        else:
            history = "p" if "checks" in text else "b"
        p_bet = nash[(card, history)]
        p = p_bet if reply in ("bet", "call") else 1 - p_bet
        return math.log(p) if p > 0 else float("-inf")

    metrics = env.policy_metrics(nash_score)
    assert metrics["exploitability"] == pytest.approx(0.0, abs=1e-9)
    # the first player's second decision is seen after its own check
    assert [m["role"] for m in conversation("s", "Q", "pb")] == ["system", "user", "assistant",
                                                                  "user"]
    # a real (tiny) model: a number in the possible range
    model, tokenizer = tiny
    real = env.policy_metrics(reply_scorer(model, ChatFormat(tokenizer), 1.0))
    assert 0 <= real["exploitability"] <= 2


def test_a_kuhn_run_reports_exploitability_before_and_after(tmp_path, capsys):
    import json

    from turnrl.config import load_config
    from turnrl.trainer import train

    train(load_config(None, [
        "--model.name", "tiny", "--env.name", "kuhn-poker", "--rollout.max_new_tokens", "3",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.steps", "1",
        "--eval.episodes", "4", "--run.tensorboard", "false", "--run.progress", "false",
        "--run.out_dir", str(tmp_path)]))
    for when in ("before", "after"):
        saved = json.loads((tmp_path / f"eval_{when}.json").read_text())
        assert 0 <= saved["env_metrics"]["exploitability"] <= 2
    assert "exploitability: " in capsys.readouterr().out
