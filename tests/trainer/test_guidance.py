"""Guidance for all-failed groups (explore.guidance): which groups fire, the demonstration's
tokens and "old" log-probs, hints in the prompt, and a task the tiny model learns only with it."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import local_ray
from turnrl.algorithms.replay import failed_groups
from turnrl.config import ConfigError, load_config
from turnrl.envs import StepResult, register_env
from turnrl.metrics import read_metrics
from turnrl.models import tiny_tokenizer
from turnrl.rollout import run_sync
from turnrl.trainer import train
from turnrl.trainer.guidance import (
    Guidance,
    HintLevels,
    derived_hint,
    next_hint_level,
)
from turnrl.types import Episode, read_episodes


@register_env("say-seven")
class SaySeven:
    """Success only for a reply that starts with 777: the tiny model (355 characters, each
    token one) says it about once in 10^4 tries, so its groups all fail."""

    cooperative = True

    async def reset(self, seed: int) -> str:
        return "Say the secret digit."

    async def step(self, action: str) -> StepResult:
        ok = action.strip().startswith("777")
        return StepResult("", float(ok), True, {"success": ok})

    def reference_player(self):
        class Oracle:
            def reset(self, first_observation):
                pass

            def act(self, observation):
                return "777"
        return Oracle()


@register_env("say-seven-thrice")
class SaySevenThrice:
    """Three turns, each paying 0.25 for a reply starting with 777 (success: all three); the
    state is how many were said so far. A plain-``def`` env: guidance must take both kinds."""

    state_key = "said 0"

    def reset(self, seed: int) -> str:
        self.said = self.turn = 0
        self.state_key = "said 0"
        return "Say the secret digit, three times."

    def step(self, action: str) -> StepResult:
        self.turn += 1
        ok = action.strip().startswith("777")
        self.said += ok
        done = self.turn == 3
        return StepResult("" if done else f"Again ({self.turn} of 3).", 0.25 * ok, done,
                          {"success": done and self.said == 3, "state_key": f"said {self.said}"})

    def reference_player(self):
        return SaySeven().reference_player()


@register_env("say-seven-hinted")
class SaySevenOwnHints(SaySeven):
    """No reference player, but hints of its own, one per level."""

    reference_player = None

    def hint(self, level: int) -> str:
        return f"Level {level} hint: the digit is 7."


@register_env("say-seven-bad-hint")
class SaySevenBadHint(SaySevenOwnHints):
    def hint(self, level: int):
        return level


@register_env("say-seven-lost-player")
class SaySevenLostPlayer(SaySeven):
    """A reference player that says the wrong thing."""

    def reference_player(self):
        player = SaySeven().reference_player()
        player.act = lambda observation: "778"
        return player


@register_env("say-seven-unguided")
class SaySevenNoPlayer(SaySeven):
    reference_player = None


def _ep(group: int, reward: float, success: bool = False) -> Episode:
    return Episode(env="e", seed=10 + group, group=group, reward=reward, success=success)


def test_only_groups_without_any_signal_fire():
    episodes = [_ep(0, 0.0), _ep(0, 0.0), _ep(1, 0.0), _ep(1, 1.0, True),
                _ep(2, 0.3), _ep(2, 0.5), _ep(3, -1.0), _ep(3, -1.0)]
    assert failed_groups(episodes) == [(0, 10), (3, 13)]


def _cfg(tmp_path, name, *more):
    return load_config(None, [
        "--model.name", "tiny", "--env.name", name, "--rollout.max_new_tokens", "4",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "2", "--optim.lr", "5e-3",
        "--eval.episodes", "32", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.sample_episodes", "16", "--run.out_dir", str(tmp_path / name), *more])


def test_guided_demonstrations_give_a_signal_and_read_as_no_mismatch(tmp_path):
    train(_cfg(tmp_path / "demo", "say-seven", "--run.steps", "1", "--explore.guidance",
               "demo"))
    train(_cfg(tmp_path / "off", "say-seven", "--run.steps", "1"))
    (guided,), (plain,) = (read_metrics(tmp_path / r / "say-seven" / "metrics.jsonl")
                           for r in ("demo", "off"))
    assert guided["guide/fired_groups"] == 2 and guided["guide/episodes"] == 2
    assert guided["guide/success"] == 1.0
    assert guided["grad_norm"] > 0 and plain["grad_norm"] == 0  # no signal without guidance
    # the demonstration's "old" log-probs are the learner's own: no mismatch measured
    assert guided["mismatch/kl"] < 1e-4
    episodes = read_episodes(tmp_path / "demo" / "say-seven" / "episodes" / "step-000001.jsonl")
    demos = [ep for ep in episodes if ep.info.get("guided") == "demo"]
    assert len(demos) == 2 and all(ep.success and ep.reward == 1.0 for ep in demos)
    for ep in demos:  # only the reply is trained: "777" and the end of turn
        assert ep.turns[0].action == "777"
        trained = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m]
        assert trained == tiny_tokenizer()("777", add_special_tokens=False)["input_ids"] + [
            tiny_tokenizer().eos_token_id]
        assert all(lp < 0 for lp, m in zip(ep.logprobs, ep.loss_mask, strict=True) if m)


@pytest.mark.parametrize("advantage", ["gigpo", "turn_gae"])
def test_a_demonstration_carries_the_env_s_own_turn_rewards_states_and_end(tmp_path,
                                                                         advantage):
    """Played through the turn loop, a demonstration's turns are the env's: its per-turn
    rewards and state keys, which turn-level estimators credit, and its end reason."""
    train(_cfg(tmp_path, "say-seven-thrice", "--run.steps", "1", "--explore.guidance", "demo",
               "--algo.advantage", advantage, "--rollout.max_turns", "3",
               "--eval.episodes", "0"))
    (row,) = read_metrics(tmp_path / "say-seven-thrice" / "metrics.jsonl")
    assert row["guide/episodes"] == 2 and row["guide/success"] == 1.0 and row["grad_norm"] > 0
    episodes = read_episodes(tmp_path / "say-seven-thrice" / "episodes" / "step-000001.jsonl")
    demos = [ep for ep in episodes if ep.info.get("guided") == "demo"]
    assert len(demos) == 2
    for ep in demos:
        assert [t.reward for t in ep.turns] == [0.25, 0.25, 0.25] and ep.reward == 0.75
        assert [t.state for t in ep.turns] == ["said 0", "said 1", "said 2"]
        assert [t.observation for t in ep.turns] == ["Again (1 of 3).", "Again (2 of 3).", ""]
        assert (ep.status, ep.end_reason) == ("done", "done")
        assert sum(ep.loss_mask) == 3 * 4  # three replies of "777" and their end of turn
    own = [ep for ep in episodes if "guided" not in ep.info]
    assert all(not ep.success for ep in own)


def test_a_frozen_lake_demonstration_is_the_env_s_own_episode(tmp_path):
    """Through the gymnasium adapter: the demonstration's turns hold what the env itself
    returns to the player's moves, state by state (replayed here without the turn loop)."""
    pytest.importorskip("gymnasium")
    from turnrl.envs import make_env
    from turnrl.envs.contract import start_state
    from turnrl.envs.reference import reference_player

    lake = ["--env.options.game", "FrozenLake-v1", "--env.options.is_slippery", "false"]
    train(_cfg(tmp_path, "gymnasium", "--run.steps", "1", "--explore.guidance", "demo",
               "--algo.advantage", "gigpo", "--rollout.max_turns", "12",
               "--rollout.max_new_tokens", "6", "--eval.episodes", "0", *lake))
    episodes = read_episodes(tmp_path / "gymnasium" / "episodes" / "step-000001.jsonl")
    demos = [ep for ep in episodes if ep.info.get("guided") == "demo"]
    assert demos and all(ep.success and ep.status == "done" for ep in demos)
    for ep in demos:
        env = make_env("gymnasium", game="FrozenLake-v1", is_slippery=False)
        observation = run_sync(env.reset(ep.seed))
        player = reference_player(env, "gymnasium")
        player.reset(observation)
        expected, state = [], str(start_state(env, observation))
        for _ in ep.turns:
            action = player.act(observation)
            result = run_sync(env.step(action))
            expected.append((action, result.reward, state))
            observation, state = result.observation, str(result.info["state_key"])
        assert [(t.action, t.reward, t.state) for t in ep.turns] == expected
        assert len(ep.turns) >= 6 and ep.turns[-1].reward == 1.0 and ep.reward == 1.0


