"""``turnrl eval``: play checkpoints (or the base model) on held-out tasks, several samples
each; one policy, a paired comparison of two, or several training seeds of one config.

The maths (pass@k, intervals, tests) is in ``turnrl.evaluation`` and ``turnrl.stats``; the
held-out tasks and how they are played are a training run's (``turnrl.trainer.evaluation``);
this module finds checkpoints and their run's config, loads weights and plays the episodes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from turnrl.checkpoint import is_checkpoint, latest_checkpoint, load_weights
from turnrl.config import Config, ConfigError, MixEntry, load_config, load_run_config
from turnrl.envs import make_env
from turnrl.envs.contract import seats, uses_pool
from turnrl.evaluation import (
    SampledEval,
    aggregate_seeds,
    compare,
    end_reasons_line,
    episode_transcript,
    sampled_columns,
    sampled_row,
    summarize_samples,
)
from turnrl.metrics import print_table as _print_table
from turnrl.models import configure_torch
from turnrl.policy import Policy, load_policy, publish
from turnrl.selfplay.outcomes import OUTCOMES, role_outcomes
from turnrl.trainer.evaluation import held_out_seeds, play_tasks
from turnrl.types import Episode

BASE = "base"
"""Names the config's model as it loads, untrained, where a checkpoint is expected."""


def resolve_checkpoint(target: str) -> Path | None:
    """A checkpoint directory for ``target``: itself, a run directory's newest checkpoint,
    or None for ``base``. Anything else is a one-line error."""
    if target == BASE:
        return None
    path = Path(target)
    if is_checkpoint(path):
        return path
    if (path / "config.yaml").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"run directory '{path}' has no checkpoint yet")
        return found
    raise FileNotFoundError(f"no checkpoint at '{path}'; pass a RUN_DIR, a "
                            "RUN_DIR/checkpoints/step-NNNNNN directory or 'base'")


def run_config(checkpoint: Path | None, config_path: str | None, overrides: list[str]) -> Config:
    """The config to evaluate under: ``--config`` if given, else the checkpoint's run's own
    (its model, env and settings; keys that moved since it was written are read at their new
    place), else the defaults; overrides apply on top."""
    if config_path is None and checkpoint is not None:
        saved = checkpoint.parent.parent / "config.yaml"
        if saved.is_file():
            return load_run_config(str(saved), overrides)
    return load_config(config_path, overrides)


def play(policy: Policy, cfg: Config, samples: int, label: str
         ) -> tuple[SampledEval, list[Episode]]:
    """``eval.episodes`` held-out tasks x ``samples`` episodes each, the sampler reseeded
    with ``run.seed`` first so two policies compared draw alike; the result and the
    episodes."""
    refuse_self_play(policy.make_env(), cfg.env.name, cfg.env.options)
    refuse_mixed_self_play(cfg.env.mix_plan())
    policy.engine.generator.manual_seed(cfg.run.seed)
    seeds = [seed for seed in held_out_seeds(cfg) for _ in range(samples)]
    _, episodes = play_tasks(cfg, policy, policy.make_env, seeds, cfg.env.name)
    return summarize_samples(label, episodes, samples), episodes


GAMES_SHOWN_PER_ROLE = 2
"""Games ``turnrl eval`` keeps as conversations per role: the first won and the first not won."""


def game_report(episodes: list[Episode], decode) -> dict | None:
    """For a game (episodes that record a ``role``): per role win/draw/loss rates with 95%
    Wilson intervals (``selfplay.outcomes.role_outcomes``) and a few games as transcripts, a won and a
    not-won one per role (what report.html's Games section shows); None otherwise."""
    roles = role_outcomes(episodes)
    if not roles:
        return None
    shown = []
    for role in roles:
        mine = [ep for ep in episodes if str(ep.info.get("role")) == role]
        won = [ep for ep in mine if ep.info.get("outcome") == "win"][:1]
        rest = [ep for ep in mine if ep.info.get("outcome") != "win"]
        shown += (won + rest)[:GAMES_SHOWN_PER_ROLE]
    return {"roles": roles, "samples": [episode_transcript(ep, decode) for ep in shown]}


