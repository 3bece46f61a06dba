"""An estimator registered from outside the library: it declares its level and the ``critic``
options it reads, the config hands it exactly those, a training run uses its advantages, and
a run stored with the old critic keys resumes with its estimator state."""

from __future__ import annotations

import pytest
import torch
import yaml

from turnrl.algorithms.credit import turn_to_token_advantages
from turnrl.algorithms.estimators import EstimatorSettings
from turnrl.checkpoint import latest_checkpoint, load_component
from turnrl.cli import main
from turnrl.config import ConfigError, load_config
from turnrl.metrics import read_metrics
from turnrl.registry import ESTIMATORS, estimator_level
from turnrl.trainer import train

RUN = ["--model.name", "tiny", "--env.name", "key-corridor", "--env.options", "{horizon: 3}",
       "--rollout.max_new_tokens", "2", "--rollout.max_turns", "3", "--rollout.group_size", "2",
       "--rollout.groups_per_step", "1", "--eval.episodes", "0", "--run.progress", "false",
       "--run.tensorboard", "false"]
BUILT = []
"""Every ``TurnConstant`` the registry's factory built, to look at after a run."""


class TurnConstant:
    """Every turn's advantage is ``critic.gamma`` (so the policy loss at ratio 1 is -gamma);
    counts its calls against ``critic.updates`` as a critic would count its steps."""

    def __init__(self, settings: EstimatorSettings) -> None:
        self.settings, self.calls = settings, 0
        BUILT.append(self)

    def advantages(self, episodes, model, pad_id):
        self.calls += 1
        width = max(len(ep.token_ids) for ep in episodes)
        gamma = self.settings.critic.gamma
        return turn_to_token_advantages(
            episodes, [torch.full((len(ep.turns),), gamma) for ep in episodes], width)

    def metrics(self):
        return {"mine/steps": float(self.calls * self.settings.critic.updates)}

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


@pytest.fixture
def registered():
    ESTIMATORS.register("turn_constant", level="turn", options=("gamma", "updates"))(
        TurnConstant)
    BUILT.clear()
    yield
    del ESTIMATORS["turn_constant"]


def test_a_registered_turn_level_estimator_gets_its_critic_options_and_drives_the_update(
        registered, tmp_path):
    assert estimator_level("turn_constant") == "turn" and estimator_level("grpo") == "episode"
    cfg = load_config(None, RUN + ["--algo.advantage", "turn_constant", "--critic.gamma", "0.5",
                                   "--critic.updates", "3", "--run.steps", "2",
                                   "--run.out_dir", str(tmp_path)])
    train(cfg)
    (estimator,) = BUILT
    assert (estimator.settings.critic.gamma, estimator.settings.critic.updates) == (0.5, 3)
    assert estimator.settings.seed == cfg.run.seed and estimator.settings.hidden_size > 0
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["mine/steps"] for r in records] == [3.0, 6.0]
    # token_mean of -A * ratio at ratio 1: the loss is minus the advantage it was given
    assert [r["loss/policy"] for r in records] == pytest.approx([-0.5, -0.5], abs=1e-3)
    state = load_component(latest_checkpoint(tmp_path), "estimator")
    assert state == {"calls": 2}


def test_options_a_registered_estimator_does_not_read_are_refused(registered):
    with pytest.raises(ConfigError, match="critic.tau is not read by algo.advantage "
                                          "turn_constant"):
        load_config(None, ["--algo.advantage", "turn_constant", "--critic.tau", "0.5"])
    with pytest.raises(ConfigError, match="explore.pass_k .* turn_constant is turn-level"):
        load_config(None, ["--algo.advantage", "turn_constant", "--explore.pass_k", "2"])
    ESTIMATORS.register("bad_options", level="turn", options=("gama",))(TurnConstant)
    try:
        with pytest.raises(ConfigError, match="declares critic option 'gama'"):
            load_config(None, ["--algo.advantage", "bad_options"])
    finally:
        del ESTIMATORS["bad_options"]
    for bad in ({"level": "step"}, {"options": "gamma"}):
        with pytest.raises(ValueError, match="bad"):
            ESTIMATORS.register("bad", **bad)(TurnConstant)
    assert "bad" not in ESTIMATORS


def test_a_run_stored_with_old_critic_keys_resumes_with_its_estimator_state(tmp_path, capsys):
    """A turn_gae run; its config.yaml rewritten as the old layout wrote it (algo.critic_*,
    a credit section); ``--resume`` and ``turnrl eval RUN_DIR`` still read it."""
    args = RUN + ["--algo.advantage", "turn_gae", "--critic.updates", "2",
                  "--critic.warmup_updates", "2", "--run.out_dir", str(tmp_path)]
    assert main(["train", *args, "--run.steps", "1"]) == 0
    stored = yaml.safe_load((tmp_path / "config.yaml").read_text())
    critic = stored.pop("critic")
    stored["algo"].update(gamma=critic["gamma"], gae_lambda=critic["gae_lambda"],
                          critic_lr=critic["lr"], critic_tau=critic["tau"],
                          critic_updates=critic["updates"],
                          replay_episodes=critic["replay_episodes"],
                          gigpo_step_weight=critic["gigpo_step_weight"])
    stored["credit"] = {"warmup_updates": critic["warmup_updates"], "scale": critic["scale"],
                        "critic_features": critic["features"]}
    stored["staleness"]["auto"] = stored.pop("pool")["auto"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(stored))
    assert main(["train", "--resume", "--run.out_dir", str(tmp_path), "--run.steps", "2"]) == 0
    records = read_metrics(tmp_path / "metrics.jsonl")
    # the critic's step count went on from the checkpoint: 2 after step 1, 4 after step 2
    assert [r["credit/critic_updates"] for r in records] == [2.0, 4.0]
    assert [r["credit/critic_in_use"] for r in records] == [0.0, 1.0]
    assert main(["eval", str(tmp_path), "--eval.episodes", "2"]) == 0
    assert "turnrl eval: error" not in capsys.readouterr().err


def test_help_names_a_registered_estimator_as_a_reader(registered):
    from turnrl.config import config_help

    lines = config_help("critic").splitlines()
    gamma = lines[lines.index("  --critic.gamma FLOAT (default 0.95)") + 1]
    assert "turn_constant" in gamma and "gigpo" in gamma
    tau = lines[lines.index("  --critic.tau FLOAT (default 0.1)") + 1]
    assert "turn_constant" not in tau and "archer" in tau
