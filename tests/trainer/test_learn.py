"""The one learner loop: ``learn(cfg, source)`` takes any source that has the protocol's
methods, with no change to the loop (a demonstration or game source is one more class)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from turnrl.config import load_config
from turnrl.trainer import LocalSource, SourceDefaults, learn
from turnrl.types import read_episodes

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--run.progress", "false",
        "--run.tensorboard", "false", "--run.threads", "1", "--optim.lr", "1e-3"]


class Replay(SourceDefaults):
    """Replays recorded episodes every step: off-policy data from older weights, the shape a
    demonstration source has. Logs every call the loop makes to it."""

    off_policy = True

    def __init__(self, episodes):
        self.episodes, self.calls, self.replayed = episodes, [], 0

    def open(self, run):
        self.calls.append("open")
        self.start = run.checkpoint_state.get("replayed", 0)

    def publish(self, version, model):
        self.calls.append(f"publish {version}")

    def evaluate(self, run, when):
        self.calls.append(f"evaluate {when}")
        return super().evaluate(run, when)

    def wait_ready(self):
        self.calls.append("wait_ready")

    def collect(self, step):
        self.calls.append(f"collect {step}")
        self.replayed += len(self.episodes)
        return self.episodes

    def step_metrics(self, step, episodes, update_metrics):
        self.calls.append(f"step_metrics {step}")
        assert "loss/policy" in update_metrics  # after the update
        return {"replay/episodes": float(self.replayed)}

    def state_dict(self):
        return {"replayed": self.start + self.replayed}

    def close(self):
        self.calls.append("close")

    def result(self, result):
        self.calls.append("result")
        return result


def test_a_source_written_outside_the_library_trains_through_the_one_loop(tmp_path):
    recorded = tmp_path / "recorded"
    cfg = load_config(None, TINY + ["--run.steps", "1", "--eval.episodes", "0",
                                    "--run.sample_episodes", "4", "--run.out_dir", str(recorded)])
    learn(cfg, LocalSource())
    episodes = read_episodes(recorded / "episodes" / "step-000001.jsonl")
    assert len(episodes) == 4
    for i, ep in enumerate(episodes):  # re-scored, so each group has a signal
        ep.reward = float(i % 2)

    replay = Replay(episodes)
    out = tmp_path / "replayed"
    cfg = load_config(None, TINY + ["--run.steps", "2", "--eval.episodes", "2",
                                    "--run.checkpoint_every", "1", "--run.out_dir", str(out)])
    result = learn(cfg, replay)
    assert replay.calls == [
        "open", "publish 0", "evaluate before", "wait_ready",
        "collect 0", "publish 1", "step_metrics 0",
        "collect 1", "publish 2", "step_metrics 1",
        "evaluate after", "result", "close"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["replay/episodes"] for x in lines] == [4.0, 8.0]
    # An off-policy source gets decoupled PPO: importance weights against the recorded
    # behaviour log-probs, whose ESS the update reports.
    assert all(0 < x["offpolicy/ess"] <= 1 + 1e-6 for x in lines)
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert {k: state[k] for k in ("step", "replayed")} == {"step": 2, "replayed": 8}
    assert "model.safetensors" in state["files"]  # each file's size and CRC-32 (checkpoint.py)
    assert result.before is not None and result.after is not None and "after 2 steps" in result.table
    first = load_file(out / "checkpoints" / "step-000001" / "model.safetensors")
    last = load_file(out / "checkpoints" / "step-000002" / "model.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in first)


class OwnStep(Replay):
    """A source with a step of its own instead of ``rl_step`` (as SFT's token NLL is) that
    runs out of episodes before step 2 of 4."""

    def collect(self, step):
        if step < 2:
            return super().collect(step)
        self.calls.append(f"collect {step}")
        return None

    def update(self, learner, episodes, timer):
        self.calls.append(f"update {len(episodes)}")
        with timer("update"):
            learner.model.get_input_embeddings().weight.data[0] += 1.0
        return None, {"own/loss": 0.5}

    def step_metrics(self, step, episodes, update_metrics):
        self.calls.append(f"step_metrics {step}")
        return {"own/seen": update_metrics["own/loss"]}

    def progress(self, metrics):
        return {"own": f"{metrics['own/seen']:.1f}"}


def test_a_source_s_own_step_replaces_rl_step_and_no_episodes_end_the_run(tmp_path, capsys):
    recorded = tmp_path / "recorded"
    cfg = load_config(None, TINY + ["--run.steps", "1", "--eval.episodes", "0",
                                    "--run.sample_episodes", "4", "--run.out_dir", str(recorded)])
    learn(cfg, LocalSource())
    episodes = read_episodes(recorded / "episodes" / "step-000001.jsonl")
    source, out = OwnStep(episodes), tmp_path / "own"
    cfg = load_config(None, TINY + ["--run.steps", "4", "--eval.episodes", "0",
                                    "--run.checkpoint_every", "1", "--run.progress", "true",
                                    "--run.out_dir", str(out)])
    learn(cfg, source)
    assert source.calls == [
        "open", "publish 0", "evaluate before", "wait_ready",
        "collect 0", "update 4", "publish 1", "step_metrics 0",
        "collect 1", "update 4", "publish 2", "step_metrics 1",
        "collect 2", "evaluate after", "result", "close"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["own/loss"], x["own/seen"]) for x in lines] == [(1, 0.5, 0.5),
                                                                           (2, 0.5, 0.5)]
    assert "reward/mean" not in lines[0]  # no rl_step: no episode summary either
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001",
                                                                       "step-000002"]
    assert "own=0.5" in capsys.readouterr().out  # the source's progress field
    # only the source's step changed the weights: +1 on one embedding row a step
    fresh, last = (load_file(out / "checkpoints" / f"step-00000{i}" / "model.safetensors")
                   for i in (1, 2))
    changed = [k for k in last if not torch.equal(last[k], fresh[k])]
    assert len(changed) == 1
    delta = last[changed[0]] - fresh[changed[0]]
    assert torch.equal(delta[0], torch.ones_like(delta[0])) and not delta[1:].any()
