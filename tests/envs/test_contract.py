"""The env contract (turnrl/envs/contract.py) and ``turnrl envs NAME``."""

from __future__ import annotations

from turnrl.cli import main
from turnrl.envs import StepResult, register_env
from turnrl.envs.contract import (
    is_cooperative,
    prompt_and_tools,
    start_state,
    step_state,
    system_prompt,
)


class Bare:
    async def reset(self, seed: int) -> str:
        return "start"

    async def step(self, action: str) -> StepResult:
        return StepResult("", 0.0, True)


class Declaring(Bare):
    system_prompt = "Be brief."
    cooperative = True
    state_key = "s0"


def test_an_env_with_only_reset_and_step_gets_every_default():
    env = Bare()
    assert system_prompt(env) is None and prompt_and_tools(env, "json") == (None, None)
    assert not is_cooperative(env)
    assert start_state(env, "obs") == "obs" and step_state({}, "next") == "next"


def test_declared_attributes_are_read_and_only_a_true_cooperative_counts():
    env = Declaring()
    assert system_prompt(env) == "Be brief." and prompt_and_tools(env, None) == ("Be brief.", None)
    assert is_cooperative(env) and start_state(env, "obs") == "s0"
    assert step_state({"state_key": 3}, "next") == 3
    env.cooperative = "yes"  # truthy is not a promise
    assert not is_cooperative(env)


@register_env("contract-needs-option")
def needs_option(secret: int, rounds: int = 2):
    """An env whose factory needs an option."""
    return Declaring()


def test_turnrl_envs_name_describes_options_prompt_and_tools(capsys):
    assert main(["envs", "guess-number"]) == 0
    out = capsys.readouterr().out
    assert "low = 1" in out and "max_turns = 5" in out
    assert "cooperative: True" in out and "number guessing game" in out
    assert main(["envs", "tool-arithmetic"]) == 0
    out = capsys.readouterr().out
    assert "tool calculator: Evaluate an arithmetic expression" in out
    assert main(["envs", "contract-needs-option"]) == 0
    out = capsys.readouterr().out
    assert "secret (required)" in out and "rounds = 2" in out and "not built" in out
    assert main(["envs"]) == 0
    assert "contract-needs-option" in capsys.readouterr().out


def test_turnrl_envs_with_an_unknown_name_says_the_closest(capsys):
    assert main(["envs", "guess-numbr"]) == 2
    assert "did you mean 'guess-number'" in capsys.readouterr().err
