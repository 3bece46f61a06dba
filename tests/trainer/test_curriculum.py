"""Curricula and mixtures (docs/curriculum.md): a difficulty knob that follows training
success, and several envs in one run with per-env metrics and evaluation rows."""

from __future__ import annotations

import json

import pytest

from turnrl.config import ConfigError, load_config
from turnrl.envs import StepResult, register_env
from turnrl.envs.mix import mix_choice
from turnrl.evaluation import EvalResult
from turnrl.metrics import read_metrics
from turnrl.policy import env_factories, training_seeds
from turnrl.serve.source import ServedSource
from turnrl.trainer import LocalSource, learn
from turnrl.trainer.curriculum import next_level
from turnrl.types import read_episodes

TINY = ["--model.name", "tiny", "--rollout.max_new_tokens", "2", "--rollout.max_turns", "1",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.progress", "false",
        "--run.tensorboard", "false", "--run.threads", "1", "--run.sample_episodes", "4"]


class Fixed:
    """One turn; whatever the reply, solved iff ``solved`` (reward 1 or 0)."""

    cooperative = True

    def __init__(self, solved: bool):
        self.solved = solved

    async def reset(self, seed: int) -> str:
        return "Say anything."

    async def step(self, action: str) -> StepResult:
        return StepResult("", float(self.solved), True, {"success": self.solved})


@register_env("test-knob")
def knob(difficulty: int = 0) -> Fixed:
    """Solved at difficulty 0 and 1 by any reply, never at 2 or more."""
    return Fixed(difficulty < 2)


@register_env("test-always")
def always() -> Fixed:
    return Fixed(True)


@register_env("test-never")
def never() -> Fixed:
    return Fixed(False)


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(("level", "success", "expected"), [
    (0, 0.9, 1),    # above the band: harder
    (1, 0.81, 2),
    (2, 0.95, 2),   # already the hardest: stays
    (2, 0.1, 1),    # below the band: easier
    (0, 0.0, 0),    # already the easiest: stays
    (1, 0.5, 1),    # inside the band: stays
    (1, 0.3, 1),    # the band's edges count as inside
    (1, 0.8, 1),
])
def test_next_level_moves_out_of_the_band_and_stops_at_the_ends(level, success, expected):
    assert next_level(level, 3, success, (0.3, 0.8)) == expected


def test_one_level_never_moves():
    assert next_level(0, 1, 1.0, (0.3, 0.8)) == 0
    assert next_level(0, 1, 0.0, (0.3, 0.8)) == 0


# --------------------------------------------------------------------------- bad input


def _config(*args):
    return load_config(None, ["--model.name", "tiny", *args])


CURRICULUM = ["--env.name", "test-knob", "--env.curriculum.option", "difficulty"]


