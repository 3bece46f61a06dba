"""A real multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head with no CPUs and one
worker node, each its own raylet): joining by $RAY_ADDRESS, code and files reaching the
workers, node loss survived or named. docs/cluster.md."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import uuid

import pytest

from tests.conftest import no_ray_oom_killer
from turnrl.config import ConfigError, load_config
from turnrl.distributed.cluster import (
    WorkerSetup,
    check_reachable,
    local_cluster_cpus,
    module_to_ship,
    worker_runtime_env,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402 - after the skip

TINY = ["--model.name", "tiny", "--rollout.max_new_tokens", "3", "--run.progress", "false",
        "--run.tensorboard", "false", "--run.mode", "async", "--optim.lr", "1e-3",
        "--ray.num_workers", "1", "--rollout.group_size", "2", "--rollout.groups_per_step", "2",
        "--eval.episodes", "0", "--run.checkpoint_every", "0"]

ENV_MODULE = '''
import logging
from turnrl.envs import StepResult, register_env

@register_env("{name}")
class ShippedDigit:
    """Lives in a module the worker node cannot import on its own."""

    def __init__(self, turns=1):
        self.turns = turns

    async def reset(self, seed):
        self.turn = 0
        logging.getLogger("shipped").warning("reset seed %d", seed)
        return "Say a digit."

    async def step(self, action):
        self.turn += 1
        done = self.turn >= self.turns
        return StepResult("Again." if not done else "", float(action[:1].isdigit()), done, {{}})
'''


@pytest.fixture(scope="module")
def cluster():
    """A head that runs nothing (0 CPUs, as a cluster's head often is) and one 1-CPU node."""
    with no_ray_oom_killer():
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    yield nodes
    nodes.shutdown()


@pytest.fixture(scope="module")
def shipped_env(tmp_path_factory):
    """An env in a module on the learner's sys.path only (the worker gets it by py_modules)."""
    folder = tmp_path_factory.mktemp("user_code")
    module = f"cluster_env_{uuid.uuid4().hex[:8]}"
    name = f"shipped-digit-{module[-8:]}"
    (folder / f"{module}.py").write_text(ENV_MODULE.format(name=name))
    sys.path.insert(0, str(folder))
    __import__(module)
    yield name
    sys.path.remove(str(folder))


@pytest.fixture
def joined(cluster, monkeypatch):
    """$RAY_ADDRESS set, ray.address empty: as under `ray job submit` or in a cluster pod."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    yield cluster
    if ray.is_initialized():
        ray.shutdown()


def _ensure_worker_node(cluster) -> None:
    if not cluster.worker_nodes:
        with no_ray_oom_killer():
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()


def test_runtime_env_ships_user_modules_and_caches_but_not_installed_code(shipped_env,
                                                                          monkeypatch):
    from turnrl.envs import ENVS

    monkeypatch.setenv("TURNRL_CACHE", "/shared/turnrl-cache")
    cfg = load_config(None, TINY + ["--env.name", shipped_env,
                                    "--ray.runtime_env.env_vars.HF_HOME", "/shared/hf",
                                    "--ray.runtime_env.pip", "[]"])
    env = worker_runtime_env(cfg, [ENVS[shipped_env]])
    [shipped] = env["py_modules"]
    assert shipped.endswith(".py") and os.path.isfile(shipped)
    assert env["env_vars"] == {"TURNRL_CACHE": "/shared/turnrl-cache", "HF_HOME": "/shared/hf"}
    assert env["pip"] == []  # passed through as given
    import torch

    import turnrl.envs

    # Installed packages, turnrl and __main__ (pickled by value) are not shipped.
    assert module_to_ship(torch.nn.Linear) is None
    assert module_to_ship(turnrl.envs.make_env) is None
    assert module_to_ship(type("Here", (), {"__module__": "__main__"})) is None


def test_a_local_cluster_counts_the_workers_and_every_ray_actor_learner_rank():
    def cpus(*args: str) -> int:
        return local_cluster_cpus(load_config(None, ["--model.name", "tiny", *args]), 2)

    assert cpus() == 2  # 1 worker: the machine's 2 cores
    assert cpus("--ray.num_workers", "2", "--ray.learner_cpus", "1") == 3
    ranks = ["--learner.world_size", "2", "--learner.launcher", "ray"]
    assert cpus(*ranks) == 3  # 1 worker + 2 ranks of 1 CPU (each rank's bundle needs one)
    assert cpus(*ranks, "--ray.learner_cpus", "2") == 5
    assert cpus("--learner.world_size", "2", "--ray.learner_cpus", "2") == 3  # local ranks


def test_an_unreachable_address_is_one_clear_line():
    for address in ("127.0.0.1:1", "127.0.0.1:9"):
        with pytest.raises(ConfigError, match=r"cannot reach the Ray cluster at .* \$RAY_ADDRESS"):
            check_reachable(address, timeout_s=2)
    with pytest.raises(ConfigError, match="not 'auto' or HOST:PORT"):
        check_reachable("nohost")


def test_files_travel_as_content_and_a_missing_model_dir_names_the_node(tmp_path, monkeypatch):
    from turnrl.models import tiny_tokenizer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jinja").write_text(tiny_tokenizer().chat_template)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config(None, TINY + ["--env.name", "say-digit",
                                    "--model.chat_template", "chat.jinja",
                                    "--model.name", "model"])
    sent, setup = WorkerSetup.of(cfg)
    assert sent.model.name == str(model)  # absolute: the worker's cwd is another
    assert setup.files["model.chat_template"] == (tmp_path / "chat.jinja").read_text()
    (model / "config.json").unlink()  # as on a node without the directory
    with pytest.raises(RuntimeError, match=f"worker 3 on .*: the model directory {model} "
                                           "is missing on that node"):
        setup.apply(sent, 3)
    old = WorkerSetup("0.0.1", setup.files)
    with pytest.raises(RuntimeError, match="runs turnrl .* the learner 0.0.1: install"):
        old.apply(sent, 0)


@pytest.mark.slow
def test_async_training_joins_by_ray_address_with_shipped_code_and_files(
        joined, shipped_env, tmp_path, monkeypatch, caplog):
    """The env's module is not importable on the worker node without py_modules, the chat
    template is a path relative to the learner's cwd, and the run joins by $RAY_ADDRESS."""
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics
    from turnrl.models import tiny_tokenizer

    _ensure_worker_node(joined)
    module = module_to_ship(__import__("turnrl.envs", fromlist=["ENVS"]).ENVS[shipped_env])
    run_dir = tmp_path / "run"
    learner_cwd = tmp_path / "learner"
    learner_cwd.mkdir()
    monkeypatch.chdir(learner_cwd)
    (learner_cwd / "chat.jinja").write_text(tiny_tokenizer().chat_template)
    cfg = load_config(None, TINY + ["--env.name", shipped_env, "--run.steps", "2",
                                    "--model.chat_template", "chat.jinja",
                                    "--run.out_dir", str(run_dir)])
    with caplog.at_level("WARNING", logger="turnrl.worker"):
        result = train_async(cfg)
    assert len(result.trained) == 2 * 2
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    # The worker's warnings reached the learner, named by worker and node.
    assert any("[worker 0 @ " in r.getMessage() and "reset seed" in r.getMessage()
               for r in caplog.records)
    # Without the runtime_env the worker node could not have imported the env's module,
    # nor found the template at the learner's relative path.
    ray.init(address=joined.address, log_to_driver=False)
    name = os.path.basename(module).removesuffix(".py")

    @ray.remote(num_cpus=1)
    def probe():
        import importlib.util
        return importlib.util.find_spec(name) is None, os.path.exists("chat.jinja")

    assert ray.get(probe.remote(), timeout=120) == (True, False)


def _kill_node_after_first_step(cluster, run_dir, then=None):
    """Remove the worker's node once the learner has trained a step; ``then()`` after."""
    def kill():
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                cluster.remove_node(next(iter(cluster.worker_nodes)))
                if then is not None:
                    then()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_lost_node_without_spare_room_is_named_and_its_worker_killed(joined, tmp_path):
    from turnrl.launch import train_async

    _ensure_worker_node(joined)
    run_dir = tmp_path / "run"
    cfg = load_config(None, TINY + ["--env.name", "say-digit", "--run.steps", "50",
                                    "--ray.node_loss_wait_s", "3",
                                    "--run.out_dir", str(run_dir)])
    ray.cloudpickle.register_pickle_by_value(sys.modules["tests.conftest"])
    try:
        killer = _kill_node_after_first_step(joined, run_dir)
        with pytest.raises(RuntimeError) as caught:
            train_async(cfg)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules["tests.conftest"])
    killer.join(60)
    message = str(caught.value)
    assert "every rollout worker is down: worker 0 on " in message
    assert "node dead" in message and re.search(r"dead nodes: \S+ \(\w{8}\)", message)
    assert "a restart needs CPU 1 (free 0)" in message and "ray.node_loss_wait_s" in message
    assert "\n" not in message


