"""OpenEnv (openenv-core 0.3) environments as TurnRL environments, in process or over HTTP.

An OpenEnv environment is an ``Environment[ActT, ObsT, StateT]`` with ``reset(seed=...)`` and
``step(action)``; its ``Observation`` carries ``done``, ``reward`` and ``metadata`` next to its
own fields, its ``Action`` is a typed pydantic model. ``env`` names the class
(``module:Class`` or ``path/to/file.py:Class``, constructed with ``env_options``).

``transport``: ``local`` runs it in this process (its ``reset_async``/``step_async``);
``http`` starts a real OpenEnv server for it in a subprocess (``openenv_server``, stopped at
exit) and plays each episode through the official WebSocket client (``GenericEnvClient``),
one session per episode, as a remote deployment would; ``url`` plays a server that already
runs (``action_field`` must then be given, as the class is not imported).

The reply fills the action's text field (``action_field``: by default the one required
``str`` field); the observation shown is ``observation_field`` (by default the one ``str``
field besides ``done``/``reward``/``metadata``, else all of them as JSON). The reward of a
step is the observation's ``reward`` (None -> 0); success: the episode ended with a reward of
at least ``success_at``. An environment that raises fails its episode with the reason.
"""

from __future__ import annotations

import json
from typing import Any

from turnrl import leftovers
from turnrl.envs.adapters.openenv_server import import_spec, server_for, stop_all, wire_types
from turnrl.envs.base import StepResult, register_env

SKIP = {"done", "reward", "metadata"}
leftovers.CLOSE_AT_END.append(stop_all)  # a run's servers end with it, not reported as leftovers


def require_openenv() -> Any:
    """``openenv.core``; a ValueError when missing, so the CLI prints it as one line."""
    try:
        import openenv.core as core
    except ImportError:
        raise ValueError("openenv-core is not installed; run: pip install 'turnrl[envs]' "
                          "(or pip install openenv-core==0.3.0)") from None
    return core


def text_field(model: type, kind: str, given: str) -> str:
    """The field of ``model`` that holds text: ``given``, else its only ``str`` field."""
    fields = {name: f for name, f in model.model_fields.items() if name not in SKIP}
    if given:
        if given not in fields:
            raise ValueError(f"openenv {kind}_field '{given}': {model.__name__} has fields "
                             f"{', '.join(fields) or 'none'}")
        return given
    texts = [name for name, f in fields.items() if f.annotation is str]
    if kind == "action":
        texts = [name for name in texts if fields[name].is_required()] or texts
    if len(texts) == 1:
        return texts[0]
    if kind == "observation":
        return ""  # all fields, as JSON
    raise ValueError(f"openenv env: cannot tell which {model.__name__} field takes the reply "
                     f"(str fields: {', '.join(texts) or 'none'}); set env.options.action_field")


def observation_text(observation: Any, field: str) -> str:
    """What the policy reads of an observation (a pydantic model, or a dict over HTTP)."""
    data = observation if isinstance(observation, dict) else observation.model_dump()
    if field:
        return str(data.get(field, ""))
    return json.dumps({k: v for k, v in data.items() if k not in SKIP}, default=str)


@register_env("openenv")
class OpenEnv:
    """An OpenEnv environment (env=module:Class), in process or via a local server (transport=http)."""

    def __init__(self, env: str = "", env_options: dict | None = None,
                 transport: str = "local", url: str = "", action_field: str = "",
                 observation_field: str = "", success_at: float = 1.0):
        require_openenv()
        if transport not in ("local", "http"):
            raise ValueError(f"openenv transport '{transport}': choose local or http")
        if not env and not url:
            raise ValueError("env.options.env is required: the Environment class as "
                             "module:Class or path/to/file.py:Class")
        self.options, self.transport, self.success_at = env_options or {}, transport, success_at
        self.env_cls = import_spec(env) if env else None
        if self.env_cls is None:  # a running server, its types unknown here
            if not action_field:
                raise ValueError("openenv url without env: set env.options.action_field")
            self.action_field, self.observation_field = action_field, observation_field
        else:
            action_cls, observation_cls = wire_types(self.env_cls)
            self.action_cls = action_cls
            self.action_field = text_field(action_cls, "action", action_field)
            self.observation_field = text_field(observation_cls, "observation",
                                                observation_field)
        if transport == "http" and not url:
            if not getattr(self.env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
                raise ValueError(f"openenv env {env}: it does not declare "
                                 "SUPPORTS_CONCURRENT_SESSIONS = True, so its server takes one "
                                 "episode at a time; use transport local")
            # options the constructor rejects fail here, in one line, not in every episode
            url = server_for(env, self.options, check=self._built_once).url
        self.url = url
        self.client: Any = None
        self.env: Any = None if url else self.env_cls(**self.options)

    def _built_once(self) -> None:
        self.env_cls(**self.options).close()

    async def _close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
        if self.env is not None:
            env, self.env = self.env, None
            env.close()

    async def reset(self, seed: int) -> str:
        if self.url:
            await self._close()  # a session per episode
            from openenv.core import GenericEnvClient
            self.client = GenericEnvClient(base_url=self.url)
            result = await self.client.reset(seed=seed)
            return observation_text(result.observation, self.observation_field)
        if self.env is None:  # closed when the last episode ended
            self.env = self.env_cls(**self.options)
        observation = await self.env.reset_async(seed=seed)
        return observation_text(observation, self.observation_field)

    async def _step(self, action: str) -> tuple[Any, Any, bool, dict]:
        """(observation, reward, done, metadata) of one step, over HTTP or in process."""
        if self.client is not None:
            result = await self.client.step({self.action_field: action})
            observation = result.observation
            metadata = observation.get("metadata", {}) if isinstance(observation, dict) else {}
            return observation, result.reward, result.done, metadata
        observation = await self.env.step_async(self.action_cls(**{self.action_field: action}))
        return observation, observation.reward, observation.done, observation.metadata

    async def step(self, action: str) -> StepResult:
        try:
            observation, reward, done, metadata = await self._step(action)
        except BaseException:
            await self._close()
            raise
        reward = float(reward or 0.0)
        if done:
            await self._close()
        info = {"success": bool(done and reward >= self.success_at), **(metadata or {})}
        return StepResult(observation_text(observation, self.observation_field), reward,
                          bool(done), info)