def print_roles(label: str, games: dict) -> None:
    """A line per role: win, draw and loss rates with their 95% intervals."""
    for role, row in games["roles"].items():
        rates = ", ".join(f"{name} {100 * row[name]:.1f}% [{100 * row[f'{name}_lo']:.1f}, "
                          f"{100 * row[f'{name}_hi']:.1f}]" for name in OUTCOMES)
        print(f"{label} as {role}: {rates} ({int(row['episodes'])} games, "
              f"{int(row['failed'])} failed)")


def refuse_self_play(env, name: str, options: dict) -> None:
    """pass@k needs one episode per task against a fixed opponent: a self-play or pool env is
    refused with the option that picks one (training evaluates against each of them)."""
    if not (seats(env) or uses_pool(options)):
        return
    fixed = getattr(env, "eval_opponents", ()) or ("<a fixed opponent>",)
    raise ConfigError(f"turnrl eval plays a fixed opponent, and env {name} is self-play (or a "
                      f"pool): add --env.options.opponent {fixed[0]} (or one of "
                      f"{', '.join(fixed)})")


def refuse_mixed_self_play(mix: Sequence[MixEntry]) -> None:
    """A mix whose entry is a self-play game (its games would give an episode per seat to
    count as one task's sample) or plays a pool (no player here) is refused the same way."""
    for i, entry in enumerate(mix):
        env = make_env(entry.name, **entry.options)
        if seats(env) or uses_pool(entry.options):
            fixed = getattr(env, "eval_opponents", ()) or ("<a fixed opponent>",)
            raise ConfigError(f"turnrl eval plays a fixed opponent, and env.mix[{i}] "
                              f"({entry.label}) is self-play (or a pool): evaluate it alone "
                              f"with --env.name {entry.name} --env.options.opponent {fixed[0]} "
                              "(training evaluates such entries against each fixed opponent)")


class Evaluator:
    """One loaded policy whose weights are swapped between checkpoints of the same model."""

    def __init__(self, cfg: Config):
        configure_torch(cfg.run.threads)
        self.cfg = cfg
        self.policy = load_policy(cfg)
        self.base = copy.deepcopy(self.policy.model.state_dict())
        self.games: dict[str, dict] = {}
        """label -> ``game_report`` of its episodes (games only)."""

    def run(self, checkpoint: Path | None, samples: int, label: str | None = None
            ) -> SampledEval:
        if checkpoint is None:
            self.policy.model.load_state_dict(self.base)
        else:
            load_weights(checkpoint, self.policy.model)  # LoRA: the adapter
        # ct2, a bf16 copy or vLLM sample from weights of their own: give them these
        publish(self.policy.engine, self.policy.model, self.policy.engine.version)
        name = label or (BASE if checkpoint is None else _label(checkpoint))
        result, episodes = play(self.policy, self.cfg, samples, name)
        games = game_report(episodes, self.policy.tokenizer.decode)
        if games is not None:
            self.games[result.label] = games
        return result

    def result_dict(self, result: SampledEval) -> dict:
        """``result`` as JSON, with its game report (per-role rates, sample games) if any."""
        games = self.games.get(result.label)
        return {**result.to_dict(), **({"games": games} if games else {})}

    def print_games(self, results: list[SampledEval]) -> None:
        for result in results:
            if result.label in self.games:
                print_roles(result.label, self.games[result.label])


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """The results table; piped (not a terminal), at least 140 columns wide, so labels and
    intervals are not cut to the 80-column default."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 140))
    _print_table(title, columns, rows, console=console)


def print_end_reasons(results: list[SampledEval]) -> None:
    """Why each policy's episodes ended (``turnrl.types.END_REASONS``), a line each."""
    for result in results:
        print(f"{result.label}: {end_reasons_line(result.end_reasons or {})}")


def _label(checkpoint: Path) -> str:
    return f"{checkpoint.parent.parent.name}/{checkpoint.name}"


def base_model(name: str) -> str:
    """The model a run started from, followed back through checkpoints: a run whose
    ``model.name`` is another run's checkpoint (RL after ``sft.env_demos``, or a run started
    from ``runs/X/checkpoints/step-N``) has that run's model, so a warm-up and the RL after
    it, or runs after different warm-ups, compare as one model."""
    seen = set()
    while is_checkpoint(name) and name not in seen:
        seen.add(name)
        saved = Path(name).parent.parent / "config.yaml"
        if not saved.is_file():
            break
        name = load_run_config(str(saved), []).model.name
    return name


