"""bench.learning's arithmetic: version times, the first crossing, the tide-vs-sync figures."""

import math

import pytest

from tidejax.bench.learning import compare, first_time_reaching, version_times


def test_version_times_accumulate_step_seconds():
    steps = [{"step": 2, "version": 2, "step_s": 5.0}, {"step": 1, "version": 1, "step_s": 3.0}]
    assert version_times(steps) == {0: 0.0, 1: 3.0, 2: 8.0}


def test_first_time_reaching_interpolates_and_says_never():
    times, rewards = [0.0, 10.0, 20.0], [0.2, 0.4, 0.8]
    assert first_time_reaching(times, rewards, 0.3) == pytest.approx(5.0)
    assert first_time_reaching(times, rewards, 0.1) == 0.0
    assert math.isinf(first_time_reaching(times, rewards, 0.9))


def run(finals_and_times):
    return {"evals": [{"version": v, "time_s": t, "reward": r} for v, t, r in finals_and_times]}


def test_compare_gap_se_and_time_fraction():
    sync = [run([(0, 0, 0.5), (4, 100, 0.7)]), run([(0, 0, 0.5), (4, 120, 0.5)])]
    tide = [run([(0, 0, 0.5), (4, 50, 0.7)]), run([(0, 0, 0.5), (4, 70, 0.7)])]
    out = compare({"sync": sync, "tide": tide})
    assert out["tide_vs_sync_final_gap"] == pytest.approx(0.1)
    # var over seeds: tide 0, sync 0.02 (ddof 1); se = sqrt(0/2 + 0.02/2)
    assert out["gap_se"] == pytest.approx(0.1)
    # sync's mean final 0.6 at mean time 110; tide's mean curve 0.5 -> 0.7 over 0 -> 60 s
    # reaches 0.6 at 30 s
    assert out["tide_time_to_sync_final"] == pytest.approx(30 / 110)
