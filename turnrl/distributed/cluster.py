"""A real Ray cluster: joining it, and making every worker's node see what the learner sees.

On one machine a worker process shares the learner's files, cache and (through Ray's
default of putting the driver's directory on its path) most of its code. On another node
none of that holds, so the learner sends it along (docs/cluster.md):

- code: the module that defines the configured env, when it is not an installed package,
  goes in the workers' ``runtime_env`` ``py_modules`` (``ray.runtime_env`` adds the user's
  own: working_dir, pip, env_vars); turnrl itself must be installed on every node, in the
  learner's version (checked by each worker at start);
- files a worker reads again (``model.chat_template``) travel as their content and are
  written to a private directory on the worker's node; ``$TURNRL_CACHE`` travels as an env
  var; a local model directory missing on a worker's node is named with the node.

Pure helpers besides ``connect`` and ``WorkerSetup.apply`` (which run Ray and the file system).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from turnrl.config import Config, ConfigError

FILE_FIELDS = (("model", "chat_template"),)
"""(section, field) of config paths a worker opens again: shipped as their content."""
CACHE_VARS = ("TURNRL_CACHE", "HF_HOME")
"""The learner's cache locations, passed on to the workers when set."""


def cluster_address(cfg: Config) -> str:
    """``ray.address``, else ``$RAY_ADDRESS`` (set by ``ray job submit`` and in cluster pods)."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS", "")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """One clear line when ``HOST:PORT`` answers nothing (Ray itself retries for a minute)."""
    if address == "auto" or address.startswith(("ray://", "local")):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address {address!r} is not 'auto' or HOST:PORT "
                          "(e.g. 10.0.0.1:6379, the head's `ray start --head --port`)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"cannot reach the Ray cluster at {address} ({err}); is its head "
                          "up (`ray status` there)? fix ray.address or $RAY_ADDRESS, or leave "
                          "both empty to start a local cluster") from None


def connect(cfg: Config) -> bool:
    """Join (``ray.address`` or ``$RAY_ADDRESS``) or start a local Ray cluster; True if we
    started it. Joining never passes resources: the cluster's nodes declare their own."""
    import ray

    if ray.is_initialized():
        return False
    address = cluster_address(cfg)
    if address:
        check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as err:
            raise ConfigError(f"cannot join the Ray cluster at {address!r}: {err}; "
                              f"{auth_hint()}start one (`ray start --head`) or leave "
                              "ray.address and $RAY_ADDRESS empty to start a local one"
                              ) from None
        return True
    # Workers' own CPUs are reserved logically; on a small machine they may oversubscribe.
    cpus = local_cluster_cpus(cfg, os.cpu_count() or 1)
    # log_to_driver=False: worker start-up chatter would break the progress bar; worker
    # warnings reach the learner in their reports (Fleet.reconcile), errors as exceptions.
    # address="local": a new cluster even where another one runs on this host (a plain
    # ray.init would join it, and then refuses num_cpus).
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


def local_cluster_cpus(cfg: Config, cores: int) -> int:
    """The CPUs a local cluster declares: this machine's cores, or what the workers and the
    learner reserve when more (Ray-actor learner ranks: a bundle of at least 1 CPU each)."""
    learner = cfg.ray.learner_cpus
    if cfg.learner.launcher == "ray" and cfg.learner.world_size > 1:
        learner = cfg.learner.world_size * max(1.0, learner)
    return max(cores, math.ceil(cfg.ray.num_workers * cfg.ray.worker_cpus + learner))


def auth_hint() -> str:
    """A hint when the head may use token authentication that this process does not send.

    Ray turns it on for ``ray start --head`` when ``~/.ray/auth_token`` exists there (any
    earlier local ``ray.init`` writes one), but never for a process joining by address."""
    if os.environ.get("RAY_AUTH_MODE"):
        return ""
    return ("if the head uses token authentication (Ray enables it when ~/.ray/auth_token "
            "exists where `ray start --head` ran), set RAY_AUTH_MODE=token and the head's "
            "token ($RAY_AUTH_TOKEN or ~/.ray/auth_token) for the learner and every node; ")


def installed(path: Path) -> bool:
    """Whether ``path`` lies in an installed distribution (site-packages or the stdlib)."""
    roots = {sysconfig.get_path(name) for name in ("purelib", "platlib", "stdlib")}
    resolved = path.resolve()
    return any(part in ("site-packages", "dist-packages") for part in resolved.parts) or any(
        root and resolved.is_relative_to(Path(root).resolve()) for root in roots)


