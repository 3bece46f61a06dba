"""Ray's private calls TurnRL uses (turnrl/distributed/ray_internals.py) still exist in the
installed Ray, and a Ray without them gets the one-line error or the public fallback."""

from __future__ import annotations

import builtins

import pytest

from tests.conftest import no_ray_oom_killer

ray = pytest.importorskip("ray")

from turnrl.distributed import ray_internals  # noqa: E402


def test_the_installed_ray_has_the_private_calls():
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    from ray._private.state import available_resources_per_node

    assert callable(upload_py_modules_if_needed) and callable(upload_working_dir_if_needed)
    assert callable(available_resources_per_node)


def _without(monkeypatch, module: str) -> None:
    real_import = builtins.__import__

    def refusing(name, *args, **kwargs):
        if name == module:
            raise ImportError(f"No module named '{module}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refusing)


def test_a_ray_without_the_upload_step_gets_one_line(monkeypatch, tmp_path):
    _without(monkeypatch, "ray._private.runtime_env.py_modules")
    with pytest.raises(ray_internals.RayInternalsMissing) as err:
        ray_internals.upload_runtime_env({"py_modules": [str(tmp_path)]})
    message = str(err.value)
    assert "\n" not in message and ray.__version__ in message and "py_modules" in message


@pytest.fixture(scope="module")
def local_cluster():
    with no_ray_oom_killer():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_free_resources_fall_back_to_the_cluster_total(local_cluster, monkeypatch):
    node = ray.get_runtime_context().get_node_id()
    per_node = ray_internals.node_available(node)
    assert per_node.get("CPU") == 2.0
    _without(monkeypatch, "ray._private.state")
    assert ray_internals.node_available(node).get("CPU") == 2.0
    assert ray_internals.node_available("no-such-node") != {}  # the cluster's total


def test_an_upload_leaves_no_scratch_directory_behind(local_cluster, monkeypatch, tmp_path):
    module = tmp_path / "my_envs"
    module.mkdir()
    (module / "__init__.py").write_text("X = 1\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    env = ray_internals.upload_runtime_env({"py_modules": [str(module)]})
    (uri,) = env["py_modules"]
    assert uri.startswith("gcs://") and list(scratch.iterdir()) == []
