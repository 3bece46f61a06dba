"""Supervised warm-up: imitate a scripted reference policy, so RL starts from a competent policy.

RL from a random tiny model spends its whole budget learning to spell a move. A short
imitation phase on transcripts of the scripted players (``turnrl.envs.reference``) gives a
policy that plays the game, and RL then has something to improve.

To leave room for RL, the demonstrations are *noisy*: each of the expert's actions is, with
probability ``noise``, replaced by a noise action, which the expert then takes as its own and
keeps playing from. Two kinds: "random", a random legal action (``RANDOM_ACTIONS``), and
"wasted", a legal action that changes nothing (``WASTED_ACTIONS``: a wall bump, a repeated
guess or question), so the demonstration is the expert's game with turns inserted. The model
imitates every action of the transcript, the noisy ones included, so it learns an
epsilon-noisy expert: it plays the game but wastes some turns, and which turn was wasted is
only visible through the outcome, which is what turn-level credit assignment is about. (A
small model also imitates the expert itself only partly, which leaves further room.)

Demonstrations are tokenised exactly as the rollout loop tokenises an episode (``ChatFormat``
deltas, the end-of-turn token sampled by the policy), so the warmed-up model sees the same
ids in RL. ``warm_start`` trains a fresh ``tiny_model`` and saves it with its tokenizer as a
local Hugging Face directory: ``--model.name DIR`` then starts RL from it (the character-level
tokenizer round-trips through ``save_pretrained``; ``tests/benchmarks/test_warmup.py`` checks it).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from turnrl.envs import make_env
from turnrl.envs.maze import MOVES
from turnrl.envs.reference import REFERENCE_POLICIES
from turnrl.evaluation import EvalResult, evaluate
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine, SamplingParams

Transcript = list[tuple[str, str]]
"""(observation, action) pairs of one episode, the first observation being the reset one."""


# ---- noise: random legal actions and wasted turns --------------------------------------------
# Each takes (env, reference policy, observation, rng, transcript so far) and returns the action
# to take instead of the expert's, or None when there is none (the expert's action stands). It
# makes the policy remember that action as its own (the policies keep their last action in
# ``last``), so the expert keeps playing correctly from wherever the noise led.

def _open_directions(observation: str) -> list[str]:
    found = re.search(r"open: ([a-z, ]*)", observation)
    listed = found.group(1).split(", ") if found else []
    return [d for d in MOVES if d in listed]


def _random_guess(env, policy, observation, rng, transcript) -> str:
    guess = rng.randint(env.low, env.high)
    policy.last = guess
    return str(guess)


def _random_direction(env, policy, observation, rng, transcript) -> str:
    direction = rng.choice(_open_directions(observation) or list(MOVES))
    policy.last = (direction, False)  # a step forward on the path, retraced like any other
    return direction


def _random_question(env, policy, observation, rng, transcript) -> str:
    attribute = rng.choice(list(policy.table.attributes))
    policy.last = ("ask", attribute)
    return f"{attribute}?"


def _random_word(env, policy, observation, rng, transcript) -> str:
    word = rng.choice(sorted(env.allowed))
    policy.last = word
    return word


def _repeat_guess(env, policy, observation, rng, transcript) -> str | None:
    """Guess-number and wordle: say the previous guess again (same reply, nothing learnt)."""
    if not transcript:
        return None
    previous = transcript[-1][1]
    # act() has just set ``last`` to its own guess: an int in guess-number, a word in wordle
    policy.last = type(policy.last)(previous)
    return previous


def _bump_wall(env, policy, observation, rng, transcript) -> str | None:
    """Maze: walk into a wall (the agent stays put; the expert reads "Wall." and ignores it)."""
    closed = [d for d in MOVES if d not in _open_directions(observation)]
    return rng.choice(closed) if closed else None


def _repeat_question(env, policy, observation, rng, transcript) -> str | None:
    """Twenty questions: ask again a question already answered."""
    asked = sorted({a for _, a in transcript if a.endswith("?")})
    if not asked:
        return None
    question = rng.choice(asked)
    policy.last = ("ask", question[:-1])
    return question


NoiseAction = Callable[[Any, Any, str, random.Random, "Transcript"], "str | None"]

RANDOM_ACTIONS: dict[str, NoiseAction] = {
    "guess-number": _random_guess,
    "maze": _random_direction,
    "twenty-questions": _random_question,
    "wordle": _random_word,
}
"""Noise kind "random", a random legal action: guess-number, any number of the game's range;
maze, an open direction; twenty-questions, any attribute; wordle, any allowed word."""

WASTED_ACTIONS: dict[str, NoiseAction] = {
    "guess-number": _repeat_guess,
    "maze": _bump_wall,
    "twenty-questions": _repeat_question,
    "wordle": _repeat_guess,
}
"""Noise kind "wasted", a legal action that changes nothing and so only costs a turn: the
previous guess again, a step into a wall, a question already answered. The state, and so the
expert's next move, are as before: the demonstration is the expert's with turns inserted."""

NOISE_KINDS = {"random": RANDOM_ACTIONS, "wasted": WASTED_ACTIONS}


async def _noisy_episode(env, policy, seed: int, noise: float, rng: random.Random,
                         noise_action: NoiseAction) -> tuple[Transcript, bool]:
    observation = await env.reset(seed)
    policy.reset(observation)
    transcript: Transcript = []
    while True:
        # act() first even when the action is replaced: it reads the last reply into the
        # policy's memory; the noise action then overwrites what it remembers doing.
        action = policy.act(observation)
        if noise and rng.random() < noise:
            action = noise_action(env, policy, observation, rng, transcript) or action
        transcript.append((observation, action))
        result = await env.step(action)
        if result.done:
            return transcript, bool(result.info.get("success"))
        observation = result.observation


def demonstrations(env_name: str, options: dict | None = None, seeds: Sequence[int] = range(64),
                   *, noise: float = 0.0, kind: str = "random",
                   seed: int = 0) -> list[tuple[Transcript, bool]]:
    """One (transcript, success) per env seed, played by the reference policy with each action
    replaced with probability ``noise`` (drawn from ``seed``) by a noise action of ``kind``:
    "random" (``RANDOM_ACTIONS``) or "wasted" (``WASTED_ACTIONS``)."""
    if env_name not in REFERENCE_POLICIES:
        raise ValueError(f"no reference policy for '{env_name}'; "
                         f"choose one of: {', '.join(REFERENCE_POLICIES)}")
    if not 0 <= noise <= 1:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    if kind not in NOISE_KINDS:
        raise ValueError(f"noise kind must be one of {', '.join(NOISE_KINDS)}, got {kind!r}")
    rng = random.Random(seed)
    noise_action = NOISE_KINDS[kind][env_name]

    async def play_all():
        return [await _noisy_episode(make_env(env_name, **(options or {})),
                                     REFERENCE_POLICIES[env_name](), s, noise, rng,
                                     noise_action) for s in seeds]

    return asyncio.run(play_all())


def encode_demonstration(chat: ChatFormat, system_prompt: str | None,
                         transcript: Transcript) -> tuple[list[int], list[int]]:
    """Token ids of a transcript as the rollout loop builds them, and a 0/1 mask of the tokens
    the policy would have sampled (each action and its end-of-turn token)."""
    messages, rendered, ids = chat.start(transcript[0][0], system_prompt)
    ids, mask = list(ids), [0] * len(ids)
    for i, (_, action) in enumerate(transcript):
        sampled = chat.encode(action) + [chat.end_of_turn]
        ids += sampled
        mask += [1] * len(sampled)
        if i + 1 < len(transcript):
            rendered, new = chat.continue_after(messages, rendered, action, True,
                                                transcript[i + 1][0])
            ids += new
            mask += [0] * len(new)
    return ids, mask


def imitation_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                   attention: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the masked tokens, each predicted from the one before.
    ``[B, T]`` ids, target mask and attention mask -> scalar."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    targets = mask[:, 1:].bool()
    return nn.functional.cross_entropy(logits[targets], ids[:, 1:][targets])


def pad_rows(rows: Sequence[tuple[list[int], list[int]]], pad: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, target mask) rows padded on the right: ``[B, T]`` ids, mask and attention."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, (row_ids, row_mask) in enumerate(rows):
        ids[r, :len(row_ids)] = torch.tensor(row_ids)
        mask[r, :len(row_ids)] = torch.tensor(row_mask)
        attention[r, :len(row_ids)] = 1
    return ids, mask, attention


def imitation_steps(model: nn.Module, rows: Sequence[tuple[list[int], list[int]]], pad: int,
                    *, steps: int, lr: float, batch: int = 8, seed: int = 0) -> list[float]:
    """``steps`` AdamW steps of ``imitation_loss`` on random batches of (ids, target mask)
    rows (gradients clipped at 1); the model is left in eval mode. Returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        picked = [rows[i] for i in torch.randperm(len(rows), generator=generator)[:batch]]
        loss = imitation_loss(model, *pad_rows(picked, pad))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@dataclass(frozen=True)
