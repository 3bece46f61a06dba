"""``env.module``: a user's own env module, loaded by name, ``module:ENV`` or a ``.py`` path,
each mistake one line naming the module and the fix; stored with the run, so ``turnrl eval``
of the run loads it again; shipped to Ray workers, which import it too.
The leftovers of such an env, run by the command or by a script, are in ``test_leftovers.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from turnrl.config import ConfigError, load_config, load_run_config
from turnrl.distributed.cluster import module_to_ship
from turnrl.envs import ENVS
from turnrl.envs.user_module import LOADED, load_env_module

TESTS = Path(__file__).parents[1]
LEAKY = TESTS / "helpers" / "leaky_envs.py"
TINY = ["--model.name", "tiny", "--rollout.max_new_tokens", "3", "--run.progress", "false",
        "--run.tensorboard", "false", "--eval.episodes", "2"]
BOUND_S = 240
"""Loose: each run takes 20-30 s on the busy 2-core machine; one that hangs never ends."""


def _module(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def forget():
    """Forget what a test imported and registered, so tests do not see each other's."""
    envs, modules, loaded = dict(ENVS), set(sys.modules), dict(LOADED)
    yield
    ENVS.clear(), ENVS.update(envs)
    LOADED.clear(), LOADED.update(loaded)
    for name in set(sys.modules) - modules:
        del sys.modules[name]


def test_a_path_is_stored_absolute_and_module_colon_env_picks_the_env(monkeypatch):
    monkeypatch.chdir(LEAKY.parent)
    cfg = load_config(None, ["--env.module", "leaky_envs.py:tidy"])
    assert cfg.env.module == f"{LEAKY}:tidy" and cfg.env.name == "tidy"
    assert load_config(None, ["--env.module", "my_envs"]).env.module == "my_envs"
    same = load_config(None, ["--env.module", "my_envs:mine", "--env.name", "mine"])
    assert same.env.name == "mine"


@pytest.mark.parametrize(("module", "message"), [
    ("nosuch/envs.py", "env.module 'nosuch/envs.py': no file "),
    ("my envs", "is neither a module name (my_envs, pkg.envs) nor a .py file path"),
    ("my_envs:mine", "picks env 'mine' but env.name is 'wordle': drop one of them"),
])
def test_a_bad_env_module_fails_in_one_line_at_config_load(module, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--env.module", module, "--env.name", "wordle"])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_module_file_registers_its_envs_once_and_is_shipped_by_its_file(tmp_path, forget):
    path = _module(tmp_path, "my_counter_envs", """
        from turnrl import StepResult, register_env
        IMPORTS = []
        IMPORTS.append(1)

        @register_env("my-counter")
        class Counter:
            async def reset(self, seed):
                return "count"
            async def step(self, action):
                return StepResult("", 1.0, True)
        """)
    spec = f"{path}:my-counter"
    module = load_env_module(spec)
    assert ENVS["my-counter"].__module__ == "my_counter_envs" == module.__name__
    assert load_env_module(spec) is module and module.IMPORTS == [1]  # imported once
    assert module_to_ship(module) == module_to_ship(ENVS["my-counter"]) == str(path)
    # a worker imports it by name (Ray put the shipped file on its path)
    assert load_env_module("my_counter_envs", shipped=True) is module


@pytest.mark.parametrize(("body", "message"), [
    ("x = 1\nraise RuntimeError('no API key')\n",
     "failed to import: RuntimeError: no API key at {path}:2; fix the module"),
    ("def broken(:\n", "failed to import: SyntaxError: "),
    ("import zz_not_installed_zz\n",
     "failed to import: ModuleNotFoundError: No module named 'zz_not_installed_zz' at {path}:1"),
])
def test_an_error_in_the_module_names_its_line(tmp_path, forget, body, message):
    path = _module(tmp_path, "my_broken_envs", body)
    with pytest.raises(ConfigError) as info:
        load_env_module(str(path))
    text = str(info.value)
    assert text.startswith(f"env.module '{path}'") and "\n" not in text
    assert message.format(path=path) in text
    assert "my_broken_envs" not in sys.modules  # a retry after the fix imports it again


def test_unknown_names_and_clashes_name_the_fix(tmp_path, forget, monkeypatch):
    with pytest.raises(ConfigError, match="no module named 'zz_my_envs' on sys.path; give the "
                       r"path of its .py file instead \(--env.module path/to/zz_my_envs.py\) "
                       "or add its directory to PYTHONPATH"):
        load_env_module("zz_my_envs")
    clash = _module(tmp_path, "json", "")
    with pytest.raises(ConfigError, match="a module named 'json' is already imported from .*; "
                       "rename json.py"):
        load_env_module(str(clash))
    monkeypatch.syspath_prepend(str(LEAKY.parent))
    with pytest.raises(ConfigError, match=r"registers no env 'nope' \(it registers: "
                       r"leaky-thread, leaky-event, leaky-child, leaky-file, .*tidy, "
                       r"busy-torch, busy-torch-past-exit\)"):
        load_env_module("leaky_envs:nope")


def _command(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "turnrl.cli", *args, *TINY],
                              capture_output=True, text=True, timeout=BOUND_S, cwd=cwd,
                              env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"turnrl {' '.join(args)} did not exit within {BOUND_S} s")