def _same_job(configs: list[Config], what: str) -> None:
    """Paired or pooled results need the same model and task on every side."""
    keys = {(base_model(c.model.name), c.env.name, json.dumps(c.env.options, sort_keys=True))
            for c in configs}
    if len(keys) > 1:
        raise ConfigError(f"{what} need the same model and env; got {sorted(keys)}")


def eval_one(target: str | None, config_path: str | None, overrides: list[str],
             samples: int) -> dict:
    checkpoint = resolve_checkpoint(target) if target else None
    cfg = run_config(checkpoint, config_path, overrides)
    label = checkpoint.name if checkpoint else cfg.model.name
    evaluator = Evaluator(cfg)
    result = evaluator.run(checkpoint, samples, label)
    print_table(f"{cfg.env.name}: {cfg.eval.episodes} held-out tasks x {samples} samples "
                f"({result.episodes} episodes)",
                sampled_columns(result.ks()), [sampled_row(result)])
    print_end_reasons([result])
    evaluator.print_games([result])
    return {"kind": "single", "env": cfg.env.name, "model": cfg.model.name,
            "result": evaluator.result_dict(result)}


def eval_compare(a: str, b: str, config_path: str | None, overrides: list[str],
                 samples: int) -> dict:
    points = [resolve_checkpoint(a), resolve_checkpoint(b)]
    if points == [None, None]:
        raise ConfigError("--compare base base compares the base model with itself")
    configs = [run_config(p, config_path, overrides) for p in points]
    configs = [c if p else configs[1 - i]  # 'base' is the other side's untrained model
               for i, (p, c) in enumerate(zip(points, configs, strict=True))]
    _same_job(configs, "--compare A B")
    evaluator = Evaluator(configs[0])
    results = [evaluator.run(p, samples, None if p else BASE) for p in points]
    if results[0].label == results[1].label:
        raise ConfigError(f"--compare was given the same policy twice ({results[0].label})")
    outcome = compare(*results)
    print_table(f"{evaluator.cfg.env.name}: {evaluator.cfg.eval.episodes} held-out tasks x "
                f"{samples} samples, same tasks and sampler seed",
                sampled_columns(results[0].ks()), [sampled_row(r) for r in results])
    print_end_reasons(results)
    evaluator.print_games(results)
    d = outcome.difference
    verdict = "differ" if outcome.p_value < 0.05 else "do not differ detectably"
    print(f"pass@1 {outcome.a} - {outcome.b}: {100 * d.value:+.1f} points "
          f"[{100 * d.lo:+.1f}, {100 * d.hi:+.1f}] ({d.method}); {outcome.test}: "
          f"p = {outcome.p_value:.4g} -> they {verdict} at the 5% level")
    return {"kind": "compare", "env": evaluator.cfg.env.name, "model": evaluator.cfg.model.name,
            "results": [evaluator.result_dict(r) for r in results],
            "comparison": outcome.to_dict()}


def eval_seeds(run_dirs: list[str], config_path: str | None, overrides: list[str],
               samples: int) -> dict:
    """Each run's newest checkpoint, then pass@k pooled over the runs (training seeds)."""
    points = [resolve_checkpoint(d) for d in run_dirs]
    if any(p is None for p in points):
        raise ConfigError("pooling over seeds takes run directories, not 'base'")
    configs = [run_config(p, config_path, overrides) for p in points]
    _same_job(configs, "runs pooled over seeds")
    evaluator = Evaluator(configs[0])
    results = []
    for point, cfg in zip(points, configs, strict=True):
        evaluator.cfg = cfg  # each run's own settings (same model and env, checked above)
        results.append(evaluator.run(point, samples))
    pooled = aggregate_seeds(results)
    rows = [sampled_row(r) for r in results]
    rows.append([f"mean of {len(results)} seeds", *(pooled[str(k)].text()
                                                     for k in results[0].ks()), "", "", "", ""])
    print_table(f"{configs[0].env.name}: {len(results)} training seeds, "
                f"{configs[0].eval.episodes} tasks x {samples} samples each "
                "(pooled row: t-interval over seed means)",
                sampled_columns(results[0].ks()), rows)
    print_end_reasons(results)
    evaluator.print_games(results)
    return {"kind": "seeds", "env": configs[0].env.name, "model": configs[0].model.name,
            "results": [evaluator.result_dict(r) for r in results],
            "pooled": {k: vars(e) for k, e in pooled.items()}}
