"""Fixed key-corridor episode sets from a scripted policy, tokenised as the rollout loop does,
for checking the turn-level critics against the closed-form values (tests/algorithms/test_credit_truth.py)."""

from __future__ import annotations

import asyncio
import random

from turnrl.envs.credit_tasks import KeyCorridor
from turnrl.rollout import ChatFormat
from turnrl.types import Episode, Turn


def scripted_episode(chat: ChatFormat, env: KeyCorridor, key: int, seed: int, group: int,
                     filler: str = "x") -> Episode:
    """Play one episode that picks ``key`` then replies ``filler`` every turn, tokenised as the
    rollout loop tokenises a real one (ChatFormat deltas, an end-of-turn token per action)."""

    async def play() -> Episode:
        first = await env.reset(seed)
        ep = Episode(env="key-corridor", seed=seed, group=group)
        messages, rendered, ids = chat.start(first, env.system_prompt)
        ep.append(ids, policy=False)
        state = env.state_key
        action = str(key)
        while True:
            sampled = chat.encode(action) + [chat.end_of_turn]
            start, end = ep.append(sampled, policy=True, logprobs=[-1.0] * len(sampled),
                                   version=0)
            result = await env.step(action)
            ep.turns.append(Turn(start, end, action, result.observation, result.reward,
                                 "stop", state))
            ep.reward += result.reward
            if result.done:
                ep.status, ep.success = "done", bool(result.info["success"])
                return ep
            state = result.info["state_key"]
            rendered, new = chat.continue_after(messages, rendered, action, True,
                                                result.observation)
            ep.append(new, policy=False)
            action = filler

    return asyncio.run(play())


def key_corridor_dataset(tokenizer, horizon: int, p_right: float, groups: int,
                         group_size: int, keys: int = 2, seed: int = 0) -> list[Episode]:
    """``groups * group_size`` episodes of a policy that picks the right key with probability
    ``p_right`` and a uniformly random wrong one otherwise (the fixed right key is 1). Exactly
    ``round(p_right * group_size)`` episodes of each group pick it, so the data set's own
    frequencies equal the policy's and ``key_corridor_values(horizon, p_right, gamma)`` is the
    exact value of the data, with no sampling error."""
    rng = random.Random(seed)
    chat = ChatFormat(tokenizer)
    env = KeyCorridor(horizon=horizon, keys=keys)
    episodes = []
    for g in range(groups):
        for n in range(group_size):
            wrong = [k for k in range(keys) if k != env.default_key]
            key = env.default_key if n < round(p_right * group_size) else rng.choice(wrong)
            episodes.append(scripted_episode(chat, env, key, seed=g, group=g,
                                             filler=rng.choice("xyz.")))
    return episodes
