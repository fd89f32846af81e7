"""bench.learning's arithmetic: version times, the first crossing, the tide-vs-sync figures."""

import math

import pytest

from tidejax.bench.learning import (
    compare,
    first_time_reaching,
    paired_gap,
    parse_variants,
    version_times,
)
from tidejax.config import run_config_from_dict


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


def test_paired_gap_pairs_by_seed():
    tide = [run([(4, 0, 0.5)]), run([(4, 0, 0.9)])]
    variant = [run([(4, 0, 0.6)]), run([(4, 0, 0.9)])]
    gap, se = paired_gap(variant, tide)
    assert gap == pytest.approx(0.05)
    # differences 0.1 and 0.0: std (ddof 1) 0.0707, / sqrt(2) = 0.05
    assert se == pytest.approx(0.05)
    with pytest.raises(ValueError):
        paired_gap(variant, tide[:1])


def test_variants_load_on_the_base_and_reject_bad_specs(tmp_path):
    path = tmp_path / "deadline.toml"
    path.write_text('[rollout]\nconsume_order = "deadline"\n')
    base = run_config_from_dict({"steps": 3})
    variants = parse_variants([f"deadline={path}"], base)
    assert variants["deadline"].rollout.consume_order == "deadline"
    assert variants["deadline"].steps == 3 and variants["deadline"].system == "tide"
    for bad in ("deadline", f"sync={path}", f"=={path}"):
        with pytest.raises(ValueError):
            parse_variants([bad], base)
    with pytest.raises(ValueError, match="label 'x' is a system name or repeated"):
        parse_variants([f"x={path}", f"x={path}"], base)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[rollout]\nconsume_ordr = 1\n")
    with pytest.raises(ValueError, match="consume_ordr"):
        parse_variants([f"w={wrong}"], base)
