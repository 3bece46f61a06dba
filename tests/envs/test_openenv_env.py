"""OpenEnv environments as TurnRL environments (turnrl/envs/adapters/openenv_env.py), with an
environment written in OpenEnv's own format (tests/envs/external/openenv_guess.py): in process
and through its official client against a real local server, in the env mixture, sync and on a
worker, and what a broken one does."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from functools import partial

import pytest

pytest.importorskip("openenv.core")

from turnrl.config import load_config  # noqa: E402
from turnrl.envs import make_env  # noqa: E402
from turnrl.envs.adapters import openenv_server  # noqa: E402
from turnrl.metrics import read_metrics  # noqa: E402
from turnrl.rollout import ChatFormat, run_episodes, run_sync  # noqa: E402
from turnrl.samplers import HFEngine, SamplingParams  # noqa: E402
from turnrl.trainer import train  # noqa: E402
from turnrl.types import read_episodes  # noqa: E402

GUESS = "tests.envs.external.openenv_guess:GuessNumberEnvironment"


def play(env, seed, replies):
    async def run():
        first, results = await env.reset(seed), []
        for reply in replies:
            results.append(await env.step(reply))
            if results[-1].done:
                break
        return first, results
    return asyncio.run(run())


@pytest.mark.parametrize("transport", ["local", "http"])
def test_a_game_plays_the_same_in_process_and_through_its_server(transport):
    env = make_env("openenv", env=GUESS, transport=transport, env_options={"high": 4})
    first, results = play(env, 3, ["1", "2", "3", "4"])
    assert first == "Guess my number between 1 and 4. Reply with one number."
    target = len(results)  # the guesses count up, so the last one is the target
    assert [r.observation for r in results] == ["Higher."] * (target - 1) + ["Correct!"]
    assert [r.reward for r in results] == [0.0] * (target - 1) + [1.0]
    assert results[-1].done and results[-1].info["success"]
    if transport == "http":  # a real subprocess server, answering the official client
        server = openenv_server.SERVERS[next(iter(openenv_server.SERVERS))]
        assert server.process.poll() is None and env.url == server.url


def test_a_running_server_is_played_by_url_with_the_fields_named():
    url = openenv_server.server_for(GUESS, {"high": 4}).url
    env = make_env("openenv", url=url, action_field="message", observation_field="prompt")
    first, results = play(env, 3, ["1", "2", "3", "4"])
    assert first.startswith("Guess my number between 1 and 4")
    assert results[-1].observation == "Correct!" and results[-1].info["success"]
    with pytest.raises(ValueError, match="set env.options.action_field"):
        make_env("openenv", url=url)


def gone(pid: int, within_s: float = 60.0) -> bool:
    """Whether process ``pid`` has exited (a zombie awaiting its parent counts) in time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