def test_one_hint_level_is_the_player_s_whole_first_reply(tmp_path):
    train(_cfg(tmp_path, "say-seven", "--run.steps", "1", "--explore.guidance", "hint",
               "--explore.guidance_attempts", "3", "--explore.hint_levels", "1"))
    (row,) = read_metrics(tmp_path / "say-seven" / "metrics.jsonl")
    assert row["guide/fired_groups"] == 2 and row["guide/episodes"] == 6
    assert row["guide/hint_level"] == 1.0
    text = [tiny_tokenizer().decode(ep.token_ids) for ep in read_episodes(
        tmp_path / "say-seven" / "episodes" / "step-000001.jsonl") if ep.info.get("guided")]
    assert len(text) == 6 and all("Hint: a good first reply here is: 777" in t for t in text)


def test_the_hint_level_climbs_one_step_per_failure_and_falls_one_per_success():
    """The staircase on a hand-built run of outcomes (False: the hinted group failed)."""
    outcomes = [False, False, False, False, True, True, True, False, True]
    level, seen = 1, []
    for solved in outcomes:
        level = next_hint_level(level, solved, 3)
        seen.append(level)
    assert seen == [2, 3, 3, 3, 2, 1, 1, 2, 1]
    assert next_hint_level(1, False, 1) == 1  # one level: nowhere to go
    assert next_hint_level(5, True, 3) == 3  # a level from a run with more levels is capped


