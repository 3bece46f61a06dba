"""Named registries of pluggable pieces (advantage estimators, ...), at the bottom of the imports.

A registry maps a name to a factory. It lives below ``config`` so the config can check a
name against it (with a did-you-mean) while the implementations register themselves from
higher layers: ``turnrl/__init__.py`` imports the built-in ones, so any ``import turnrl...``
fills the registry before a config is built. A user's own entry registers the same way
(``@ESTIMATORS.register("mine")``) before the config that names it is loaded.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any


class UnknownName(ValueError):
    """A name no entry was registered under; the message lists the close ones."""


class Registry(dict[str, Callable[..., Any]]):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``@REGISTRY.register("name")`` over a class or factory function."""
        def add(factory: Callable[..., Any]) -> Callable[..., Any]:
            self[name] = factory
            return factory
        return add

    def check(self, name: str) -> None:
        """Raise ``UnknownName`` (with a did-you-mean) unless ``name`` is registered."""
        if name in self:
            return
        close = difflib.get_close_matches(name, list(self), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of: {', '.join(self)}"
        raise UnknownName(f"unknown {self.kind} '{name}'; {hint}")


ESTIMATORS = Registry("advantage estimator")
"""``algo.advantage`` names -> estimator factories ``(algo, hidden_size, seed) -> estimator``;
filled by ``turnrl.algorithms.estimators``."""
