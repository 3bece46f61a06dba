"""``env.module``: importing a user's own module, whose ``@register_env`` envs a run then names.

A module name is imported from ``sys.path``; a ``.py`` path is imported under its file's stem
(``path/to/my_envs.py`` -> ``my_envs``), so that Ray can ship it to the workers as that module
(``turnrl.distributed.cluster``) and a worker imports the same name (``shipped=True``).
Each mistake is one ``ConfigError`` line naming the module and the fix; an error raised by
the module's own code names its type, message and the line that raised it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from turnrl.config import ConfigError, parse_env_module
from turnrl.envs.base import ENVS

LOADED: dict[str, ModuleType] = {}
"""``env.module`` value -> the module it imported in this process (each imports once)."""


def load_env_module(spec: str, *, shipped: bool = False) -> ModuleType | None:
    """Import ``env.module`` (None when it is ''); ``shipped``: on a Ray worker, where a
    path's module arrived by name (``py_modules``) and the learner's path may not exist."""
    module = parse_env_module(spec)
    if module is None:
        return None
    if spec in LOADED:
        return LOADED[spec]
    if module.is_path and not shipped:
        loaded = _import_file(spec, Path(module.target).expanduser())
    else:
        loaded = _import_name(spec, Path(module.target).stem if module.is_path else module.target)
    if module.env and module.env not in ENVS:
        mine = [name for name, f in ENVS.items() if getattr(f, "__module__", "") == loaded.__name__]
        raise ConfigError(f"env.module '{spec}': the module registers no env '{module.env}' "
                          f"(it registers: {', '.join(mine) or 'none'}); fix the name after ':' "
                          "or add @register_env('" + module.env + "') to the env")
    LOADED[spec] = loaded
    return loaded


def module_of(spec: str) -> ModuleType | None:
    """The module ``env.module`` imported in this process (None: none, or not yet)."""
    return LOADED.get(spec)


def _import_name(spec: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.split(".")[0] != err.name.split(".")[0]:
            raise _failed(spec, err) from None  # the module imports something missing
        raise ConfigError(f"env.module '{spec}': no module named '{name}' on sys.path; give "
                          "the path of its .py file instead (--env.module path/to/"
                          f"{name.split('.')[-1]}.py) or add its directory to PYTHONPATH"
                          ) from None
    except Exception as err:  # noqa: BLE001 - the user's module: one line, with its place
        raise _failed(spec, err) from None


def _import_file(spec: str, path: Path) -> ModuleType:
    """Import the file at ``path`` as the module named by its stem (once: a module of that
    name already imported from the same file is it)."""
    if not path.is_file():
        raise ConfigError(f"env.module '{spec}': no file {path.resolve()}; give the path of "
                          "the .py file that registers your env")
    name = path.stem
    if not name.isidentifier():
        raise ConfigError(f"env.module '{spec}': '{path.name}' cannot be imported as a module; "
                          "rename it to a valid Python name (letters, digits, _)")
    existing = sys.modules.get(name)
    if existing is not None:
        if Path(getattr(existing, "__file__", "") or "").resolve() == path.resolve():
            return existing
        raise ConfigError(f"env.module '{spec}': a module named '{name}' is already imported "
                          f"from {getattr(existing, '__file__', None) or 'built-ins'}; rename "
                          f"{path.name}")
    module_spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = loaded  # as an import would: its envs pickle by reference to Ray
    try:
        module_spec.loader.exec_module(loaded)
    except Exception as err:  # noqa: BLE001 - the user's module: one line, with its place
        del sys.modules[name]
        raise _failed(spec, err) from None
    return loaded


def _failed(spec: str, err: BaseException) -> ConfigError:
    """One line for an error the module's own code raised, at the line that raised it."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if isinstance(err, SyntaxError):
        where = f" at {err.filename}:{err.lineno}"
    message = str(err).splitlines()[0] if str(err) else ""
    return ConfigError(f"env.module '{spec}' failed to import: {type(err).__name__}: "
                       f"{message}{where}; fix the module")
