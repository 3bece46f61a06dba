"""Held-out evaluation: success rates and pass@k with 95% intervals, failed episodes counted.

``evaluate`` plays episodes; ``summarize`` gives the before/after table's row (one sample
per task); ``summarize_samples`` groups several samples per task into pass@k with
intervals; ``compare`` tests two policies on the same tasks; ``aggregate_seeds`` pools
training seeds. docs/evaluation.md says which interval and test is used where, and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from turnrl.envs.base import Env
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.loop import run_episodes, run_sync
from turnrl.samplers.base import Engine, SamplingParams
from turnrl.stats import (
    bootstrap_mean_interval,
    format_rate,
    mcnemar_exact,
    pass_at_k,
    sign_flip_test,
    t_interval,
    wilson_interval,
)
from turnrl.types import Episode

COLUMNS = ["policy", "success [95% CI]", "mean reward", "mean turns", "episodes"]
"""Header of the tables whose rows ``EvalResult.row`` gives."""


@dataclass
class EvalResult:
    episodes: int
    successes: int
    mean_reward: float
    mean_turns: float
    failed: int
    """Episodes that ended by an env timeout or error: counted as failures, not dropped."""
    end_reasons: dict[str, int] | None = None
    """Episodes per ``Episode.end_reason`` (``turnrl.types.END_REASONS``)."""
    env_metrics: dict[str, float] | None = None
    """What the env measured of the policy itself (its ``policy_metrics``, e.g. Kuhn Poker's
    exploitability), when it offers that."""
    per_env: dict[str, EvalResult] | None = None
    """A mix's result per env label (``evaluate_each``); the fields above pool them."""

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.episodes)

    def row(self, label: str) -> list[str]:
        return [label, format_rate(self.successes, self.episodes), f"{self.mean_reward:.3f}",
                f"{self.mean_turns:.2f}", str(self.episodes)]

    def to_dict(self) -> dict:
        lo, hi = self.interval
        out = {**asdict(self), "success_rate": self.success_rate, "ci_lo": lo, "ci_hi": hi}
        per_env = out.pop("per_env")  # a single env's file stays as it was
        if per_env is not None:
            out["per_env"] = {label: r.to_dict() for label, r in self.per_env.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> EvalResult:
        """The result ``to_dict`` wrote (a saved before/after evaluation)."""
        per_env = data.get("per_env")
        return cls(**{k: data[k] for k in ("episodes", "successes", "mean_reward",
                                           "mean_turns", "failed")},
                   end_reasons=data.get("end_reasons"), env_metrics=data.get("env_metrics"),
                   per_env=None if per_env is None else {
                       label: cls.from_dict(r) for label, r in per_env.items()})


def summarize(episodes: Sequence[Episode]) -> EvalResult:
    n = len(episodes)
    return EvalResult(
        episodes=n,
        successes=sum(ep.success for ep in episodes),
        mean_reward=sum(ep.reward for ep in episodes) / max(n, 1),
        mean_turns=sum(len(ep.turns) for ep in episodes) / max(n, 1),
        failed=sum(ep.status in ("timeout", "error") for ep in episodes),
        end_reasons=count_end_reasons(episodes),
    )


def count_end_reasons(episodes: Sequence[Episode]) -> dict[str, int]:
    """Episodes per reason they ended (``turnrl.types.END_REASONS``), most common first; an
    episode from a file written before reasons were recorded counts under its status."""
    counts: dict[str, int] = {}
    for ep in episodes:
        reason = ep.end_reason or ep.status
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def end_reasons_line(counts: dict[str, int]) -> str:
    """``ended: done 28, turn_limit 3, env_timeout 1`` for a summary."""
    return "ended: " + ", ".join(f"{reason} {n}" for reason, n in counts.items())


def evaluate(make: Callable[[], Env], seeds: Sequence[int], engine: Engine, chat: ChatFormat,
             params: SamplingParams, *, env_name: str, max_turns: int, chunk: int = 32,
             env_timeout_s: float = 30.0, max_context: int | None = None
             ) -> tuple[EvalResult, list[Episode]]:
    """Play one episode per seed (``chunk`` at a time, to bound the batch)."""
    episodes: list[Episode] = []
    for i in range(0, len(seeds), chunk):
        pairs = [(seed, i + j) for j, seed in enumerate(seeds[i:i + chunk])]
        episodes += run_sync(run_episodes(make, pairs, engine, chat, params,
                                             env_name=env_name, max_turns=max_turns,
                                             env_timeout_s=env_timeout_s,
                                             max_context=max_context))
    return summarize(episodes), episodes


def reply_scorer(model, chat: ChatFormat, temperature: float
                 ) -> Callable[[list[dict], str], float]:
    """``score(messages, reply)``: the log-probability that the policy answers the
    conversation ``messages`` (rendered by its chat template, the generation prompt added)
    with exactly ``reply`` then its end-of-turn token, at ``temperature``. What an env's
    ``policy_metrics`` reads the policy through (envs/contract.py)."""
    import torch

    def score(messages: list[dict], reply: str) -> float:
        prompt = chat.encode(chat.render(messages, True))
        answer = chat.encode(reply) + [chat.end_of_turn]
        device = next(model.parameters()).device
        ids = torch.tensor([prompt + answer], device=device)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        model.train(was_training)
        logp = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
        return float(logp.gather(1, torch.tensor(answer, device=device)[:, None]).sum())

    return score


def with_env_metrics(result: EvalResult, env: Env, score: Callable[[list[dict], str], float]
                     ) -> EvalResult:
    """``result`` with the env's ``policy_metrics(score)`` added, if the env has one."""
    measure = getattr(env, "policy_metrics", None)
    if not callable(measure):
        return result
    return replace(result, env_metrics={k: float(v) for k, v in measure(score).items()})
def evaluate_each(makes: dict[str, Callable[[], Env]], seeds: Sequence[int], engine: Engine,
                  chat: ChatFormat, params: SamplingParams, **options
                  ) -> tuple[EvalResult, list[Episode]]:
    """``evaluate`` on every env of a mix (label -> factory), the same seeds each: the pooled
    result with each env's own in ``per_env``."""
    per_env, episodes = {}, []
    for label, make in makes.items():
        per_env[label], played = evaluate(make, seeds, engine, chat, params, env_name=label,
                                          **options)
        episodes += played
    pooled = summarize(episodes)
    pooled.per_env = per_env
    return pooled, episodes


# --------------------------------------------------------------------------- pass@k over samples

FAILURE_STATUSES = ("truncated", "timeout", "error")
"""Episode endings other than ``done``: counted (as non-successes), never dropped."""


@dataclass
class Estimate:
    """A point estimate with its 95% interval and how the interval was made."""

    value: float
    lo: float
    hi: float
    method: str

    def text(self) -> str:
        return f"{100 * self.value:.1f}% [{100 * self.lo:.1f}, {100 * self.hi:.1f}]"


@dataclass
class SampledEval:
    """Held-out tasks (env seeds), each played ``samples`` times: pass@k and what failed."""

    label: str
    seeds: list[int]
    successes: list[int]
    """Correct samples per task, in the order of ``seeds``."""
    samples: int
    mean_turns: float
    mean_tokens: float
    mean_policy_tokens: float
    mean_reward: float
    statuses: dict[str, int]
    """Episodes per ending: done, truncated (out of turns or context), timeout, error."""
    end_reasons: dict[str, int] | None = None
    """Episodes per reason they ended (``count_end_reasons``): the statuses, finer."""

    @property
    def episodes(self) -> int:
        return len(self.seeds) * self.samples

    @property
    def failures(self) -> int:
        return sum(self.statuses.get(s, 0) for s in FAILURE_STATUSES)

    def ks(self) -> list[int]:
        """1, 2, 4, ... up to the samples per task, and the samples themselves."""
        ks = [k for k in (2**i for i in range(12)) if k < self.samples]
        return ks + [self.samples]

    def task_pass_at(self, k: int) -> list[float]:
        return [pass_at_k(self.samples, c, k) for c in self.successes]

    def pass_at(self, k: int) -> Estimate:
        """pass@k, the mean over tasks of the unbiased estimator (Chen et al. 2021).

        With one sample per task the episodes are independent Bernoulli draws, so pass@1
        gets a Wilson interval; otherwise samples of a task are correlated and the
        interval is a percentile bootstrap over tasks.
        """
        if self.samples == 1:
            lo, hi = wilson_interval(sum(self.successes), len(self.successes))
            return Estimate(sum(self.successes) / max(len(self.successes), 1), lo, hi,
                            "Wilson score")
        value, lo, hi = bootstrap_mean_interval(self.task_pass_at(k))
        return Estimate(value, lo, hi, "percentile bootstrap over tasks")

    def to_dict(self) -> dict:
        return {"label": self.label, "tasks": len(self.seeds), "samples": self.samples,
                "episodes": self.episodes,
                "pass_at_k": {str(k): asdict(self.pass_at(k)) for k in self.ks()},
                "mean_turns": self.mean_turns, "mean_tokens": self.mean_tokens,
                "mean_policy_tokens": self.mean_policy_tokens, "mean_reward": self.mean_reward,
                "failures": self.failures, "statuses": self.statuses,
                "end_reasons": self.end_reasons or {},
                "per_task": [{"seed": s, "successes": c}
                             for s, c in zip(self.seeds, self.successes, strict=True)]}


def summarize_samples(label: str, episodes: Sequence[Episode], samples: int) -> SampledEval:
    """Group episodes by task seed (in first-seen order); every task needs ``samples``."""
    counts: dict[int, list[bool]] = {}
    for ep in episodes:
        counts.setdefault(ep.seed, []).append(ep.success)
    uneven = {s: len(v) for s, v in counts.items() if len(v) != samples}
    if uneven:
        raise ValueError(f"tasks with other than {samples} samples: {uneven}")
    n = max(len(episodes), 1)
    statuses: dict[str, int] = {}
    for ep in episodes:
        statuses[ep.status] = statuses.get(ep.status, 0) + 1
    return SampledEval(
        label, list(counts), [sum(v) for v in counts.values()], samples,
        mean_turns=sum(len(ep.turns) for ep in episodes) / n,
        mean_tokens=sum(len(ep.token_ids) for ep in episodes) / n,
        mean_policy_tokens=sum(ep.num_policy_tokens for ep in episodes) / n,
        mean_reward=sum(ep.reward for ep in episodes) / n, statuses=statuses,
        end_reasons=count_end_reasons(episodes))


def sampled_columns(ks: Sequence[int]) -> list[str]:
    return ["policy", *(f"pass@{k} [95% CI]" for k in ks), "mean turns", "mean tokens",
            "failures (trunc/timeout/error)", "tasks x samples"]


def sampled_row(result: SampledEval) -> list[str]:
    s = result.statuses
    fails = "/".join(str(s.get(k, 0)) for k in FAILURE_STATUSES)
    return [result.label, *(result.pass_at(k).text() for k in result.ks()),
            f"{result.mean_turns:.2f}", f"{result.mean_tokens:.1f}",
            f"{result.failures} ({fails})", f"{len(result.seeds)} x {result.samples}"]


@dataclass
class Comparison:
    """Whether A and B differ in pass@1 on the same tasks, by a named paired test."""

    a: str
    b: str
    difference: Estimate
    """pass@1 of A minus pass@1 of B."""
    test: str
    p_value: float

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "difference": asdict(self.difference),
                "test": self.test, "p_value": self.p_value}


