"""The adapters' and ToolEnv's reference players (oracles for ``sft.env_demos``): each solves
its env on several seeds, and its demonstrations tokenise exactly as the turn loop plays the
same replies."""

from __future__ import annotations

import pytest

from tests.sft.test_sft import _chat, _same
from turnrl.demos.conversation import conversation_episode
from turnrl.envs import make_env
from turnrl.envs.contract import fixed_opponent_options
from turnrl.envs.reference import play, reference_player
from turnrl.rollout import run_sync
from turnrl.tools import parse_tool_calls, render_call

pytest.importorskip("gymnasium")
pytest.importorskip("reasoning_gym")

CASES = [
    ("gymnasium", {"game": "FrozenLake-v1", "is_slippery": False}),
    ("gymnasium", {"game": "FrozenLake-v1", "is_slippery": False, "map_name": "8x8"}),
    ("gymnasium", {"game": "Taxi-v4"}),
    ("reasoning-gym", {"task": "basic_arithmetic"}),
    ("reasoning-gym", {"task": "leg_counting"}),
    ("reasoning-gym", {"task": "chain_sum"}),
    ("tool-arithmetic", {}),
]
IDS = ["frozenlake4", "frozenlake8", "taxi", "rg-arith", "rg-legs", "rg-chain", "tool-arith"]


def _solve(env_name: str, options: dict, seed: int) -> tuple[float, bool, int]:
    env = make_env(env_name, **options)

    async def episode():
        await env.reset(seed)
        player = reference_player(env, env_name)
        return await play(env, player, seed)  # play resets again: same seed, same task

    return run_sync(episode())


@pytest.mark.parametrize("env_name, options", CASES, ids=IDS)
def test_each_reference_player_solves_its_env_on_several_seeds(env_name, options):
    results = [_solve(env_name, options, seed) for seed in range(6)]
    assert all(success for _, success, _ in results), results


def test_gymnasium_plans_are_shortest_and_taxi_plans_differ_by_seed():
    lake = [_solve("gymnasium", CASES[0][1], s)[2] for s in range(3)]
    assert lake == [6, 6, 6]  # 4x4: 3 down and 3 right is the least any path needs
    assert [_solve("gymnasium", CASES[1][1], s)[2] for s in range(2)] == [14, 14]
    taxi = [_solve("gymnasium", CASES[2][1], s)[2] for s in range(8)]
    assert len(set(taxi)) > 1 and max(taxi) <= 20


def test_no_reachable_goal_has_no_plan_and_blackjack_hits_below_17():
    from turnrl.envs.adapters.gymnasium_env import shortest_plan

    walled = make_env("gymnasium", game="FrozenLake-v1", is_slippery=False,
                      desc=["SFH", "FHH", "HHG"])
    run_sync(walled.reset(0))
    assert shortest_plan(walled.env.unwrapped.P, 0) is None
    blackjack = make_env("gymnasium", game="Blackjack-v1")
    observation = run_sync(blackjack.reset(0))
    player = reference_player(blackjack, "gymnasium")
    assert player.act(observation) == ("hit" if blackjack.obs[0] < 17 else "stick")


def test_tool_calls_render_as_each_format_parses_them():
    for fmt in ("hermes", "llama3-json"):
        text = render_call("calculator", {"expression": "12 * 34"}, fmt)
        call, = parse_tool_calls(text, fmt)
        assert (call.name, call.arguments, call.problem) == (
            "calculator", {"expression": "12 * 34"}, "")
    env = make_env("tool-arithmetic")
    run_sync(env.reset(3))
    env.fmt = "llama3-json"  # as tool_prompt sets it for a Llama template
    first = reference_player(env, "tool-arithmetic").act("")
    assert "<tool_call>" not in first and parse_tool_calls(first, "llama3-json")[0].problem == ""


async def _written_the_old_way(env_name: str, options: dict, seed: int, chat, max_turns: int
                               ) -> tuple[list[dict], list[dict] | None, bool]:
    """(messages, tools, success) of the reference player's episode as scripted
    demonstrations were written before they were played through the turn loop: the player
    against the env directly, the conversation built as the loop's ``ChatFormat`` would (the
    oracle the loop-played demonstrations must equal)."""
    env = make_env(env_name, **fixed_opponent_options(make_env(env_name, **options), options))
    observation = await env.reset(seed)
    system_prompt, tools = chat.env_prompt(env)  # a ToolEnv learns the call format here
    player = reference_player(env, env_name)
    system_prompt = system_prompt or chat.system_prompt
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": observation})
    player.reset(observation)
    for turn in range(max_turns):
        action = player.act(observation)
        messages.append({"role": "assistant", "content": action})
        result = await env.step(action)
        if result.done or turn + 1 == max_turns:
            return messages, tools, bool(result.done and (result.info or {}).get("success"))
        observation = result.observation
        messages += chat.env_messages(observation, (result.info or {}).get("tool_results"), tools)
    return messages, tools, False