@pytest.mark.slow
def test_turnrl_train_loads_a_module_file_and_eval_of_the_run_loads_it_again(tmp_path):
    """The command alone (no import of the module anywhere else) trains on an env of the
    file, stores the module with the run, and ``turnrl eval RUN_DIR`` plays it again."""
    rel = os.path.relpath(LEAKY, tmp_path)
    done = _command(["train", "--env.module", f"{rel}:leaky-child", "--run.steps", "1",
                     "--run.out_dir", "run"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "env 'leaky-child' left 1 child process(es) running after the run" in done.stderr
    saved = load_run_config(str(tmp_path / "run" / "config.yaml"))
    assert saved.env.module == f"{LEAKY}:leaky-child" and saved.env.name == "leaky-child"
    done = _command(["eval", "run"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaky-child: 2 held-out tasks" in done.stdout, done.stdout[-2000:]
    assert "env 'leaky-child' left 1 child process(es) running after the run" in done.stderr


@pytest.mark.slow
def test_ray_workers_import_the_module_that_registered_the_env(tmp_path):
    """The module registers an env defined elsewhere (``leaky_envs``, shipped as the env's
    own module): only env.module makes the registering file reach the workers
    (``py_modules``), each of which imports it by name before building its env."""
    (tmp_path / "mods").mkdir()  # not the learner's directory, which Ray puts on their path
    _module(tmp_path / "mods", "my_registry", f"""
        import sys
        sys.path.insert(0, {str(LEAKY.parent)!r})
        from leaky_envs import Tidy
        from turnrl import register_env
        register_env("tidy-again")(Tidy)
        """)
    done = _command(["train", "--env.module", "mods/my_registry.py:tidy-again", "--run.mode",
                     "async", "--ray.num_workers", "1", "--rollout.group_size", "2",
                     "--rollout.groups_per_step", "1", "--run.steps", "1",
                     "--run.out_dir", "run"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"file package for local module '{tmp_path / 'mods' / 'my_registry.py'}'" in done.stderr
    assert "tidy-again: 2 held-out episodes, before vs after" in done.stdout, done.stdout[-2000:]


def test_turnrl_envs_lists_the_envs_of_a_module(tmp_path, forget, capsys):
    from turnrl.cli import main

    path = _module(tmp_path, "my_listed_envs", '''
        from turnrl import register_env

        @register_env("my-listed")
        class Listed:
            """Listed by turnrl envs --env.module."""
        ''')
    assert main(["envs", "--env.module", str(path)]) == 0
    assert "my-listed" in capsys.readouterr().out
    assert main(["envs", "--env.module", str(tmp_path / "missing.py")]) == 2
    assert "env.module" in capsys.readouterr().err
