"""The local OpenEnv server a run starts for ``--env.name openenv --env.options.transport http``.

A real subprocess (``python .../openenv_server.py SPEC OPTIONS FD``: this file run as a script,
so the server does not import TurnRL, torch included) serving
the environment with OpenEnv's own ``create_fastapi_app`` under uvicorn; every TurnRL episode
talks to it over OpenEnv's WebSocket session protocol through the official ``EnvClient``. One
server per (environment, options) per process, started on first use; it is stopped at the end
of the run (``leftovers.CLOSE_AT_END``, registered by the adapter) or at exit (``atexit``),
and stops itself when the process that started it dies (a killed run or Ray worker leaves no
server behind).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, get_args

SESSIONS = 256
"""Concurrent WebSocket sessions a server takes (one per episode in flight)."""
IDLE_SESSION_S = 600.0
"""A session idle this long is closed by the server (an episode cut off mid-game)."""


def import_spec(spec: str) -> Any:
    """``module:Name`` or ``path/to/file.py:Name`` -> the object it names."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"openenv env '{spec}': give it as module:Class or path/to/file.py:Class")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"openenv env '{spec}': no such file {path}")
        module = sys.modules.get(path.stem)
        if getattr(module, "__file__", None) != str(path):
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[path.stem] = module
            loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            raise ValueError(f"openenv env '{spec}': no module named '{err.name}'; install "
                             "the environment's package or give the path of its .py file"
                             ) from None
    if not hasattr(module, attr):
        raise ValueError(f"openenv env '{spec}': module {target} has no '{attr}'")
    return getattr(module, attr)


def wire_types(env_cls: type) -> tuple[type, type]:
    """The (Action, Observation) classes an ``Environment[ActT, ObsT, StateT]`` declares."""
    from openenv.core.env_server.types import Action, Observation

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = [a for a in get_args(base) if isinstance(a, type)]
            action = next((a for a in args if issubclass(a, Action)), None)
            observation = next((a for a in args if issubclass(a, Observation)), None)
            if action and observation:
                return action, observation
    raise ValueError(f"openenv env {env_cls.__name__}: declare its types as "
                     "Environment[MyAction, MyObservation, State]")


class LocalServer:
    """A started server subprocess; ``url`` once it answers ``/health``."""

    def __init__(self, spec: str, options: dict, start_timeout_s: float = 60.0) -> None:
        # The socket is bound and listening here, then handed to the server: a port probed
        # free and bound later by the child could be taken in between by another process.
        with socket.create_server(("127.0.0.1", 0)) as sock:
            self.port = sock.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            command = [sys.executable, __file__, spec, json.dumps(options), str(sock.fileno())]
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, start_new_session=True,
                                            pass_fds=(sock.fileno(),))
        self._wait(start_timeout_s)

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"the OpenEnv server exited ({self.process.returncode}): "
                                   f"{err[-1] if err else 'no message'}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the OpenEnv server did not answer on {self.url} in {timeout_s:g}s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


SERVERS: dict[str, LocalServer] = {}
_LOCK = threading.Lock()


def server_for(spec: str, options: dict, check: Callable[[], Any] | None = None) -> LocalServer:
    """This process's server for ``spec`` with ``options``, started on first use, after
    ``check`` (which raises for options the server would fail every session on)."""
    key = json.dumps([spec, options], sort_keys=True)
    with _LOCK:
        if key not in SERVERS:
            if check is not None:
                check()
            SERVERS[key] = LocalServer(spec, options)
        return SERVERS[key]


@atexit.register
def stop_all() -> None:
    with _LOCK:
        for server in SERVERS.values():
            server.stop()
        SERVERS.clear()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main(spec: str, options_json: str, fd: str) -> None:
    """Serve ``spec`` on the listening socket the parent passed as file descriptor ``fd``."""
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.types import ConcurrencyConfig

    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    env_cls = import_spec(spec)
    action_cls, observation_cls = wire_types(env_cls)
    config = ConcurrencyConfig(max_concurrent_envs=SESSIONS, session_timeout=IDLE_SESSION_S)
    app = create_fastapi_app(partial(env_cls, **json.loads(options_json)), action_cls,
                             observation_cls, concurrency_config=config)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[socket.socket(fileno=int(fd))])


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as under ``python -m``: the run's directory, not this one's
    main(*sys.argv[1:4])