class WarmupConfig:
    """Everything that decides a warmed-up model (and so names its cache entry)."""

    env: str
    options: dict = field(default_factory=dict)
    noise: float = 0.2
    """probability that a demonstrated action is replaced by a noise action"""
    kind: str = "random"
    """noise kind: "random" (a random legal action) or "wasted" (a turn that changes nothing)"""
    episodes: int = 512
    """demonstration episodes (env seeds 0..episodes-1; RL's held-out seeds are far above)"""
    steps: int = 300
    """optimiser steps"""
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    """seeds the tiny model's initial weights, the noise and the batch order"""
    max_positions: int = 2048
    """context length of the tiny model (character-level tokens: long episodes need room)"""
    hidden_size: int = 64
    """width of the tiny model (``tiny_model``'s default is 64)"""
    num_layers: int = 2
    """decoder layers of the tiny model (``tiny_model``'s default is 2)"""


def warm_up(model: nn.Module, tokenizer, wcfg: WarmupConfig, *,
            log: Callable[[str], None] | None = None) -> list[float]:
    """Train ``model`` in place by imitation of noisy reference demonstrations; returns the
    loss of every step. The global RNGs are left untouched."""
    env = make_env(wcfg.env, **wcfg.options)
    chat = ChatFormat(tokenizer)
    demos = demonstrations(wcfg.env, wcfg.options, range(wcfg.episodes), noise=wcfg.noise,
                           kind=wcfg.kind, seed=wcfg.seed)
    encoded = [encode_demonstration(chat, getattr(env, "system_prompt", None), t)
               for t, _ in demos]
    pad = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=wcfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # short linear warm-up, then cosine decay
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + torch.cos(
            torch.tensor(torch.pi * s / wcfg.steps)).item()))
    generator = torch.Generator().manual_seed(wcfg.seed)
    device = next(model.parameters()).device
    model.train()
    losses = []
    order: list[int] = []
    for step in range(wcfg.steps):
        if len(order) < wcfg.batch_size:
            order += torch.randperm(len(encoded), generator=generator).tolist()
        rows, order = [encoded[i] for i in order[:wcfg.batch_size]], order[wcfg.batch_size:]
        ids, mask, attention = (t.to(device) for t in pad_rows(rows, pad))
        loss = imitation_loss(model, ids, mask, attention)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if log and ((step + 1) % 50 == 0 or step + 1 == wcfg.steps):
            log(f"warm-up {wcfg.env} step {step + 1}/{wcfg.steps}: loss {losses[-1]:.3f}")
    model.eval()
    return losses


