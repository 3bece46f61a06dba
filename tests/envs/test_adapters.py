"""Environment wrappers and adapters, played through the Env API with scripted replies."""

import asyncio
import sys
from functools import partial

import pytest

from turnrl.envs import make_env
from turnrl.envs.wrappers import attempt_reward
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import HFEngine, SamplingParams


def play(env, seed, replies):
    async def run():
        obs, results = await env.reset(seed), []
        for reply in replies:
            results.append(await env.step(reply))
            if results[-1].done:
                break
        return obs, results
    return asyncio.run(run())


def test_try_again_pays_less_per_attempt_and_repeats_the_question():
    env = make_env("try-again", inner="arithmetic", max_attempts=3, discount=0.5)
    question, _ = play(env, 7, [])
    a, b = map(int, question.split("Compute ")[1].split(".")[0].split("+"))
    _, results = play(env, 7, ["0", "1", str(a + b)])
    assert [r.observation for r in results[:2]] == ["Let's try again."] * 2
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == pytest.approx(0.25) and results[-1].info["success"]
    assert attempt_reward(1.0, 1, 0.5) == 1.0


def test_try_again_ends_after_max_attempts_without_reward():
    env = make_env("try-again", inner="arithmetic", max_attempts=2)
    _, results = play(env, 1, ["x", "y", "z"])
    assert len(results) == 2 and results[-1].done and results[-1].reward == 0.0
    assert not results[-1].info["success"]


def test_try_again_bad_options_fail_in_one_line():
    with pytest.raises(ValueError, match="max_attempts"):
        make_env("try-again", max_attempts=0)
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("try-again", inner="nope")


def test_gymnasium_frozenlake_scripted_episode_reaches_the_goal():
    env = make_env("gymnasium", game="FrozenLake-v1", is_slippery=False)
    obs, results = play(env, 0, ["go right", "hmm", "right", "down", "down", "down", "right"])
    assert obs.splitlines()[0] == "@FFF" and "\x1b" not in obs  # plain text, "@" is the agent
    assert results[0].observation.splitlines()[-4] == "S@FF" and env.state_key == "15"
    assert results[1].observation.startswith("Reply with one of")
    assert results[-1].done and results[-1].reward == 1.0 and results[-1].info["success"]


def test_gymnasium_renderings_are_plain_text_with_the_agent_marked():
    taxi = make_env("gymnasium", game="Taxi-v4")
    obs = asyncio.run(taxi.reset(3))
    assert "\x1b" not in obs and obs.count("@") == 1
    assert "The passenger is at R and wants to go to Y." in obs
    blackjack = make_env("gymnasium", game="Blackjack-v1")
    assert asyncio.run(blackjack.reset(0)).startswith("Your hand totals")
    cliff = make_env("gymnasium", game="CliffWalking-v1")
    assert asyncio.run(cliff.reset(0)).splitlines()[-1].startswith("x  C")
    result = asyncio.run(cliff.step("right"))  # into the cliff: back to the start, -100
    assert result.reward == -100.0 and result.observation.splitlines()[-1].startswith("x  C")


@pytest.mark.parametrize("name,options", [
    ("gymnasium", {"game": "Taxi-v4", "max_turns": 3}),
    ("try-again", {"inner": "arithmetic", "max_attempts": 2}),
    ("reasoning-gym", {"task": "leg_counting"}),
    ("textarena", {"game": "GuessTheNumber-v0"}),
    ("try-again", {"inner": "reasoning-gym", "task": "basic_arithmetic", "max_attempts": 2}),
])
def test_adapters_play_through_the_turn_loop_with_the_tiny_model(tiny, name, options):
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    episodes = run_sync(run_episodes(partial(make_env, name, **options), [(0, 0), (1, 0)],
                                     engine, ChatFormat(tok), SamplingParams(max_new_tokens=4)))
    for episode in episodes:
        assert episode.status in ("done", "truncated"), episode.info
        assert 1 <= len(episode.turns) <= 3
        assert len(episode.token_ids) == len(episode.loss_mask)


def test_reasoning_gym_scores_with_its_own_score_answer():
    env = make_env("reasoning-gym", task="basic_arithmetic")
    _, [right] = play(env, 3, ["Let me think.\nAnswer: -61"])
    _, [wrong] = play(env, 3, ["\\boxed{5}"])
    assert right.reward == 1.0 and right.info["success"] and right.done
    assert wrong.reward < 1.0 and not wrong.info["success"]


def test_textarena_guess_the_number_scripted_binary_search_wins():
    env = make_env("textarena", game="GuessTheNumber-v0")

    async def search():
        await env.reset(0)
        lo, hi = 1, 20
        for _ in range(10):
            guess = (lo + hi) // 2
            result = await env.step(f"[{guess}]")
            if result.done:
                return result
            assert result.reward == 0.0 and "target number is" in result.observation
            lo, hi = (guess + 1, hi) if "higher" in result.observation else (lo, guess - 1)
        return result

    final = asyncio.run(search())
    assert final.done and final.reward == 1.0 and final.info["success"]


@pytest.mark.parametrize("name,module", [("gymnasium", "gymnasium"),
                                         ("reasoning-gym", "reasoning_gym"),
                                         ("textarena", "textarena")])
def test_a_missing_library_names_the_pip_install(monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'turnrl\[envs\]'"):
        make_env(name)
