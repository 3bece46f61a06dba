"""Placement on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``): the learner's
node (the head: 1 CPU, 1 logical GPU), node "a" (2 CPUs, 2 of the custom resource
``rollout``, label pool=a) and node "b" (2 CPUs, 1 logical GPU, label pool=b). Workers land
where ray.placement, ray.worker_resources and ray.worker_labels say; the learner's seat holds
its CPUs and GPU. docs/cluster.md."""

from __future__ import annotations

import time

import pytest

from tests.conftest import no_ray_oom_killer
from turnrl.config import ConfigError, load_config
from turnrl.distributed.placement import (
    LearnerSeat,
    auto_learner_gpus,
    learner_threads,
    release_placement,
    worker_bundle,
    worker_group,
    worker_options,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402 - after the skip

TINY = ["--model.name", "tiny", "--rollout.max_new_tokens", "3", "--run.progress", "false",
        "--run.tensorboard", "false", "--run.mode", "async", "--env.name", "say-digit",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--eval.episodes", "0",
        "--run.checkpoint_every", "0"]


def config(*args: str):
    return load_config(None, TINY + list(args))


def test_a_worker_bundle_and_options_carry_every_reservation():
    cfg = config("--ray.worker_cpus", "2", "--ray.worker_resources.rollout", "1",
                 "--ray.worker_labels.pool", "a")
    assert worker_bundle(cfg) == {"CPU": 2.0, "rollout": 1.0}  # no GPU: zeros left out
    options = worker_options(cfg)
    assert options["resources"] == {"rollout": 1.0} and options["label_selector"] == {
        "pool": "a"}
    assert worker_bundle(config("--ray.worker_cpus", "0")) == {}
    for bad, why in ((["--ray.worker_resources.GPU", "1"], "ray.worker_gpus"),
                     (["--ray.worker_resources.x", "0"], "positive amount"),
                     (["--ray.learner_gpus", "-2"], "-1 \\(auto\\)"),
                     (["--ray.placement", "scatter"], "placement")):
        with pytest.raises(ConfigError, match=why):
            config(*bad)


@pytest.mark.parametrize(("on_cuda", "cluster", "worker", "workers", "node_free", "want"), [
    (False, 4, 1, 1, 1, 0.0),  # the learner on the CPU: nothing to hold
    (True, 2, 1, 1, 1, 1.0),  # a GPU to spare beyond the workers': the learner's, whole
    (True, 1, 1, 1, 1, 0.0),  # one GPU the worker takes whole: shared as before, not held
    (True, 1, 0.5, 1, 1, 0.5),  # half for the worker, the other half held for the learner
    (True, 1, 0.3, 2, 1, 0.4),
    (True, 3, 1, 1, 0, 0.0),  # spare GPUs, but none on the learner's node
])
def test_the_learners_gpu_share_is_what_the_workers_leave(on_cuda, cluster, worker, workers,
                                                          node_free, want):
    assert auto_learner_gpus(on_cuda, cluster, worker, workers, node_free) == pytest.approx(want)


def test_learner_threads_follow_its_own_reservation(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # joined: not every core of the node
    for threads, cpus, want in ((2, 1, 1), (0, 1, 1), (4, 2, 2), (1, 4, 1), (3, 0, 3)):
        cfg = config("--ray.learner_cpus", str(cpus), "--run.threads", str(threads))
        assert learner_threads(cfg) == want, (threads, cpus)


@pytest.fixture(scope="module")
def cluster():
    with no_ray_oom_killer():
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1})
        nodes.add_node(num_cpus=2, resources={"rollout": 2}, labels={"pool": "a"})
        nodes.add_node(num_cpus=2, num_gpus=1, labels={"pool": "b"})
    nodes.wait_for_nodes()
    yield nodes
    if ray.is_initialized():
        ray.shutdown()
    nodes.shutdown()


@pytest.fixture
def connected(cluster):
    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False)
    yield cluster


