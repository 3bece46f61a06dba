"""``ToolEnv``: any task with tools. A task source, a list of tools and a reward function.

Each turn the policy either calls tools or answers. Calls (the fallback ``<tool_call>``
format, which the system prompt teaches, or Llama-3.1 JSON with ``fmt="llama3-json"``) run
concurrently, each under ``call_timeout_s``; their results come back as the next
observation, ``<tool_response>`` blocks, malformed calls as blocks saying what was wrong.
A reply without a call is the answer: the episode ends with ``reward(answer, answer=...,
**facts)`` (None counts as 0). Running out of turns ends it with 0.

``info``: ``success`` (reward >= ``success_at``), ``tool_calls``, ``malformed_calls``,
``well_formed_calls`` (at least one call and none malformed), ``answered``; after a turn
of calls also ``tool_results`` ({"name", "content"} or {"name", "error"} per call), which a
turn loop rendering native ``tool`` messages can use instead of the observation text.

The prompt (``tool_prompt``): where the model's chat template renders tools itself (Qwen,
Llama 3.1+), the tools go to the template and calls are parsed in its format, their results
go back as ``tool`` messages (the turn loop renders ``tool_results``); otherwise (SmolLM2)
the system prompt teaches the fallback format and results go back as a user message.

MCP servers' tools (``turnrl.tools.mcp``, docs/mcp.md) are tools like any other; the env
starts their servers on ``reset`` (again, when one died) and fails the episode when one
exits during a turn of calls (``MCPServerError``: the env step raises, ``end_reason``
env_error with the server's exit code and stderr tail).

Built in: "tool-arithmetic", products of two 3-digit numbers with a calculator tool
(SmolLM2-135M cannot multiply those in its head; with the tool it only has to copy).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import operator
import random
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnrl.envs.base import StepResult, register_env
from turnrl.envs.reference import ScriptedReplies
from turnrl.rewards import integer_match
from turnrl.tools import (
    FORMATS,
    Tool,
    fallback_system_prompt,
    format_tool_results,
    parse_tool_calls,
    render_call,
    run_tool_calls,
    tool,
)
from turnrl.tools.calls import as_tool_dict, check_call
from turnrl.tools.mcp.servers import tool_servers


@dataclass(frozen=True)
class Task:
    prompt: str
    answer: Any
    facts: dict = field(default_factory=dict)
    """more keyword arguments for the reward function (e.g. ``tests`` for code rewards)"""
    calls: tuple[tuple[str, dict], ...] = ()
    """(tool name, arguments) of calls that solve it: the reference player's first turn"""