def success_rate(model: nn.Module, tokenizer, env_name: str, options: dict | None = None, *,
                 episodes: int = 64, max_turns: int = 8, max_new_tokens: int = 8,
                 temperature: float = 1.0, seed_offset: int = 1_000_000,
                 seed: int = 0) -> EvalResult:
    """Play ``episodes`` held-out seeds (from ``seed_offset``, as ``eval`` does in training)."""
    chat = ChatFormat(tokenizer)
    engine = HFEngine(model, tokenizer.pad_token_id, seed=seed)
    params = SamplingParams(max_new_tokens, temperature, 1.0, stop_token_ids=(chat.end_of_turn,))
    make = partial(make_env, env_name, **(options or {}))
    result, _ = evaluate(make, range(seed_offset, seed_offset + episodes), engine, chat, params,
                         env_name=env_name, max_turns=max_turns,
                         max_context=getattr(model.config, "max_position_embeddings", None))
    return result


MARKER = "turnrl-warmup.json"
"""Written last into a finished warm-start directory, with its ``WarmupConfig`` and stats."""


def warm_start(directory: str | Path, wcfg: WarmupConfig, *,
               log: Callable[[str], None] | None = None) -> tuple[Path, dict]:
    """A tiny model warmed up by ``wcfg``, saved as a Hugging Face dir (model + tokenizer) at
    ``directory``; reused when a finished one with the same config is already there.

    Returns (the directory, its marker: the config, final loss and wall seconds). Pass the
    directory as ``model.name`` to train from it.
    """
    from turnrl.models import tiny_model

    directory = Path(directory)
    marker = directory / MARKER
    wanted = asdict(wcfg)
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("config") == wanted:
            return directory, info
    start = time.perf_counter()
    model, tokenizer = tiny_model(wcfg.seed, max_positions=wcfg.max_positions,
                                  hidden_size=wcfg.hidden_size, num_layers=wcfg.num_layers)
    losses = warm_up(model, tokenizer, wcfg, log=log)
    info = {"config": wanted, "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "seconds": time.perf_counter() - start}
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory, info
