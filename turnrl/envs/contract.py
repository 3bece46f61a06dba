"""The env contract in one place: everything the framework calls, reads or probes on an env.

Required (``Env`` in base.py): ``reset(seed) -> str`` and ``step(action) -> StepResult``,
``async`` or plain ``def``. Everything else is optional; the framework reads it only through
the functions below, so this table is the whole contract:

==================  ==============  ===========================================================
attribute           default         what it does
==================  ==============  ===========================================================
``system_prompt``   no system msg   the system message of every episode (read after ``reset``)
``tools`` +         no tools        ``ToolEnv``: typed tools; ``tool_prompt(native_format)``
``tool_prompt``                     returns (system prompt, tool schemas) for the template
``state_key``       the observation  names the state after ``reset`` (GiGPO's anchor states);
                                    each step's ``info["state_key"]`` names the next one
``cooperative``     False           class attribute: reset/step never block their event loop,
                                    so such envs may share one thread (rollout/env_calls.py)
``eval_options``    {}              options held-out evaluation builds the env with, on top
                                    of the run's (``dataset``: ``{"split": "eval"}``)
``hint(level)``     derived         text appended to the first observation when
                                    ``explore.guidance hint`` replays a failed group; called
                                    after ``reset``, ``level`` from 1 (the least help) to
                                    ``explore.hint_levels`` (the most); None or "": the hint
                                    derived from the reference player (trainer/guidance.py)
==================  ==============  ===========================================================

``reference_player()`` (default: the built-in player for the env's name, else none) returns a
scripted player (``reset``/``act``, envs/reference.py) for this env; it is called after
``reset`` and may read the env's hidden state (an oracle). Scripted demonstrations
(``sft.env_demos``) and guidance read it through ``envs.reference.reference_player``.

``policy_metrics(score)`` (default: none) measures the policy itself at each evaluation:
``score(messages, reply)`` is the log-probability that the policy answers a chat with exactly
``reply``; what it returns (name -> number) is logged as ``eval/NAME`` and kept with the
before/after results (Kuhn Poker: its exploitability, envs/kuhn.py).

Games with several seats (self-play, docs/selfplay.md): an env whose ``seats`` (a tuple of
two or more role names) is non-empty is played by the policy in every seat at once; one game
gives one episode per seat, each seat's replies trained under its own mask with its own
reward, the other seats' moves reaching it as environment text. Such an env also has
``seat_to_move`` (the seat whose reply the next ``step`` takes; read after ``reset`` and after
every step that is not done), ``observe(seat) -> str`` (what that seat reads before its next
move, or at the end), and, when a step ends the game, ``info["seats"]``: seat -> a dict with
that seat's ``reward`` and the info of its episode (``outcome``, ``success``, ...).
``zero_sum = True`` (class attribute) makes the turn loop flag a finished game whose rewards
do not sum to zero (``info["zero_sum_violation"]``). An env without ``seats`` is
single-agent, as before. ``set_opponent(player)`` (optional) hands a single-agent game an
outside player (a frozen past policy: ``turnrl.selfplay``) for its other seat.
``eval_opponents`` (a tuple of ``opponent`` option values) names the fixed opponents a run
trained against ``self`` or ``pool`` is evaluated against, one row each.
``choose_for_seed(seed)`` (optional) is called on a new env before anything else, with the
seed its ``reset`` will get: an env that picks what it plays from the seed (a mix,
envs/mix.py) picks then, so its ``seats`` and ``cooperative`` are the chosen game's.

``StepResult.info`` keys the framework reads (any others are kept with the episode, made
JSON-safe): ``success`` (bool, a solved episode for evaluation) and ``state_key`` (above).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from turnrl.config.env_plan import OUTSIDE_OPPONENTS


def eval_options(env: Any) -> dict[str, Any]:
    """Options evaluation builds the env with on top of the run's (a dataset's held-out
    split: ``{"split": "eval"}``); {} for most envs."""
    return dict(getattr(env, "eval_options", None) or {})


def system_prompt(env: Any) -> Any:
    """The env's system message (None: none); the turn loop refuses one that is not text."""
    return getattr(env, "system_prompt", None)


def has_tools(env: Any) -> bool:
    return bool(getattr(env, "tools", None)) and hasattr(env, "tool_prompt")


def prompt_and_tools(env: Any, native_format: str | None
                     ) -> tuple[str | None, list[dict] | None]:
    """(system prompt, tool schemas for the template) of a freshly reset env. An env with
    ``tools`` and ``tool_prompt(native_format)`` (``ToolEnv``) is told the model's own call
    format (None: the template has none, and the env teaches a fallback itself)."""
    if has_tools(env):
        return env.tool_prompt(native_format)
    return system_prompt(env), None


