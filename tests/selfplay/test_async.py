"""Self-play in async mode (docs/selfplay.md, docs/async.md): a rollout worker's own engine
plays every seat, each game gives one episode per seat, each seat's episode records the
weights versions that played the game, and the learner counts staleness per role."""

from __future__ import annotations

import sys
from functools import partial

import pytest

from tests.conftest import MovesEngine, RecordingHandle, local_ray
from turnrl.config import ConfigError, load_config
from turnrl.envs import make_env
from turnrl.rollout import ChatFormat, TurnLoop, run_sync
from turnrl.samplers import SamplingParams
from turnrl.types import ENV_VERSION, Episode

BASE = ["--model.name", "tiny", "--rollout.max_new_tokens", "3", "--run.progress", "false",
        "--run.tensorboard", "false", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2"]


def _cfg(tmp_path, *extra):
    return load_config(None, [*BASE, "--run.mode", "async", "--run.out_dir", str(tmp_path),
                              *extra])


# ---- what async mode accepts and refuses -----------------------------------------------------

@pytest.mark.parametrize("args", [
    ["--env.name", "tictactoe-selfplay"],
    ["--env.name", "kuhn-poker-selfplay"],
    ["--env.name", "tictactoe", "--env.options.opponent", "self"],
    ["--env.name", "kuhn-poker", "--env.options.opponent", "random"],
    ["--env.name", "tictactoe", "--env.options.opponent", "model", "--env.opponent_model",
     "tiny"],
    ["--env.name", "tictactoe", "--env.options.opponent", "endpoint",
     "--env.opponent_endpoint", "http://127.0.0.1:9/v1", "--env.opponent_endpoint_model", "m"],
    ["--env.name", "kuhn-poker", "--env.options.opponent", "pool"],
])
def test_async_mode_takes_self_play_and_the_opponents_a_worker_can_build(tmp_path, args):
    cfg = _cfg(tmp_path, *args)
    assert cfg.run.mode == "async"


@pytest.mark.parametrize("env", ["tictactoe", "kuhn-poker", "textarena-2p"])
def test_async_mode_refuses_the_pool_on_vllm_workers_in_one_line(tmp_path, env):
    _cfg(tmp_path, "--env.name", env, "--env.options.opponent", "pool")  # hf workers: fine
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, "--env.name", env, "--env.options.opponent", "pool", "--rollout.sampler",
             "vllm", "--ray.worker_gpus", "1")
    message = str(err.value)
    assert "\n" not in message
    assert "opponent pool with rollout.sampler vllm" in message
    assert "--rollout.sampler hf" in message and "--run.mode sync" in message


@pytest.mark.parametrize("opponent", ["self", "pool"])
def test_mixes_of_games_run_in_async_mode(opponent):
    """A mix's game entry in async mode (tests/distributed/test_plan.py plays one): groups
    are sized by the entry with the most seats, and an entry against the pool gives the
    learner a pool to keep, as a run of that game alone does."""
    from turnrl.distributed.book import episodes_per_group
    from turnrl.distributed.source import RaySource

    cfg = load_config(None, ["--env.name", "mix", "--run.mode", "async", "--env.mix",
                             f'[{{"name": "tictactoe-selfplay", "options": {{"opponent": '
                             f'"{opponent}"}}}}, {{"name": "tictactoe"}}]'])
    alone = load_config(None, ["--env.name", "tictactoe-selfplay", "--run.mode", "async",
                               "--env.options.opponent", opponent])
    assert episodes_per_group(cfg) == episodes_per_group(alone)
    assert RaySource(cfg).pool_versions == ([] if opponent == "pool" else None)


# ---- the worker's side: its env, its pool, the versions of each seat --------------------------

def test_a_group_holds_one_episode_per_seat_and_worker_pools_count_them(tmp_path):
    from turnrl.distributed.book import episodes_per_group
    from turnrl.distributed.workers import worker_pool_size

    for name, per_game in [("tictactoe-selfplay", 2), ("kuhn-poker-selfplay", 2),
                           ("tictactoe", 1), ("test-chatter", 2), ("say-digit", 1)]:
        cfg = _cfg(tmp_path, "--env.name", name, "--rollout.group_size", "3")
        assert episodes_per_group(cfg) == 3 * per_game, name
        assert worker_pool_size(cfg, 4, episodes_per_group(cfg)) == 4 * 3 * per_game
    assert worker_pool_size(cfg, 4) == 4 * 3  # default: group_size episodes a group


