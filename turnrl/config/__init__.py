"""One typed configuration source: frozen dataclasses, YAML files and ``--section.key`` overrides.

Modules, by topic:

- ``core``      the model, env, rollout, algo, optim, eval and run sections
- ``critic``    turn-level credit (discount, the critic, GiGPO weights)
- ``async_``    async mode: ray, staleness, pool
- ``serve``     the OpenAI-compatible endpoint
- ``explore``   exploration and stability options
- ``distill``   on-policy distillation from a teacher
- ``judge``     an LLM judge scoring episodes against a rubric
- ``reward``    a reward model scoring episodes; turnrl rm's preference data
- ``root``      ``Config``: the sections in order
- ``checks``    every check that reads more than one section
- ``renames``   keys that moved, and translating stored configs written with them
- ``load``      YAML + overrides -> ``Config``, saving it
- ``help``      ``turnrl train --help [SECTION|all]``
- ``types``     value conversion, one-line ``ConfigError``, the ``Section`` base

Each field's docstring sits on the line after it (an attribute docstring); ``field_docs`` reads
them back with ``ast`` so ``--help`` never drifts from the code.
"""

from __future__ import annotations

from turnrl.config.async_ import PoolConfig, RayConfig, StalenessConfig
from turnrl.config.checks import (
    VLLM_TEMPERATURES,
    check_across,
    check_critic_options,
    check_vllm_temperature,
)
from turnrl.config.core import (
    AlgoConfig,
    EnvConfig,
    EvalConfig,
    LossAgg,
    ModelConfig,
    OptimConfig,
    PolicyLossName,
    RolloutConfig,
    RunConfig,
)
from turnrl.config.critic import CriticConfig
from turnrl.config.distill import DistillConfig
from turnrl.config.env_plan import Curriculum, EnvModule, MixEntry, parse_env_module
from turnrl.config.explore import ExploreConfig
from turnrl.config.help import config_help, section_help, sections_help
from turnrl.config.judge import JudgeConfig
from turnrl.config.learner import LearnerConfig
from turnrl.config.load import (
    changed_keys,
    config_from_dict,
    config_to_dict,
    load_config,
    load_run_config,
    save_config,
)
from turnrl.config.lora_plan import LoraSpec
from turnrl.config.renames import MOVED, translate_stored
from turnrl.config.reward import RewardConfig
from turnrl.config.root import Config, sections
from turnrl.config.sampler import SamplerConfig
from turnrl.config.serve import ServeConfig
from turnrl.config.sft import SftConfig
from turnrl.config.types import (
    ConfigError,
    Section,
    convert_value,
    did_you_mean,
    field_docs,
    parse_yaml_value,
    type_hints,
    type_name,
)

__all__ = [
    "MOVED",
    "VLLM_TEMPERATURES",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DistillConfig",
    "Curriculum",
    "EnvConfig",
    "EnvModule",
    "EvalConfig",
    "ExploreConfig",
    "JudgeConfig",
    "LearnerConfig",
    "LossAgg",
    "PolicyLossName",
    "LoraSpec",
    "MixEntry",
    "ModelConfig",
    "OptimConfig",
    "PoolConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "RewardConfig",
    "SamplerConfig",
    "Section",
    "ServeConfig",
    "SftConfig",
    "StalenessConfig",
    "changed_keys",
    "check_across",
    "check_critic_options",
    "check_vllm_temperature",
    "config_from_dict",
    "config_help",
    "config_to_dict",
    "convert_value",
    "did_you_mean",
    "field_docs",
    "load_config",
    "load_run_config",
    "parse_env_module",
    "parse_yaml_value",
    "save_config",
    "section_help",
    "sections",
    "sections_help",
    "translate_stored",
    "type_hints",
    "type_name",
]
