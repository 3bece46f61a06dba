"""Named registries of pluggable pieces (advantage estimators, ...), at the bottom of the imports.

A registry maps a name to an entry. It lives below ``config`` so the config can check a
name against it (with a did-you-mean) while the implementations register themselves from
higher layers: ``turnrl/__init__.py`` imports the built-in ones, so any ``import turnrl...``
fills the registry before a config is built. A user's own entry registers the same way
(``@ESTIMATORS.register("mine", level="turn", options=("gamma",))``) before the config that
names it is loaded.

The estimator registry is the one place estimator names are known: each entry declares its
level (what its advantages are indexed by) and the ``critic`` section options it reads, and
everything else (the config's checks, ``train_agent``) asks it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

Level = Literal["episode", "turn", "token"]
"""What an estimator scores: each episode (``[B]`` advantages), each turn (spread over the
turn's policy tokens, ``[B, T]``) or each token (``[B, T]``)."""
LEVELS: tuple[str, ...] = get_args(Level)


class UnknownName(ValueError):
    """A name no entry was registered under; the message lists the close ones."""


class Registry(dict[str, Any]):
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


@dataclass(frozen=True)
class EstimatorEntry:
    """A registered advantage estimator."""

    factory: Callable[[Any], Any]
    """``factory(settings) -> estimator``; ``settings`` is an
    ``turnrl.algorithms.estimators.EstimatorSettings`` (algo, critic, hidden_size, seed)."""
    level: Level
    """what it scores: 'episode', 'turn' or 'token'"""
    options: tuple[str, ...] = ()
    """the ``critic`` section fields it reads; setting any other one is refused"""


class EstimatorRegistry(Registry):
    """``algo.advantage`` names -> ``EstimatorEntry``."""

    def register(self, name: str, *, level: Level = "episode",  # type: ignore[override]
                 options: Sequence[str] = ()) -> Callable[[Callable[..., Any]],
                                                          Callable[..., Any]]:
        """Decorator over a factory ``(settings) -> estimator`` (a class taking the settings
        is one): ``@ESTIMATORS.register("mine", level="turn", options=("gamma", "lr"))``."""
        def add(factory: Callable[..., Any]) -> Callable[..., Any]:
            self.add(name, factory, level=level, options=options)
            return factory
        return add

    def add(self, name: str, factory: Callable[..., Any], *, level: Level = "episode",
            options: Sequence[str] = ()) -> None:
        """Register ``factory`` under ``name`` (the non-decorator form)."""
        if level not in LEVELS:
            raise ValueError(f"estimator '{name}': level must be one of {', '.join(LEVELS)}, "
                             f"got {level!r}")
        if isinstance(options, str):  # ("gamma") is a string, not a tuple: a common slip
            raise ValueError(f"estimator '{name}': options must be a sequence of critic "
                             f"option names, got the string {options!r}")
        self[name] = EstimatorEntry(factory, level, tuple(options))

    def __setitem__(self, name: str, entry: EstimatorEntry) -> None:
        if not isinstance(entry, EstimatorEntry):  # a bare factory would lose level and options
            raise TypeError(f"estimator '{name}': register it with ESTIMATORS.register(name, "
                            "level=..., options=...) or ESTIMATORS.add(...), not by assignment")
        super().__setitem__(name, entry)

    def level(self, name: str) -> Level:
        """The level ``name`` declared ('episode', 'turn' or 'token')."""
        self.check(name)
        return self[name].level

    def options(self, name: str) -> tuple[str, ...]:
        """The ``critic`` options ``name`` declared it reads."""
        self.check(name)
        return self[name].options


ESTIMATORS = EstimatorRegistry("advantage estimator")
"""``algo.advantage`` names -> ``EstimatorEntry`` (factory, level, critic options read);
filled by ``turnrl.algorithms.estimators``."""


def estimator_level(name: str) -> Level:
    """The level of the estimator registered as ``name``: 'episode' ([B] advantages, one per
    episode), 'turn' or 'token' ([B, T])."""
    return ESTIMATORS.level(name)
