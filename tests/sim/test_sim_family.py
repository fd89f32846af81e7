"""The workload family: non-stationary streams and the seeded sample."""

import dataclasses
import statistics

import pytest

from tidejax.sim import family, tables
from tidejax.sim import workload as wl


def _mean_response(stream: wl.TaskStream, first: int, n: int) -> float:
    return statistics.fmean(
        r for i in range(first, first + n) for tr in stream.group(i).trajectories
        for r in tr.responses
    )


def test_response_growth_scales_responses_by_update():
    base = dataclasses.replace(wl.preset("text-7b"), batch_groups=10, b_min_groups=5)
    grown = dataclasses.replace(base, response_growth=0.5)  # x(1 + 0.5 * update)
    a, b = wl.TaskStream(base), wl.TaskStream(grown)
    # update 0 (groups 0-9): growth factor 1 + 0.5 * i / 10 < 1.5; same draws otherwise
    g0a, g0b = a.group(0), b.group(0)
    assert g0a.trajectories == g0b.trajectories  # factor exactly 1 at group 0
    # update 4 (group 40): factor 3, capped at the 512-token response cap
    for ta, tb in zip(a.group(40).trajectories, b.group(40).trajectories):
        for ra, rb in zip(ta.responses, tb.responses):
            assert rb >= ra
            assert rb <= 512
    assert _mean_response(b, 40, 5) > 1.5 * _mean_response(a, 40, 5)


def test_mix_shift_switches_task_weights_at_the_update():
    base = wl.preset("text-7b")
    ws, alf = base.types
    spec = dataclasses.replace(
        base,
        batch_groups=4,
        b_min_groups=2,
        types=(ws, dataclasses.replace(alf, weight=0.0)),
        mix_shift_at=5,
        mix_after=(0.0, 1.0),
    )
    s = wl.TaskStream(spec)
    before = {s.group(i).type_index for i in range(20)}  # updates 0-4
    after = {s.group(i).type_index for i in range(20, 40)}  # updates 5-9
    assert before == {0} and after == {1}
    assert not spec.stationary and base.stationary


def test_mix_shift_needs_a_weight_per_type():
    base = wl.preset("text-7b")
    with pytest.raises(ValueError, match="mix_after"):
        dataclasses.replace(base, mix_shift_at=3, mix_after=(1.0,))
    with pytest.raises(ValueError, match="weights are 0"):
        dataclasses.replace(base, types=tuple(dataclasses.replace(t, weight=0) for t in base.types))


def test_eval_groups_grow_at_their_phase():
    spec = dataclasses.replace(wl.preset("text-7b"), eval_every=10, eval_tasks=4)
    s = wl.TaskStream(spec)
    assert s.update_of(0, is_eval=True) == 10 and s.update_of(3, is_eval=True) == 10
    assert s.update_of(4, is_eval=True) == 20
    assert s.update_of(256, is_eval=False) == 2


def test_family_sample_is_seeded_and_covers_every_drift_kind():
    a, b = family.sample(8, seed=3, steps=40), family.sample(8, seed=3, steps=40)
    assert a == b
    assert family.sample(8, seed=4, steps=40) != a
    assert {m.drift for m in a} == set(family.DRIFTS)
    for m in a:
        assert m.n_gpus in family.GPU_COUNTS
        assert m.spec.group_size in family.GROUP_SIZES
        assert m.stationary == (m.drift == "none")
        if m.drift == "growth":  # x2-x4 by the last update
            assert 2.0 <= 1 + m.spec.response_growth * 40 <= 4.0
        if m.drift == "mix":
            assert m.spec.mix_shift_at == 20
            assert sum(t.weight for t in m.spec.types if t.weight == 0) == 0
        # per-GPU trajectories per update stay the preset's (within rounding of groups)
        base = wl.osworld() if "gui" in m.spec.name else wl.text()
        per_gpu = base.batch_groups * base.group_size / family.PRESET_GPUS
        assert m.spec.batch_groups == max(2, round(per_gpu * m.n_gpus / m.spec.group_size))


def test_ratio_summary_reads_worst_median_and_drift_rows():
    def row(drift, x):
        return {"drift": drift, "over_best_fixed": {"tidejax": x}}

    rows = [row("none", 1.1), row("none", 0.9), row("mix", 1.5), row("eval", 1.3)]
    st = tables.ratio_summary(rows)
    assert st["worst"] == 0.9 and st["median"] == pytest.approx(1.2)
    assert st["nonstationary_worst"] == 1.3 and st["nonstationary_median"] == pytest.approx(1.4)


def _tiny_member() -> family.Member:
    """The sample's GUI member (small groups) cut to two groups a step, for 2-step runs."""
    m = family.sample(3, seed=0, steps=2, gpu_counts=(8,))[2]
    spec = dataclasses.replace(m.spec, batch_groups=2, b_min_groups=1, eval_tasks=2)
    return dataclasses.replace(m, spec=spec)