class ToolEnv:
    """The ``Env`` protocol over ``tasks(seed) -> Task``, ``tools`` and ``reward``."""

    def __init__(self, tasks: Callable[[int], Task], tools: list[Tool], reward: Callable,
                 *, instructions: str = "", max_turns: int = 4, call_timeout_s: float = 10.0,
                 fmt: str = "hermes", success_at: float = 1.0, tool_bonus: float = 0.0,
                 native_tools: bool = True, own_servers: bool = False):
        if max_turns < 1:
            raise ValueError(f"ToolEnv max_turns must be >= 1, got {max_turns}")
        if fmt not in FORMATS:
            raise ValueError(f"ToolEnv fmt '{fmt}' is unknown; use one of {', '.join(FORMATS)}")
        self.tasks, self.tools, self.reward = tasks, as_tool_dict(tools), reward
        self.max_turns, self.call_timeout_s, self.fmt = max_turns, call_timeout_s, fmt
        self.success_at, self.tool_bonus = success_at, tool_bonus
        self.instructions, self.native_tools = instructions, native_tools
        self.system_prompt = fallback_system_prompt(self.tools, instructions)
        self.servers = tool_servers(self.tools)  # MCP servers behind some of the tools
        self.own_servers = own_servers
        if own_servers:  # an episode's own servers: closed when it ends, or when dropped
            weakref.finalize(self, close_soon, list(self.servers))
        self.task: Task | None = None
        self.turn = self.calls = self.malformed = 0

    def tool_prompt(self, native_format: str | None) -> tuple[str | None, list[dict] | None]:
        """(system prompt, tool schemas) for a model whose template renders tools in
        ``native_format`` (None: it has no tool support). With native support the template
        shows the tools and calls are parsed in its format; without, the system prompt
        teaches the fallback. The turn loop calls this after ``reset``."""
        if native_format is None or not self.native_tools:
            return self.system_prompt, None
        self.fmt = native_format
        return self.instructions or None, [t.schema() for t in self.tools.values()]

    async def reset(self, seed: int) -> str:
        for server in self.servers:
            server.start()  # a no-op while it runs; raises with the reason if it cannot
        self.task = self.tasks(seed)
        self.turn = self.calls = self.malformed = 0
        return self.task.prompt

    async def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("ToolEnv.step before reset")
        self.turn += 1
        try:
            result = await self._step(action)
        except BaseException:  # the episode fails (or timed out: no awaiting here)
            if self.own_servers:
                close_soon(self.servers)
            raise
        if result.done:
            await self.close()
        return result

    async def close(self) -> None:
        """Close the MCP servers this env owns (``own_servers``: one per episode)."""
        if self.own_servers:
            await asyncio.to_thread(close_now, self.servers)

    async def _step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action, self.fmt)
        if calls:
            results = await run_tool_calls(calls, self.tools, self.call_timeout_s)
            for server in self.servers:
                server.check()  # a server that died is the env's failure, not the model's
            self.calls += len(calls)
            self.malformed += sum(bool(check_call(c, self.tools)) for c in calls)
            done = self.turn >= self.max_turns
            info = self._info(False, 0.0)
            info["tool_results"] = [{"name": r.name, "error": r.error} if r.error else
                                    {"name": r.name, "content": r.content} for r in results]
            return StepResult(format_tool_results(results), 0.0, done, info)
        value = self.reward(action, answer=self.task.answer, **self.task.facts)
        if inspect.isawaitable(value):
            value = await value
        value = 0.0 if value is None else float(value)
        info = self._info(True, value)
        bonus = self.tool_bonus if info["well_formed_calls"] else 0.0
        return StepResult("", value + bonus, True, info)

    def reference_player(self) -> ScriptedReplies:
        """The oracle for ``sft.env_demos`` (call it after ``reset``): the task's ``calls`` in
        one turn, written in the format the env parses, then the answer as ``str(answer)``;
        just the answer when the task names no calls."""
        calls = [render_call(name, arguments, self.fmt) for name, arguments in self.task.calls]
        turns = ["\n".join(calls)] if calls else []
        return ScriptedReplies([*turns, str(self.task.answer)])

    def _info(self, answered: bool, value: float) -> dict:
        return {"success": answered and value >= self.success_at, "answered": answered,
                "tool_calls": self.calls, "malformed_calls": self.malformed,
                "well_formed_calls": self.calls > 0 and self.malformed == 0}


def close_now(servers: list) -> None:
    for server in servers:
        server.close()


def close_soon(servers: list) -> None:
    """Close ``servers`` on a thread of their own (a finalizer must not block its caller)."""
    threading.Thread(target=close_now, args=(servers,), daemon=True,
                     name="mcp-episode-close").start()


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _bounded(value: float | int) -> float | int:
    if abs(value) > 10**100:  # keeps (10**64)**64**... from eating memory and time
        raise ValueError("intermediate results above 1e100 are not supported")
    return value


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponents above 64 are not supported")
        return _bounded(_OPERATORS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not "
                     f"'{ast.unparse(node)}'")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "123 * 456".

    Args:
        expression: numbers with + - * / // % ** and parentheses
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def multiplication_task(seed: int, low: int = 100, high: int = 999) -> Task:
    rng = random.Random(seed)
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Task(f"What is {a} times {b}?", a * b,
                calls=(("calculator", {"expression": f"{a} * {b}"}),))


@register_env("tool-arithmetic")
def tool_arithmetic(low: int = 100, high: int = 999, max_turns: int = 3,
                    tool_bonus: float = 0.0) -> ToolEnv:
    """Multiply two numbers in [low, high] with a calculator tool; reward 1 for the product."""
    return ToolEnv(
        lambda seed: multiplication_task(seed, low, high), [calculator],
        lambda reply, answer: integer_match(reply, answer, which="last"),
        instructions="Answer the question. Use the calculator for arithmetic, then reply "
                     "with just the final number.",
        max_turns=max_turns, tool_bonus=tool_bonus)