def test_the_worker_builds_its_own_outside_opponent(tmp_path):
    from turnrl.distributed.worker_engines import worker_env_factory

    model = worker_env_factory(_cfg(tmp_path, "--env.name", "tictactoe", "--env.options.opponent",
                                    "model", "--env.opponent_model", "tiny"))()
    assert model.player.name == "model:tiny"
    endpoint = worker_env_factory(_cfg(
        tmp_path, "--env.name", "kuhn-poker", "--env.options.opponent", "endpoint",
        "--env.opponent_endpoint", "http://127.0.0.1:9", "--env.opponent_endpoint_model",
        "other"))()
    assert endpoint.player.name == "endpoint:other"
    assert endpoint.player.url == "http://127.0.0.1:9/v1/chat/completions"
    selfplay = worker_env_factory(_cfg(tmp_path, "--env.name", "tictactoe-selfplay"))()
    assert selfplay.seats == ("X", "O")


def _swapping_loop(tok, moves, *, group_size=1, pool_size=None, make=None):
    """A worker's loop (not lock-step, partial rollouts) over a scripted engine whose weights
    version goes up by one before every generate call: each move is sampled by a new version."""
    chat = ChatFormat(tok)
    engine = MovesEngine(tok, moves)
    engine.version = -1

    def new_version():
        engine.version += 1

    loop = TurnLoop(make or partial(make_env, "tictactoe", opponent="self"), engine, chat,
                    SamplingParams(8, 1.0, stop_token_ids=(chat.end_of_turn,)),
                    group_size=group_size, pool_size=pool_size, env_name="tictactoe",
                    before_generate=new_version, worker=0)
    loop.seats.record_versions = True
    return loop


def _policy_versions(episode: Episode) -> list[int]:
    return sorted({v for v in episode.versions if v != ENV_VERSION})


def test_each_seat_records_the_versions_that_played_its_game(tiny):
    _, tok = tiny
    # X 1, O 2, X 3, O 4, X 5, O 6, X 7 (X wins): call k samples with version k
    loop = _swapping_loop(tok, [str(c) for c in range(1, 10)])
    loop.submit(0, 0)
    run_sync(loop.run(until_drained=True))
    (group,) = loop.take_groups()
    x, o = group.episodes
    assert (x.info["role"], o.info["role"]) == ("X", "O")
    # every move trained once, in its mover's episode, with the version that sampled it
    assert [t.action for t in x.turns] == ["1", "3", "5", "7"]
    assert [t.action for t in o.turns] == ["2", "4", "6"]
    assert _policy_versions(x) == [0, 2, 4, 6] and _policy_versions(o) == [1, 3, 5]
    for episode in (x, o):
        trained = [i for i, m in enumerate(episode.loss_mask) if m]
        assert trained == [i for t in episode.turns for i in range(t.start, t.end)]
    # both seats' episodes name both seats' oldest versions
    assert x.info["seat_versions"] == o.info["seat_versions"] == {"X": 0, "O": 1}
    assert group.oldest_version == 0  # the group's staleness: its oldest seat


def test_a_seat_that_never_moved_records_no_version(tiny):
    _, tok = tiny
    # X writes no cell: it loses at once, O never moves
    loop = _swapping_loop(tok, ["no"])
    loop.submit(0, 0)
    run_sync(loop.run(until_drained=True))
    x, o = loop.take_groups()[0].episodes
    assert o.num_policy_tokens == 0 and o.reward == 1.0
    assert x.info["seat_versions"] == o.info["seat_versions"] == {"X": 0, "O": ENV_VERSION}


def test_the_sync_loop_records_no_seat_versions(tiny):
    from turnrl.rollout import run_episodes

    _, tok = tiny
    chat = ChatFormat(tok)
    episodes = run_sync(run_episodes(partial(make_env, "tictactoe", opponent="self"),
                                     [(0, 0)], MovesEngine(tok, ["5", "1", "9"]), chat,
                                     SamplingParams(8, 1.0, stop_token_ids=(chat.end_of_turn,)),
                                     env_name="tictactoe"))
    assert len(episodes) == 2 and not any("seat_versions" in ep.info for ep in episodes)


