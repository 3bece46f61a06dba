"""``ray.weight_sync: broadcast``: weights reach the rollout workers through a torch.distributed
group. On CPUs the group is gloo, the same code path as NCCL on GPUs but for the backend, so
these run it for real: a local Ray cluster, the tiny model, real worker processes.
tests/gpu/test_weight_broadcast_gpu.py checks the NCCL path (skipped without two GPUs).
"""

from __future__ import annotations

import time

import pytest
import torch

from turnrl.config import ConfigError, load_config
from turnrl.distributed.weight_sync import (
    TIED_KEYS,
    WeightGroupError,
    choose_backend,
    flatten,
    plan_layout,
    unflatten,
    weights_digest,
)
from turnrl.distributed.worker_engines import with_tied_weights, without_tied_weights
from turnrl.lora import published_state

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.mode", "async",
        "--optim.lr", "1e-3", "--rollout.group_size", "4", "--rollout.groups_per_step", "2",
        "--eval.episodes", "0", "--run.checkpoint_every", "0", "--ray.weight_sync", "broadcast",
        "--algo.entropy_coef", "0.01"]  # every update changes the weights, rewards or not


# ---- the layout: buckets of one dtype, back to the same tensors --------------------------------

def _mixed_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(50, 8, generator=generator)
    return without_tied_weights({
        "embed.weight": embed, "a.weight": torch.randn(8, 8, generator=generator),
        "a.bias": torch.randn(8, generator=generator).to(torch.bfloat16),
        "steps": torch.tensor(7, dtype=torch.int64), "scalar": torch.tensor(0.5),
        "lm_head.weight": embed})  # tied to the embedding: sent once


@pytest.mark.parametrize("bucket_bytes", [1, 300, 1 << 20])
def test_a_layout_flattens_and_restores_every_tensor_bit_for_bit(bucket_bytes):
    state = _mixed_state()
    layout = plan_layout(state, bucket_bytes)
    assert all(len({s.name for s in b.slots}) == len(b.slots) for b in layout.buckets)
    names = [s.name for b in layout.buckets for s in b.slots]
    assert sorted(names) == sorted(k for k in state if k != TIED_KEYS)  # each tensor once
    assert layout.aliases == {"lm_head.weight": "embed.weight"}
    flats = flatten(state, layout, torch.device("cpu"))
    for flat, bucket in zip(flats, layout.buckets, strict=True):
        assert str(flat.dtype) == f"torch.{bucket.dtype}" and flat.numel() == bucket.numel
        if bucket_bytes == 1:  # every tensor is over the bound: a bucket each
            assert len(bucket.slots) == 1
    restored = unflatten([f.clone() for f in flats], layout)
    assert weights_digest(with_tied_weights(restored)) == weights_digest(
        with_tied_weights(state))
    assert restored[TIED_KEYS] == layout.aliases
    assert with_tied_weights(restored)["lm_head.weight"].data_ptr() == \
        restored["embed.weight"].data_ptr()


def test_the_flattened_copy_does_not_follow_the_learners_next_update():
    state = _mixed_state()
    layout = plan_layout(state)
    flats = flatten(state, layout, torch.device("cpu"))
    before = weights_digest(unflatten(flats, layout))
    state["a.weight"].add_(1.0)  # the optimiser's next step, in place
    assert weights_digest(unflatten(flats, layout)) == before


def test_the_digest_tells_one_flipped_bit():
    state = {"w": torch.ones(4)}
    flipped = {"w": torch.ones(4)}
    flipped["w"].view(torch.int32)[2] ^= 1
    assert weights_digest(state) != weights_digest(flipped)
    assert weights_digest(state) == weights_digest({"w": torch.ones(4)})
    assert weights_digest(state) != weights_digest({"v": torch.ones(4)})


# ---- which backend, and the combinations refused ------------------------------------------------

def test_nccl_only_when_every_member_holds_cuda_weights_on_a_gpu_of_its_own():
    cpu, gpu = ("cpu", ""), lambda uuid: ("cuda", uuid)
    assert choose_backend(cpu, {1: cpu, 2: cpu}) == "gloo"
    assert choose_backend(gpu("L"), {1: cpu}) == "gloo"  # a CPU worker: through host memory
    assert choose_backend(cpu, {1: gpu("A")}) == "gloo"
    assert choose_backend(gpu("L"), {1: gpu("A"), 2: gpu("B")}) == "nccl"
    for workers, named in (({1: gpu("L")}, "worker 1 and the learner"),
                           ({1: gpu("A"), 3: gpu("A")}, "worker 3 and worker 1")):
        with pytest.raises(WeightGroupError) as err:
            choose_backend(gpu("L"), workers)
        message = str(err.value)
        assert named in message and "--ray.weight_sync object_store" in message
        assert "\n" not in message