BUILT_IN = [("guess-number", {}), ("twenty-questions", {}), ("maze", {}), ("wordle", {}),
            ("tictactoe-selfplay", {}), ("kuhn-poker", {}), ("kuhn-poker-selfplay", {}),
            ("gymnasium", {"game": "Blackjack-v1"})]


@pytest.mark.parametrize("env_name, options", CASES + BUILT_IN,
                         ids=IDS + [name for name, _ in BUILT_IN[:-1]] + ["blackjack"])
def test_env_demos_are_the_loop_s_episodes_of_what_the_player_wrote_before(env_name, options):
    """Demonstrations are played through the turn loop (``reference_episode``); their tokens,
    loss masks and turns are what the conversation the player used to be scripted into
    tokenises to, and the same seeds succeed."""
    from turnrl.demos.scripted import env_demonstrations

    chat, max_turns = _chat(), 20
    demos, failed = env_demonstrations(env_name, options, 4, chat, max_turns=max_turns)
    assert demos and len(demos) + len(failed) == 4
    for seed in range(4):
        messages, tools, success = run_sync(_written_the_old_way(env_name, options, seed, chat,
                                                                 max_turns))
        demo = next((d for d in demos if d.where == f"{env_name} seed {seed}"), None)
        assert (demo is not None) == success
        if demo is not None:
            assert demo.messages == [] and len(demo.episodes) == 1
            _same(conversation_episode(chat, messages, tools), demo.episodes[0])


@pytest.mark.parametrize("template", ["LLAMA", "NATIVE"])
def test_env_demos_use_the_tool_format_and_tool_role_of_the_model_s_template(template):
    """Under a template with tools of its own, the demonstration's call is in the template's
    format (the player writes it after the env learnt the format: as <tool_call> tags under
    a Llama-style JSON template it would not parse) and the results come back as ``tool``
    messages, as the conversation written the old way tokenises."""
    from tests.rollout import test_tool_loop
    from turnrl.demos.scripted import env_demonstrations

    chat = _chat(getattr(test_tool_loop, template))
    fmt = {"LLAMA": "llama3-json", "NATIVE": "hermes"}[template]
    assert chat.native_tools == fmt and chat.tool_role
    demos, failed = env_demonstrations("tool-arithmetic", {}, 2, chat, max_turns=3)
    assert failed == [] and len(demos) == 2
    for seed, demo in enumerate(demos):
        episode, = demo.episodes
        call = episode.turns[0].action
        assert ("<tool_call>" in call) == (fmt == "hermes")
        assert parse_tool_calls(call, fmt)[0].name == "calculator"
        messages, tools, success = run_sync(_written_the_old_way("tool-arithmetic", {}, seed,
                                                                 chat, 3))
        assert success and [m["role"] for m in messages] == ["system", "user", "assistant",
                                                             "tool", "assistant"]
        _same(conversation_episode(chat, messages, tools), episode)


@pytest.mark.parametrize("reply", [None, 42, ["4"]])
def test_env_demos_refuse_a_player_reply_that_is_not_text_in_one_line(reply):
    from turnrl.demos.data import DataError
    from turnrl.demos.scripted import env_demonstrations
    from turnrl.envs import register_env
    from turnrl.envs.builtin import GuessNumber

    class Player:
        def reset(self, first_observation):
            pass

        def act(self, observation):
            return reply

    @register_env("guess-number-odd-player")
    class OddPlayer(GuessNumber):
        def reference_player(self):
            return Player()

    with pytest.raises(DataError, match=rf"guess-number-odd-player' seed 0: env reset raised "
                       rf"NotTextReply: the reference player's act\(\) returned "
                       rf"{type(reply).__name__}, not text") as err:
        env_demonstrations("guess-number-odd-player", {}, 1, _chat(), max_turns=3)
    assert "\n" not in str(err.value)
