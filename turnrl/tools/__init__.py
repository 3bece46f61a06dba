"""Tools as typed Python functions: schema, call parsing (native and fallback), running.

    from turnrl.tools import tool, parse_tool_calls, run_tool_calls, format_tool_results

    @tool
    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        \"\"\"
        return a * b

docs/tools.md describes the formats, the built-in ``python`` tool and ``ToolEnv``.
"""

from turnrl.tools.calls import (
    FORMATS,
    ToolCall,
    ToolResult,
    check_call,
    fallback_system_prompt,
    format_tool_results,
    parse_tool_calls,
    render_call,
    run_tool_calls,
)
from turnrl.tools.native import native_tool_format, render_prompt
from turnrl.tools.python_tool import python_tool
from turnrl.tools.schema import Tool, make_tool, tool

__all__ = ["FORMATS", "Tool", "ToolCall", "ToolResult", "check_call", "fallback_system_prompt",
           "format_tool_results", "make_tool", "native_tool_format", "parse_tool_calls",
           "python_tool", "render_call", "render_prompt", "run_tool_calls", "tool"]