def test_robustness_rows_compare_every_system_with_the_best_fixed_full_run():
    from tidejax.sim.config import SimConfig

    m = _tiny_member()
    spec = m.spec
    (row,) = tables.robustness([m], SimConfig(steps=2), sweep_steps=1, n=1)
    ratios = row["over_best_fixed"]
    assert row["gpus"] == 8 and row["member"] == spec.name
    assert {"sync", "bidirl", "tidejax", "tidejax+bidirl"} <= set(ratios)
    assert {"areal", "streamrl"} <= set(ratios)
    best = row["best_fixed"].split("@")[0]
    assert best in ("areal", "streamrl")
    assert ratios[best] == 1.0 and max(ratios["areal"], ratios["streamrl"]) == 1.0
    assert all(r > 0 for r in ratios.values())
    assert 0 < row["stream_ceiling"] <= 1 and row["cap_over_best_fixed"] > 0


def _marked_run(system: str, paces: list[tuple[int, float]]):
    """A RunResult whose steps consume ``paces`` (tokens, seconds) one step each."""
    from tidejax.sim.metrics import RunResult

    t, tok = [0.0], [0]
    for n, s in paces:
        tok.append(tok[-1] + n)
        t.append(t[-1] + s)
    return RunResult(
        system=system, workload="w", steps=len(paces), wall_s=t[-1], consumed_tokens=tok[-1],
        consumed_response_tokens=tok[-1], dropped_tokens=0, goodput=tok[-1] / t[-1],
        rwt_gpu_s=0.0, twt_gpu_s=0.0, kv_hit_rate=0.0, mean_staleness=0.0, max_staleness=0,
        breakdown={}, roles={}, extra={"step_marks": t, "consumed_marks": tok},
    )


def test_phase_paces_split_the_steps_evenly():
    run = _marked_run("a", [(100, 10.0), (100, 10.0), (100, 20.0), (100, 20.0)])
    assert tables.phase_paces(run, 2) == [(200, 20.0), (200, 40.0)]
    assert tables.phase_paces(run, 1) == [(400, 60.0)]
    with pytest.raises(ValueError, match="phases"):
        tables.phase_paces(run, 5)


def test_phase_oracle_maximises_the_whole_run_not_each_phase():
    # by hand: phase 1 gives A 100 tok in 10 s (pace 10) or B 300 tok in 40 s (pace 7.5);
    # phase 2 is 10 tok in 10 s either way. A then: 110 / 20 = 5.5; B then: 310 / 50 = 6.2,
    # so the oracle takes B's slower phase 1, which a per-phase choice would not
    a = _marked_run("A", [(100, 10.0), (10, 10.0)])
    b = _marked_run("B", [(300, 40.0), (10, 10.0)])
    goodput, pick = tables.phase_oracle([a, b], 2)
    assert goodput == pytest.approx(6.2)
    assert pick[0] == "B"
    # one phase: the best whole run
    assert tables.phase_oracle([a, b], 1) == (pytest.approx(6.2), ("B",))
    # a switch each way: A's fast first half, B's fast second half
    c = _marked_run("C", [(200, 20.0), (200, 40.0)])
    d = _marked_run("D", [(200, 40.0), (200, 20.0)])
    assert tables.phase_oracle([c, d], 2) == (pytest.approx(10.0), ("C", "D"))


def test_headroom_rows_hold_every_fixed_split_and_oracles_no_worse_than_them():
    from tidejax.sim.config import SimConfig

    m = _tiny_member()
    (row,) = tables.headroom([m], SimConfig(steps=2), phases=2, n=1)
    x = row["over_best_fixed"]
    names = {r["system"] for r in row["runs"]}
    for family_name in ("areal", "streamrl", "tidejax-fixed"):
        assert {f"{family_name}@{r:g}" for r in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)} <= names
    assert "tidejax" in names and row["best_tidejax_fixed"].startswith("tidejax-fixed@")
    # the oracle may keep one run throughout, so it is never below that run
    assert x["baseline_oracle"] >= 1.0 - 1e-9
    assert x["tidejax_fixed_oracle"] >= x["tidejax_fixed"] - 1e-9
    assert len(row["tidejax_fixed_oracle_pick"]) == 2


def test_headroom_cli_rejects_phases_outside_the_run_before_running(capsys):
    from tidejax.experiments import simulate

    for bad in ("0", "11"):
        with pytest.raises(SystemExit):
            simulate.main(["--table", "headroom", "--steps", "10", "--phases", bad])
        assert "--phases must be between 1 and --steps (10)" in capsys.readouterr().err


def test_phase_oracle_equals_a_search_of_every_choice():
    import itertools

    import numpy as np

    rng = np.random.default_rng(3)
    for _ in range(20):
        runs = [
            _marked_run(f"r{j}", [(int(rng.integers(1, 500)), float(rng.uniform(1, 60)))
                                  for _ in range(6)])
            for j in range(4)
        ]
        paces = [tables.phase_paces(r, 3) for r in runs]
        picks = ([paces[i][k] for k, i in enumerate(c)]
                 for c in itertools.product(range(4), repeat=3))
        exhaustive = max(sum(p[0] for p in pk) / sum(p[1] for p in pk) for pk in picks)
        assert tables.phase_oracle(runs, 3)[0] == pytest.approx(exhaustive, rel=1e-12)