@pytest.mark.parametrize("args, named", [
    (["--run.mode", "sync"], "--run.mode async"),
    (["--rollout.sampler", "vllm", "--ray.worker_gpus", "1", "--model.lora.r", "4"],
     "--ray.weight_sync object_store"),
    (["--ray.weight_sync_timeout_s", "0"], "weight_sync_timeout_s"),
    (["--ray.weight_sync", "nccl"], "weight_sync"),
])
def test_combinations_it_cannot_serve_are_refused_in_one_line(args, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + args)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_the_default_is_still_the_object_store():
    assert load_config(None, [a for a in TINY if a not in ("--ray.weight_sync", "broadcast")]
                       ).ray.weight_sync == "object_store"


# ---- on a local Ray cluster ---------------------------------------------------------------------

def _recording_source(cfg):
    """A ``RaySource`` that notes the learner's digest of every version it publishes, and the
    workers' digests before it stops them."""
    from turnrl.distributed.source import RaySource

    class Recording(RaySource):
        published: dict[int, str] = {}
        newest: list = []
        loaded: list = []
        members: list[int] = []

        def publish(self, version, model):
            self.published[version] = weights_digest(
                with_tied_weights(without_tied_weights(published_state(model))))
            super().publish(version, model)

        def evaluate(self, run, when):
            if when == "after":
                import ray

                handles = [self.fleet.handles[w] for w in self.fleet.alive()]
                self.newest = ray.get([h.newest_weights_digest.remote() for h in handles])
                self.loaded = ray.get([h.loaded_weights_digest.remote() for h in handles])
                if self.fleet.weights.broadcaster is not None:
                    self.members = sorted(self.fleet.weights.broadcaster.members)
            return super().evaluate(run, when)

    return Recording(cfg)


def _check_workers_hold_the_learners_weights(source, steps: int) -> None:
    assert [v for v, _, _ in source.newest] == [steps] * len(source.newest)
    for version, digest, devices in source.newest:  # what the next generate call loads
        assert digest == source.published[version] and devices == ["cpu"]
    for version, digest in source.loaded:  # what each worker samples with now; -1: a
        if version != -1:  # restarted worker not asked to generate since (it loads `newest`)
            assert 0 <= version <= steps and digest == source.published[version]
    assert any(version != -1 for version, _ in source.loaded)
    assert len(set(source.published.values())) == steps + 1  # each update changed them


def test_workers_receive_bit_identical_weights_through_the_group(ray_cluster, tmp_path):
    from turnrl.metrics import read_metrics
    from turnrl.trainer.learn import learn

    cfg = load_config(None, TINY + ["--ray.num_workers", "2", "--run.steps", "3",
                                    "--run.out_dir", str(tmp_path)])
    source = _recording_source(cfg)
    learn(cfg, source)
    fleet = source.fleet
    # The start version goes through the object store while the workers build their
    # models; every update after it through the group, formed once.
    assert fleet.weights.broadcast_versions == [1, 2, 3]
    group = fleet.weights.broadcaster
    assert group.generation == 1 and group.backend == "gloo"
    assert source.members == [0, 1]
    _check_workers_hold_the_learners_weights(source, 3)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["async/weights_broadcast"] for r in records] == [1.0, 1.0, 1.0]
    assert all(r["async/weight_bytes_per_version"] > 0 for r in records)


def test_a_lora_run_broadcasts_the_adapter_alone(ray_cluster, tmp_path):
    """``model.lora``: the group carries the adapter's tensors (``published_state``), and the
    worker's adapter ends bit-identical to the learner's."""
    from turnrl.trainer.learn import learn

    cfg = load_config(None, TINY + ["--ray.num_workers", "1", "--run.steps", "2",
                                    "--model.lora.r", "4", "--run.out_dir", str(tmp_path)])
    source = _recording_source(cfg)
    learn(cfg, source)
    assert source.fleet.weights.broadcast_versions == [1, 2]
    _check_workers_hold_the_learners_weights(source, 2)
    model = source.run.learner.model
    every_weight = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < source.fleet.weights.version_bytes < every_weight / 4  # the adapter, not the model


