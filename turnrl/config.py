"""One typed configuration source: frozen dataclasses, YAML files and ``--section.key`` overrides.

Each field's docstring sits on the line after it (an attribute docstring); ``field_docs`` reads
them back with ``ast`` so ``--help`` never drifts from the code.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_origin

import yaml

from turnrl.config_async import RayConfig, StalenessConfig
from turnrl.config_credit import CreditConfig
from turnrl.config_explore import ExploreConfig
from turnrl.config_serve import ServeConfig
from turnrl.config_sft import SftConfig
from turnrl.config_types import (  # noqa: F401 - ConfigError is part of this module's API
    ConfigError,
    check_vllm_temperature,
    convert_value,
    did_you_mean,
    field_docs,
    parse_yaml_value,
    type_hints,
    type_name,
)
from turnrl.config_types import (
    Section as _Section,
)
from turnrl.registry import ESTIMATORS, UnknownName

# Named because the literal is too long to sit beside its field.
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class ModelConfig(_Section):
    name: str = "smollm2-135m-instruct"
    """policy model: built-in 'smollm2-135m-instruct' or 'tiny', or a local Hugging Face model dir"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """parameter dtype of the policy (and reference) model"""
    cache_dir: str = ""
    """where the converted offline model is cached; '' means ~/.cache/turnrl"""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'"""
    chat_template: str = ""
    """a Jinja chat template file replacing the tokenizer's ('' keeps it): for models whose
    own template rewrites earlier turns (start-up says so)"""

    def _check(self) -> None:
        self._require("name", bool(self.name), "a model name or path")
        self._require("device", self.device in ("auto", "cpu") or self.device.startswith("cuda"),
                      "'auto', 'cpu', 'cuda' or 'cuda:N'")
        self._require("chat_template", not self.chat_template
                      or Path(self.chat_template).expanduser().is_file(), "an existing file")


@dataclass(frozen=True)
class EnvConfig(_Section):
    name: str = "guess-number"
    """registered environment name"""
    options: dict[str, Any] = field(default_factory=dict)
    """keyword arguments for the environment's constructor, e.g. --env.options.high 20"""

    def _check(self) -> None:
        self._require("name", bool(self.name), "a registered environment name")


@dataclass(frozen=True)
class RolloutConfig(_Section):
    group_size: int = 8
    """episodes per prompt/seed (the GRPO group)"""
    groups_per_step: int = 4
    """groups collected per training step"""
    max_new_tokens: int = 8
    """tokens generated per policy turn"""
    max_turns: int = 8
    """hard cap on policy turns per episode, on top of the environment's own"""
    temperature: float = 1.0
    """sampling temperature (0 = greedy)"""
    top_p: float = 1.0
    """nucleus sampling probability mass"""
    env_timeout_s: float = 30.0
    """an environment step slower than this many seconds fails the episode"""
    reuse_cache: bool = True
    """keep each episode's KV cache across turns, so a turn prefills only its new tokens"""

    def _check(self) -> None:
        self._at_least(1, "group_size", "groups_per_step", "max_new_tokens", "max_turns")
        self._at_least(0, "temperature")
        self._require("top_p", 0 < self.top_p <= 1, "in (0, 1]")
        self._require("env_timeout_s", self.env_timeout_s > 0, "> 0")


@dataclass(frozen=True)
class AlgoConfig(_Section):
    advantage: str = "grpo"
    """advantage estimator, a name in turnrl.registry.ESTIMATORS: grpo, dr_grpo, rloo,
    reinforce_pp (per episode), gigpo, turn_gae, archer (per turn), or one you registered"""
    clip_low: float = 0.2
    """lower PPO clip: the ratio is kept above 1 - clip_low"""
    clip_high: float = 0.28
    """upper clip: the ratio is kept below 1 + clip_high (clip-higher, DAPO)"""
    dual_clip: float = 0.0
    """dual-clip PPO (Ye et al. 2020): 0 = off, else c > 1 bounds a negative-advantage
    token's loss by c * |A| (verl uses 3)"""
    loss_agg: LossAgg = "token_mean"
    """how per-token losses are reduced to one number"""
    loss_agg_constant: int = 0
    """divisor of seq_mean_token_sum_norm; 0 means max_new_tokens * max_turns"""
    kl_coef: float = 0.0
    """KL penalty towards the reference model; 0 skips the reference model entirely"""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    """KL estimator (Schulman's k1/k2/k3, or |log ratio|)"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient"""
    epochs: int = 1
    """optimisation passes over each batch"""
    gamma: float = 0.95
    """discount per turn for turn-level credit (gigpo, turn_gae, archer)"""
    gae_lambda: float = 0.95
    """GAE lambda over turns (turn_gae)"""
    gigpo_step_weight: float = 1.0
    """GiGPO: weight of the step-level (anchor-state) advantage added to the episode-level one"""
    critic_lr: float = 1e-3
    """learning rate of the turn-level critic (turn_gae, archer)"""
    critic_tau: float = 0.1
    """Polyak rate of the critic's target networks (archer)"""
    critic_updates: int = 8
    """critic gradient steps per training step (turn_gae, archer)"""
    replay_episodes: int = 256
    """ArCHer replay buffer size, in episodes"""
    decoupled: bool = False
    """decoupled PPO (AReaL): importance weights against the behaviour policy, trust region
    around the proximal (pre-update) policy; always on in async mode"""
    is_cap: float = 5.0
    """truncate behaviour importance weights at this value (0 = no truncation)"""

    def _check(self) -> None:
        try:
            ESTIMATORS.check(self.advantage)
        except UnknownName as err:
            raise ConfigError(f"algo.advantage: {err}") from None
        self._at_least(0, "clip_low", "clip_high", "loss_agg_constant", "kl_coef", "entropy_coef",
                       "critic_tau", "is_cap")
        self._at_least(1, "epochs", "critic_updates", "replay_episodes")
        self._require("clip_low", self.clip_low < 1, "< 1 (the ratio's floor 1 - clip_low must "
                      "stay above 0)")
        self._require("dual_clip", self.dual_clip == 0 or self.dual_clip > 1,
                      "0 (off) or > 1")
        self._require("gamma", 0 <= self.gamma <= 1, "in [0, 1]")
        self._require("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]")
        self._require("critic_lr", self.critic_lr > 0, "> 0")


