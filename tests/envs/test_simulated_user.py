"""``simulated-user`` (envs/simulated_user.py): the scripted user's rule and the goal check,
a real local model user batched across episodes, an endpoint user that leaks the answer
(redacted: the policy never sees the hidden answer; the user never sees the scoring), one-line
refusals, and real training runs."""

from __future__ import annotations

import asyncio
import json
from functools import partial

import pytest

from tests.conftest import MovesEngine
from tests.helpers.judge_server import ChatServer
from turnrl.envs import make_env
from turnrl.envs.simulated_user import REDACTED, is_correct, names, redact, scripted_reply
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams
from turnrl.selfplay.endpoint import EndpointOpponent
from turnrl.selfplay.opponents import FrozenPolicy, ModelOpponent

QUESTIONS = ["fever?", "do you cough?", "any rash?", "answer: flu"]


def hidden(env) -> list[str]:
    """Every row's answer and aliases (what the policy must never read)."""
    return sorted({w for r in (*env.rows, *make_env("simulated-user", split="eval").rows)
                   for w in (r["answer"], *r.get("aliases", []))})


def env_text(tokenizer, episode) -> str:
    """What the policy read: the episode's tokens it did not write (system, user turns)."""
    return tokenizer.decode([t for t, m in zip(episode.token_ids, episode.loss_mask,
                                               strict=True) if not m])


