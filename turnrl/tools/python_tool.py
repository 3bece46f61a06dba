"""The built-in ``python`` tool: the model's code runs in ``turnrl.sandbox``."""

from __future__ import annotations

from turnrl.sandbox import Limits, Sandbox, SandboxResult
from turnrl.tools.schema import Tool, make_tool


def python_tool(sandbox: Sandbox | None = None, limits: Limits | None = None) -> Tool:
    """A tool named "python" that runs code in ``sandbox`` (default: the best backend here,
    2 s wall clock) and returns what it printed, or the error."""
    box = sandbox or Sandbox(limits=limits or Limits(wall_s=2.0, cpu_s=2.0))

    async def python(code: str) -> str:
        """Run a Python program and return what it prints. Use print() to see a value.

        Args:
            code: the complete program
        """
        return describe(await box.run(code))

    return make_tool(python)


def describe(result: SandboxResult, tail: int = 800) -> str:
    """What the model is shown: stdout when the code ran, else the status and the error."""
    if result.ok:
        return result.stdout if result.stdout else "(the program printed nothing)"
    return (f"{result.stdout[-tail:]}\n[{result.status}] {result.reason}".strip() if
            result.status != "error" else f"{result.stdout[-tail:]}{result.stderr[-tail:]}")
