"""benchmarks/learning/simulated_user.py: held-out success by patient, the unit its episodes
are drawn from (each patient is played several times, so episodes are not independent)."""

from __future__ import annotations

import json

import simulated_user


def _episodes(path, outcomes: dict[str, list[bool]]):
    rows = [{"success": won, "info": {"judge_reference": f"The user's situation: ... The right "
                                                        f"answer: {patient}."}}
            for patient, wins in outcomes.items() for won in wins]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_rates_are_per_patient_and_the_interval_is_over_patients(tmp_path):
    rates = simulated_user.by_patient(_episodes(tmp_path / "e.jsonl", {
        "flu": [True, True, False, False], "cold": [False] * 4, "sprain": [True] * 4}))
    assert rates == {"cold": 0.0, "flu": 0.5, "sprain": 1.0}
    line = simulated_user.patient_line(rates)
    # mean 0.5 over 3 patients, s = 0.5: t_{0.975, 2} = 4.303 -> half-width 124%, clipped
    assert line == "50.0% [0.0, 100.0] (t over 3 patients)"
    assert simulated_user.patient_line({"a": 0.25, "b": 0.25}) == \
        "25.0% [25.0, 25.0] (t over 2 patients)"