def test_each_task_keeps_its_own_level_and_the_book_stays_bounded():
    levels = HintLevels(4)
    for key, solved in [("a", False), ("b", False), ("a", False), ("a", True), ("b", False),
                        ("b", False), ("b", False)]:
        levels.record(key, solved)
    assert (levels.level("a"), levels.level("b"), levels.level("new")) == (2, 4, 1)
    resumed = Guidance("hint", 2, 3, {"hint_levels": levels.state_dict()})
    assert resumed.hint_levels.level_of == {"a": 2, "b": 3}  # a smaller top level caps them
    assert resumed.state_dict() == {"hint_levels": {"a": 2, "b": 3}}
    assert Guidance("demo", 2, 3).state_dict() == {}
    levels.MAX_TASKS = 2
    levels.record("c", False)
    assert list(levels.level_of) == ["b", "c"]  # the task seen longest ago goes first


def test_a_derived_hint_shows_a_growing_share_of_the_first_reply():
    assert [derived_hint("777", level, 3) for level in (1, 2, 3)] == [
        "Hint: a good first reply here starts with: 7",
        "Hint: a good first reply here starts with: 77",
        "Hint: a good first reply here is: 777"]
    assert derived_hint("search(x)", 1, 4).endswith("starts with: sea")
    assert derived_hint("42", 5, 3).endswith("is: 42")


def test_in_training_each_hinted_group_gets_the_level_its_task_s_history_set(tmp_path):
    """Every say-seven seed has the same prompt, so it is one task: each hinted group's
    level must be the staircase's over the outcomes before it, in order."""
    train(_cfg(tmp_path, "say-seven", "--run.steps", "3", "--explore.guidance", "hint",
               "--eval.episodes", "0"))
    rows = read_metrics(tmp_path / "say-seven" / "metrics.jsonl")
    level, known, every_level = 1, False, []
    for step, row in enumerate(rows, 1):
        episodes = read_episodes(tmp_path / "say-seven" / "episodes" /
                                 f"step-{step:06d}.jsonl")
        if known and any(ep.success for ep in episodes if "guided" not in ep.info):
            level = next_hint_level(level, True, 3)
        groups: dict[int, list] = {}
        for ep in episodes:
            if ep.info.get("guided"):
                groups.setdefault(ep.group, []).append(ep)
        used = []
        for eps in groups.values():
            assert len(eps) == 2 and all(ep.info["hint_level"] == level for ep in eps)
            prompt = tiny_tokenizer().decode(eps[0].token_ids[:eps[0].turns[0].start])
            assert re.search(r"Hint: [^<]*", prompt).group(0) == derived_hint("777", level, 3)
            used.append(level)
            level, known = next_hint_level(level, any(ep.success for ep in eps), 3), True
        every_level += used
        assert row["guide/hint_level"] == (sum(used) / len(used) if used else 0.0)
    assert max(every_level) == 3  # the tiny model fails at levels 1 and 2: help rises
    (checkpoint,) = (tmp_path / "say-seven" / "checkpoints").glob("step-000003")
    saved = json.loads((checkpoint / "state.json").read_text())["hint_levels"]
    assert list(saved.values()) == [level]  # one task, where the staircase left it