@dataclass(frozen=True)
class OptimConfig(_Section):
    lr: float = 4e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping threshold (0 = no clipping)"""
    micro_batch_size: int = 8
    """sequences per forward/backward; the batch is split and gradients accumulated"""
    memory_budget_mb: int = 0
    """size micro-batches so activations stay under this many MB (0 = micro_batch_size rows)"""
    shared_prefix: bool = True
    """compute the prompt a group shares once in the update's forward and backward"""

    def _check(self) -> None:
        self._require("lr", self.lr > 0, "> 0")
        self._at_least(0, "weight_decay", "max_grad_norm", "memory_budget_mb")
        self._at_least(1, "micro_batch_size")


@dataclass(frozen=True)
class EvalConfig(_Section):
    episodes: int = 64
    """held-out episodes for the before/after evaluation (0 = skip evaluation)"""
    every: int = 0
    """evaluate every N steps; 0 = only before and after training"""
    temperature: float = 1.0
    """evaluation sampling temperature (0 = greedy)"""
    seed_offset: int = 1_000_000
    """held-out seeds start here, disjoint from training seeds"""

    def _check(self) -> None:
        self._at_least(0, "episodes", "every", "temperature")
        self._at_least(1, "seed_offset")


@dataclass(frozen=True)
class RunConfig(_Section):
    steps: int = 12
    """training steps"""
    seed: int = 0
    """global random seed (training episode seeds derive from it)"""
    out_dir: str = ""
    """run directory for metrics, samples and checkpoints; '' = runs/<env>-<date>-<time>"""
    checkpoint_every: int = 4
    """save a checkpoint every N steps (0 = only at the end)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep on disk"""
    sample_episodes: int = 4
    """episodes per step written to the run directory for inspection"""
    threads: int = 2
    """torch CPU threads (0 = torch default)"""
    tensorboard: bool = True
    """log to TensorBoard when it is installed"""
    wandb: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "turnrl"
    """Weights & Biases project name"""
    progress: bool = True
    """show a rich progress bar"""
    mode: Literal["sync", "async"] = "sync"
    """which rollout source feeds the learner: 'sync' = lock-step, each step's episodes from
    the current weights (turnrl train: this process's engine; train_agent: the step's tasks
    against the served weights); 'async' = generation goes on while the learner trains
    (turnrl train: Ray rollout workers; train_agent: agents keep playing), groups at most
    staleness.max_versions behind, decoupled PPO"""

    def _check(self) -> None:
        self._at_least(1, "steps", "keep_checkpoints")
        self._at_least(0, "seed", "checkpoint_every", "sample_episodes", "threads")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """policy model"""
    env: EnvConfig = field(default_factory=EnvConfig)
    """environment"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """episode collection"""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """RL objective"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimiser"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """held-out evaluation"""
    run: RunConfig = field(default_factory=RunConfig)
    """run bookkeeping and logging"""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray cluster and rollout workers (async mode)"""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    """bounded staleness and partial rollouts (async mode)"""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """the OpenAI-compatible endpoint (turnrl serve)"""
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    """exploration and stability options (docs/exploration.md)"""
    credit: CreditConfig = field(default_factory=CreditConfig)
    """turn-level credit: critic warm-up, advantage scale (docs/credit_assignment.md)"""
    sft: SftConfig = field(default_factory=SftConfig)
    """supervised fine-tuning on demonstrations (turnrl sft; docs/sft.md)"""

    def __post_init__(self) -> None:
        if self.ray.engine == "vllm":
            check_vllm_temperature(self.rollout.temperature)


# ---- keys, merging, loading -------------------------------------------------------------------


def _sections() -> dict[str, type]:
    return dict(type_hints(Config))


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _sections().items() for f in dataclasses.fields(cls)]


def _closest_key(key: str) -> str:
    """Typo in the field name first, then the same field in another section, then any key."""
    section, _, name = key.partition(".")
    if section in _sections():
        names = [f.name for f in dataclasses.fields(_sections()[section])]
        if match := difflib.get_close_matches(name, names, n=1):
            return f"; did you mean '{section}.{match[0]}'?"
    moved = [k for k in _all_keys() if k.endswith(f".{name}")]
    # A high cutoff: the shared 'section.' prefix alone makes unrelated keys look similar.
    return did_you_mean(key, moved, cutoff=0) or did_you_mean(key, _all_keys(), cutoff=0.8)


def _unknown_key(key: str) -> ConfigError:
    hint = _closest_key(key)
    section = key.split(".")[0]
    if not hint and section in _sections():
        names = ", ".join(f.name for f in dataclasses.fields(_sections()[section]))
        hint = f"; valid keys in '{section}': {names}"
    elif not hint:
        hint = f"; valid sections: {', '.join(_sections())}"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _apply(tree: dict, key: str, value: Any) -> None:
    """Set dotted ``key`` in the nested ``tree``; keys below a dict field set entries inside it."""
    section, _, rest = key.partition(".")
    name, _, sub = rest.partition(".")
    cls = _sections().get(section)
    if cls is None or name not in type_hints(cls):
        raise _unknown_key(key)
    if not sub:
        tree[section][name] = value
        return
    if get_origin(type_hints(cls)[name]) is not dict:
        raise _unknown_key(key)
    *parents, leaf = sub.split(".")
    target = tree[section][name]
    for part in parents:
        target = target.setdefault(part, {}) if isinstance(target, dict) else None
    if not isinstance(target, dict):
        raise ConfigError(f"{key}: the parent is not a mapping; set the whole dict instead")
    target[leaf] = value


def _merge(tree: dict, data: Any, origin: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{origin} must be a mapping of sections (e.g. 'algo: {{clip_high: 0.28}}'), "
            f"got {type(data).__name__}"
        )
    for section, values in data.items():
        if section not in _sections():
            hint = did_you_mean(str(section), list(_sections())) or (
                f"; valid sections: {', '.join(_sections())}"
            )
            raise ConfigError(f"unknown config section '{section}'{hint}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"config section '{section}' must be a mapping, got {values!r}")
        for name, value in values.items():
            _apply(tree, f"{section}.{name}", value)


def _parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """``--a.b v``, ``--a.b=v`` and ``a.b=v`` become ``(key, raw string)`` pairs."""
    pairs, i = [], 0
    while i < len(args):
        arg, i = args[i], i + 1
        key = arg.removeprefix("--")
        if "=" in key:
            key, value = key.split("=", 1)
        elif arg.startswith("--") and i < len(args) and not args[i].startswith("--"):
            value, i = args[i], i + 1
        else:
            raise ConfigError(f"--{key} needs a value")
        pairs.append((key, value))
    return pairs


def _build(tree: Mapping[str, Mapping[str, Any]]) -> Config:
    return Config(**{name: cls(**tree[name]) for name, cls in _sections().items()})


def _read_yaml(path: str) -> Any:
    if not Path(path).is_file():
        raise ConfigError(f"config file '{path}' not found; check the path")
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file '{path}' is not valid YAML ({exc}); fix it") from None


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path``, then command-line ``overrides``."""
    tree = config_to_dict(Config())
    if path:
        _merge(tree, _read_yaml(path), f"config file '{path}'")
    for key, value in _parse_overrides(overrides):
        # Entries inside a dict field have no declared type, so let YAML type them (20 -> int).
        _apply(tree, key, parse_yaml_value(value) if key.count(".") >= 2 else value)
    return _build(tree)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    a, b = config_to_dict(old), config_to_dict(new)
    return [f"{section}.{key}" for section in a for key in a[section]
            if a[section][key] != b[section][key]]


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Rebuild a config (e.g. on resume) with the same checks as ``load_config``."""
    tree = config_to_dict(Config())
    _merge(tree, data, "config")
    return _build(tree)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a kill mid-write must not leave a truncated config for --resume.
    tmp = Path(path).with_suffix(".yaml.tmp")
    with open(tmp, "w") as f:
        f.write(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- help ------------------------------------------------------------------------------------


def config_help() -> str:
    """One line per dotted key: flag, type, default and docstring."""
    defaults, lines = config_to_dict(Config()), []
    for section, cls in _sections().items():
        docs = field_docs(cls)
        for name, tp in type_hints(cls).items():
            default = defaults[section][name]
            shown = repr(default) if isinstance(default, str) else default
            lines.append(f"--{section}.{name} {type_name(tp)} (default {shown})  {docs[name]}")
    return "\n".join(lines)