def _wait_for_steps(run_dir, steps: int, timeout_s: float = 300) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        assert time.monotonic() < deadline, f"no step {steps} within {timeout_s:g} s"
        time.sleep(0.05)


def _wait_until_lost(node, timeout_s: float = 120) -> None:
    """Until Ray lists ``node`` as dead and a rollout worker as restarting (its actor waits for
    room): the loss is known to the cluster, not only to the node's own processes."""
    deadline = time.monotonic() + timeout_s
    while True:
        dead = any(n["NodeID"] == node.node_id and not n["Alive"] for n in ray.nodes())
        restarting = any(a["State"] == "RESTARTING" and "-rollout-" in a["Name"]
                         for a in ray._private.state.actors().values())
        if dead and restarting:
            return
        assert time.monotonic() < deadline, f"dead {dead}, restarting {restarting}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("user_module", [False, True],
                         ids=["builtin-env-back-at-once", "shipped-env-back-once-declared-lost"])
def test_a_node_removed_then_added_back_the_run_finishes_every_group_once(
        joined, shipped_env, tmp_path, user_module):
    """The worker restarts on the replacement node (with and without py_modules to set up
    there; the node back at once, or once Ray has declared the old one dead and the worker
    restarting: the event a fixed 20 s away stood for) and the run trains every group exactly
    once. The learner runs in a thread: Ray starts a node only from the main thread (it sets a
    signal handler)."""
    from turnrl.launch import train_async

    _ensure_worker_node(joined)
    run_dir = tmp_path / "run"
    env = shipped_env if user_module else "say-digit"
    cfg = load_config(None, TINY + ["--env.name", env, "--run.steps", "4",
                                    "--ray.node_loss_wait_s", "600",
                                    "--run.out_dir", str(run_dir)])
    outcome: dict = {}

    def learn():
        try:
            outcome["result"] = train_async(cfg)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = err

    learner = threading.Thread(target=learn, daemon=True)
    learner.start()
    _wait_for_steps(run_dir, 1)
    lost = next(iter(joined.worker_nodes))
    joined.remove_node(lost)
    if user_module:
        _wait_until_lost(lost)
    joined.add_node(num_cpus=1)
    added = time.monotonic()
    learner.join(600)
    assert not learner.is_alive(), "the run did not finish within 600 s of the node's return"
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    assert result.worker_restarts >= 1
    ids = [assignment for assignment, _ in result.trained]
    assert len(ids) == 4 * 2 and len(set(ids)) == len(ids)  # every group trained once
    # Loose: a restart on the new node takes seconds; the bug was minutes (not a timing test).
    back_s = time.monotonic() - added
    print(f"run finished {back_s:.1f} s after the node came back")
    assert back_s < 180


