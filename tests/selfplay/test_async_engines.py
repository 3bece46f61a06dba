"""Async self-play on each worker engine and a worker's wait for its opponent pool
(docs/selfplay.md, async section): the pool needs HF workers (refused in one line on vLLM and
CTranslate2 workers), every other opponent runs on a CTranslate2 worker too, and a game whose
pool never comes fails with the pool's reason, not as an env timeout."""

from __future__ import annotations

import pytest

from tests.conftest import groups_within
from turnrl.config import ConfigError, load_config
from turnrl.selfplay.pool import pool_wait_s

BASE = ["--model.name", "tiny", "--rollout.max_new_tokens", "3", "--run.progress", "false",
        "--run.tensorboard", "false", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--run.mode", "async"]
ENGINES = {"hf": [], "ct2": ["--rollout.sampler", "ct2"],
           "vllm": ["--rollout.sampler", "vllm", "--ray.worker_gpus", "1"]}
OPPONENTS = {
    "self": ["--env.options.opponent", "self"],
    "selfplay-env": [],
    "random": ["--env.options.opponent", "random"],
    "model": ["--env.options.opponent", "model", "--env.opponent_model", "tiny"],
    "endpoint": ["--env.options.opponent", "endpoint", "--env.opponent_endpoint",
                 "http://127.0.0.1:9/v1", "--env.opponent_endpoint_model", "m"],
}


def _cfg(tmp_path, *extra):
    return load_config(None, [*BASE, "--run.out_dir", str(tmp_path), *extra])


def _env(opponent: str) -> list[str]:
    return ["--env.name", "tictactoe-selfplay" if opponent == "selfplay-env" else "tictactoe"]


# ---- what each worker engine takes ----------------------------------------------------------

@pytest.mark.parametrize("engine", ["ct2", "vllm"])
@pytest.mark.parametrize("env", ["tictactoe", "kuhn-poker", "textarena-2p"])
def test_the_pool_is_refused_on_workers_without_an_hf_model_in_one_line(tmp_path, engine, env):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, "--env.name", env, "--env.options.opponent", "pool", *ENGINES[engine])
    message = str(err.value)
    assert "\n" not in message
    assert f"opponent pool with rollout.sampler {engine}" in message
    assert "--rollout.sampler hf" in message and "--run.mode sync" in message


def test_the_pool_is_taken_on_hf_workers_and_in_sync_mode_on_any_engine(tmp_path):
    _cfg(tmp_path, "--env.name", "tictactoe", "--env.options.opponent", "pool")
    cfg = load_config(None, ["--model.name", "tiny", "--run.out_dir", str(tmp_path),
                             "--env.name", "tictactoe", "--env.options.opponent", "pool",
                             "--rollout.sampler", "ct2"])  # sync mode: the learner holds the pool
    assert cfg.run.mode == "sync"


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("opponent", list(OPPONENTS))
def test_every_other_opponent_is_taken_on_every_engine(tmp_path, engine, opponent):
    cfg = _cfg(tmp_path, *_env(opponent), *OPPONENTS[opponent], *ENGINES[engine])
    assert cfg.rollout.sampler == engine


@pytest.mark.parametrize("opponent", ["self", "selfplay-env", "model"])
def test_a_ct2_worker_plays_the_opponents_it_builds(tmp_path, opponent):
    """What the config check lets through runs: a CTranslate2 worker plays self-play (its own
    engine in both seats) and a local model opponent (an HF model of the worker's own)."""
    pytest.importorskip("ctranslate2", reason="the ct2 extra is not installed")
    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.models import tiny_model

    cfg = _cfg(tmp_path, *_env(opponent), *OPPONENTS[opponent], *ENGINES["ct2"],
               "--rollout.sampler_dtype", "float32")
    worker = RolloutWorker(cfg, pool_size=4)
    try:
        state = tiny_model(seed=1)[0].state_dict()
        worker.set_weights(0, without_tied_weights({k: v.detach().clone()
                                                    for k, v in state.items()}))
        worker.assign([(0, 7)])
        [group] = groups_within(worker, 180)
        names = {ep.info.get("opponent") for ep in group.episodes}
        seats = 2 if opponent != "model" else 1
        assert len(group.episodes) == cfg.rollout.group_size * seats
        assert names == ({"model:tiny"} if opponent == "model" else {"self"})
        assert all(ep.status != "error" for ep in group.episodes), \
            [ep.info.get("reason") for ep in group.episodes]
    finally:
        worker.stop()


# ---- a worker's wait for the learner's pool -------------------------------------------------

@pytest.mark.parametrize("env_timeout_s, margin", [
    (0.5, 0.25), (2.0, 1.0), (4.0, 1.0), (10.0, 2.0), (30.0, 6.0), (300.0, 60.0)])
def test_a_game_waits_for_the_pool_less_than_its_env_call_lasts(env_timeout_s, margin):
    assert pool_wait_s(env_timeout_s) == pytest.approx(env_timeout_s - margin)


@pytest.mark.parametrize("env_args", [
    ["--env.name", "tictactoe", "--env.options.role", "x"],  # drawn for the reset's info
    ["--env.name", "tictactoe", "--env.options.role", "o"],  # the opponent moves at reset
    ["--env.name", "kuhn-poker"],
])
def test_a_worker_game_whose_pool_never_comes_fails_with_the_pools_reason(tmp_path, env_args):
    """A worker as the learner starts it (its env timeout from the config, its pool empty:
    weights sent, no pool): the game fails alone, as an env error naming the empty pool,
    not as an env timeout (the wait used to equal the env call's own timeout, which fired
    first)."""
    from turnrl.distributed.worker_engines import without_tied_weights, worker_env_factory
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.models import tiny_model
    from turnrl.selfplay.pool import PoolDraw

    cfg = _cfg(tmp_path, *env_args, "--env.options.opponent", "pool",
               "--rollout.env_timeout_s", "10", "--rollout.group_size", "4")
    worker = RolloutWorker(cfg, pool_size=8)
    try:
        # The draw the worker's env factory makes gives up before the env call's timer...
        draw = worker_env_factory(cfg, worker.pool)().player
        assert isinstance(draw, PoolDraw) and draw.pool is worker.pool
        assert draw.wait_s == pool_wait_s(10.0) <= 10.0 - 1.0
        # ...so every game fails with the pool's reason (with equal waits the two raced: a
        # game's reset or first step ended either way, more often as a timeout under load).
        state = tiny_model(seed=1)[0].state_dict()
        worker.set_weights(0, without_tied_weights({k: v.detach().clone()
                                                    for k, v in state.items()}))
        worker.assign([(0, 7), (1, 8)])
        groups = []
        while len(groups) < 2:
            groups += groups_within(worker, 180)
        for episode in (ep for group in groups for ep in group.episodes):
            assert (episode.status, episode.end_reason) == ("error", "env_error"), episode.info
            assert "the opponent pool is empty" in episode.info["reason"]
    finally:
        worker.stop()
