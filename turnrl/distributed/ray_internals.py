"""The two things TurnRL needs from Ray that Ray has no public call for, in one place.

- Uploading an actor's ``runtime_env`` (local ``py_modules``/``working_dir`` -> URIs): Ray's
  ``ray.init`` does it for a job's runtime_env, but the learner may join a Ray it did not start
  (``ray.address``, tests), so the workers' env is uploaded per actor, with Ray's own step.
- One node's free resources (the learner's GPU is reserved only if its node has one free).

Both live in ``ray._private`` and can move between Ray releases. Each is looked up when used
and, where it is missing, fails with one line naming the Ray version and the public way round
(``available`` falls back to the cluster's free total). tests/distributed/test_ray_internals.py checks that
the installed Ray still has them, so a Ray upgrade that drops one fails CI, not a user's run.
"""

from __future__ import annotations

import tempfile
from typing import Any


class RayInternalsMissing(RuntimeError):
    """This Ray release lacks a private call TurnRL relies on; the message says what to do."""


def _ray_version() -> str:
    import ray

    return ray.__version__


def upload_runtime_env(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """``runtime_env`` with its local py_modules and working_dir uploaded to the cluster and
    replaced by their URIs (what an actor's own runtime_env accepts)."""
    try:
        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    except ImportError as err:
        raise RayInternalsMissing(
            f"Ray {_ray_version()} has no runtime_env upload step TurnRL can call ({err}); "
            "install the Ray version of TurnRL's tests (ray==2.60.*) or install the env's "
            "module on every node and leave ray.runtime_env's py_modules/working_dir empty"
        ) from err
    # the packages are built here, then sit in the cluster's object store: scratch goes after
    with tempfile.TemporaryDirectory(prefix="turnrl-runtime-env-") as scratch:
        env = upload_py_modules_if_needed(dict(runtime_env), include_gitignore=True,
                                          scratch_dir=scratch)
        env = upload_working_dir_if_needed(env, include_gitignore=True, scratch_dir=scratch)
    env.pop("excludes", None)
    return env


def node_available(node_id: str) -> dict[str, float]:
    """One node's free resources; the cluster's free total where this Ray cannot say (an
    over-estimate on a multi-node cluster: a reservation that does not fit then waits and
    fails with the placement error)."""
    import ray

    try:
        from ray._private.state import available_resources_per_node
    except ImportError:
        return dict(ray.available_resources())
    return dict(available_resources_per_node().get(node_id, {}))
