"""``mcp``: a ``ToolEnv`` whose tools are those of MCP servers, configured from ``env.options``.

    env:
      name: mcp
      options:
        servers:                  # commands (stdio) and URLs (Streamable HTTP)
          - python my_server.py
          - [npx, -y, some-mcp-server]
          - http://localhost:8000/mcp
          - {url: https://tools.example.com/mcp, headers: {Authorization: Bearer ...}}
        tasks: tasks.jsonl        # {"prompt": ..., "answer": ..., more facts for the reward}
        reward: exact             # exact | numeric | integer
        instructions: "Use the tools, then give the final answer."
        per_episode: false        # true: a server process (an HTTP session) per episode

Each server is started once per process and shared by the episodes (``shared_server``), or,
with ``per_episode``, once per episode so no state leaks between episodes (``episode_tools``);
docs/mcp.md has the details.
"""

from __future__ import annotations

from pathlib import Path

from turnrl.datafile import DataFileError, parse_json, text_lines
from turnrl.envs.base import register_env
from turnrl.envs.tool_env import Task, ToolEnv
from turnrl.rewards import exact_match, integer_match, numeric_match
from turnrl.tools.mcp.errors import MCPServerError
from turnrl.tools.mcp.servers import episode_tools, parse_spec, shared_server

REWARDS = {"exact": exact_match, "numeric": numeric_match,
           "integer": lambda reply, answer: integer_match(reply, answer, which="last")}


def read_tasks(path: str) -> list[Task]:
    """Tasks from a JSONL file: one object per line with "prompt" and "answer"; every other
    key is a fact passed to the reward."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"mcp env: tasks file '{path}' not found; pass env.options.tasks "
                         "FILE.jsonl with one {\"prompt\": ..., \"answer\": ...} per line")
    tasks = []
    try:
        for number, line in text_lines(file):
            if line.strip():
                tasks.append(task_row(parse_json(line, f"{path}:{number}"), f"{path}:{number}"))
    except DataFileError as err:
        raise ValueError(f"mcp env: {err}") from None
    except OSError as err:
        raise ValueError(f"mcp env: tasks file '{path}' cannot be read "
                         f"({err.strerror or err})") from None
    if not tasks:
        raise ValueError(f"mcp env: {path} holds no tasks")
    return tasks


def task_row(row, where: str) -> Task:
    """One tasks-file row (``where``: FILE:LINE) as a ``Task``; other keys are facts."""
    if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
        raise DataFileError(f"{where}: needs \"prompt\" and \"answer\"; write one "
                            "{\"prompt\": ..., \"answer\": ...} object a line")
    facts = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
    return Task(str(row["prompt"]), row["answer"], facts)


@register_env("mcp")
def mcp_env(servers: list | str = (), tasks: str = "", reward: str = "exact",
            instructions: str = "", max_turns: int = 4, call_timeout_s: float = 10.0,
            start_timeout_s: float = 30.0, tool_bonus: float = 0.0,
            per_episode: bool = False) -> ToolEnv:
    """Tasks from a JSONL file, answered with the tools of MCP servers (stdio or HTTP)."""
    specs = [servers] if isinstance(servers, str | dict) else list(servers)
    if not specs:
        raise ValueError("mcp env: give env.options.servers, a list of server commands or "
                         "URLs (e.g. [\"python server.py\", \"http://localhost:8000/mcp\"])")
    if not isinstance(per_episode, bool):
        raise ValueError(f"mcp env: per_episode must be true or false, got {per_episode!r}")
    if reward not in REWARDS:
        raise ValueError(f"mcp env: reward '{reward}' is unknown; use one of "
                         f"{', '.join(REWARDS)}")
    rows = read_tasks(tasks)
    try:
        for spec in specs:
            parse_spec(spec)  # every spec checked before any server starts
        tools = [t for spec in specs
                 for t in (episode_tools(spec, start_timeout_s) if per_episode
                           else shared_server(spec, start_timeout_s).tools())]
    except (MCPServerError, ValueError) as err:  # at start-up, a config error: one line
        raise ValueError(f"mcp env: {err}") from None
    return ToolEnv(lambda seed: rows[seed % len(rows)], tools, REWARDS[reward],
                   instructions=instructions, max_turns=max_turns,
                   call_timeout_s=call_timeout_s, tool_bonus=tool_bonus,
                   own_servers=per_episode)