def task_differences(a: SampledEval, b: SampledEval) -> list[float]:
    """Per-task pass@1 of A minus B's, over the tasks both played."""
    if a.seeds != b.seeds or a.samples != b.samples:
        raise ValueError("compare needs both sides evaluated on the same tasks and samples")
    return [(ca - cb) / a.samples for ca, cb in zip(a.successes, b.successes, strict=True)]


def paired_difference(a: SampledEval, b: SampledEval) -> Estimate:
    """pass@1 of A minus B with a percentile bootstrap over tasks of the paired differences."""
    value, lo, hi = bootstrap_mean_interval(task_differences(a, b))
    return Estimate(value, lo, hi, "paired percentile bootstrap over tasks")


def compare(a: SampledEval, b: SampledEval) -> Comparison:
    """Paired comparison of pass@1 over the tasks both played.

    One sample per task: McNemar's exact test on the discordant tasks (each task is one
    pair of episodes, same seed, sampler reseeded alike). Several: the paired sign-flip
    permutation test on per-task success-rate differences (which is McNemar's exact test
    again when the rates are 0/1). The difference's interval is a percentile bootstrap
    over tasks of the per-task differences.
    """
    diffs = task_differences(a, b)
    difference = paired_difference(a, b)
    if a.samples == 1:
        only_a = sum(d > 0 for d in diffs)
        only_b = sum(d < 0 for d in diffs)
        return Comparison(a.label, b.label, difference, "McNemar exact (paired per task)",
                          mcnemar_exact(only_a, only_b))
    return Comparison(a.label, b.label, difference,
                      "paired sign-flip permutation test on per-task pass@1",
                      sign_flip_test(diffs))