def test_an_env_s_own_hints_need_no_reference_player(tmp_path):
    train(_cfg(tmp_path, "say-seven-hinted", "--run.steps", "1", "--explore.guidance", "hint",
               "--eval.episodes", "0"))
    episodes = read_episodes(tmp_path / "say-seven-hinted" / "episodes" / "step-000001.jsonl")
    hinted = [ep for ep in episodes if ep.info.get("guided")]
    assert len(hinted) == 4
    text = [tiny_tokenizer().decode(ep.token_ids) for ep in hinted]
    # both groups are one task: the first hinted at level 1, the next (after it failed) at 2
    assert sorted({ep.info["hint_level"] for ep in hinted}) == [1, 2]
    for ep, t in zip(hinted, text, strict=True):
        assert f"Level {ep.info['hint_level']} hint: the digit is 7." in t


def test_a_hint_that_is_not_text_is_named_once_and_training_goes_on(tmp_path):
    with pytest.warns(UserWarning, match=r"its hint failed: TypeError: env hint\(1\) returned "
                      "int; return text or None"):
        train(_cfg(tmp_path, "say-seven-bad-hint", "--run.steps", "1", "--explore.guidance",
                   "hint", "--eval.episodes", "0"))
    (row,) = read_metrics(tmp_path / "say-seven-bad-hint" / "metrics.jsonl")
    assert row["guide/episodes"] == 0


def test_an_env_without_a_player_warns_once_and_trains(tmp_path):
    with pytest.warns(UserWarning, match="env 'say-seven-unguided' cannot be guided"):
        train(_cfg(tmp_path, "say-seven-unguided", "--run.steps", "2", "--explore.guidance",
                   "demo"))
    rows = read_metrics(tmp_path / "say-seven-unguided" / "metrics.jsonl")
    assert [r["guide/episodes"] for r in rows] == [0.0, 0.0]


def _async_source(tmp_path, *more):
    """A ``RaySource`` opened on a real run (tiny model) whose groups are played here, on the
    learner's engine, instead of arriving from Ray workers."""
    from turnrl.distributed.book import AssignmentBook
    from turnrl.distributed.source import RaySource
    from turnrl.policy import training_seeds
    from turnrl.rollout.loop import Group
    from turnrl.trainer.local import play_seeds
    from turnrl.trainer.run import start_run

    cfg = _cfg(tmp_path, "say-seven", "--run.mode", "async", "--eval.episodes", "0", *more)
    run = start_run(cfg, False, decoupled=True)
    source = RaySource(cfg, fleet=object(), book=AssignmentBook(lambda index: index))
    source.open(run)
    played = play_seeds(run, training_seeds(cfg, 0), run.policy.make_env)
    groups = [Group(g, played[g * 4].seed, [ep for ep in played if ep.group == g])
              for g in range(2)]
    source.take = lambda need: groups[:need]  # what the workers would have delivered
    return source, run


def test_a_player_that_fails_its_seeds_is_named_as_such(tmp_path):
    with pytest.warns(UserWarning, match="its reference player did not succeed on seed"):
        train(_cfg(tmp_path, "say-seven-lost-player", "--run.steps", "1",
                   "--explore.guidance", "demo", "--eval.episodes", "0"))
    (row,) = read_metrics(tmp_path / "say-seven-lost-player" / "metrics.jsonl")
    assert row["guide/episodes"] == 0


def test_in_async_mode_the_learner_guides_the_workers_failed_groups(tmp_path):
    source, run = _async_source(tmp_path, "--explore.guidance", "demo")
    episodes = source.collect(0)
    demos = [ep for ep in episodes if ep.info.get("guided") == "demo"]
    assert len(episodes) == 8 + 2 and len(demos) == 2
    assert source.guided["guide/fired_groups"] == 2 and source.guided["guide/success"] == 1.0
    # on-policy at the learner's version: no staleness, and the old log-probs are its own
    assert all(v == run.policy.engine.version for ep in demos
               for v, m in zip(ep.versions, ep.loss_mask, strict=True) if m)
    assert all(lp < 0 for ep in demos for lp, m in zip(ep.logprobs, ep.loss_mask,
                                                       strict=True) if m)
    assert "hint_levels" not in source.state_dict()