@pytest.mark.parametrize(("args", "says"), [
    (CURRICULUM + ["--env.curriculum.levels", "[]"], "levels must be a non-empty list"),
    (CURRICULUM, "levels must be a non-empty list"),
    (CURRICULUM + ["--env.curriculum.levels", "3"], "levels must be a non-empty list"),
    (["--env.curriculum.levels", "[1, 2]"], "option must name the env option"),
    (CURRICULUM + ["--env.curriculum.levels", "[0, 2]", "--env.curriculum.band", "[0.8, 0.3]"],
     "band must be [low, high]"),
    (CURRICULUM + ["--env.curriculum.levels", "[0, 2]", "--env.curriculum.window", "0"],
     "window must be a whole number"),
    (CURRICULUM + ["--env.curriculum.levels", "[0, 2]", "--env.curriculum.step", "2"],
     "unknown key 'step'"),
    (CURRICULUM + ["--env.curriculum.levels", "[0, 2]", "--env.options.difficulty", "1"],
     "env.options.difficulty is set by env.curriculum"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always, weight: 0}]"], "weight must be"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always, weight: 0}, "
      "{name: test-never, weight: 0}]"], "env.mix[0].weight must be a finite number > 0"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always}, {name: test-never, weight: -1}]"],
     "env.mix[1].weight must be a finite number > 0"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always, weight: lots}]"],
     "weight must be a finite number > 0"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always}, {name: test-always}]"],
     "'test-always' appears twice"),
    (["--env.name", "mix", "--env.mix", "[{weight: 2}]"], "env.mix[0].name must be"),
    (["--env.name", "mix", "--env.mix", "[test-always]"], "env.mix[0] must be a mapping"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always, wieght: 2}]"], "unknown key"),
    (["--env.name", "mix", "--env.mix", "[{name:test-always}]"],
     "YAML needs a space after the colon"),
    (["--env.name", "mix", "--env.mix", "{name: test-always}"], "env.mix: expected list"),
    (["--env.name", "mix"], "env.name mix needs env.mix, a list of {name, options, weight} "
     "entries"),
    # review: an infinite weight, or finite ones summing past the largest float, drew NaNs
    (["--env.name", "mix", "--env.mix", "[{name: test-always, weight: .inf}]"],
     "env.mix[0].weight must be a finite number > 0, got inf"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always}, {name: test-never, weight: "
      "-.inf}]"], "env.mix[1].weight must be a finite number > 0"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always, weight: 1.0e308}, "
      "{name: test-never, weight: 1e308}]"], "env.mix: the weights sum past the largest"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always, weight: nan}]"],
     "env.mix[0].weight must be a finite number > 0, got nan"),
    (["--env.mix", "[{name: test-always}]"], "set --env.name mix"),
    (["--env.name", "mix", "--env.mix", "[{name: test-always}]", "--env.options.x", "1"],
     "env.options is unused with env.mix"),
])
def test_a_bad_curriculum_or_mix_fails_in_one_line(args, says):
    with pytest.raises(ConfigError) as err:
        _config(*args)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("args", [
    ["--env.name", "mix", "--env.mix", "[{name: test-always}]"],
    CURRICULUM + ["--env.curriculum.levels", "[0, 2]"],
])
def test_train_agent_refuses_an_env_plan_it_would_ignore(args):
    with pytest.raises(ConfigError, match="train_agent plays its own tasks"):
        ServedSource(lambda *a: None, ["a task"], _config(*args))


@pytest.mark.parametrize(("args", "says"), [
    (["--env.name", "mix", "--env.mix", "[{name: test-always}, {name: test-nevr}]"],
     "env.mix[1]: unknown environment 'test-nevr'; did you mean 'test-never'?"),
    (["--env.name", "mix", "--env.mix", "[{name: test-knob, options: {hardness: 1}}]"],
     "env.mix[0]: bad env.options for 'test-knob'"),
    (["--env.name", "test-always", "--env.curriculum.option", "difficulty",
      "--env.curriculum.levels", "[0, 1]"],
     "env.curriculum level 0 (difficulty=0): bad env.options for 'test-always'"),
    (["--env.name", "guess-number", "--env.curriculum.option", "hgih",
      "--env.curriculum.levels", "[10, 100]"],
     "env.curriculum level 0 (hgih=10): bad env.options for 'guess-number'"),
])
def test_an_env_the_plan_cannot_build_fails_at_start_up_naming_the_key(args, says):
    with pytest.raises(ValueError) as err:
        env_factories(_config(*args))
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


@pytest.mark.parametrize(("option", "levels", "says"), [
    ("max_term", "[2, 3]", "level 0 (max_term=2): bad env.options for 'reasoning-gym': "
     "BasicArithmeticDatasetConfig.__init__() got an unexpected keyword argument 'max_term'"),
    ("max_terms", "[2, 3, 1]", "level 2 (max_terms=1): bad env.options for 'reasoning-gym': "
     "max_terms must be >= min_terms"),
])
def test_a_reasoning_gym_knob_its_generator_rejects_fails_at_start_up(option, levels, says):
    pytest.importorskip("reasoning_gym")
    cfg = _config("--env.name", "reasoning-gym", "--env.curriculum.option", option,
                  "--env.curriculum.levels", levels)
    with pytest.raises(ValueError) as err:
        env_factories(cfg)
    assert str(err.value) == f"env.curriculum {says}"