def _rollout_actors() -> list[str]:
    """Names of this cluster's rollout workers that are not dead (restarting counts)."""
    return [name for name in ray.util.list_named_actors() if "-rollout-" in name]


HELD_ENV_MODULE = '''
import asyncio
import os
import ray
from turnrl.envs import StepResult, register_env

def mark(seed):
    """An empty file naming the actor (worker incarnation) that played ``seed`` to its end."""
    actor = ray.get_runtime_context().get_actor_name() or "none"
    open(os.path.join({marks!r}, f"{{actor}}~{{seed}}"), "w").close()

@register_env("{name}")
class HeldDigit:
    """Steps wait while the file HOLD exists: the test pauses every worker's work with it."""

    async def reset(self, seed):
        self.seed = seed
        return "Say a digit."

    async def step(self, action):
        while os.path.exists({hold!r}):
            await asyncio.sleep(0.05)
        mark(self.seed)
        return StepResult("", float(action[:1].isdigit()), True, {{}})
'''


@pytest.fixture
def held_env(tmp_path):
    """An env whose steps wait while a file exists (shipped to the workers by py_modules);
    it leaves a file in ``marks`` per episode end, naming the actor that played it."""
    folder = tmp_path / "held_code"
    folder.mkdir()
    module = f"held_env_{uuid.uuid4().hex[:8]}"
    name = f"held-digit-{module[-8:]}"
    hold, marks = tmp_path / "hold", tmp_path / "marks"
    marks.mkdir()
    (folder / f"{module}.py").write_text(HELD_ENV_MODULE.format(name=name, hold=str(hold),
                                                                marks=str(marks)))
    sys.path.insert(0, str(folder))
    __import__(module)
    yield name, hold, marks
    sys.path.remove(str(folder))


def _played(marks) -> list[tuple[str, int]]:
    """(actor name, seed) of each episode the held env played to its end."""
    return [(actor, int(seed)) for actor, seed in
            (path.name.split("~") for path in marks.iterdir())]