def test_in_async_mode_hint_levels_are_kept_with_the_checkpoint(tmp_path):
    source, _ = _async_source(tmp_path, "--explore.guidance", "hint")
    episodes = source.collect(0)
    hinted = [ep for ep in episodes if ep.info.get("guided") == "hint"]
    assert len(hinted) == 4 and [ep.info["hint_level"] for ep in hinted] == [1, 1, 2, 2]
    assert source.guided["guide/hint_level"] == 1.5  # one task: level 1 failed, then 2
    level = 1
    for group in (0, 1):
        level = next_hint_level(level, any(ep.success for ep in hinted if ep.group == group), 3)
    assert list(source.state_dict()["hint_levels"].values()) == [level]


@pytest.fixture(scope="module")
def ray_cluster():
    # the envs are registered by this module, which the workers cannot import: ship it
    with local_ray(sys.modules[__name__]) as ray:
        yield ray


@pytest.mark.slow
def test_async_training_with_ray_workers_gets_a_signal_only_with_guidance(ray_cluster,
                                                                         tmp_path):
    from turnrl.launch import train_async

    for mode in ("off", "demo"):
        train_async(_cfg(tmp_path / mode, "say-seven", "--run.mode", "async", "--run.steps", "2",
                         "--ray.num_workers", "1", "--eval.episodes", "0",
                         "--explore.guidance", mode))
    plain, guided = (read_metrics(tmp_path / m / "say-seven" / "metrics.jsonl")
                     for m in ("off", "demo"))
    assert all(r["grad_norm"] == 0 for r in plain)  # workers' groups alone: no signal
    assert all(r["guide/episodes"] == 2 and r["guide/success"] == 1.0 for r in guided)
    assert all(r["grad_norm"] > 0 and r["success/rate"] == 0.0 for r in guided)


@pytest.mark.slow
def test_the_tiny_model_learns_a_task_it_never_solves_only_with_guidance(tmp_path):
    results = {}
    for mode in ("off", "demo"):
        result = train(_cfg(tmp_path / mode, "say-seven", "--run.steps", "12",
                            "--optim.lr", "1e-2", "--explore.guidance", mode))
        results[mode] = (result.before.success_rate, result.after.success_rate)
    # measured: off 0.0% -> 0.0%; demo 0.0% -> 100.0% [89.3, 100] (32 held-out, 12 steps)
    assert results["off"][1] <= 0.125  # no signal: it stays where it was
    assert results["demo"][1] >= 0.5 > results["demo"][0]


def test_under_a_temperature_schedule_demonstrations_still_read_as_no_mismatch(tmp_path):
    """The "old" log-probs of a demonstration are scored at the update's temperature: the
    schedule's at step 2 (0.5 here), not rollout.temperature."""
    train(_cfg(tmp_path, "say-seven", "--run.steps", "2", "--explore.guidance", "demo",
               "--explore.temperature_schedule", "linear", "--explore.temperature_end", "0.5",
               "--eval.episodes", "0"))
    rows = read_metrics(tmp_path / "say-seven" / "metrics.jsonl")
    assert rows[1]["explore/temperature"] == 0.5 and rows[1]["guide/episodes"] == 2
    assert all(r["mismatch/kl"] < 1e-4 for r in rows)


def test_the_step_s_success_is_the_policy_s_own_not_the_demonstrations(tmp_path):
    train(_cfg(tmp_path, "say-seven", "--run.steps", "1", "--explore.guidance", "demo",
               "--eval.episodes", "0"))
    (row,) = read_metrics(tmp_path / "say-seven" / "metrics.jsonl")
    assert row["guide/success"] == 1.0 and row["success/rate"] == 0.0
    assert row["reward/mean"] == 0.0


def test_train_agent_refuses_guidance_in_one_line():
    from turnrl.serve.train import train_agent

    async def rollout(client, task):
        return 0.0

    cfg = load_config(None, ["--model.name", "tiny", "--explore.guidance", "demo"])
    with pytest.raises(ConfigError, match="explore.guidance demo works with turnrl train") as info:
        train_agent(rollout, ["task"], cfg)
    assert "\n" not in str(info.value)


def test_a_demonstration_longer_than_the_policy_may_write_is_left_out(tmp_path):
    with pytest.warns(UserWarning, match="more than rollout.max_new_tokens 2 lets the policy"):
        train(_cfg(tmp_path, "say-seven", "--run.steps", "1", "--explore.guidance", "demo",
                   "--rollout.max_new_tokens", "2"))
    (row,) = read_metrics(tmp_path / "say-seven" / "metrics.jsonl")
    assert row["guide/episodes"] == 0


# ---- review: players that break, mixes, tool calls in the model's own format -------------


