"""The turn rule: what the policy's reply and an env's reset or step do to an episode, in
one place.

The turn loop (loop.py) applies it to every single-agent episode, and its seat collaborator
(seats.py) to every seat of a game, whose turn closes when it is that seat's turn again: a
reset's first observation starts the conversation (system prompt, tools, the input bound);
the policy's reply opens a turn; a step's result closes it (its reward, the turn limit, the
bound on the env's text) and, while the episode goes on, renders the env's reply for the
next turn. An episode whose next prompt and a whole reply would not fit the model's context
ends there, truncated.
"""

from __future__ import annotations

from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.env_calls import EnvError, end_turn, env_prompt, fail_episode
from turnrl.rollout.input_bounds import InputBound
from turnrl.rollout.slots import ENV as _ENV
from turnrl.rollout.slots import POLICY as _POLICY
from turnrl.rollout.slots import Slot as _Slot
from turnrl.samplers.base import Completion, SamplingParams
from turnrl.types import Episode


class TurnRule:
    """A reset or a step applied to its slot's episode (see the module docstring):
    ``max_turns`` turns at most, ``max_context`` tokens (None: no bound), ``params`` the
    sampling settings (a reply's room: ``max_new_tokens``)."""

    def __init__(self, chat: ChatFormat, params: SamplingParams, *, env_name: str,
                 max_turns: int, max_context: int | None) -> None:
        self.chat, self.params, self.env_name = chat, params, env_name
        self.max_turns, self.max_context = max_turns, max_context
        self.bound = InputBound(chat, max_context, getattr(params, "max_new_tokens", 0))

    def reply(self, slot: _Slot, completion: Completion, version: int) -> str:
        """The policy's ``completion`` (sampled by weights ``version``) appended to ``slot``'s
        episode as its open turn, until the env's step closes it; returns the reply's text,
        the env's next action (the stop token left out)."""
        text = self.chat.tokenizer.decode(completion.token_ids[:-1]
                                          if completion.finish_reason == "stop"
                                          else completion.token_ids)
        start, end = slot.episode.append(completion.token_ids, policy=True,
                                         logprobs=completion.logprobs, version=version)
        slot.turn = (completion, text, start, end)
        slot.phase = _ENV
        return text

    def after_reset(self, slot: _Slot, error: BaseException | None, first: str | None) -> None:
        """Start ``slot``'s conversation from the env's first observation ``first`` (or fail
        the episode with ``error``); it then waits for the policy."""
        if error is not None:
            fail_episode(slot.episode, error, "reset")
            return
        try:
            system_prompt, slot.tools, state = env_prompt(self.chat, slot.env, first,
                                                          self.env_name)
        except EnvError as err:
            return fail_episode(slot.episode, err, "reset")
        if reason := self.bound.start_refused(first, system_prompt):
            return slot.episode.end("truncated", "input_too_large", reason)
        slot.first = first
        slot.messages, slot.rendered, ids = self.chat.start(first, system_prompt, slot.tools)
        if self._overflows(slot.episode, ids):
            return
        slot.episode.append(ids, policy=False)
        slot.state, slot.phase = state, _POLICY

    def after_step(self, slot: _Slot, error: BaseException | None, result) -> None:
        """Record ``slot``'s open turn with the step's ``result`` (or ``error``); end the
        episode, or render the env's reply and let it wait for the policy again."""
        completion, text, start, end = slot.turn
        slot.turn = None
        episode = slot.episode
        reason, kept = self.bound.step_refused(episode, error, result, slot.tools)
        next_state = end_turn(episode, error if error is not None else result, start, end,
                              text, completion.finish_reason, slot.state, self.max_turns,
                              observation=kept)
        if next_state is not None and reason is not None:  # going on, but the reply can't fit
            episode.end("truncated", "input_too_large", reason)
        if episode.status != "running":
            return
        slot.state = next_state
        slot.rendered, ids = self.chat.continue_after(
            slot.messages, slot.rendered, text, completion.finish_reason == "stop",
            result.observation, (result.info or {}).get("tool_results"), slot.tools)
        if self._overflows(episode, ids):
            return
        episode.append(ids, policy=False)
        slot.phase = _POLICY

    def _overflows(self, episode: Episode, ids: list[int]) -> bool:
        """End ``episode`` as truncated if ``ids`` and a whole next reply would not fit the
        model's context; the ids are then left out, so an episode never outgrows it."""
        if not self.max_context or (len(episode.token_ids) + len(ids)
                                    + self.params.max_new_tokens <= self.max_context):
            return False
        episode.end("truncated", "context_length", "context length")
        return True