def aggregate_seeds(results: Sequence[SampledEval]) -> dict[str, Estimate]:
    """pass@k over several training seeds of one config: Student t interval over the seed
    means (each seed is one independent run; tasks and samples are nested within it)."""
    ks = results[0].ks()
    out = {}
    for k in ks:
        value, lo, hi = t_interval([r.pass_at(k).value for r in results])
        out[str(k)] = Estimate(value, lo, hi, f"t-interval over {len(results)} seed means")
    return out


def episode_transcript(episode: Episode, decode: Callable[[list[int]], str]) -> dict:
    """A small, readable JSON view of an episode: its token stream cut where the author
    changes (policy-sampled tokens vs environment and template tokens), each part decoded."""
    segments: list[dict] = []
    start = 0
    for i in range(1, len(episode.token_ids) + 1):
        if i == len(episode.token_ids) or episode.loss_mask[i] != episode.loss_mask[start]:
            role = "policy" if episode.loss_mask[start] else "env"
            segments.append({"role": role, "text": decode(episode.token_ids[start:i])})
            start = i
    transcript = {"env": episode.env, "seed": episode.seed, "group": episode.group,
                  "reward": episode.reward, "success": episode.success,
                  "status": episode.status, "end_reason": episode.end_reason,
                  "reason": episode.info.get("reason"), "turns": len(episode.turns),
                  "segments": segments}
    if "role" in episode.info:  # a seat of a game: what the report's game view needs
        transcript["game"] = {k: episode.info[k] for k in GAME_KEYS if k in episode.info}
        transcript["moves"] = [{"action": t.action, "observation": t.observation,
                                "reward": t.reward} for t in episode.turns]
    return transcript


GAME_KEYS = ("role", "opponent", "game_id", "play_order", "outcome")
"""What a game's episode info says of its play (docs/selfplay.md), kept in its transcript."""


def whole_games(chosen: Sequence[Episode], episodes: Sequence[Episode]) -> list[Episode]:
    """``chosen`` with the other seats of each multi-seat game in it (from ``episodes``), in
    ``episodes``' order: a sample of a self-play step shows whole games."""
    games = {_game_key(ep) for ep in chosen if _game_key(ep) is not None}
    picked = {id(ep) for ep in chosen}
    return [ep for ep in episodes if id(ep) in picked or _game_key(ep) in games] \
        if games else list(chosen)


def _game_key(episode: Episode) -> tuple | None:
    """Which multi-seat game ``episode`` is a seat of (None: it is a game of its own)."""
    game_id = episode.info.get("game_id")
    return None if game_id is None else (episode.env, episode.seed, episode.group, game_id)