def module_to_ship(obj: Any) -> str | None:
    """The file or package directory defining ``obj`` (or that module ``obj`` is), for
    ``py_modules``; None when the workers have it anyway (turnrl, an installed package) or
    Ray pickles it by value (``__main__``)."""
    name = (obj.__name__ if isinstance(obj, ModuleType) else getattr(obj, "__module__", None)
            ) or ""
    top = name.split(".")[0]
    if not top or top in ("__main__", "turnrl", "builtins"):
        return None
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if not file or installed(Path(file)):
        return None
    path = Path(file).resolve()
    return str(path.parent if path.name == "__init__.py" else path)


def worker_runtime_env(cfg: Config, shipped: list[Any]) -> dict[str, Any]:
    """``ray.runtime_env`` plus the modules of ``shipped`` objects and the cache env vars."""
    env = {key: value for key, value in cfg.ray.runtime_env.items()}
    modules = list(env.get("py_modules", []))
    for obj in shipped:
        path = module_to_ship(obj)
        if path and path not in modules:
            modules.append(path)
    if modules:
        env["py_modules"] = modules
    env_vars = {name: os.environ[name] for name in CACHE_VARS if os.environ.get(name)}
    env_vars.update(env.get("env_vars", {}))
    if env_vars:
        env["env_vars"] = {k: str(v) for k, v in env_vars.items()}
    return env


def uploaded(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """``runtime_env`` with its local py_modules and working_dir uploaded to the cluster and
    replaced by their URIs: an actor's own runtime_env takes only URIs (``ray.init`` does
    this for a job's, but the learner may join a Ray it did not start, as tests do)."""
    if not any(key in runtime_env for key in ("py_modules", "working_dir")):
        return runtime_env
    from turnrl.distributed.ray_internals import upload_runtime_env

    return upload_runtime_env(runtime_env)


def node_label() -> str:
    """This process's node, as people find it in ``ray status``: host name and IP."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        ip = "?"
    return f"{socket.gethostname()} ({ip})"


@dataclass(frozen=True)
class WorkerSetup:
    """What the learner sends each worker besides the config (``WorkerSetup.of``)."""

    turnrl_version: str
    files: dict[str, str] = field(default_factory=dict)
    """'section.field' -> the content of the file the learner's config names there."""
    model_dir: str = ""
    """The learner's local model directory (absolute), '' for a hub name or tiny."""

    @classmethod
    def of(cls, cfg: Config) -> tuple[Config, WorkerSetup]:
        """The config to send (local paths made absolute) and the setup that goes with it."""
        import turnrl

        files = {}
        for section, name in FILE_FIELDS:
            path = getattr(getattr(cfg, section), name)
            if path:
                files[f"{section}.{name}"] = Path(path).expanduser().read_text()
        model_dir = ""
        local = Path(cfg.model.name).expanduser()
        if cfg.model.name != "tiny" and local.is_dir():
            model_dir = str(local.resolve())
            cfg = replace(cfg, model=replace(cfg.model, name=model_dir))
        if cfg.model.cache_dir:
            cache = str(Path(cfg.model.cache_dir).expanduser().resolve())
            cfg = replace(cfg, model=replace(cfg.model, cache_dir=cache))
        return cfg, cls(turnrl.__version__, files, model_dir)

    def apply(self, cfg: Config, index: int) -> Config:
        """On the worker's node: check turnrl's version and the model directory, write the
        shipped files to a private directory and point the config at them."""
        import turnrl

        if turnrl.__version__ != self.turnrl_version:
            raise RuntimeError(
                f"rollout worker {index} on {node_label()} runs turnrl {turnrl.__version__} "
                f"from {Path(turnrl.__file__).parent}, the learner {self.turnrl_version}: "
                "install the learner's version on every node (one image for all)")
        if self.model_dir and not (Path(self.model_dir) / "config.json").is_file():
            raise RuntimeError(
                f"rollout worker {index} on {node_label()}: the model directory "
                f"{self.model_dir} is missing on that node; put it on shared storage at the "
                "same path, copy it there, or name a hub model")
        if not self.files:
            return cfg
        folder = Path(tempfile.mkdtemp(prefix=f"turnrl-worker-{index}-"))
        for key, content in self.files.items():
            section, name = key.split(".")
            path = folder / name
            path.write_text(content)
            cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: str(path)})})
        return cfg
