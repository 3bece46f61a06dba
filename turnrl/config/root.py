"""``Config``: the sections, in the order ``--help`` lists them."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnrl.config.async_ import PoolConfig, RayConfig, StalenessConfig
from turnrl.config.checks import check_across
from turnrl.config.core import (
    AlgoConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
)
from turnrl.config.critic import CriticConfig
from turnrl.config.distill import DistillConfig
from turnrl.config.explore import ExploreConfig
from turnrl.config.judge import JudgeConfig
from turnrl.config.learner import LearnerConfig
from turnrl.config.reward import RewardConfig
from turnrl.config.sampler import SamplerConfig
from turnrl.config.serve import ServeConfig
from turnrl.config.sft import SftConfig
from turnrl.config.types import type_hints


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """the policy model: which, its dtype and device"""
    env: EnvConfig = field(default_factory=EnvConfig)
    """the environment and its constructor options"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """episode collection: group sizes, turns, sampling, the sampler"""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """options of the sampler rollout.sampler chose: its caches, matrix products, GPU share"""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """the RL objective: estimator, clipping, KL, entropy"""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """turn-level credit: discount, the turn-level critic, GiGPO weights"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """the optimiser and micro-batching"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """held-out evaluation before, during and after training"""
    run: RunConfig = field(default_factory=RunConfig)
    """run bookkeeping: steps, seed, directory, checkpoints, logging, mode"""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """the learner's processes: one, or ranks on torch.distributed (ddp or fsdp)"""
    ray: RayConfig = field(default_factory=RayConfig)
    """async mode: the Ray cluster and its rollout workers"""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    """async mode: how old a trained episode may be, partial rollouts"""
    pool: PoolConfig = field(default_factory=PoolConfig)
    """async mode: how many episodes are in flight, sized at run time"""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """the OpenAI-compatible endpoint (turnrl serve, train_agent)"""
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    """exploration and stability options, all off by default"""
    sft: SftConfig = field(default_factory=SftConfig)
    """supervised fine-tuning on demonstrations (turnrl sft, a warm-up before RL)"""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """on-policy distillation: a teacher scores the sampled tokens (reverse KL), off by
    default"""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """an LLM judge scoring each training episode against a rubric (a local model or an
    OpenAI-compatible endpoint), off by default"""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """a reward model scoring episodes (reward.model), and turnrl rm's preference data"""

    def __post_init__(self) -> None:
        check_across(self)


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    return dict(type_hints(Config))