# --------------------------------------------------------------------------- curriculum runs

KNOB = TINY + ["--env.name", "test-knob", "--env.curriculum.option", "difficulty",
               "--env.curriculum.levels", "[0, 1, 2]", "--env.curriculum.window", "2",
               "--eval.episodes", "2", "--run.checkpoint_every", "0"]


def _levels(run_dir):
    return [(row["step"], row["curriculum/level"], row["curriculum/move"])
            for row in read_metrics(run_dir / "metrics.jsonl")]


def test_the_level_follows_training_success_and_resume_keeps_it(tmp_path):
    whole = tmp_path / "whole"
    result = learn(load_config(None, KNOB + ["--run.steps", "7", "--run.out_dir", str(whole)]),
                   LocalSource())
    # Levels 0 and 1 are always solved (success 1 > 0.8: up after each 2-step window), level 2
    # never (0 < 0.3: down).
    assert _levels(whole) == [(1, 0, 0), (2, 0, 1), (3, 1, 0), (4, 1, 1), (5, 2, 0),
                              (6, 2, -1), (7, 1, 0)]
    rows = read_metrics(whole / "metrics.jsonl")
    assert [r["curriculum/value"] for r in rows] == [0, 0, 1, 1, 2, 2, 1]
    assert [r["curriculum/success"] for r in rows] == [1, 1, 1, 1, 0, 0, 1]
    assert [r["success/rate"] for r in rows] == [1, 1, 1, 1, 0, 0, 1]
    # Evaluation plays the hardest level, before and after: never solved here.
    assert result.before.successes == 0 == result.after.successes
    assert result.before.episodes == 2
    assert "test-knob at difficulty=2 (the hardest level): 2 held-out episodes" in result.table

    # Stopped after step 3, mid-window at level 1, then resumed: the same levels.
    split = tmp_path / "split"
    learn(load_config(None, KNOB + ["--run.steps", "3", "--run.out_dir", str(split)]),
          LocalSource())
    state = json.loads(next(split.glob("checkpoints/step-*/state.json")).read_text())
    assert state["curriculum"] == {"level": 1, "window": [1.0]}
    learn(load_config(None, KNOB + ["--run.steps", "7", "--run.out_dir", str(split)]),
          LocalSource(), resume=True)
    assert _levels(split) == _levels(whole)


# --------------------------------------------------------------------------- mixtures

MIX = TINY + ["--env.name", "mix", "--env.mix",
              "[{name: test-always, weight: 3}, {name: test-never, weight: 1}]"]


def test_numbers_yaml_reads_as_text_are_the_numbers_they_spell():
    """YAML 1.1 reads 1e-1 and 3E0 as text (its exponents need a dot and a sign): as a weight
    or a band edge they were refused as 'not a number'."""
    cfg = _config("--env.name", "mix", "--env.mix",
                  "[{name: test-always, weight: 3E0}, {name: test-never, weight: 1e0}]")
    assert [e.weight for e in cfg.env.mix_plan()] == [3.0, 1.0]
    cfg = _config(*CURRICULUM, "--env.curriculum.levels", "[0, 2]", "--env.curriculum.band",
                  "[3e-1, 8e-1]")
    assert cfg.env.curriculum_plan().band == (0.3, 0.8)
    with pytest.raises(ConfigError, match="weight must be a finite number > 0, got 'lots'"):
        _config("--env.name", "mix", "--env.mix", "[{name: test-always, weight: lots}]")


