"""``benchmarks/speed/update_attention.py`` on the tiny model: it profiles and times each variant."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "speed"))

import torch  # noqa: E402
import update_attention as bench  # noqa: E402

from turnrl.models import tiny_model  # noqa: E402


def test_every_variant_is_timed_and_both_profiles_are_printed(capsys):
    results = bench.main(["--model", "tiny", "--shapes", "2x24x8", "--rounds", "1"])
    assert set(results["2x24x8"]) == {"sdpa", "sdpa32", "eager"}
    assert all(t > 0 for t in results["2x24x8"].values())
    printed = capsys.readouterr().out
    assert "2x24x8 fp32 profile:" in printed and "2x24x8 bf16 profile:" in printed


def test_profile_shares_are_ranked_and_add_up_to_at_most_the_whole():
    model, _ = tiny_model(seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    for bf16 in (False, True):
        shares = [share for _, share in bench.top_operators(model, ids, 8, bf16)]
        assert shares == sorted(shares, reverse=True)
        assert 0 < sum(shares) <= 1 + 1e-9


def test_float32_attention_in_a_bf16_update_scores_like_the_stock_one():
    """The variants change where attention runs, not what the update computes."""
    model, _ = tiny_model(seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    scores = {}
    for impl in ("sdpa", "sdpa32", "eager"):
        model.config._attn_implementation = impl
        scores[impl] = bench.update_pass(model, ids, 8, bf16=True)
    for impl in ("sdpa32", "eager"):
        assert (scores[impl] - scores["sdpa"]).abs().max() < 0.1
    model.config._attn_implementation = "sdpa"
    fp32 = bench.update_pass(model, ids, 8, bf16=False)
    assert (fp32 - scores["sdpa"]).abs().max() > 0  # bf16 really ran