@pytest.mark.slow
def test_a_given_up_worker_is_killed_then_revived_when_a_node_returns(joined, held_env,
                                                                       tmp_path, caplog):
    """Two workers on two nodes; one node goes with no room left for its worker: that worker
    is given up after ray.node_loss_wait_s and killed (not left restarting), its work moves to
    the other; a node added later gets a fresh actor in its place, which trains groups again,
    and every group is still trained once. The work is held (the env waits on a file) from
    the node's loss until the revived worker is up, so the run cannot end before.

    When the learner's first pool decision came after the hold, it saw the held steps'
    latencies (a slow tool, by Little's law: a pool of hundreds of groups); issued whole, the
    surviving worker's burst fed every remaining step and the revived worker's groups were
    never read: 3 of 6 runs before the fix (docs/cluster.md)."""

    from turnrl.distributed import LEDGER_FILE
    from turnrl.launch import train_async

    env, hold, marks = held_env
    _ensure_worker_node(joined)
    joined.add_node(num_cpus=1)
    joined.wait_for_nodes()
    run_dir = tmp_path / "run"
    steps = 30
    cfg = load_config(None, TINY + ["--env.name", env, "--run.steps", str(steps),
                                    "--ray.num_workers", "2", "--ray.node_loss_wait_s", "3",
                                    "--run.out_dir", str(run_dir)])
    outcome: dict = {}

    def learn():
        try:
            outcome["result"] = train_async(cfg)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = err

    def wait_for_log(text: str) -> str:
        deadline = time.monotonic() + 300
        while not (found := [r.getMessage() for r in caplog.records if text in r.getMessage()]):
            assert learner.is_alive(), f"the run ended before {text!r}: {outcome}"
            assert time.monotonic() < deadline, f"no {text!r} logged"
            time.sleep(0.1)
        return found[0]

    with caplog.at_level("WARNING", logger="turnrl.worker"):
        learner = threading.Thread(target=learn, daemon=True)
        learner.start()
        _wait_for_steps(run_dir, 1)
        assert len(_rollout_actors()) == 2
        hold.touch()
        joined.remove_node(next(iter(joined.worker_nodes)))
        given_up = wait_for_log("given up")
        alive = _rollout_actors()  # read while the run goes on (its end kills every worker)
        joined.add_node(num_cpus=1)
        wait_for_log("revived")
        [revived_name] = [n for n in _rollout_actors() if "-revived-" in n]
        ray.get(ray.get_actor(revived_name).ping.remote(), timeout=300)  # built its model
        revived = _rollout_actors()
        hold.unlink()
        learner.join(600)
    if "error" in outcome:
        raise outcome["error"]
    assert len(alive) == 1, f"the given-up worker was not killed: {alive}"
    # the lost node is named whether or not its worker had reported it ("node dead"/"alive")
    assert "dead nodes: " in given_up and "ray.node_loss_wait_s" in given_up
    lost = int(re.search(r"rollout worker (\d) given up", given_up).group(1))
    assert sorted(name.rsplit("-rollout-", 1)[1] for name in revived) == sorted(
        [str(1 - lost), f"{lost}-revived-1"])
    result = outcome["result"]
    ids = [assignment for assignment, _ in result.trained]
    assert len(ids) == steps * 2 and len(set(ids)) == len(ids)
    # The revived worker trains again: groups it played to the end (its actor marked them)
    # were trained, as worker `lost`. Seeds are never re-issued here (no regeneration).
    ledger = [json.loads(line) for line in (run_dir / LEDGER_FILE).read_text().splitlines()]
    played = {seed for actor, seed in _played(marks) if actor == revived_name}
    trained = [seed for line in ledger for _, seed, worker in line["trained"]
               if worker == lost and seed in played]
    assert trained, f"the revived worker trained no group (it played {len(played)})"
    # ... and its share: from the first step that trained one of its groups on, a fair part of
    # what was trained is its own (half expected, the share it takes at its first report, and
    # new work by load; the bug left it none), not a straggler or two.
    mine = [[worker == lost and seed in played for _, seed, worker in line["trained"]]
            for line in ledger]
    first = min(i for i, step in enumerate(mine) if any(step))
    after = [own for step in mine[first:] for own in step]
    assert sum(after) >= len(after) / 6, (
        f"the revived worker trained {sum(after)} of the {len(after)} groups trained after its "
        "first")
    # Issued work stays within what the run can train (the bug left hundreds unplayed).
    assert len(result.abandoned) < steps, f"{len(result.abandoned)} groups abandoned"
