"""The built-in ``python`` tool: the model's code runs in ``turnrl.sandbox``."""

from __future__ import annotations

from turnrl.sandbox import Limits, Sandbox, SandboxResult
from turnrl.tools.schema import Tool, make_tool


class ProgramFailed(Exception):
    """The program did not finish cleanly; the message says why (status, reason, output)."""


def python_tool(sandbox: Sandbox | None = None, limits: Limits | None = None) -> Tool:
    """A tool named "python" that runs code in ``sandbox`` (default: the best backend here,
    2 s wall clock) and returns what it printed. A program that fails (an exception, a
    signal, a limit) fails the call: its error, kept in the episode's ``tool_results``, is
    the status, the reason and the tail of the output (``describe_failure``)."""
    box = sandbox or Sandbox(limits=limits or Limits(wall_s=2.0, cpu_s=2.0))

    async def python(code: str) -> str:
        """Run a Python program and return what it prints. Use print() to see a value.

        Args:
            code: the complete program
        """
        result = await box.run(code)
        if not result.ok:
            raise ProgramFailed(describe_failure(result))
        return describe(result)

    return make_tool(python)


def describe(result: SandboxResult, tail: int = 800) -> str:
    """What the model is shown: stdout when the code ran, else ``describe_failure``."""
    if result.ok:
        return result.stdout if result.stdout else "(the program printed nothing)"
    return describe_failure(result, tail)


def describe_failure(result: SandboxResult, tail: int = 800) -> str:
    """"[status] reason", then the tails of stdout and stderr: never empty, whatever ended the
    run (an exception, a signal, the wall clock, the memory, process, output or file cap)."""
    head = f"[{result.status}] {result.reason or 'the program failed'}"
    parts = [head]
    if stdout := result.stdout[-tail:].strip("\n"):
        parts.append(f"stdout:\n{stdout}")
    if stderr := result.stderr[-tail:].strip("\n"):
        parts.append(f"stderr:\n{stderr}")
    return "\n".join(parts)