def test_the_server_stops_at_exit_and_with_the_process_that_started_it():
    script = ("import time; from turnrl.envs.adapters.openenv_server import server_for\n"
              f"print(server_for({GUESS!r}, {{}}).process.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    server_pid = int(child.stdout.readline())
    assert not gone(server_pid, 0.5)
    child.kill()  # no atexit: the server notices its parent is gone
    child.wait()
    assert gone(server_pid)
    server = openenv_server.LocalServer(GUESS, {})
    openenv_server.SERVERS["test"] = server
    openenv_server.stop_all()  # what atexit runs
    assert server.process.poll() is not None and not openenv_server.SERVERS


@pytest.mark.parametrize(("options", "message"), [
    ({}, "env.options.env is required"),
    ({"env": "no_such_openenv_module:Env"}, "no module named 'no_such_openenv_module'"),
    ({"env": "missing/file.py:Env"}, "no such file"),
    ({"env": "tests.envs.external.openenv_guess:Nope"}, "has no 'Nope'"),
    ({"env": GUESS, "action_field": "text"}, "GuessAction has fields message"),
    ({"env": GUESS, "transport": "grpc"}, "choose local or http"),
    ({"env": GUESS, "env_options": {"size": 3}}, "bad env.options for 'openenv'.*'size'"),
    ({"env": GUESS, "transport": "http", "env_options": {"size": 3}}, "'size'"),
])
def test_bad_input_is_one_line_naming_the_fix(options, message):
    with pytest.raises(ValueError, match=message) as err:
        make_env("openenv", **options)
    assert "\n" not in str(err.value)


def test_a_missing_library_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(ValueError, match=r"not installed; run: pip install 'turnrl\[envs\]'"):
        make_env("openenv", env=GUESS)


@pytest.mark.parametrize("transport", ["local", "http"])
def test_an_env_that_raises_fails_its_episode_with_the_reason_not_the_run(tiny, transport):
    model, tok = tiny
    chat = ChatFormat(tok)
    make = partial(make_env, "openenv", env=GUESS, transport=transport,
                   env_options={"crash": True})
    episodes = run_sync(run_episodes(
        make, [(seed, seed) for seed in range(2)], HFEngine(model, tok.pad_token_id, seed=1),
        chat, SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="openenv"))
    assert [ep.status for ep in episodes] == ["error", "error"]
    assert all("crashed on purpose" in ep.info["reason"] for ep in episodes)


def mix_args(tmp_path, *extra):
    entries = (f'[{{name: openenv, options: {{env: "{GUESS}", transport: http}}}}, '
               '{name: verifiers, options: {env_id: tests.envs.external.vf_sums}}]')
    return ["--model.name", "tiny", "--env.name", "mix", "--env.mix", entries,
            "--rollout.max_new_tokens", "3", "--rollout.max_turns", "3",
            "--rollout.group_size", "2", "--rollout.groups_per_step", "4", "--run.steps", "2",
            "--run.progress", "false", "--run.tensorboard", "false", "--eval.episodes", "0",
            "--run.out_dir", str(tmp_path), *extra]


def test_a_sync_run_mixes_an_openenv_server_game_with_a_verifiers_taskset(tmp_path):
    pytest.importorskip("verifiers.v1")
    train(load_config(None, mix_args(tmp_path)))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    episodes = [ep for step in (1, 2)
                for ep in read_episodes(tmp_path / "episodes" / f"step-00000{step}.jsonl")]
    played = {("split" in ep.info) for ep in episodes}
    assert played == {True, False}  # both entries drawn: verifiers rows and OpenEnv games
    assert all(ep.status in ("done", "truncated") for ep in episodes)


def test_a_rollout_worker_plays_it_through_the_server():
    """What an async run's Ray worker runs, in this process: its own server, its own client."""
    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.models import tiny_model

    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "openenv",
                             "--env.options", json.dumps({"env": GUESS, "transport": "http"}),
                             "--rollout.max_new_tokens", "3", "--rollout.max_turns", "2",
                             "--rollout.group_size", "2", "--run.mode", "async",
                             "--ray.num_workers", "1", "--run.progress", "false"])
    model, _ = tiny_model(seed=1)
    worker = RolloutWorker(cfg, index=0, pool_size=4)
    try:
        worker.set_weights(0, without_tied_weights(
            {k: v.detach().clone() for k, v in model.state_dict().items()}))
        worker.assign([(0, 5), (1, 6)])
        groups, end = [], time.monotonic() + 60
        while len(groups) < 2 and time.monotonic() < end:
            groups += worker.take_groups(wait_s=1.0).groups
    finally:
        worker.stop()
    episodes = [ep for group in groups for ep in group.episodes]
    assert len(groups) == 2 and len(episodes) == 4
    assert all(ep.status in ("done", "truncated") and ep.turns for ep in episodes), [
        (ep.status, ep.info) for ep in episodes]
    assert all(ep.turns[0].observation in ("Higher.", "Lower.", "Correct!") for ep in episodes)


def server_processes() -> set[int]:
    """Pids of OpenEnv servers this adapter started, on this machine, now, but this
    process's own (the driver's config check starts one, stopped at the end of its run)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if b"openenv_server.py" not in cmdline.read():
                    continue
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) != os.getpid():
                    found.add(int(entry))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.slow
def test_an_async_run_plays_it_on_a_ray_worker_through_the_workers_own_server(tmp_path):
    """One worker, two steps of two groups of two, no evaluation; 15-80 s (load 2-10 on 2
    cores): Ray, a worker process, and two OpenEnv servers (the driver's check, the worker's)."""
    from tests.conftest import local_ray
    from turnrl.launch import train_async

    before = server_processes()
    with local_ray():  # a worker's server: started by the worker, gone with it
        train_async(load_config(None, [
            "--model.name", "tiny", "--env.name", "openenv", "--env.options",
            json.dumps({"env": GUESS, "transport": "http"}), "--rollout.max_new_tokens", "3",
            "--rollout.max_turns", "2", "--rollout.group_size", "2",
            "--rollout.groups_per_step", "2", "--run.steps", "2", "--run.mode", "async",
            "--ray.num_workers", "1", "--eval.episodes", "0", "--run.progress", "false",
            "--run.tensorboard", "false", "--run.out_dir", str(tmp_path)]))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    episodes = read_episodes(tmp_path / "episodes" / "step-000001.jsonl")
    assert episodes and all(ep.turns[0].observation in ("Higher.", "Lower.", "Correct!")
                            for ep in episodes)
    assert all(gone(pid) for pid in server_processes() - before)