@pytest.mark.parametrize("address", ["203.0.113.1", "turnrl-no-such-host.invalid"])
def test_a_group_that_cannot_form_stops_the_run_in_one_line_within_the_timeout(
        ray_cluster, tmp_path, address):
    """The workers cannot reach the learner at ``address`` (an unroutable documentation
    address; a name that does not resolve): one line with the fix, no hang."""
    from turnrl.launch import train_async

    cfg = load_config(None, TINY + ["--ray.num_workers", "1", "--run.steps", "2",
                                    "--ray.weight_sync_address", address,
                                    "--ray.weight_sync_timeout_s", "3",
                                    "--run.out_dir", str(tmp_path)])
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        train_async(cfg)
    message = str(err.value)
    assert "did not form within 3 s" in message and address in message and "workers 0," in message
    assert "worker 0:" in message  # the worker's own reason
    assert "--ray.weight_sync_address" in message and "object_store" in message
    assert "\n" not in message
    # The workers' start on a busy machine dominates (200 s at load 8-14 on 2 cores); a hang
    # would be the test's own timeout.
    assert time.monotonic() - started < 600
    deadline = time.monotonic() + 120  # ray.kill returns before the actor is down: loose
    while ray_cluster.util.list_named_actors() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ray_cluster.util.list_named_actors()  # the workers were stopped


@pytest.mark.slow
def test_a_killed_worker_rejoins_a_new_group_and_holds_the_learners_weights(ray_cluster,
                                                                            tmp_path):
    """Worker 0 is killed as version 2 is published (Ray restarts it): a broadcast fails or
    leaves it out, and its version goes through the object store; once the new process has
    reported, the group forms again with it, and at the end both workers hold the learner's
    weights bit for bit."""
    from turnrl.trainer.learn import learn

    cfg = load_config(None, TINY + ["--ray.num_workers", "2", "--run.steps", "5",
                                    "--ray.weight_sync_timeout_s", "20",
                                    "--run.out_dir", str(tmp_path)])
    source = _recording_source(cfg)
    plain_publish = type(source).publish
    history, first = [], {}

    def publish(version, model):
        fleet = source.fleet
        if version == 2:
            first.update(fleet.incarnation)
            ray_cluster.kill(fleet.handles[0], no_restart=False)
        if version == 4:  # the learner has heard from the new process before it goes on
            deadline = time.monotonic() + 300
            while fleet.incarnation.get(0) == first[0] or 0 not in fleet.up():
                assert time.monotonic() < deadline, "the restarted worker never reported"
                source.absorb_reports(timeout_s=0.5)
        plain_publish(source, version, model)
        group = fleet.weights.broadcaster
        history.append((version, group.generation, sorted(group.members)))

    source.publish = publish
    learn(cfg, source)
    fleet = source.fleet
    assert fleet.restarts + source.ledger.totals["restarts"] >= 1
    # A broadcast to the dead process failed or left it out: the object store carried it.
    assert fleet.weights.broadcast_versions[-2:] == [4, 5]
    assert history[-1][1] >= 2 and source.members == [0, 1], history  # formed again
    assert source.newest and fleet.incarnation[0] != first[0]
    _check_workers_hold_the_learners_weights(source, 5)


@pytest.mark.slow
def test_a_group_that_cannot_form_again_mid_run_leaves_the_object_store_in_charge(
        ray_cluster, tmp_path):
    """After worker 0 is killed the group must form again, but the workers can no longer
    reach the learner (its address turned unroutable): each version goes through the object
    store, and after ``FORM_TRIES`` failures in a row broadcasting ends for the run, with the
    workers still holding the learner's weights bit for bit."""
    from turnrl.distributed.publisher import FORM_TRIES
    from turnrl.trainer.learn import learn

    steps = 2 + FORM_TRIES + 1
    cfg = load_config(None, TINY + ["--ray.num_workers", "2", "--run.steps", str(steps),
                                    "--run.out_dir", str(tmp_path)])
    source = _recording_source(cfg)
    plain_publish = type(source).publish
    first = {}

    def publish(version, model):
        fleet = source.fleet
        if version == 2:
            first.update(fleet.incarnation)
            group = fleet.weights.broadcaster
            group.address, group.timeout_s = "203.0.113.1", 2.0
            ray_cluster.kill(fleet.handles[0], no_restart=False)
        if version == steps:  # the learner has heard from the new process before the last
            deadline = time.monotonic() + 300
            while fleet.incarnation.get(0) == first[0] or 0 not in fleet.up():
                assert time.monotonic() < deadline, "the restarted worker never reported"
                source.absorb_reports(timeout_s=0.5)
        plain_publish(source, version, model)

    source.publish = publish
    learn(cfg, source)
    fleet = source.fleet
    assert fleet.weights.broadcaster is None and fleet.weights.form_failures == FORM_TRIES
    assert set(fleet.weights.broadcast_versions) <= {1, 2}
    _check_workers_hold_the_learners_weights(source, steps)