def _replying(reply):
    """say-seven whose reference player answers ``reply`` (not text, for these tests)."""

    class Player:
        def reset(self, first_observation):
            pass

        def act(self, observation):
            return reply

    class Env(SaySeven):
        def reference_player(self):
            return Player()
    return Env


@pytest.mark.parametrize("mode, reply", [("demo", None), ("demo", 777), ("demo", ["777"]),
                                         ("hint", None), ("hint", ["777"])])
def test_a_player_that_replies_with_no_text_is_named_once_and_training_goes_on(
        tmp_path, mode, reply):
    """A reply that is not text used to crash the run deep in the tokenizer (demo: None or a
    number) or to train on garbage (a list); now the group trains unguided, named once."""
    name = f"say-seven-replies-{type(reply).__name__}"
    register_env(name)(_replying(reply))
    with pytest.warns(UserWarning, match=rf"act\(\) returned {type(reply).__name__}, not "
                      r"text; return the reply as a str") as caught:
        train(_cfg(tmp_path, name, "--run.steps", "2", "--explore.guidance", mode,
                   "--eval.episodes", "0"))
    assert sum("cannot be guided" in str(w.message) for w in caught) == 1
    rows = read_metrics(tmp_path / name / "metrics.jsonl")
    assert [r["guide/episodes"] for r in rows] == [0.0, 0.0]


MIXED = ["--env.name", "mix", "--env.mix",
         "[{name: guess-number, options: {high: 8}}, {name: say-seven, label: seven}]"]


@pytest.mark.parametrize("mode", ["demo", "hint"])
def test_in_a_mix_each_group_is_guided_by_its_own_env_s_player(tmp_path, mode):
    """A mix's env is drawn at reset: its groups used to get no guidance at all (demo: 'no
    reference player'; hint: none for an env whose player is built in by name)."""
    cfg = load_config(None, [
        "--model.name", "tiny", *MIXED, "--rollout.max_new_tokens", "4",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "4", "--rollout.max_turns",
        "6", "--eval.episodes", "0", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.sample_episodes", "64", "--run.out_dir", str(tmp_path), "--run.steps", "1",
        "--explore.guidance", mode])
    train(cfg)
    episodes = read_episodes(tmp_path / "episodes" / "step-000001.jsonl")
    own = {ep.group: ep.env for ep in episodes if "guided" not in ep.info}
    failed = {g for g in own if not any(ep.success for ep in episodes
                                        if ep.group == g and "guided" not in ep.info)}
    assert failed and set(own.values()) == {"guess-number", "seven"}  # both envs drawn
    guided = [ep for ep in episodes if ep.info.get("guided") == mode]
    assert {ep.group for ep in guided} == failed  # every failed group, whichever env
    assert all(ep.env == own[ep.group] for ep in guided)  # labelled as its group's env
    if mode == "demo":
        assert all(ep.success for ep in guided)
    else:  # the guess-number player's first guess (4, the middle of 1..8) shows in its hint
        for ep in guided:
            prompt = tiny_tokenizer().decode(ep.token_ids[:ep.turns[0].start])
            assert "Hint: a good first reply here" in prompt
            assert ("4" if ep.env == "guess-number" else "7") in prompt.split("Hint:")[1]


def test_a_tool_env_demonstration_calls_in_the_model_s_own_format(tmp_path):
    """Under a template with Llama-style JSON tool calls, the demonstration's call is that
    JSON, not the fallback <tool_call> tags it used to be (the player was built before the
    env learnt the model's format)."""
    from tests.rollout.test_tool_loop import LLAMA
    from turnrl.tools import parse_tool_calls

    template = tmp_path / "llama.jinja"
    template.write_text(LLAMA)
    train(_cfg(tmp_path, "tool-arithmetic", "--run.steps", "1", "--explore.guidance", "demo",
               "--model.chat_template", str(template), "--rollout.max_new_tokens", "96",
               "--rollout.max_turns", "3", "--rollout.group_size", "2", "--eval.episodes", "0"))
    episodes = read_episodes(tmp_path / "tool-arithmetic" / "episodes" / "step-000001.jsonl")
    demos = [ep for ep in episodes if ep.info.get("guided") == "demo"]
    assert len(demos) == 2 and all(ep.success for ep in demos)
    for ep in demos:
        call = ep.turns[0].action
        assert "<tool_call>" not in call and '"parameters"' in call
        (parsed,) = parse_tool_calls(call, "llama3-json")
        assert parsed.name == "calculator" and parsed.problem == ""