def node_names() -> dict[str, str]:
    """Node id -> 'head', 'a' or 'b'."""
    head = ray.get_runtime_context().get_node_id()
    names = {}
    for node in ray.nodes():
        if node["Alive"]:
            names[node["NodeID"]] = ("head" if node["NodeID"] == head
                                     else node.get("Labels", {}).get("pool", "?"))
    return names


def wait_free_cpus(cpus: float, timeout_s: float = 180) -> None:
    """Ray frees a killed actor's resources a moment later."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) != cpus:
        assert time.monotonic() < deadline, f"free: {ray.available_resources()}"
        time.sleep(0.2)


def leased_node(handle, timeout_s: float = 300) -> str:
    """The node whose raylet gave ``handle``'s actor a worker process: in Ray's actor table,
    its address once a pid is there (before that the node may still be a forwarding one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = ray._private.state.actors(handle._actor_id.hex())
        assert info.get("State") != "DEAD", info
        if info.get("Pid"):
            return info["Address"]["NodeID"]
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def placed(cfg, group=None) -> list[str]:
    """Start ``cfg``'s workers and return the node each landed on; then stop them, once
    each has its process: the seconds a worker then spends importing torch and building its
    model say nothing of where it went (spawn_workers' actors start in every async test)."""
    from turnrl.distributed.workers import spawn_workers
    from turnrl.envs import ENVS

    handles = spawn_workers(cfg, env_factory=ENVS["say-digit"], pool_size=2, group=group)
    try:
        ids = [leased_node(handle) for handle in handles]
    finally:
        for handle in handles:
            ray.kill(handle)
    names = node_names()
    return [names[i] for i in ids]


@pytest.mark.slow
def test_spread_puts_the_workers_on_different_nodes_and_pack_on_one(connected):
    for strategy, distinct in (("spread", 2), ("strict_spread", 2), ("pack", 1),
                               ("strict_pack", 1)):
        wait_free_cpus(5)  # the last strategy's workers and bundles are given back
        cfg = config("--ray.num_workers", "2", "--ray.placement", strategy)
        group = worker_group(cfg)
        try:
            nodes = placed(cfg, group)
        finally:
            release_placement(None, group)
        assert len(set(nodes)) == distinct, (strategy, nodes)


@pytest.mark.slow
def test_workers_go_where_their_resources_and_labels_are(connected):
    assert placed(config("--ray.num_workers", "2", "--ray.worker_resources.rollout",
                         "1")) == ["a", "a"]
    assert placed(config("--ray.num_workers", "2", "--ray.worker_labels.pool", "b")) == [
        "b", "b"]
    # In a placement group the labels go on the bundles.
    cfg = config("--ray.num_workers", "2", "--ray.worker_labels.pool", "b",
                 "--ray.placement", "pack")
    group = worker_group(cfg)
    try:
        assert placed(cfg, group) == ["b", "b"]
    finally:
        release_placement(None, group)


@pytest.mark.slow
def test_a_placement_that_cannot_fit_is_one_clear_line(connected):
    for args in (["--ray.num_workers", "4", "--ray.placement", "strict_spread"],
                 ["--ray.num_workers", "3", "--ray.placement", "strict_pack"],
                 ["--ray.num_workers", "1", "--ray.placement", "pack",
                  "--ray.worker_labels.pool", "z"]):
        with pytest.raises(RuntimeError, match=r"ray.placement \w+: \d worker bundles of "
                                               r"\{'CPU': 1.0\}.* did not fit the cluster"):
            worker_group(config(*args), wait_s=1)  # none can ever fit: no need to wait
    wait_free_cpus(5)  # the failed groups were removed


@pytest.mark.slow
def test_the_learners_seat_holds_its_gpu_and_cpus_on_its_own_node(connected):
    """With the learner on CUDA its GPU is held: a GPU worker then lands on the other GPU
    node, never on the learner's; its CPUs are held on its node, and a seat that does not
    fit is one clear line."""
    head = ray.get_runtime_context().get_node_id()

    def free_on_head(name):
        return ray._private.state.available_resources_per_node()[head].get(name, 0.0)

    # earlier tests' workers are killed without waiting (ray.kill returns first): at load ~10
    # the seat found 4 of the 5 CPUs free and its node's one held for its whole 120 s
    wait_free_cpus(5)
    seat = LearnerSeat.take(config("--ray.learner_cpus", "1"), on_cuda=True)
    try:
        assert (seat.cpus, seat.gpus, seat.gpu_ids) == (1, 1.0, ["0"])
        assert free_on_head("CPU") == 0 and free_on_head("GPU") == 0
        assert placed(config("--ray.num_workers", "1", "--ray.worker_gpus", "1")) == ["b"]
    finally:
        seat.release()
    assert LearnerSeat.take(config(), on_cuda=False).group is None  # nothing to hold
    with pytest.raises(RuntimeError, match=r"the learner's reservation \(ray.learner_cpus 2, "
                                           r"ray.learner_gpus 0\) is not free on its node"):
        LearnerSeat.take(config("--ray.learner_cpus", "2"), on_cuda=False, wait_s=1)


@pytest.mark.slow
def test_an_async_run_spreads_its_workers_and_gives_the_placement_back(connected, tmp_path,
                                                                       monkeypatch):
    from turnrl.launch import train_async

    monkeypatch.setenv("RAY_ADDRESS", connected.address)
    cfg = config("--ray.num_workers", "2", "--ray.placement", "strict_spread",
                 "--ray.learner_cpus", "1", "--run.steps", "2",
                 "--run.out_dir", str(tmp_path / "run"))
    result = train_async(cfg)
    assert len(result.trained) == 2 * 2
    if not ray.is_initialized():
        ray.init(address=connected.address, log_to_driver=False)
    wait_free_cpus(5)  # seat and bundles given back


@pytest.mark.slow
def test_workers_on_one_node_share_one_pull_of_each_version(connected, tmp_path, monkeypatch):
    """Two workers packed on one node: each version they load reaches that node once (Ray
    keeps one copy per node, read by both), and the learner's per-node metric counts the
    versions Ray's object directory shows on that node, once each, not once per worker."""
    import json

    from turnrl.distributed.fleet import Fleet
    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.launch import train_async
    from turnrl.lora import state_bytes
    from turnrl.metrics import read_metrics
    from turnrl.models import tiny_model

    monkeypatch.setenv("RAY_ADDRESS", connected.address)
    published = []  # (version, ref), kept alive to ask Ray where each version went
    real_publish = Fleet.publish

    def publish(self, version, model):
        real_publish(self, version, model)
        published.append(self.weights.newest)

    monkeypatch.setattr(Fleet, "publish", publish)
    steps = 4
    run_dir = tmp_path / "run"
    cfg = config("--ray.num_workers", "2", "--ray.placement", "strict_pack",
                 "--run.steps", str(steps), "--run.out_dir", str(run_dir))
    version_bytes = state_bytes(without_tied_weights(tiny_model()[0].state_dict()))
    result = train_async(cfg)
    assert len(result.trained) == steps * 2
    names = node_names()
    where = ray.experimental.get_object_locations([ref for _, ref in published])
    on_nodes = {version: {names[n] for n in where[ref]["node_ids"]} for version, ref in published}
    lines = (run_dir / "assignments.jsonl").read_text().splitlines()
    by_node = [json.loads(line)["weights_bytes_by_node"] for line in lines]
    [node_key] = {key for step in by_node for key in step}  # one node, both workers on it
    counted = sum(step.get(node_key, 0) for step in by_node)
    [worker_node] = {node for nodes in on_nodes.values() for node in nodes} - {"head"}
    pulled = [v for v, nodes in on_nodes.items() if worker_node in nodes]
    # Counted in whole versions, each once, and every counted one is on the node; the
    # versions loaded after the last step's metrics are on the node but not yet counted.
    assert counted % version_bytes == 0 and counted >= version_bytes
    assert counted // version_bytes <= len(pulled) <= counted // version_bytes + 2, on_nodes
    per_node = [r["async/weights_mb_per_node"] for r in read_metrics(run_dir / "metrics.jsonl")
                if "async/weights_mb_per_node" in r]
    assert sum(per_node) * 1e6 == pytest.approx(counted)
