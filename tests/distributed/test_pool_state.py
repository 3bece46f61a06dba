"""The opponent pool of an async run in checkpoints (turnrl/distributed/pool_state.py): an
async pool run interrupted after a checkpoint resumes with the uninterrupted run's pool
versions, every member's weights in the checkpoints and in the workers bit for bit, and each
worker's count of games drawn; a checkpoint without a pool resumes with one warning; a
missing member is refused in one line. Also: a fired call (set_pool, resize, ...) that
raises in a worker is one line naming the worker and the method (turnrl/distributed/
fired.py ``FiredCalls.check``)."""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings

import pytest
import torch

from tests.conftest import RecordingHandle, local_ray
from turnrl.config import load_config
from turnrl.metrics import read_metrics

STEPS = 4


@pytest.fixture(scope="module")
def ray_pool():
    with local_ray() as ray:
        yield ray


def _cfg(out, steps=STEPS, opponent="pool"):
    return load_config(None, _args(out, steps, opponent))


def _args(out, steps=STEPS, opponent="pool"):
    return [
        "--model.name", "tiny", "--env.name", "tictactoe", "--env.options.opponent", opponent,
        "--env.opponent_pool_size", "3", "--env.opponent_pool_every", "1",
        "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--optim.lr", "1e-2", "--eval.episodes", "0",
        # the tiny model forfeits most games (advantages 0): the entropy term moves every step
        "--algo.entropy_coef", "0.05",
        "--run.mode", "async", "--ray.num_workers", "1", "--run.steps", str(steps),
        "--run.checkpoint_every", "2", "--run.keep_checkpoints", "5",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.out_dir", str(out)]


class Recorder:
    """What a run publishes (version -> its published tensors, cloned) and, at its first
    collection, what each worker's pool holds (games drawn, version -> digest)."""

    def __init__(self, monkeypatch):
        from turnrl.distributed.source import RaySource
        from turnrl.lora import published_state

        self.published: dict[int, dict] = {}
        self.workers: list | None = None
        publish, collect = RaySource.publish, RaySource.collect

        def publishing(source, version, model):
            self.published[version] = {k: v.clone() for k, v in published_state(model).items()}
            return publish(source, version, model)

        def collecting(source, step):
            if self.workers is None:  # fired calls to an actor run in order: after set_pool
                import ray

                self.workers = ray.get([h.pool_digests.remote() for h in source.fleet.handles])
            return collect(source, step)

        monkeypatch.setattr(RaySource, "publish", publishing)
        monkeypatch.setattr(RaySource, "collect", collecting)


def _train(cfg, monkeypatch, *, resume=False, stop_at=None):
    """``cfg``'s async run (``stop_at``: stopped as a kill would, collecting that 0-based
    step); what it published and what its workers' pools held at its first collection."""
    from turnrl.distributed.source import RaySource
    from turnrl.launch import train_async

    with monkeypatch.context() as patch:
        recorder = Recorder(patch)
        if stop_at is None:
            train_async(cfg, resume=resume)
            return recorder
        collect = RaySource.collect

        def interrupted(source, step):
            if step == stop_at:
                raise KeyboardInterrupt
            return collect(source, step)
        patch.setattr(RaySource, "collect", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train_async(cfg, resume=resume)
    return recorder


def _checkpoint(run_dir, step):
    return run_dir / "checkpoints" / f"step-{step:06d}"


def _pool(run_dir, step):
    return json.loads((_checkpoint(run_dir, step) / "state.json").read_text())["opponent_pool"]


def _member(run_dir, step, version=None):
    """The published tensors of a checkpoint's model (``version`` None) or pool member."""
    from turnrl.checkpoint import load_frozen, load_weights
    from turnrl.lora import published_state
    from turnrl.models import tiny_model

    model = tiny_model()[0]
    if version is None:
        load_weights(_checkpoint(run_dir, step), model)
    else:
        assert load_frozen(_checkpoint(run_dir, step), f"opponent_pool/v{version:06d}", model)
    return published_state(model)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _digest(state):
    from turnrl.distributed.weight_sync import weights_digest

    return weights_digest(state)


def _pool_sizes(run_dir):
    return [row["game/pool_versions"] for row in read_metrics(run_dir / "metrics.jsonl")]


def _inode(run_dir, step, version=None):
    folder = _checkpoint(run_dir, step)
    folder = folder if version is None else folder / "opponent_pool" / f"v{version:06d}"
    return (folder / "model.safetensors").stat().st_ino


@pytest.fixture(scope="module")
def straight(ray_pool, tmp_path_factory):
    """The uninterrupted run: its directory and what it published."""
    out = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as patch:
        recorder = _train(_cfg(out), patch)
    return out, recorder


@pytest.fixture(scope="module")
def cut(ray_pool, tmp_path_factory):
    """The same run stopped while collecting step 3 (after step 2's checkpoint), a copy of
    its directory as it was then, and what it published."""
    out = tmp_path_factory.mktemp("cut")
    with pytest.MonkeyPatch.context() as patch:
        recorder = _train(_cfg(out), patch, stop_at=2)
    snapshot = tmp_path_factory.mktemp("snapshot") / "run"
    shutil.copytree(out, snapshot)
    config = snapshot / "config.yaml"  # the copy is a run of its own
    config.write_text(config.read_text().replace(str(out), str(snapshot)))
    return out, snapshot, recorder


def test_an_async_run_checkpoints_its_pool_as_a_sync_run_does(straight):
    out, recorder = straight
    assert _pool_sizes(out) == [2.0, 3.0, 3.0, 3.0]  # versions 0-1, 0-2, 1-3, 2-4
    assert _pool(out, 2)["versions"] == [0, 1, 2] and _pool(out, 4)["versions"] == [2, 3, 4]
    (draws,) = _pool(out, 2)["worker_draws"]  # one worker: its games drawn so far
    assert draws >= 2 * 2 * 2 and _pool(out, 2)["draws"] == draws  # >= the games trained
    # each member's weights: those the learner published as that version (older ones built
    # from the object store when first written, the newest a link to the model's own file)
    for step, versions in ((2, (0, 1, 2)), (4, (2, 3, 4))):
        for version in versions:
            assert _equal(_member(out, step, version), recorder.published[version]), version
    assert all(not _equal(recorder.published[v], recorder.published[v + 1]) for v in range(4))
    assert _inode(out, 2, 2) == _inode(out, 2) and _inode(out, 4, 4) == _inode(out, 4)
    assert _inode(out, 4, 2) == _inode(out, 2, 2)  # written once, linked after
    assert _inode(out, 4, 3) not in {_inode(out, 2), _inode(out, 4)}


def test_a_resumed_async_pool_run_plays_the_saved_pool_in_every_worker(straight, cut,
                                                                        monkeypatch):
    out, snapshot, before = cut
    assert _pool(out, 2)["versions"] == [0, 1, 2] and not _checkpoint(out, 4).exists()
    saved = _pool(out, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _train(_cfg(out), monkeypatch, resume=True)
    assert not [w for w in caught if "opponent pool" in str(w.message)]  # none to warn of
    # the pool each step, the versions each checkpoint saves: the uninterrupted run's
    assert _pool_sizes(out) == _pool_sizes(straight[0]) == [2.0, 3.0, 3.0, 3.0]
    assert _pool(out, 4)["versions"] == _pool(straight[0], 4)["versions"] == [2, 3, 4]
    # every worker held the checkpoint's members, bit for bit, before its first resumed
    # game, and counts its games drawn on from where the checkpoint left it
    ((draws, held),) = resumed.workers
    assert held == {v: _digest(_member(out, 2, v)) for v in (0, 1, 2)}
    assert draws >= saved["worker_draws"][0] > 0
    # the members the resumed run saves: those of the run before it, then its own versions
    assert _equal(_member(out, 4, 2), _member(out, 2))
    assert _equal(_member(out, 4, 2), before.published[2])
    for version in (3, 4):
        assert _equal(_member(out, 4, version), resumed.published[version])
    assert not _equal(_member(out, 4, 3), _member(out, 4, 2))  # versions of their own
    assert _pool(out, 4)["worker_draws"][0] >= saved["worker_draws"][0]


def test_an_async_checkpoint_without_a_pool_resumes_with_a_new_pool_and_one_warning(
        cut, monkeypatch):
    _, snapshot, _ = cut
    checkpoint = _checkpoint(snapshot, 2)
    state = json.loads((checkpoint / "state.json").read_text())
    del state["opponent_pool"]  # as written before async pools were saved
    del state["files"]  # nor did it list its files' checksums (those came later still)
    (checkpoint / "state.json").write_text(json.dumps(state))
    shutil.rmtree(checkpoint / "opponent_pool")
    with pytest.warns(UserWarning) as caught:
        resumed = _train(_cfg(snapshot, steps=3), monkeypatch, resume=True)
    pool_warnings = [str(w.message) for w in caught if "opponent pool" in str(w.message)]
    assert len(pool_warnings) == 1 and "\n" not in pool_warnings[0]
    assert "has no opponent pool" in pool_warnings[0] and "step 2" in pool_warnings[0]
    assert _pool_sizes(snapshot) == [2.0, 3.0, 2.0]  # versions 2 and 3: a new pool
    ((_, held),) = resumed.workers
    assert set(held) == {2}


def test_an_async_checkpoint_missing_a_members_weights_is_refused_in_one_line(
        ray_pool, straight, tmp_path, capsys):
    from turnrl.cli import main

    torn = tmp_path / "torn"
    shutil.copytree(straight[0], torn)
    config = torn / "config.yaml"
    config.write_text(config.read_text().replace(str(straight[0]), str(torn)))
    shutil.rmtree(_checkpoint(torn, 4) / "opponent_pool" / "v000003")
    code = main(["train", "--resume", "--run.out_dir", str(torn), "--run.steps", "6"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    # state.json lists the member's files: caught before anything is loaded
    assert "opponent_pool/v000003/model.safetensors is missing" in err
    assert "step-000004" in err and "move it aside" in err


# ---- fired calls that raise ---------------------------------------------------------------------

def _polled_until(fleet, check, timeout_s=300.0):
    """Poll ``fleet`` until ``check()`` holds (loose: a busy machine starts actors slowly)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the fired call never finished"
        fleet.poll(timeout_s=0.5)


def test_a_fired_call_that_raises_in_a_worker_is_one_line_naming_worker_and_method(
        ray_pool, tmp_path, caplog):
    """A real worker (it plays no pool): a bad resize is logged and the worker goes on; a
    set_pool it refuses stops the run with the worker, the method and the cause."""
    from turnrl.distributed.book import AssignmentBook
    from turnrl.distributed.fleet import Fleet
    from turnrl.distributed.workers import spawn_workers

    cfg = _cfg(tmp_path, opponent="random")
    fleet = Fleet(spawn_workers(cfg), AssignmentBook(lambda index: index))
    try:
        fleet.wait_started(timeout_s=300)
        with caplog.at_level(logging.WARNING, logger="turnrl.worker"):
            fleet._call(0, "resize", "many")  # a worker method raising on bad input
            _polled_until(fleet, lambda: not fleet.fired.calls)
        (line,) = [r.getMessage() for r in caplog.records if "resize" in r.getMessage()]
        assert line.startswith("rollout worker 0: resize failed: TypeError") and "\n" not in line
        assert fleet.alive() == [0] and not fleet.outages.dead  # it goes on

        fleet.seed_pool([(0, ray_pool.put({"w": torch.zeros(1)}))])
        with pytest.raises(RuntimeError) as err:
            _polled_until(fleet, lambda: False)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith("rollout worker 0: set_pool failed: RuntimeError")
        assert "plays no opponent pool" in message
    finally:
        fleet.shutdown()


def test_a_fired_failure_without_a_worker_names_the_method_from_the_error():
    ray = pytest.importorskip("ray")
    from turnrl.distributed.fired import fired_failure

    err = ray.exceptions.RayTaskError("RolloutWorker.receive_weights", "Traceback ...",
                                      ValueError("generation 3 is gone\nmore"))
    assert fired_failure(None, "", err) == (
        "a rollout worker: receive_weights failed: ValueError: generation 3 is gone")
    assert fired_failure(2, "withdraw", err).startswith("rollout worker 2: withdraw failed: ")


# ---- each worker's count of games drawn ----------------------------------------------------------

def test_a_worker_counts_its_draws_on_from_the_count_it_is_sent(tmp_path):
    from turnrl.distributed.weight_sync import weights_digest
    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.lora import published_state
    from turnrl.models import tiny_model

    model = tiny_model(seed=3)[0]
    state = without_tied_weights(published_state(model))
    worker = RolloutWorker(_cfg(tmp_path), pool_size=4)
    try:
        assert worker.set_pool([(0, state)], 5) == [0] and worker.pool.draws == 5
        worker.set_pool([(0, state)], 2)  # a count older than its own: never back
        assert worker.pool.draws == 5
        first = worker.pool.sample()
        assert worker.take_groups(None, 0.0).pool_draws == 6
        worker.pool.draws = 5  # the same count draws the same opponent and stream
        again = worker.pool.sample()
        assert torch.equal(again.generator.get_state(), first.generator.get_state())
        assert not torch.equal(worker.pool.sample().generator.get_state(),
                               first.generator.get_state())
        assert worker.pool_digests() == (7, {0: weights_digest(published_state(model))})
    finally:
        worker.stop()


def test_the_learner_sends_each_worker_its_last_reported_draws_with_the_pool():
    pytest.importorskip("ray")
    from turnrl.distributed.book import AssignmentBook
    from turnrl.distributed.fleet import Fleet
    from turnrl.distributed.workers import WorkerReport

    log = []
    fleet = Fleet([RecordingHandle(log)], AssignmentBook(lambda index: index))
    fleet.weights.newest = (0, "ref-0")
    fleet.send_weights(0)
    fleet.set_pool([0])
    assert log[-1] == ("set_pool", ([(0, ["ref-0"])],))  # nothing drawn yet: no count
    fleet.reconcile(0, fleet._next_seq(), WorkerReport(0, "a", [], set(), 0, 0, pool_draws=7))
    fleet.reconcile(0, fleet._next_seq(), WorkerReport(0, "a", [], set(), 0, 0, pool_draws=3))
    assert fleet.pool_draws == {0: 7}  # a late, older report does not lower it
    del log[:]  # restarted: no weights, a fresh pool; it gets both back, and its count
    fleet.reconcile(0, fleet._next_seq(), WorkerReport(0, "b", [], set(), -1, -1))
    assert log == [("set_weights", (0, ["ref-0"])), ("set_pool", ([(0, ["ref-0"])], 7))]
    fleet.seed_pool([(0, "ref-0"), (1, "ref-1")])  # a resumed run's pool: counts included
    assert log[-1] == ("set_pool", ([(0, ["ref-0"]), (1, ["ref-1"])], 7))


def test_a_lora_async_pool_run_resumes_with_each_members_adapter(ray_pool, tmp_path,
                                                                   monkeypatch):
    """LoRA: a member is the frozen base with its version's adapter; the checkpoint holds each
    version's adapter alone, and a resumed worker holds those adapters bit for bit."""
    from turnrl.checkpoint import load_frozen
    from turnrl.lora import published_state
    from turnrl.policy import load_policy

    cfg = load_config(None, [*_args(tmp_path), "--model.lora.r", "4"])
    _train(cfg, monkeypatch, stop_at=2)
    resumed = _train(cfg, monkeypatch, resume=True)
    assert _pool_sizes(tmp_path) == [2.0, 3.0, 3.0, 3.0]
    assert _pool(tmp_path, 4)["versions"] == [2, 3, 4]
    members = _checkpoint(tmp_path, 2) / "opponent_pool"
    assert sorted(p.name for p in (members / "v000001").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    model = load_policy(cfg).model
    adapters = {}
    for version in (0, 1, 2):
        assert load_frozen(_checkpoint(tmp_path, 2), f"opponent_pool/v{version:06d}", model)
        adapters[version] = {k: v.clone() for k, v in published_state(model).items()}
    ((_, held),) = resumed.workers
    assert held == {v: _digest(state) for v, state in adapters.items()}
    assert not _equal(adapters[0], adapters[1])
    for version in (3, 4):
        assert load_frozen(_checkpoint(tmp_path, 4), f"opponent_pool/v{version:06d}", model)
        assert _equal(published_state(model), resumed.published[version])
