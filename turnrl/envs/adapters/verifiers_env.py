"""verifiers (0.4, ``verifiers.v1``) tasksets as TurnRL environments: their rows, their rubric.

A verifiers 0.4 environment is a ``Taskset`` (rows of ``TaskData``: prompt, system prompt,
answer fields) whose ``Task`` scores a finished ``Trace`` with its ``@vf.reward`` (weighted,
summed) and ``@vf.metric`` methods, plus a harness: the agent program (a chat loop, bash,
Codex, ...) that verifiers launches in a runtime and points at an interception endpoint.

The bridge is direct, turn by turn, not through an endpoint: ``reset`` hands the task's
prompt to TurnRL's own turn loop (its template check, exact token records, timeouts), and
``step`` builds a real ``vf.Trace`` of the conversation and calls the task's own
``Task.score`` on it, so the reward is the taskset's rubric, unchanged. That equals the
tool-less chat harness (verifiers' ``null`` harness: one reply ends the rollout) without its
cost: that harness is a PEP 723 script verifiers installs with ``uv`` from the network into
a runtime per rollout, which a 2-core offline laptop cannot do. Tasksets that need tool
servers or a container are refused at start-up with a one-line error (docs/environments_external.md).

Rows: verifiers 0.4 has no train/eval split; its own CLIs pick rows with ``SelectConfig``
(include/exclude idx, shuffle, skip, limit). ``train_select`` and ``eval_select`` take that
config; ``taskset`` overrides the taskset's config and ``eval_taskset`` overrides it again
for the held-out rows (``{"split": "test"}`` for a taskset with such a knob). Episode seeds
at or above ``eval_from`` (``eval.seed_offset``, 1_000_000 by default) play the eval rows.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from turnrl.envs.base import StepResult, register_env

EVAL_FROM = 1_000_000
"""Held-out episode seeds start here (``EvalConfig.seed_offset``'s default)."""


def require_verifiers() -> Any:
    """``verifiers.v1``; a ValueError when missing, so the CLI prints it as one line."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError("verifiers is not installed; run: pip install 'turnrl[envs]' "
                          "(or pip install verifiers==0.4.0)") from None
    return vf


def _import_path(path: Path) -> Any:
    """A taskset module given as a file (``my_env.py``) or a package directory."""
    target = path / "__init__.py" if path.is_dir() else path
    name = path.stem if path.is_file() else path.name
    spec = importlib.util.spec_from_file_location(name, target)
    if spec is None or spec.loader is None:
        raise ValueError(f"verifiers env_id '{path}': not a Python module; give a .py file "
                         "or a package directory")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # pickled tasks refer to their module by name
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        sys.modules.pop(name, None)
        raise ValueError(f"verifiers env_id '{path}' imports '{err.name}', which is not "
                         "installed; pip install it") from None
    return module


CLASSES: dict[str, type] = {}
"""env_id -> its Taskset class, imported once a process."""


def taskset_class(vf: Any, env_id: str) -> type:
    """The ``Taskset`` subclass ``env_id`` names: an installed taskset package (verifiers'
    own resolution: hub ids ``owner/name@version``, built-ins), a dotted module, or a path."""
    if env_id not in CLASSES:
        CLASSES[env_id] = _taskset_class(vf, env_id)
    return CLASSES[env_id]


def _taskset_class(vf: Any, env_id: str) -> type:
    if not env_id:
        raise ValueError("env.options.env_id is required: an installed verifiers taskset "
                         "package, a module name, or the path of its .py file")
    path = Path(env_id).expanduser()
    if env_id.endswith(".py") or path.is_dir():
        if not path.exists():
            raise ValueError(f"verifiers env_id '{env_id}': no such file {path.resolve()}")
        module = _import_path(path)
    else:
        from verifiers.v1.utils.loaders import import_taskset
        try:
            module = import_taskset(env_id)
        except ModuleNotFoundError:
            try:  # a dotted module on sys.path (tests.envs.external.vf_sums)
                module = importlib.import_module(env_id)
            except ModuleNotFoundError as err:
                wanted = env_id.replace("-", "_")
                if err.name and not wanted.startswith(err.name.replace("-", "_")):
                    raise ValueError(f"verifiers env_id '{env_id}' imports '{err.name}', "
                                     f"which is not installed; pip install it") from None
                raise ValueError(f"verifiers env_id '{env_id}' not found; install its "
                                 f"package (pip install {env_id}) or give the path of its "
                                 ".py file") from None
    found = [obj for name in getattr(module, "__all__", dir(module))
             if isinstance(obj := getattr(module, name, None), type)
             and issubclass(obj, vf.Taskset) and obj is not vf.Taskset]
    if len(found) != 1:
        raise ValueError(f"verifiers env_id '{env_id}': module {module.__name__} exports "
                         f"{len(found)} Taskset subclasses; export exactly one in __all__")
    return found[0]


LOADED: dict[str, list] = {}
"""(env_id, config, selection) -> its tasks: loaded once a process, not once an episode."""


def load_tasks(vf: Any, cls: type, env_id: str, overrides: dict, select: dict) -> list:
    """The rows of taskset ``cls`` under config ``overrides``, picked by ``select`` (cached)."""
    key = json.dumps([env_id, overrides, select], sort_keys=True, default=str)
    if key not in LOADED:
        LOADED[key] = _load_tasks(vf, cls, env_id, overrides, select)
    return LOADED[key]


def _load_tasks(vf: Any, cls: type, env_id: str, overrides: dict, select: dict) -> list:
    from pydantic import ValidationError
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        config = config_cls.model_validate({**overrides, "id": env_id})
        view = cls(config).select(vf.SelectConfig.model_validate(select))
    except ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"verifiers env '{env_id}': bad option {'.'.join(map(str, first['loc']))}"
                         f": {first['msg']}") from None
    if not view.bounded:
        raise ValueError(f"verifiers env '{env_id}' yields tasks forever; bound it with "
                         "train_select/eval_select {'limit': N}")
    tasks = list(view)
    if not tasks:
        raise ValueError(f"verifiers env '{env_id}': the selection {select or '{}'} leaves "
                         "no tasks; widen train_select/eval_select")
    for task in tasks[:1]:
        if task.NEEDS_CONTAINER or type(task).toolsets(task.config):
            raise ValueError(f"verifiers env '{env_id}': its tasks need "
                             f"{'a container' if task.NEEDS_CONTAINER else 'tool servers'}, "
                             "which the direct bridge does not run; see "
                             "docs/environments_external.md")
    return tasks


def text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def conversation_trace(vf: Any, task: Any, prompt: list, reply: str) -> Any:
    """A ``vf.Trace`` of ``prompt`` (messages the model was shown) and its ``reply``, as
    verifiers' own rollout records one: a chain of message nodes, the reply sampled."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                    hash=task.hash), agent=AgentInfo(config=vf.AgentConfig()))
    for i, message in enumerate([*prompt, {"role": "assistant", "content": reply}]):
        trace.nodes.append(MessageNode.model_validate({
            "parent": i - 1 if i else None, "message": message,
            "sampled": message["role"] == "assistant"}))
    trace.is_completed = True
    return trace


@register_env("verifiers")
class Verifiers:
    """A verifiers 0.4 taskset (env_id=package, module or .py), scored by its own rubric."""

    def __init__(self, env_id: str = "", taskset: dict | None = None,
                 eval_taskset: dict | None = None, train_select: dict | None = None,
                 eval_select: dict | None = None, eval_from: int = EVAL_FROM,
                 success_at: float = 1.0):
        self.vf = require_verifiers()
        cls = taskset_class(self.vf, env_id)
        self.env_id, self.eval_from, self.success_at = env_id, eval_from, success_at
        self.train = load_tasks(self.vf, cls, env_id, taskset or {}, train_select or {})
        self.eval = load_tasks(self.vf, cls, env_id, {**(taskset or {}), **(eval_taskset or {})},
                               eval_select or {})
        self.task: Any = None
        self.split = "train"
        self.prompt: list[dict] = []
        self.system_prompt: str | None = None

    def pick(self, seed: int) -> Any:
        """The task episode ``seed`` plays: train rows below ``eval_from``, eval rows above."""
        self.split = "eval" if seed >= self.eval_from else "train"
        if self.split == "eval":
            return self.eval[(seed - self.eval_from) % len(self.eval)]
        return self.train[seed % len(self.train)]

    async def reset(self, seed: int) -> str:
        self.task = self.pick(seed)
        data = self.task.data
        if isinstance(data.prompt, str) or data.prompt is None:
            messages = [{"role": "user", "content": data.prompt or ""}]
        else:
            messages = [m.model_dump(exclude_none=True) for m in data.prompt]
        system = [m for m in messages if m["role"] == "system"]
        self.system_prompt = data.system_prompt or (system[0]["content"] if system else None)
        turns = [m for m in messages if m["role"] != "system"]
        self.prompt = ([{"role": "system", "content": self.system_prompt}]
                       if self.system_prompt else []) + turns
        return "\n\n".join(text_of(m.get("content")) for m in turns)

    async def step(self, action: str) -> StepResult:
        trace = conversation_trace(self.vf, self.task, self.prompt, action)
        await self.task.score(trace)  # raises (a TaskError naming the reward) -> episode fails
        reward = float(trace.reward)
        info = {"success": reward >= self.success_at, "split": self.split,
                "task": self.task.data.name or self.task.data.idx, "rewards": {k: v.score for k, v in trace.rewards.items()
                                                if v is not None},
                "metrics": {k: v for k, v in trace.metrics.items() if v is not None}}
        return StepResult("", reward, True, info)