def play(make, tokenizer, moves, seeds):
    chat = ChatFormat(tokenizer)
    return run_sync(run_episodes(
        make, [(s, i) for i, s in enumerate(seeds)], MovesEngine(tokenizer, moves), chat,
        SamplingParams(8, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="simulated-user",
        max_turns=8))


def test_the_scripted_user_answers_by_rule_and_the_goal_is_checked():
    facts, vocabulary = {"fever", "cough"}, {"fever", "cough", "rash"}
    assert scripted_reply("Do you have a fever?", facts, vocabulary) == "Yes."
    assert scripted_reply("rashes?", facts, vocabulary) == "No."
    assert scripted_reply("fever or rash?", facts, vocabulary).startswith("One thing")
    assert scripted_reply("how are you", facts, vocabulary).startswith("Sorry")
    row, choices = {"answer": "flu", "aliases": ["influenza"]}, ["cold", "flu", "allergy"]
    assert is_correct("Influenza.", row, choices) and is_correct("the flu", row, choices)
    assert not is_correct("flu or cold", row, choices)  # naming two choices is no answer
    assert not is_correct("cold", row, choices)
    env = make_env("simulated-user")
    first = asyncio.run(env.reset(0))
    row = env.row
    assert first == row["opening"] and row["goal"] not in env.system_prompt
    fact = row["facts"][0]
    assert asyncio.run(env.step(f"{fact}?")).observation == "Yes."
    step = asyncio.run(env.step(f"answer: {row['answer']}"))
    assert step.done and step.info["success"] and step.reward == pytest.approx(0.95)
    assert row["goal"] in step.info["judge_reference"]  # told to a judge, not to the policy
    asyncio.run(env.reset(0))
    wrong = next(c for c in env.choices if c != row["answer"])
    assert asyncio.run(env.step(f"answer: {wrong}"))[1:3] == (0.0, True)
    judged = make_env("simulated-user", reward="judge")
    asyncio.run(judged.reset(0))
    step = asyncio.run(judged.step(f"answer: {row['answer']}"))
    assert step.reward == 0.0 and step.info["success"]  # the judge's score is the reward


def test_the_reference_player_solves_every_task_against_the_scripted_user():
    for split in ("train", "eval"):
        env = make_env("simulated-user", split=split)
        for seed in range(len(env.rows)):
            observation = asyncio.run(env.reset(seed))
            player = env.reference_player()
            player.reset(observation)
            step = asyncio.run(env.step(player.act(observation)))
            while not step.done:
                step = asyncio.run(env.step(player.act(step.observation)))
            assert step.info["success"] and step.info["turns"] <= 5, env.row


def test_a_local_model_user_is_called_in_batches_across_episodes(tiny):
    model, tok = tiny
    chat = ChatFormat(tok)
    player = FrozenPolicy(model, chat, SamplingParams(6, 1.0, stop_token_ids=(
        chat.end_of_turn,)), 0, 3, label="model:tiny")
    user = ModelOpponent(player, seed=3)
    make = user.attach(partial(make_env, "simulated-user", opponent="model",
                               show_choices=False))
    episodes = play(make, tok, QUESTIONS, range(8))
    assert all(ep.status == "done" and ep.info["turns"] == 4 for ep in episodes)
    assert {ep.info["user"] for ep in episodes} == {"model:tiny"}
    calls = sum(player.moves.batch_sizes)
    assert calls == 8 * 3  # three questions in each of 8 episodes
    # lock-step turns: the 8 episodes' questions reach the user together, a batch a turn
    assert len(player.moves.batch_sizes) <= calls // 2 and max(player.moves.batch_sizes) > 2
    env = make()
    for ep in episodes:  # the policy never read a hidden answer
        text = env_text(tok, ep).lower()
        assert not [w for w in hidden(env) if f" {w}" in text]


def test_the_policy_never_sees_the_hidden_answer_and_the_user_never_sees_the_scoring(tiny):
    _, tok = tiny
    env = make_env("simulated-user", show_choices=False)
    every = hidden(env)
    # a careless user model: it blurts out every diagnosis it knows
    blurt = "I bet it is " + ", ".join(every) + ". Influenza? FLU!"
    server = ChatServer(lambda body: blurt)
    try:
        user = EndpointOpponent(server.base_url, "leaky", timeout_s=10)
        make = user.attach(partial(make_env, "simulated-user", opponent="endpoint",
                                   show_choices=False))
        episodes = play(make, tok, QUESTIONS, range(6))
    finally:
        server.close()
    assert all(ep.status == "done" for ep in episodes)
    for ep in episodes:
        asyncio.run(env.reset(ep.seed))  # the episode's task
        text = env_text(tok, ep)
        assert REDACTED in text and ep.info["redacted"] >= 3  # each reply named it
        assert not [w for w in (env.row["answer"], *env.row["aliases"]) if names(text, w)]
        assert env.row["goal"] not in text
    assert len(server.requests) == 6 * 3  # one call a question
    systems = [r["messages"][0]["content"] for r in server.requests]
    goals = {r["goal"] for r in env.rows}
    assert all(any(goal in s for goal in goals) for s in systems)  # the user knows its goal
    for text in systems:  # ... but never the answers, the answer format or the reward
        assert "answer:" not in text.lower() and "reward" not in text.lower()
        assert not [w for w in every if names(text, w)]


def test_redact_takes_aliases_whole_and_counts():
    text, count = redact("Maybe hay fever, or Allergy; not allergyish.", ["allergy", "hay fever"])
    assert text == f"Maybe {REDACTED}, or {REDACTED}; not allergyish." and count == 2


def test_bad_options_and_tasks_are_refused_in_one_line(tmp_path):
    cases = [({"opponent": "pool"}, "opponent must be one of scripted, model, endpoint"),
             ({"reward": "vibes"}, "reward check or judge"),
             ({"path": str(tmp_path / "none.jsonl")}, "does not exist")]
    def tasks(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    # bad rows are named by their file line (as the user sees them), not their index in the
    # split: the eval row on line 2 is the eval split's row 0
    row = {"goal": "You lost your keys.", "answer": "keys"}
    nofacts = tasks("nofacts.jsonl", [{**row, "split": "train"}, {**row, "split": "eval"}])
    good = {**row, "facts": [], "split": "train"}
    cases += [({"path": nofacts}, r"nofacts.jsonl:1: no 'facts' list"),
              ({"path": tasks("nogoal.jsonl", [good, {"answer": "keys", "facts": [],
                                                      "split": "eval"}])},
               r"nogoal.jsonl:2: no 'goal' text"),
              ({"path": tasks("alias.jsonl", [good, good, {**good, "aliases": "key"},
                                              {**good, "split": "eval"}]),
                "opponent": "model"}, r"alias.jsonl:3: 'aliases' must be a list"),
              ({"path": tasks("train.jsonl", [{**row, "facts": [], "split": "train"}])},
               "eval split.* has no rows")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            make_env("simulated-user", **options)
        assert "\n" not in str(err.value)
    assert make_env("simulated-user", path=nofacts, opponent="model").rows  # a model needs none
    from turnrl.config import ConfigError, load_config

    for args, message in [(["--env.options.opponent", "model"], "needs env.opponent_model"),
                          (["--env.options.reward", "judge"], "the judge section, which is off")]:
        with pytest.raises(ConfigError, match=message) as err:
            load_config(None, ["--env.name", "simulated-user", *args])
        assert "\n" not in str(err.value)
    env = make_env("simulated-user", opponent="model")
    asyncio.run(env.reset(0))
    with pytest.raises(RuntimeError, match="has no player"):
        asyncio.run(env.step("fever?"))


@pytest.mark.parametrize("user", ["scripted", "model"])
def test_turnrl_train_two_steps_with_a_simulated_user(tmp_path, capsys, user):
    from turnrl.cli import main

    extra = (["--env.options.opponent", "model", "--env.opponent_model", "tiny"]
             if user == "model" else [])
    assert main(["train", "--model.name", "tiny", "--env.name", "simulated-user",
                 "--rollout.max_new_tokens", "4", "--env.options.max_turns", "2",
                 "--rollout.group_size", "2", "--rollout.groups_per_step", "2",
                 "--run.steps", "2", "--eval.episodes", "4", "--run.progress", "false",
                 "--run.tensorboard", "false", "--run.out_dir", str(tmp_path / "run"), *extra]) == 0
    played = [json.loads(line) for f in (tmp_path / "run").glob("eval_after.jsonl")
              for line in f.read_text().splitlines()]
    assert len(played) == 4 and all(ep["status"] == "done" for ep in played)
    expected = "model:tiny" if user == "model" else "scripted"
    assert {ep["info"]["user"] for ep in played} == {expected}  # evaluation has its user
    capsys.readouterr()
    assert main(["envs"]) == 0 and "simulated-user" in capsys.readouterr().out


@pytest.mark.slow
def test_an_async_run_with_a_model_user(tmp_path):
    from tests.conftest import local_ray
    from turnrl.config import load_config
    from turnrl.launch import train_async
    from turnrl.types import read_episodes

    cfg = load_config(None, [
        "--model.name", "tiny", "--env.name", "simulated-user", "--env.options.opponent",
        "model", "--env.opponent_model", "tiny", "--env.options.max_turns", "2",
        "--rollout.max_new_tokens", "4", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--run.steps", "1", "--eval.episodes", "2",
        "--run.mode", "async", "--ray.num_workers", "1", "--run.progress", "false",
        "--run.tensorboard", "false", "--run.out_dir", str(tmp_path)])
    with local_ray():
        train_async(cfg)
    (path,) = (tmp_path / "episodes").glob("step-*.jsonl")
    trained, evaluated = read_episodes(path), read_episodes(tmp_path / "eval_after.jsonl")
    assert len(trained) == 4 and len(evaluated) == 2
    # the worker's user and the learner's evaluation user: both the model, both replied
    assert all(ep.status == "done" and ep.info["user"] == "model:tiny" and ep.info["turns"] == 2
               for ep in (*trained, *evaluated))


def test_a_judged_run_tells_the_judge_the_hidden_goal_and_never_the_policy(tmp_path):
    from tests.helpers.judge_server import JudgeServer
    from turnrl.config import load_config
    from turnrl.trainer import train

    server = JudgeServer()
    try:
        cfg = load_config(None, [
            "--model.name", "tiny", "--env.name", "simulated-user", "--env.options.reward",
            "judge", "--env.options.max_turns", "2", "--rollout.max_new_tokens", "4",
            "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.steps", "1",
            "--eval.episodes", "0", "--run.progress", "false", "--run.tensorboard", "false",
            "--judge.base_url", server.base_url, "--judge.model", "strict",
            "--judge.rubric", "The agent names the diagnosis. REQUIRED: answer",
            "--run.out_dir", str(tmp_path)])
        train(cfg)
    finally:
        server.close()
    assert len(server.requests) >= 1
    goals = {r["goal"] for r in make_env("simulated-user").rows}
    for request in server.requests:
        system, transcript = (m["content"] for m in request["messages"])
        assert "The right answer:" in system and any(g in system for g in goals)
        assert "right answer" not in transcript and not any(g in transcript for g in goals)


def test_options_of_the_wrong_type_are_refused_by_name():
    """turn_cost 'abc' was accepted and failed every correct answer at step time (1.0 - 'abc'
    * 0); max_turns and eval_fraction of the wrong type were refused with Python's own '<'
    error, naming neither option."""
    for options, name in [({"turn_cost": "abc"}, "turn_cost"), ({"turn_cost": -0.5}, "turn_cost"),
                          ({"max_turns": "abc"}, "max_turns"), ({"max_turns": 2.5}, "max_turns"),
                          ({"eval_fraction": "x"}, "eval_fraction"),
                          ({"show_choices": "no"}, "show_choices")]:
        with pytest.raises(ValueError, match=f"simulated-user: {name} must be") as err:
            make_env("simulated-user", **options)
        assert "\n" not in str(err.value)