@pytest.mark.parametrize("group_size, pool_size", [(2, 6), (2, 4), (1, 3), (1, 5), (3, 8)])
def test_a_worker_pool_counts_every_seat_of_a_game(tiny, group_size, pool_size):
    _, tok = tiny
    loop = _swapping_loop(tok, [str(c) for c in range(1, 10)], group_size=group_size,
                          pool_size=pool_size)
    for assignment in range(4):
        loop.submit(assignment, assignment)
    run_sync(loop.run(until_drained=True))
    groups = loop.take_groups()
    assert len(groups) == 4 and all(len(g.episodes) == 2 * group_size for g in groups)
    # a group starts whole, and only when all of its seats fit (or the pool is empty)
    assert loop.stats.max_live == max(2 * group_size,
                                      pool_size // (2 * group_size) * 2 * group_size)


def test_staleness_per_role_by_hand():
    from turnrl.trainer.buffer import role_staleness

    def episode(role, versions):
        return Episode("g", 0, 0, versions=list(versions), info={"role": role} if role else {})

    episodes = [episode("X", [-1, 3, 3]), episode("O", [-1, 4]), episode("X", [5, -1]),
                episode("O", [-1, -1]), episode(None, [1])]
    assert role_staleness(episodes, 6) == {
        "async/staleness_mean/O": (2 + 0) / 2, "async/staleness_max/O": 2.0,
        "async/staleness_mean/X": (3 + 1) / 2, "async/staleness_max/X": 3.0}
    assert role_staleness([episode(None, [1])], 6) == {}


# ---- a real local Ray cluster ------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_games():
    """A local Ray cluster that can build this module's game (shipped by value)."""
    with local_ray(sys.modules[__name__], sys.modules["tests.conftest"]) as ray:
        yield ray


def _pairs(episodes):
    """A step's episodes as games: each game's seats are consecutive, in seat order."""
    return [episodes[i:i + 2] for i in range(0, len(episodes), 2)]


@pytest.mark.slow
@pytest.mark.parametrize("env, advantage, roles", [
    ("tictactoe-selfplay", "rae", ("X", "O")),
    ("kuhn-poker-selfplay", "grpo", ("first", "second")),
    ("test-chatter", "rae", ("a", "b")),
])
def test_an_async_self_play_run_trains_every_seat(ray_games, tmp_path, env, advantage, roles):
    from turnrl.algorithms.credit import episode_group_ids
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics
    from turnrl.types import read_episodes

    cfg = _cfg(tmp_path, "--env.name", env, "--algo.advantage", advantage, "--run.steps", "2",
               "--eval.episodes", "0", "--run.sample_episodes", "100", "--ray.num_workers",
               "1", "--optim.lr", "1e-3")
    result = train_async(cfg)
    assert len(result.trained) == 2 * 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        first, second = roles
        assert row[f"game/{first}/reward"] == pytest.approx(-row[f"game/{second}/reward"])
        assert row["game/opponent/self"] == 2 * 2 * 2 and row["warn/zero_sum"] == 0.0
        for role in roles:  # staleness counted per role, within the run's bound
            assert 0 <= row[f"async/staleness_mean/{role}"] \
                <= row[f"async/staleness_max/{role}"] <= row["async/max_versions"]
        if advantage == "rae":  # one baseline per seat; zero-sum: they mirror each other
            base = f"rae/baseline/{env}/"
            assert row[base + first] == pytest.approx(-row[base + second], abs=1e-9)
    for path in sorted((tmp_path / "episodes").glob("step-*.jsonl")):
        episodes = read_episodes(path)
        assert len(episodes) == 2 * 2 * 2  # 2 groups of 2 games, an episode per seat
        # GRPO per role: each group splits into one group per seat
        ids = episode_group_ids(episodes).tolist()
        assert len(set(ids)) == 2 * 2
        for a, b in _pairs(episodes):
            assert (a.info["role"], b.info["role"]) == roles
            assert a.seed == b.seed and a.group == b.group
            assert a.info["opponent"] == b.info["opponent"] == "self"
            assert a.reward + b.reward == pytest.approx(0.0)
            # both seats' versions, as each seat's episode saw them
            versions = {roles[0]: min(_policy_versions(a), default=ENV_VERSION),
                        roles[1]: min(_policy_versions(b), default=ENV_VERSION)}
            assert a.info["seat_versions"] == b.info["seat_versions"] == versions
            assert a.num_policy_tokens > 0  # the first seat always moves
            for ep in (a, b):  # each seat trains exactly its own moves
                trained = [i for i, m in enumerate(ep.loss_mask) if m]
                assert trained == [i for t in ep.turns for i in range(t.start, t.end)]
            # X moves first: the seats' move counts differ by at most one
            assert len(a.turns) - len(b.turns) in (0, 1)
            if env == "test-chatter":  # whole games: each move once, in its mover's episode
                assert len(a.turns) == len(b.turns) == 2
                assert [t.action for t in a.turns] == a.info["moves"]
                assert [t.action for t in b.turns] == b.info["moves"]


@pytest.mark.slow
@pytest.mark.parametrize("opponent, recorded", [("random", "random"), ("model", "model:tiny")])
def test_an_async_run_against_a_fixed_or_a_model_opponent(ray_games, tmp_path, opponent,
                                                           recorded):
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics
    from turnrl.types import read_episodes

    cfg = _cfg(tmp_path, "--env.name", "tictactoe", "--env.options.opponent", opponent,
               "--env.options.role", "both", "--env.opponent_model", "tiny", "--run.steps",
               "1", "--eval.episodes", "0", "--run.sample_episodes", "100",
               "--ray.num_workers", "1")
    train_async(cfg)
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row[f"game/opponent/{recorded}"] == 2 * 2  # one episode a game: the policy's seat
    (path,) = (tmp_path / "episodes").glob("step-*.jsonl")
    episodes = read_episodes(path)
    assert len(episodes) == 2 * 2 and {ep.info["opponent"] for ep in episodes} == {recorded}
    assert all("seat_versions" not in ep.info for ep in episodes)  # one seat: its tokens tell


# ---- the opponent pool in async mode: the learner's versions, held by every worker -------------

def test_the_pool_rule_by_hand():
    from turnrl.selfplay.pool import pool_after_offer

    assert pool_after_offer([], 5, every=2, size=3) == [5]  # the first offered always joins
    assert pool_after_offer([5], 6, every=2, size=3) == [5, 6]
    assert pool_after_offer([5, 6], 7, every=2, size=3) is None  # not an every-th version
    assert pool_after_offer([5, 6], 6, every=2, size=3) is None  # already held
    assert pool_after_offer([4, 6, 8], 10, every=2, size=3) == [6, 8, 10]  # oldest goes


def test_a_pool_mirror_holds_the_versions_it_is_told_and_games_wait_for_its_first(tiny):
    import threading

    import torch

    from turnrl.selfplay.pool import OpponentPool

    _, tok = tiny
    chat = ChatFormat(tok)
    pool = OpponentPool(chat, SamplingParams(3, 1.0), size=2, every=1, seed=0)
    built = []

    def build(version):
        built.append(version)
        return type("Player", (), {"version": version, "model": torch.zeros(1)})()

    drawn = []
    waiter = threading.Thread(target=lambda: drawn.append(pool.sample(wait_s=60)))
    waiter.start()
    pool.hold([3], build)  # the first member wakes the waiting game
    waiter.join(timeout=30)
    assert [p.member.version for p in drawn] == [3] and built == [3]
    pool.hold([3, 5], build)
    assert pool.versions() == [3, 5] and built == [3, 5]  # 3 kept, not rebuilt
    pool.hold([5], build)
    assert pool.versions() == [5] and {pool.sample().member.version for _ in range(8)} == {5}
    empty = OpponentPool(chat, SamplingParams(3, 1.0), size=2, every=1)
    empty.close()
    with pytest.raises(RuntimeError, match="the opponent pool is empty"):
        empty.sample(wait_s=60)  # closed: no wait


def test_a_worker_plays_the_pool_versions_the_learner_sends(tmp_path):
    import torch

    from tests.conftest import groups_within
    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.models import tiny_model

    cfg = _cfg(tmp_path, "--env.name", "kuhn-poker", "--env.options.opponent", "pool",
               "--env.opponent_pool_size", "2")
    states = [without_tied_weights({k: v.detach().clone()
                                    for k, v in tiny_model(seed=s)[0].state_dict().items()})
              for s in (1, 2)]
    worker = RolloutWorker(cfg, pool_size=8)
    try:
        worker.assign([(0, 7)])  # its games wait for the pool (and the weights)
        worker.set_weights(0, states[0])
        assert worker.set_pool([(0, states[0])]) == [0]
        episodes = groups_within(worker, 120)[0].episodes
        assert {ep.info["opponent"] for ep in episodes} == {"pool-v0"}
        assert worker.set_pool([(0, states[0]), (1, states[1])]) == [0, 1]
        frozen = {m.version: m.model for m in worker.pool.members}
        name = "model.embed_tokens.weight"
        for version, state in enumerate(states):  # each copy holds its version's weights
            assert torch.equal(frozen[version].state_dict()[name], state[name])
        assert not any(p.requires_grad for p in frozen[1].parameters())
        worker.assign([(1, 8), (2, 9), (3, 10)])
        groups = []
        while len(groups) < 3:  # a report may hold several groups
            groups += groups_within(worker, 120)
        assert {ep.info["opponent"] for g in groups for ep in g.episodes} \
            <= {"pool-v0", "pool-v1"}
    finally:
        worker.stop()


@pytest.mark.slow
def test_an_async_run_against_the_pool(ray_games, tmp_path):
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics
    from turnrl.types import read_episodes

    cfg = _cfg(tmp_path, "--env.name", "tictactoe", "--env.options.opponent", "pool",
               "--env.opponent_pool_size", "2", "--run.steps", "3", "--eval.episodes", "4",
               "--run.sample_episodes", "100", "--ray.num_workers", "1")
    train_async(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    # version 0 joins at the start, then every version; the newest 2 are kept
    assert [r["game/pool_versions"] for r in rows] == [2.0, 2.0, 2.0]
    opponents = set()
    for path in (tmp_path / "episodes").glob("step-*.jsonl"):
        opponents |= {ep.info["opponent"] for ep in read_episodes(path)}
    assert opponents and opponents <= {"pool-v0", "pool-v1", "pool-v2"}
    evaluated = read_episodes(tmp_path / "eval_after.jsonl")  # against the fixed players
    assert {ep.info["opponent"] for ep in evaluated} == {"random", "minimax"}


def test_the_learner_sends_the_pool_with_the_weights_and_again_after_a_restart():
    pytest.importorskip("ray")
    from turnrl.distributed.book import AssignmentBook
    from turnrl.distributed.fleet import Fleet
    from turnrl.distributed.workers import WorkerReport

    log = []
    fleet = Fleet([RecordingHandle(log)], AssignmentBook(lambda index: index))
    fleet.weights.newest = (0, "ref-0")
    fleet.send_weights(0)
    assert [name for name, _ in log] == ["set_weights"]  # no pool: nothing else sent
    fleet.set_pool([0])
    fleet.weights.newest = (1, "ref-1")
    fleet.send_weights(0)
    fleet.set_pool([0, 1])
    assert log[1:] == [("set_pool", ([(0, ["ref-0"])],)), ("set_weights", (1, ["ref-1"])),
                       ("set_pool", ([(0, ["ref-0"])],)),
                       ("set_pool", ([(0, ["ref-0"]), (1, ["ref-1"])],))]
    fleet.weights.newest = (2, "ref-2")
    fleet.set_pool([1, 2])  # the oldest leaves; its weights are no longer sent
    assert log[-1] == ("set_pool", ([(1, ["ref-1"]), (2, ["ref-2"])],))
    # a restarted worker reports no weights: it gets the weights and the pool again
    del log[:]
    fleet.incarnation[0] = "before"
    fleet.reconcile(0, fleet._next_seq(), WorkerReport(0, "after", [], set(), -1, -1))
    assert log == [("set_weights", (2, ["ref-2"])),
                   ("set_pool", ([(1, ["ref-1"]), (2, ["ref-2"])],))]


def test_a_game_whose_pool_never_comes_fails_alone_with_the_reason(tiny):
    from turnrl.rollout import run_episodes
    from turnrl.selfplay.pool import OpponentPool, PoolDraw

    _, tok = tiny
    chat = ChatFormat(tok)
    empty = OpponentPool(chat, SamplingParams(3, 1.0), size=2, every=1)

    class Quick:
        name = "quick"

        def act(self, system_prompt, observation):
            return next(str(c) for c in range(1, 10) if str(c) in observation)

    built = []

    def make():  # the policy plays O: the opponent moves at reset
        env = make_env("tictactoe", opponent="pool", role="o")
        env.set_opponent(PoolDraw(empty, wait_s=0.2) if not built else Quick())
        built.append(env)
        return env

    starved, fine = run_sync(run_episodes(
        make, [(0, 0), (1, 1)], MovesEngine(tok, ["5", "9", "3", "7"]), chat,
        SamplingParams(4, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="tictactoe"))
    assert starved.status == "error" and "the opponent pool is empty" in starved.info["reason"]
    assert fine.status == "done" and fine.info["opponent"] == "quick"
