"""The one turn loop: it owns the chat template, the token bookkeeping and env timeouts.

Token-in-token-out: the ids the policy is trained on are exactly the ids it sampled. The
conversation is never re-tokenised; each environment reply is rendered with the chat
template and only the *new* text is tokenised and appended. That is sound only when the
template renders earlier turns unchanged as the conversation grows, which
``ChatFormat.check`` verifies at start-up (templates that strip whitespace, drop reasoning
or move a system prompt break it silently in other frameworks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from turnrl.envs.base import Env, StepResult
from turnrl.rollout.engine import Engine, SamplingParams
from turnrl.types import Episode, Turn


class TemplateError(ValueError):
    """The tokenizer's chat template cannot support token-in-token-out multi-turn rollouts."""


class ChatFormat:
    """Renders a conversation turn by turn as token deltas."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; use an instruct model or "
                                "set tokenizer.chat_template before training")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.end_of_turn = tokenizer.eos_token_id
        self.end_of_turn_text = tokenizer.decode([self.end_of_turn])

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def start(self, observation: str, system_prompt: str | None = None
              ) -> tuple[list[dict], str, list[int]]:
        """The first prompt: (messages, rendered text, token ids).

        ``system_prompt`` (the environment's) overrides the one given at construction;
        with neither, the template's own default applies.
        """
        system_prompt = system_prompt or self.system_prompt
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": observation})
        text = self.render(messages, generation_prompt=True)
        return messages, text, self.encode(text)

    def continue_after(self, messages: list[dict], rendered: str, action: str, stopped: bool,
                       observation: str) -> tuple[str, list[int]]:
        """Tokens that follow the policy's reply: end of its turn, the env's reply, our turn.

        ``rendered`` is the text so far (the policy's reply not included); ``stopped`` tells
        whether the policy itself sampled the end-of-turn token, which then is not repeated.
        Appends both messages to ``messages``; returns (new rendered text, new token ids).
        """
        messages += [{"role": "assistant", "content": action},
                     {"role": "user", "content": observation}]
        full = self.render(messages, generation_prompt=True)
        prefix = rendered + action
        if not full.startswith(prefix):
            at = next((i for i, (a, b) in enumerate(zip(full, prefix, strict=False)) if a != b),
                      min(len(full), len(prefix)))
            raise TemplateError(
                f"the chat template does not preserve the conversation prefix at turn "
                f"{len(messages) // 2} (differs at char {at}: {full[at:at + 30]!r} vs "
                f"{prefix[at:at + 30]!r}); token-in-token-out training needs a template that "
                "renders earlier turns unchanged: fix tokenizer.chat_template")
        rest = full[len(prefix):]
        if stopped and rest.startswith(self.end_of_turn_text):
            rest = rest[len(self.end_of_turn_text):]
        return full, self.encode(rest)

    def check(self) -> None:
        """Verify on a scripted conversation that every turn extends the previous render."""
        messages, rendered, _ = self.start("What is 2+2?")
        for action, reply in [("4", "Correct. And 3+3?"), (" 6 ", "Yes!\nNext: 1+1")]:
            rendered, _ = self.continue_after(messages, rendered, action, True, reply)


@dataclass
class _Live:
    env: Env
    episode: Episode
    messages: list[dict]
    rendered: str
    state: str
    """Key of the state the next action is taken in (see ``Turn.state``)."""


async def _with_timeout(coro, timeout_s: float):
    """Await ``coro`` for at most ``timeout_s``; then cancel it and move on without waiting.

    Unlike ``asyncio.wait_for``, this does not wait for the cancelled step to finish, so an
    environment that swallows ``CancelledError`` cannot hold the turn loop.
    """
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise TimeoutError
    return task.result()


def run_sync(coro):
    """``asyncio.run`` for the trainer, except that tasks still pending at the end (an env
    step that timed out and ignores cancellation) are cancelled once and abandoned."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.close()


async def run_episodes(
    make: Callable[[], Env],
    seeds: Sequence[tuple[int, int]],
    engine: Engine,
    chat: ChatFormat,
    params: SamplingParams,
    *,
    env_name: str = "env",
    max_turns: int = 8,
    max_context: int | None = None,
    env_timeout_s: float = 30.0,
) -> list[Episode]:
    """Play one episode per ``(seed, group)`` pair, all turns of all episodes batched.

    At each turn every live episode is continued in one ``engine.generate`` call, then all
    environment steps run concurrently; a step slower than ``env_timeout_s`` or raising an
    exception ends its episode with status "timeout" or "error" (reason in ``info``).
    """
    live: list[_Live] = []
    envs = [make() for _ in seeds]
    firsts = await asyncio.gather(*(_with_timeout(env.reset(seed), env_timeout_s)
                                    for env, (seed, _) in zip(envs, seeds, strict=True)),
                                  return_exceptions=True)
    episodes = []
    for env, (seed, group), first in zip(envs, seeds, firsts, strict=True):
        episode = Episode(env=env_name, seed=seed, group=group)
        episodes.append(episode)
        if isinstance(first, BaseException):
            _fail(episode, first, "reset")
            continue
        messages, rendered, ids = chat.start(first, getattr(env, "system_prompt", None))
        episode.append(ids, policy=False)
        # An env's own state key names the start state, so a later return to it matches.
        live.append(_Live(env, episode, messages, rendered,
                          state=str(getattr(env, "state_key", first))))

    while live:
        completions = engine.generate([s.episode.token_ids for s in live], params)
        texts = [chat.tokenizer.decode(c.token_ids[:-1] if c.finish_reason == "stop"
                                       else c.token_ids) for c in completions]
        results = await asyncio.gather(*(_with_timeout(s.env.step(text), env_timeout_s)
                                         for s, text in zip(live, texts, strict=True)),
                                       return_exceptions=True)
        still_live = []
        for state, completion, text, result in zip(live, completions, texts, results,
                                                   strict=True):
            episode = state.episode
            start, end = episode.append(completion.token_ids, policy=True,
                                        logprobs=completion.logprobs, version=engine.version)
            next_state = _end_turn(episode, result, start, end, text, completion.finish_reason,
                                   state.state, max_turns)
            if next_state is None:
                continue
            state.state = next_state
            state.rendered, ids = chat.continue_after(
                state.messages, state.rendered, text, completion.finish_reason == "stop",
                result.observation)
            episode.append(ids, policy=False)
            if max_context and len(episode.token_ids) + params.max_new_tokens > max_context:
                episode.status = "truncated"
                episode.info["reason"] = "context length"
                continue
            still_live.append(state)
        live = still_live
    return episodes


def _end_turn(episode: Episode, outcome: StepResult | BaseException, start: int, end: int,
              text: str, finish_reason: str, state: str, max_turns: int) -> str | None:
    """Record a policy turn and the env's answer (or failure): the next state key, or None
    when the episode has ended (done, failed, or out of turns)."""
    if isinstance(outcome, BaseException):
        episode.turns.append(Turn(start, end, text, "", 0.0, finish_reason, state))
        _fail(episode, outcome, "step")
        return None
    _record(episode, outcome, start, end, text, finish_reason, state)
    if outcome.done:
        episode.status = "done"
        return None
    if len(episode.turns) >= max_turns:
        episode.status = "truncated"
        return None
    return str((outcome.info or {}).get("state_key", outcome.observation))


def _record(episode: Episode, result: StepResult, start: int, end: int, text: str,
            finish_reason: str, state: str) -> None:
    episode.turns.append(Turn(start, end, text, result.observation, float(result.reward),
                              finish_reason, state))
    episode.reward += float(result.reward)
    info = dict(result.info or {})
    info.pop("state_key", None)
    if "success" in info:
        episode.success = bool(info.pop("success"))
    episode.info.update(info)


def _fail(episode: Episode, error: BaseException, where: str) -> None:
    is_timeout = isinstance(error, TimeoutError)
    episode.status = "timeout" if is_timeout else "error"
    episode.info["reason"] = (f"env {where} timed out" if is_timeout
                              else f"env {where} raised {type(error).__name__}: {error}")