def start_state(env: Any, observation: str) -> Any:
    """The state a reset env is in: its ``state_key`` when it has one, else the observation
    (the turn loop bounds it as text)."""
    return getattr(env, "state_key", observation)


def step_state(info: dict, observation: str) -> Any:
    """The state a step led to: ``info["state_key"]`` when given, else the observation."""
    return info.get("state_key", observation)


def hint(env: Any, level: int) -> str | None:
    """The env's own hint at ``level`` (None: it has none, or none at that level); read after
    ``reset``. One that is not text is refused with a one-line reason."""
    own = getattr(env, "hint", None)
    if not callable(own):
        return None
    text = own(level)
    if text is not None and not isinstance(text, str):
        raise TypeError(f"env hint({level}) returned {type(text).__name__}; return text or None")
    return text or None


def seats(env: Any) -> tuple[str, ...]:
    """The roles the policy plays in one game of ``env`` (empty: a single-agent env). Read
    once per game, after the env is built; a value that is not two or more distinct names is
    refused with one line."""
    value = getattr(env, "seats", ())
    if not value:
        return ()
    if (not isinstance(value, (tuple, list)) or len(value) < 2
            or not all(isinstance(s, str) and s for s in value) or len(set(value)) != len(value)):
        raise ValueError(f"env seats must be two or more distinct role names, got {value!r}")
    return tuple(value)


def chosen_for_seed(env: Any, seed: int) -> Any:
    """``env``, told (``choose_for_seed``) the seed of the game it is about to play, when it
    picks its game from the seed (a mix); any other env as it is."""
    choose = getattr(env, "choose_for_seed", None)
    if callable(choose):
        choose(seed)
    return env


def is_zero_sum(env: Any) -> bool:
    """Whether the env declares (``zero_sum = True``) that its seats' rewards sum to zero."""
    return getattr(env, "zero_sum", False) is True


def is_cooperative(env: Any) -> bool:
    """Whether ``env`` declares (class attribute ``cooperative = True``) that its reset and
    step never block their event loop: they await all waiting and do little work between."""
    return getattr(env, "cooperative", False) is True


def factory_options(factory: Callable[..., Any]) -> list[tuple[str, str]]:
    """(name, default) of each ``env.options`` keyword a factory takes ("" when required)."""
    options = []
    for p in inspect.signature(factory).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            options.append((f"{'*' if p.kind is p.VAR_POSITIONAL else '**'}{p.name}", ""))
        else:
            options.append((p.name, "" if p.default is p.empty else repr(p.default)))
    return options


def describe(name: str, factory: Callable[..., Any], env: Any | None) -> str:
    """What ``turnrl envs NAME`` prints: the env's doc, its options, and what an instance
    built with the default options declares (``env`` None: it could not be built)."""
    doc = inspect.getdoc(factory) or "(no docstring)"
    lines = [name, "", doc, "", "options (--env.options.NAME VALUE):"]
    options = factory_options(factory)
    lines += [f"  {opt} = {default}" if default else f"  {opt} (required)"
              for opt, default in options] or ["  (none)"]
    if env is None:
        return "\n".join(lines)
    lines += ["", "declares:"]
    prompt, _ = prompt_and_tools(env, None)  # as a template without a tool format shows it
    lines.append("  system_prompt:" if prompt else "  system_prompt: (none)")
    lines += [f"    {line}" for line in (prompt or "").splitlines()]
    if has_tools(env):
        tools = env.tools.values() if isinstance(env.tools, dict) else env.tools
        for tool in tools:
            summary = (getattr(tool, "description", "") or inspect.getdoc(tool) or "").strip()
            first = summary.splitlines()[0] if summary else ""
            lines.append(f"  tool {getattr(tool, 'name', tool)}: {first}")
    else:
        lines.append("  tools: (none)")
    lines.append(f"  cooperative: {is_cooperative(env)}")
    if seats(env):
        lines.append(f"  seats: {', '.join(seats(env))} (self-play: one episode per seat)")
    if hasattr(env, "state_key"):
        lines.append("  state_key: yes (names its states for GiGPO)")
    return "\n".join(lines)




def uses_pool(options: dict[str, Any]) -> bool:
    """Whether the env plays an outside player the trainer hands over: the pool of frozen
    past policies (``opponent: pool``), another local model (``opponent: model``) or an
    agent behind an OpenAI-compatible endpoint (``opponent: endpoint``)."""
    return options.get("opponent") in OUTSIDE_OPPONENTS


def fixed_opponent_options(env: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the env's first fixed opponent (``eval_opponents``) in place of
    ``self`` or ``pool``: what scripted demonstrations (``sft.env_demos``) of a self-play game
    play, the policy's role by the seed's parity. Other envs' options are returned as given."""
    opponents = getattr(env, "eval_opponents", ())
    if not (seats(env) or uses_pool(options)) or not opponents:
        return options
    return {**options, "opponent": opponents[0]}
