"""A ReAct-style agent written only against the official ``openai`` client, trained by TurnRL.

The agent knows nothing of TurnRL: it calls ``client.chat.completions.create`` with a tool,
runs the calls the model makes, and returns a reward. ``train_agent`` serves the policy,
runs the agent, trains on exactly the tokens it was served, and updates the served weights.

    python examples/openai_agent.py                       # tiny model, a few steps
    python examples/openai_agent.py --model.name smollm2-135m-instruct --run.steps 10
"""

import json
import random
import sys

from turnrl.config import load_config
from turnrl.serve.train import train_agent

MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "required": ["a", "b"],
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def task(seed: int) -> dict:
    """A product of two 3-digit numbers: too hard to do in the head, easy with the tool."""
    rng = random.Random(seed)
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return {"question": f"What is {a} times {b}?", "answer": a * b}


async def rollout(client, task: dict, model: str = "", max_turns: int = 3,
                  max_tokens: int = 48) -> float:
    """Reason, act (call the tool), observe, until the model answers: 1 if right, else 0."""
    model = model or (await client.models.list()).data[0].id
    messages = [{"role": "system", "content": "Call the multiply tool, then give the number."},
                {"role": "user", "content": task["question"]}]
    for _ in range(max_turns):
        reply = (await client.chat.completions.create(
            model=model, messages=messages, tools=[MULTIPLY], max_tokens=max_tokens)).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return float(str(task["answer"]) in (reply.content or ""))
        for call in reply.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) * int(args["b"]))
            except (KeyError, TypeError, ValueError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


if __name__ == "__main__":
    defaults = ["--model.name", "tiny", "--run.steps", "3", "--rollout.group_size", "4",
                "--rollout.groups_per_step", "2", "--serve.port", "0",
                "--run.out_dir", "runs/openai-agent"]
    cfg = load_config(None, [*defaults, *sys.argv[1:]])  # later flags win
    evals = [task(1_000_000 + i) for i in range(cfg.eval.episodes)]
    train_agent(rollout, [task(i) for i in range(10_000)], cfg, eval_tasks=evals)
