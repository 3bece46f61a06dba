"""verifiers 0.4 tasksets as TurnRL environments (turnrl/envs/adapters/verifiers_env.py), with a
taskset written in verifiers' own format (tests/envs/external/vf_sums.py): its rows, its
rubric, its held-out rows, and what a broken one does."""

from __future__ import annotations

import asyncio
import sys
from functools import partial

import pytest

pytest.importorskip("verifiers.v1")

from tests.conftest import local_ray  # noqa: E402
from turnrl.config import load_config  # noqa: E402
from turnrl.envs import make_env  # noqa: E402
from turnrl.metrics import read_metrics  # noqa: E402
from turnrl.rollout import ChatFormat, run_episodes, run_sync  # noqa: E402
from turnrl.samplers import HFEngine, SamplingParams  # noqa: E402
from turnrl.trainer import train  # noqa: E402
from turnrl.types import read_episodes  # noqa: E402

SUMS = "tests.envs.external.vf_sums"
SPLITS = {"env_id": SUMS, "eval_taskset": {"split": "eval"}, "train_select": {"limit": 6}}


def play(env, seed, reply):
    async def run():
        return await env.reset(seed), await env.step(reply)
    return asyncio.run(run())


def test_a_taskset_plays_its_rows_scored_by_its_own_rubric():
    env = make_env("verifiers", **SPLITS)
    question, result = play(env, 2, "3 + 5 = 8")
    assert question == "What is 3+5? Reply with just the number."
    assert env.system_prompt == "Answer with one number."
    assert result.done and result.reward == 1.0 and result.info["success"]
    assert result.info["rewards"] == {"correct": 1.0}
    assert result.info["metrics"] == {"reply_chars": 9.0}  # the task's @vf.metric ran too
    _, wrong = play(env, 2, "9")
    assert wrong.reward == 0.0 and not wrong.info["success"]
    as_messages = make_env("verifiers", env_id=SUMS, taskset={"as_messages": True})
    assert play(as_messages, 2, "8") == (question, result._replace(info={
        **result.info, "metrics": {"reply_chars": 1.0}}))
    assert as_messages.system_prompt == "Answer with one number."


def test_held_out_seeds_play_the_eval_rows_and_training_seeds_the_selected_train_rows():
    env = make_env("verifiers", **SPLITS)
    train_questions = {play(env, seed, "0")[0] for seed in range(20)}
    eval_questions = {play(env, 1_000_000 + seed, "0")[0] for seed in range(20)}
    assert len(train_questions) == 6  # train_select limit 6: seeds cycle over six rows
    assert all(int(q.split("What is ")[1].split("+")[0]) < 10 for q in train_questions)
    assert all(int(q.split("What is ")[1].split("+")[0]) >= 10 for q in eval_questions)
    by_path = make_env("verifiers", env_id="tests/envs/external/vf_sums.py",
                       eval_select={"include": {"idx": "3:5"}})
    assert play(by_path, 1_000_001, "0")[0] == play(by_path, 4, "0")[0]


@pytest.mark.parametrize(("options", "message"), [
    ({}, "env_id is required"),
    ({"env_id": "no-such-verifiers-env"}, "not found; install its package"),
    ({"env_id": "missing/file.py"}, "no such file"),
    ({"env_id": SUMS, "taskset": {"num_tasks": "many"}}, "bad option num_tasks"),
    ({"env_id": SUMS, "train_select": {"include": {"idx": "100:"}}}, "leaves no tasks"),
])
def test_bad_input_is_one_line_naming_the_fix(options, message):
    with pytest.raises(ValueError, match=message) as err:
        make_env("verifiers", **options)
    assert "\n" not in str(err.value)


def test_a_taskset_whose_dependency_is_missing_names_it(tmp_path):
    path = tmp_path / "vf_needs_more.py"
    path.write_text("import not_a_real_dependency_xyz\n")
    with pytest.raises(ValueError, match="imports 'not_a_real_dependency_xyz', which is not"):
        make_env("verifiers", env_id=str(path))


def test_a_missing_library_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ValueError, match=r"not installed; run: pip install 'turnrl\[envs\]'"):
        make_env("verifiers", env_id=SUMS)


def test_a_reward_that_raises_fails_its_episode_with_the_reason_not_the_run(tiny):
    model, tok = tiny
    chat = ChatFormat(tok)
    make = partial(make_env, "verifiers", env_id=SUMS, taskset={"raise_on": 0, "num_tasks": 2})
    episodes = run_sync(run_episodes(
        make, [(seed, seed) for seed in range(4)], HFEngine(model, tok.pad_token_id, seed=1),
        chat, SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="verifiers"))
    failed = [ep for ep in episodes if ep.group % 2 == 0]
    assert failed and all(ep.status == "error" and "crashed on purpose" in ep.info["reason"]
                          for ep in failed)
    assert all(ep.status == "done" for ep in episodes if ep.group % 2 == 1)


def run_args(tmp_path, *extra):
    return ["--model.name", "tiny", "--env.name", "verifiers", "--env.options.env_id", SUMS,
            "--env.options.eval_taskset", '{"split": "eval"}', "--rollout.max_new_tokens", "3",
            "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.steps", "2",
            "--run.progress", "false", "--run.tensorboard", "false", "--eval.episodes", "2",
            "--run.out_dir", str(tmp_path), *extra]


def test_a_sync_run_trains_on_train_rows_and_evaluates_on_eval_rows(tmp_path):
    train(load_config(None, run_args(tmp_path)))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    trained = read_episodes(tmp_path / "episodes" / "step-000001.jsonl")
    assert trained and all(ep.status == "done" and "rewards" in ep.info for ep in trained)
    assert {ep.info["split"] for ep in trained} == {"train"}
    held_out = read_episodes(tmp_path / "eval_after.jsonl")
    assert len(held_out) == 2 and {ep.info["split"] for ep in held_out} == {"eval"}


@pytest.mark.slow
def test_an_async_run_plays_it_on_a_ray_worker(tmp_path):
    """Seconds, not tens: one worker, two steps of two groups of two, no evaluation."""
    from turnrl.launch import train_async

    with local_ray():
        train_async(load_config(None, run_args(tmp_path, "--run.mode", "async",
                                               "--ray.num_workers", "1", "--eval.episodes", "0")))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    episodes = read_episodes(tmp_path / "episodes" / "step-000001.jsonl")
    assert episodes and all(ep.status == "done" and "rewards" in ep.info for ep in episodes)


def test_turnrl_envs_lists_verifiers_and_openenv(capsys):
    from turnrl.cli import main

    assert main(["envs"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert {"verifiers", "openenv"} <= set(listed)
