"""The chat template as token deltas: render a conversation turn by turn, tokenise only what is new.

Token-in-token-out: the ids the policy is trained on are exactly the ids it sampled. The
conversation is never re-tokenised; each environment reply is rendered with the chat
template and only the *new* text is tokenised and appended. That is sound only when the
template renders earlier turns unchanged as the conversation grows, which
``ChatFormat.check`` verifies at start-up (templates that strip whitespace, drop reasoning
or move a system prompt break it silently in other frameworks).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


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
        """Verify that every turn extends the previous render, for the content real policies
        write (``PROBES``); name the content a template rewrites, and the fix."""
        for kind, action, reply in PROBES:
            messages, rendered, _ = self.start("What is 2+2?")
            try:
                rendered, _ = self.continue_after(messages, rendered, action, True, reply)
                self.continue_after(messages, rendered, "4", True, "Thanks.")
            except TemplateError as err:
                raise TemplateError(
                    f"the chat template rewrites earlier assistant turns that contain {kind} "
                    f"({err.args[0].split('; ')[0].removeprefix('the chat template ')}); "
                    "token-in-token-out training needs earlier turns rendered unchanged: pass a "
                    "template that keeps them as --model.chat_template FILE.jinja (e.g. the "
                    "model's own template without that rewriting)") from None


PROBES = (
    ("plain text", "4", "Correct. And 3+3?"),
    ("surrounding whitespace", " 6 ", "Yes!\nNext: 1+1"),
    ("a reasoning block", "<think>2 and 2 make 4.</think>The answer is 4.", "Right."),
    ("a tool call", '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>',
     '{"result": 4}'),
    ("newlines and special characters", "Line one\n\n  na\u00efve \u2014 10% & <b>x</b> \U0001f642\n",
     "Noted: \u2713"),
)
"""(what it is, a policy's reply, the env's answer): contents templates are known to rewrite
in earlier turns (Qwen3's drops reasoning blocks; some trim whitespace)."""
