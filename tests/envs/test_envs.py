import asyncio
import math
import random

import pytest

from turnrl.envs import ENVS, make_env
from turnrl.rewards import first_integer, integer_match, last_integer


def play(env, seed, policy):
    """Drive an env with a plain-Python policy(observation_history) -> reply."""

    async def go():
        history = [await env.reset(seed)]
        reward, turns = 0.0, 0
        while True:
            result = await env.step(policy(history))
            turns += 1
            reward += result.reward
            if result.done:
                return reward, result.info, turns
            history.append(result.observation)

    return asyncio.run(go())


def bisect_policy(low, high):
    state = {"lo": low, "hi": high, "last": None}

    def policy(history):
        if state["last"] is not None:
            if history[-1].startswith("Higher"):
                state["lo"] = state["last"] + 1
            elif history[-1].startswith("Lower"):
                state["hi"] = state["last"] - 1
        state["last"] = (state["lo"] + state["hi"]) // 2
        return f"{state['last']}"

    return policy


def test_rewards_parse_integers():
    assert first_integer("I guess 7, then 9") == 7
    assert last_integer("12 + 5 = 17") == 17
    assert first_integer("no number") is None
    assert integer_match("12 + 5 = 17", 17, "last") == 1.0
    assert integer_match("12 + 5 = 17", 17, "first") == 0.0
    assert integer_match(" 17.", 17, "only") == 1.0
    assert integer_match("17 apples", 17, "only") == 0.0


def test_arithmetic_is_deterministic_and_verifiable():
    env = make_env("arithmetic")
    prompt_a = asyncio.run(env.reset(3))
    prompt_b = asyncio.run(make_env("arithmetic").reset(3))
    assert prompt_a == prompt_b
    a, b = (int(x) for x in prompt_a.split()[1].rstrip(".").split("+"))
    reward, info, _ = play(make_env("arithmetic"), 3, lambda h: f"{a} + {b} = {a + b}")
    assert reward == 1.0 and info["success"]
    reward, info, _ = play(make_env("arithmetic"), 3, lambda h: f"{a + b + 1}")
    assert reward == 0.0 and not info["success"]


@pytest.mark.parametrize("high", [10, 100])
def test_guess_number_bisection_always_wins(high):
    turns_needed = math.ceil(math.log2(high))
    for seed in range(40):
        env = make_env("guess-number", high=high, max_turns=turns_needed + 1)
        reward, info, turns = play(env, seed, bisect_policy(1, high))
        assert info["success"] and turns <= turns_needed + 1
        assert reward == pytest.approx(1.0 - 0.1 * (turns - 1))


def test_guess_number_random_and_silent_players_do_worse():
    rng = random.Random(0)
    wins = sum(play(make_env("guess-number", high=100), s,
                    lambda h: str(rng.randint(1, 100)))[1]["success"] for s in range(100))
    assert wins < 20
    reward, info, turns = play(make_env("guess-number"), 0, lambda h: "I'm ready to play!")
    assert reward == 0.0 and not info["success"] and turns == 5


def test_make_env_errors_are_one_line_with_a_suggestion():
    with pytest.raises(ValueError, match="did you mean 'guess-number'"):
        make_env("guess-nmber")
    with pytest.raises(ValueError, match="bad env.options for 'arithmetic'"):
        make_env("arithmetic", nonsense=1)
    assert {"arithmetic", "guess-number"} <= set(ENVS)
