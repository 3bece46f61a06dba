"""Scripted demonstrations: an env's reference player (envs/reference.py) plays it, and
each successful episode becomes a conversation as the turn loop would have rendered it (the
env's system prompt, its observations as user messages, the player's replies).

``--sft.env_demos N`` plays seeds 0..N-1 of ``env.name`` (training seeds; the held-out
evaluation's start at ``eval.seed_offset``) up to ``rollout.max_turns`` turns each. A
self-play game (``seats``) is played against its first fixed opponent (``eval_opponents``:
TicTacToe's random player, Kuhn Poker's random one), both roles by the seed's parity.
"""

from __future__ import annotations

from turnrl.demos.data import DataError, Demonstration
from turnrl.envs import make_env
from turnrl.envs.contract import fixed_opponent_options
from turnrl.envs.reference import (
    REFERENCE_POLICIES,
    NotTextReply,
    player_reply,
    reference_player,
)
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.loop import run_sync


def env_demonstrations(env_name: str, options: dict, count: int, chat: ChatFormat,
                       max_turns: int) -> tuple[list[Demonstration], list[str]]:
    """(demonstrations of the successful episodes, a line per failed one)."""
    if count == 0:
        return [], []
    demos, failed = [], []
    # a self-play game's demonstrations: its reference player against a fixed opponent
    options = fixed_opponent_options(make_env(env_name, **options), options)
    for seed in range(count):
        env = make_env(env_name, **options)
        messages, tools, success, _ = run_sync(scripted_conversation(
            env, env_name, seed, chat, max_turns))
        where = f"{env_name} seed {seed}"
        if success:
            demos.append(Demonstration(messages, tools, where))
        else:
            failed.append(f"{where}: left out: the scripted player did not succeed in "
                          f"{max_turns} turns")
    return demos, failed


async def scripted_conversation(env, env_name: str, seed: int, chat: ChatFormat,
                                max_turns: int
                                ) -> tuple[list[dict], list[dict] | None, bool, float]:
    """(messages, tool schemas, success, total reward) of one episode of ``env``'s reference
    player
    (envs/reference.py): the messages the turn loop's ``ChatFormat`` builds (an env's reply as
    the next user message), the last observation left out (an episode ends with the policy's
    reply)."""
    observation = await env.reset(seed)
    # the prompt first: a ToolEnv learns the model's call format there, and its player
    # writes its calls in that format
    system_prompt, tools = chat.env_prompt(env)
    player = reference_player(env, env_name)
    if player is None:
        raise DataError(f"sft.env_demos: env '{env_name}' offers no scripted demonstrations "
                        f"(no reference_player(); built-in ones: {', '.join(REFERENCE_POLICIES)})")
    system_prompt = system_prompt or chat.system_prompt
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": observation})
    player.reset(observation)
    total = 0.0
    for turn in range(max_turns):
        try:
            action = player_reply(player, observation)
        except NotTextReply as err:
            raise DataError(f"sft.env_demos: env '{env_name}' seed {seed}: {err}") from None
        messages.append({"role": "assistant", "content": action})
        result = await env.step(action)
        total += result.reward
        if result.done or turn + 1 == max_turns:
            success = bool(result.done and (result.info or {}).get("success"))
            return messages, tools, success, total
        observation = result.observation
        # as the loop renders it: tool results as tool messages where the template has them
        messages += chat.env_messages(observation, (result.info or {}).get("tool_results"), tools)
    return messages, tools, False, total
