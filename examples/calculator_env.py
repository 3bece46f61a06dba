"""A new multi-turn, tool-using environment in a few dozen lines, then RL on it.

The agent may call a calculator (``CALC: 37*41``) before it answers (``ANSWER: 1517``).
TurnRL owns the turn loop, the chat template and which tokens are trained; the
environment only says what happens after each reply.

    python examples/calculator_env.py                     # tiny model, a few steps
    python examples/calculator_env.py --model.name smollm2-135m-instruct --run.steps 20
"""

import random
import re
import sys

from turnrl import StepResult, register_env
from turnrl.cli import main
from turnrl.envs.reference import ScriptedReplies


@register_env("calculator")
class Calculator:
    system_prompt = ("Solve the problem. To use the calculator write CALC: <a>*<b>. "
                     "End with ANSWER: <number>.")

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns

    async def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.a, self.b, self.turn = rng.randint(10, 99), rng.randint(10, 99), 0
        return f"What is {self.a} times {self.b}?"

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        out_of_turns = self.turn >= self.max_turns
        if answer := re.search(r"ANSWER:\s*(-?\d+)", action):
            solved = int(answer.group(1)) == self.a * self.b
            return StepResult("", float(solved), True, {"success": solved})
        if call := re.search(r"CALC:\s*(\d+)\s*\*\s*(\d+)", action):
            return StepResult(f"{int(call.group(1)) * int(call.group(2))}", 0.0, out_of_turns)
        return StepResult("Write CALC: <a>*<b> or ANSWER: <number>.", 0.0, out_of_turns)

    def reference_player(self):  # an expert for --explore.guidance demo and warm-ups
        return ScriptedReplies([f"CALC: {self.a}*{self.b}", f"ANSWER: {self.a * self.b}"])


if __name__ == "__main__":
    defaults = ["--env.name", "calculator", "--model.name", "tiny", "--run.steps", "3",
                "--rollout.max_new_tokens", "24", "--eval.episodes", "8",
                "--run.out_dir", "runs/calculator"]
    sys.exit(main(["train", *defaults, *sys.argv[1:]]))  # later flags win
