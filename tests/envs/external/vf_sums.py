"""A verifiers (0.4) taskset in that library's own format: add two numbers, reply with the sum.

``split`` picks disjoint rows (train: a+b with a < 10; eval: a >= 10), the knob a taskset
built on a dataset exposes; ``raise_on`` names a task index whose reward raises, so the
adapter's failure path has a real reward function to run.
"""

import re

import verifiers.v1 as vf


class SumsData(vf.TaskData):
    answer: int


class SumsTask(vf.Task[SumsData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.name == "boom":
            raise RuntimeError("the grader crashed on purpose")
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumsConfig(vf.TasksetConfig):
    split: str = "train"
    """train: first addend 1..9; eval: first addend 10..19 (held out)."""
    num_tasks: int = 20
    raise_on: int = -1
    """index of a task whose reward raises (-1: none)."""
    as_messages: bool = False
    """the prompt as a message list (system message included) instead of a string."""


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        base = 1 if self.config.split == "train" else 10
        for i in range(self.config.num_tasks):
            a, b = base + i % 9, 1 + (i * 7) % 5
            question = f"What is {a}+{b}? Reply with just the number."
            prompt = ([vf.SystemMessage(content="Answer with one number."),
                       vf.UserMessage(content=[vf.TextContentPart(text=question)])]
                      if self.config.as_messages else question)
            data = SumsData(prompt=prompt, answer=a + b,
                            system_prompt=None if self.config.as_messages else
                            "Answer with one number.",
                            name="boom" if i == self.config.raise_on else f"sum-{i}")
            yield SumsTask(data, self.config.task)


__all__ = ["SumsTaskset"]
