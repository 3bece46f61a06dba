"""An LLM judge for agents without a verifiable reward: score a group's attempts relative to
each other (the idea of ART's RULER: a judge ranks attempts at one task better than it scores
one alone, and GRPO only needs the ranking within a group).

Weaker than a verifiable reward, and meant for when none exists: the judge's scores are
noisy, can be gamed by the policy (confident-sounding answers, length), and a judge model as
small as the ones that run here mostly fails to answer in the required format, in which case
the group gets no reward and is not trained on (never a made-up score).
"""

from __future__ import annotations

import json
import re

JUDGE_SYSTEM = ("You grade attempts at a task. Compare the attempts with each other and score "
                "each from 0 (useless) to 10 (best possible). Reply with JSON only.")


def judge_messages(task: str, transcripts: list[str]) -> list[dict]:
    """The judge's prompt: the task, every attempt numbered, the answer format."""
    attempts = "\n\n".join(f"<attempt {i + 1}>\n{t.strip()}\n</attempt {i + 1}>"
                           for i, t in enumerate(transcripts))
    return [{"role": "system", "content": JUDGE_SYSTEM},
            {"role": "user", "content": f"Task:\n{task}\n\n{attempts}\n\nScore all "
             f"{len(transcripts)} attempts relative to each other. Answer exactly "
             f'{{"scores": [{", ".join(f"<attempt {i + 1}>" for i in range(len(transcripts)))}]}}'
             " with numbers from 0 to 10."}]


def parse_scores(text: str, n: int) -> list[float] | None:
    """The ``n`` scores in the judge's reply, scaled to [0, 1]; None when the reply has no
    JSON object with a list of ``n`` numbers in [0, 10] under "scores"."""
    for match in re.finditer(r"\{.*?\}", text, re.DOTALL):
        try:
            scores = json.loads(match.group(0)).get("scores")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(scores, list) and len(scores) == n and all(
                isinstance(s, int | float) and not isinstance(s, bool) and 0 <= s <= 10
                for s in scores):
            return [float(s) / 10 for s in scores]
    return None


async def judge_group(client, model: str, task: str, transcripts: list[str], *,
                      tries: int = 2, max_tokens: int = 64) -> list[float] | None:
    """Ask the judge (any OpenAI-compatible ``client``: the served policy itself or another
    local model) to score ``transcripts`` relative to each other; greedy, ``tries`` attempts.
    Returns scores in [0, 1], or None when the judge never answered in the format."""
    for attempt in range(tries):
        reply = await client.chat.completions.create(  # greedy first, then sampled retries
            model=model, messages=judge_messages(task, transcripts),
            temperature=0 if attempt == 0 else 1.0, max_tokens=max_tokens)
        try:
            content = reply.choices[0].message.content or ""
        except (AttributeError, IndexError, TypeError):  # no choices: an answer out of shape
            content = ""
        scores = parse_scores(content if isinstance(content, str) else "", len(transcripts))
        if scores is not None:
            return scores
    return None