def test_groups_are_drawn_by_weight_deterministically():
    cfg = load_config(None, MIX + ["--rollout.groups_per_step", "8", "--run.seed", "5"])
    seeds = [seed for step in range(100) for seed, _ in training_seeds(cfg, step)[::2]]
    draws = [mix_choice([3.0, 1.0], cfg.run.seed, seed) for seed in seeds]
    assert len(draws) == 800
    first = draws.count(0)
    assert abs(first - 600) < 3 * (800 * 0.75 * 0.25) ** 0.5  # within 3 sigma of 3:1
    assert draws == [mix_choice([3.0, 1.0], 5, seed) for seed in seeds]  # the same again
    other = [mix_choice([3.0, 1.0], 6, seed) for seed in seeds]
    assert other != draws  # another run seed, another draw
    assert [mix_choice([1.0, 1e-9, 1.0], 0, s) for s in range(200)].count(1) == 0


def test_a_mix_plays_each_groups_env_and_logs_and_evaluates_per_env(tmp_path):
    out = tmp_path / "mix"
    result = learn(load_config(None, MIX + ["--rollout.groups_per_step", "4", "--run.steps", "2",
                                            "--eval.episodes", "3", "--eval.every", "1",
                                            "--run.out_dir", str(out)]),
                   LocalSource())
    rows = read_metrics(out / "metrics.jsonl")
    for row in rows:
        played = {label: row.get(f"env/{label}/episodes", 0)
                  for label in ("test-always", "test-never")}
        assert sum(played.values()) == 8  # 4 groups of 2
        # The label drawn for the seed is the env that played it: one always solves.
        if played["test-always"]:
            assert row["env/test-always/success"] == 1 == row["env/test-always/reward"]
        if played["test-never"]:
            assert row["env/test-never/success"] == 0 == row["env/test-never/reward"]
        assert row["success/rate"] == played["test-always"] / 8
    assert (rows[0]["eval/test-always/success"], rows[0]["eval/test-never/success"]) == (1, 0)
    episodes = read_episodes(out / "episodes" / "step-000001.jsonl")
    assert {ep.env for ep in episodes} <= {"test-always", "test-never"}
    assert all(ep.success == (ep.env == "test-always") for ep in episodes)

    # Evaluation: every env on the same held-out seeds, pooled and per env.
    for when, evaluated in (("before", result.before), ("after", result.after)):
        assert evaluated.per_env["test-always"].successes == 3
        assert evaluated.per_env["test-never"].successes == 0
        assert (evaluated.episodes, evaluated.successes) == (6, 3)
        saved = json.loads((out / f"eval_{when}.json").read_text())
        assert saved["per_env"]["test-always"]["success_rate"] == 1.0
        assert saved["per_env"]["test-never"]["episodes"] == 3
    assert "mix of test-always, test-never: 3 held-out episodes per env" in result.table
    for label in ("test-always before", "test-always after", "test-never before",
                  "test-never after"):
        assert label in result.table


def test_per_env_metrics_count_every_played_group_even_those_dynamic_sampling_drops(tmp_path):
    out = tmp_path / "dynamic"
    learn(load_config(None, MIX + ["--run.steps", "1", "--eval.episodes", "0",
                                   "--explore.dynamic_sampling", "true",
                                   "--explore.dynamic_max_rounds", "2",
                                   "--run.out_dir", str(out)]), LocalSource())
    row = read_metrics(out / "metrics.jsonl")[0]
    # No group has a signal (each env always or never solves): 1 + 2 rounds of 2 groups.
    assert row["dynamic/collected_groups"] == 6
    played = row.get("env/test-always/episodes", 0) + row.get("env/test-never/episodes", 0)
    assert played == 12


def test_a_saved_per_env_evaluation_reads_back_whole_and_a_single_env_file_is_unchanged():
    one = EvalResult(episodes=4, successes=3, mean_reward=0.75, mean_turns=1.0, failed=0)
    other = EvalResult(episodes=4, successes=0, mean_reward=0.0, mean_turns=2.0, failed=1)
    pooled = EvalResult(episodes=8, successes=3, mean_reward=0.375, mean_turns=1.5, failed=1,
                        per_env={"a": one, "b": other})
    again = EvalResult.from_dict(json.loads(json.dumps(pooled.to_dict())))
    assert again == pooled and again.per_env["b"].failed == 1
    assert "per_env" not in one.to_dict()
    assert EvalResult.from_dict(one.to_dict()) == one
