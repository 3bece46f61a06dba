"""Steps whose episodes ended before the policy's first reply (a prompt longer than the
context: ``input_too_large``). Before, a step where every episode did crashed the update
(``shared_prefix_split``: "argmax(): Expected reduction dim 1 to have non-zero size"), and so
could a step where only some did, once a micro-batch held only such episodes. Now those rows
are left out of the micro-batches and scorers, and a step with none left skips its update
with a warning (``WARN=no_policy_tokens`` on the progress line) and the run goes on."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

from tests.conftest import local_ray
from turnrl.config import AlgoConfig, OptimConfig, load_config
from turnrl.envs import StepResult, register_env
from turnrl.metrics import read_metrics
from turnrl.trainer import UpdateSettings, policy_update, train
from turnrl.trainer.step import batch_logprobs, micro_batches, shared_prefix_split
from turnrl.types import Batch, Episode, read_episodes

HUGE = "word " * 4000  # 20,000 chars: over the tiny model's 1024 tokens x 13 chars a token


@register_env("prompt-too-long")
class PromptTooLong:
    """Say a digit; seeds that are multiples of ``every`` get a prompt the context cannot
    hold (``every`` 1: all of them)."""

    def __init__(self, every: int = 1):
        self.every = every

    async def reset(self, seed: int) -> str:
        return HUGE if seed % self.every == 0 else "Say a digit."

    async def step(self, action: str) -> StepResult:
        ok = action[:1].isdigit()
        return StepResult("", float(ok), True, {"success": ok})


def episodes_with_empty(empty_rows: set[int], rows: int = 6) -> list[Episode]:
    """Episodes of a prompt and one reply each; those in ``empty_rows`` have no tokens at all
    (refused before their prompt was rendered), but row 1 keeps a prompt without a reply."""
    gen = torch.Generator().manual_seed(0)
    episodes = []
    for row in range(rows):
        ep = Episode(env="toy", seed=row // 3, group=row // 3)
        if row not in empty_rows or row == 1:
            ep.append(torch.randint(3, 60, (6,), generator=gen).tolist(), policy=False)
        if row not in empty_rows:
            n = 2 + row % 3
            ep.append(torch.randint(3, 60, (n,), generator=gen).tolist(), policy=True,
                      logprobs=[-1.0] * n, version=0)
        episodes.append(ep)
    return episodes


def settings(micro: int, shared_prefix: bool, agg: str = "token_mean") -> UpdateSettings:
    return UpdateSettings(AlgoConfig(loss_agg=agg), OptimConfig(micro_batch_size=micro,
                                                                shared_prefix=shared_prefix),
                          temperature=1.0, agg_constant=8)


def test_micro_batches_leave_out_rows_without_policy_tokens():
    batch = Batch.from_episodes(episodes_with_empty({1, 4}), torch.linspace(-1, 1, 6), 0)
    for size in (1, 2, 6):
        chunks = micro_batches(batch, size)
        assert sum(len(mb) for mb in chunks) == 4
        assert all(mb.input_ids.shape[1] > 0 and mb.loss_mask.bool().any(dim=1).all()
                   for mb in chunks)
    empty = Batch.from_episodes([Episode("toy", 0, 0)] * 3, torch.zeros(3), 0)
    assert empty.input_ids.shape == (3, 0)
    assert micro_batches(empty, 2) == [] and shared_prefix_split(empty) is None


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_an_update_with_some_empty_rows_equals_the_update_without_them(tiny, shared_prefix):
    model, _ = tiny
    mixed = episodes_with_empty({1, 4})
    kept = [ep for ep in mixed if ep.num_policy_tokens]
    advantages = torch.tensor([1.0, 0.5, -1.0, 0.3, 2.0, -0.7])
    with_empty = Batch.from_episodes(mixed, advantages, 0)
    without = Batch.from_episodes(kept, advantages[[0, 2, 3, 5]], 0)
    results = []
    for batch in (with_empty, without):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        # micro-batches of one row: before, the rows without tokens made empty micro-batches
        metrics = policy_update(trained, optimizer, batch, settings(1, shared_prefix))
        assert metrics["update/skipped"] == 0.0
        results.append(torch.cat([p.detach().flatten() for p in trained.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-6)
    assert not torch.equal(results[0], torch.cat([p.flatten() for p in model.parameters()]))


def test_scoring_a_batch_with_empty_rows_scores_the_others_as_alone(tiny):
    model, _ = tiny
    mixed = episodes_with_empty({0, 1, 2})  # the whole first group has no policy token
    batch = Batch.from_episodes(mixed, torch.zeros(6), 0)
    with torch.no_grad():
        scores = batch_logprobs(model, batch, 1.0, rows_per_pass=1, shared_prefix=True)
        alone = batch_logprobs(model, batch.select(torch.tensor([3, 4, 5])), 1.0, 3)
    assert torch.equal(scores[:3], torch.zeros_like(scores[:3]))
    width = alone.shape[1]
    assert torch.allclose(scores[3:, :width], alone, atol=1e-5)
    assert bool((scores[3:] != 0).any())


def test_an_update_with_no_policy_token_is_skipped_with_a_warning(tiny):
    model, _ = tiny
    before = [p.detach().clone() for p in model.parameters()]
    for episodes in ([Episode("toy", 0, 0)] * 4, episodes_with_empty(set(range(4)), rows=4)):
        batch = Batch.from_episodes(episodes, torch.ones(len(episodes)), 0)
        with pytest.warns(UserWarning, match="update skipped: no row of the batch has a policy"):
            metrics = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                    settings(2, True))
        assert metrics == {"update/skipped": 1.0, "warn/no_policy_tokens": 1.0}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def run_cfg(tmp_path, name: str, every: int, *extra: str):
    return load_config(None, [
        "--model.name", "tiny", "--env.name", "prompt-too-long", "--env.options.every",
        str(every), "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--optim.micro_batch_size", "1",
        "--run.steps", "2", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.sample_episodes", "4", "--eval.episodes", "3",
        "--run.out_dir", str(tmp_path / name), *extra])


def test_a_run_whose_every_prompt_is_too_long_skips_its_updates_and_goes_on(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(run_cfg(tmp_path, "all", 1))
    records = read_metrics(tmp_path / "all" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["warn/no_policy_tokens"] == 1.0 and r["update/skipped"] == 1.0
               for r in records)
    said = [str(w.message) for w in caught if "update skipped" in str(w.message)]
    assert len(said) == 2 and "none of the step's 4 episodes has a policy token " \
        "(4 input_too_large); e.g. input too large: the first prompt" in said[0]
    # Evaluation, where every episode is refused too, still ends with its table.
    assert result.before.episodes == result.after.episodes == 3
    assert result.after.success_rate == 0.0 and "after 2 steps" in result.table
    assert (tmp_path / "all" / "checkpoints").is_dir()


def test_a_run_where_some_prompts_are_too_long_trains_on_the_others(tmp_path):
    train(run_cfg(tmp_path, "some", 2))
    records = read_metrics(tmp_path / "some" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    episodes = read_episodes(tmp_path / "some" / "episodes" / "step-000001.jsonl")
    reasons = sorted(ep.end_reason for ep in episodes)
    assert reasons == ["done", "done", "input_too_large", "input_too_large"]
    assert all(r["update/skipped"] == 0.0 and not r.get("warn/no_policy_tokens")
               and torch.isfinite(torch.tensor(r["loss/policy"])) for r in records)


@pytest.mark.slow
def test_async_steps_with_no_policy_token_skip_their_updates(tmp_path):
    from turnrl.launch import train_async

    with local_ray(sys.modules[__name__]):
        train_async(run_cfg(tmp_path, "async", 1, "--run.mode", "async",
                            "--ray.num_workers", "1", "--eval.episodes", "0"))
    records = read_metrics(tmp_path / "async" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["warn/no_policy_tokens"] == 1.0 for r in records)
