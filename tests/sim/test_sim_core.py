"""Simulator building blocks: decode timing, workload stream, cost models, ideal bound."""

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidejax.sched.perf import DecodeCurve, HardwareSpec, ModelSpec
from tidejax.sim import workload as wl
from tidejax.sim.costs import CostModel
from tidejax.sim.metrics import Ledger
from tidejax.sim.rollout import Rank

CURVE = DecodeCurve.of(ModelSpec.qwen25_7b(), HardwareSpec.h100())


def brute(curve, batch, ctx, k):
    total = 0.0
    for i in range(k):
        mem = curve.a + curve.b * (ctx + i * batch)
        total += max(mem, curve.c * batch) + curve.ovh
    return total / curve.derate if ctx < curve.short_ctx * batch else total


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 400), st.integers(0, 3_000_000), st.integers(0, 600))
def test_decode_closed_form_matches_iteration_sum(batch, ctx, k):
    assert CURVE.iters_time(batch, ctx, k) == pytest.approx(brute(CURVE, batch, ctx, k), rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 400), st.integers(0, 3_000_000), st.floats(0, 30))
def test_iters_within_is_the_inverse(batch, ctx, dt):
    k = CURVE.iters_within(batch, ctx, dt)
    assert CURVE.iters_time(batch, ctx, k) <= dt + 1e-12
    assert CURVE.iters_time(batch, ctx, k + 1) > dt


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 400),
    st.integers(0, 3_000_000),
    st.one_of(st.floats(1e-9, 0.05), st.floats(0, 30), st.floats(30, 3000)),
)
def test_iters_reaching_is_the_first_boundary_at_or_after(batch, ctx, dt):
    """The simulator's fast search: what iters_within + one more iteration used to give,
    and the time it returns is iters_time's own (so events land bit for bit where they did)."""
    k, t_k = CURVE.iters_reaching(batch, ctx, dt)
    old = CURVE.iters_within(batch, ctx, dt)
    if CURVE.iters_time(batch, ctx, old) < dt:
        old += 1
    assert k == old and t_k == CURVE.iters_time(batch, ctx, k)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 200_000), st.integers(0, 200_000), st.sampled_from(["qwen2.5-7b", "qwen2.5-14b"])
)
def test_prefill_coeffs_are_prefill_time_bit_for_bit(n, cached, model):
    from tidejax.sched import perf

    m, hw = ModelSpec.preset(model), HardwareSpec.h100()
    lin, attn, rate = perf.prefill_coeffs(m, hw)
    expect = perf.prefill_time(m, hw, n, cached)
    assert (lin * n + attn * n * (cached + n / 2)) / rate == expect if n > 0 else expect == 0.0


def test_calibrated_rates_match_calibration_rows():
    cost = CostModel(ModelSpec.qwen25_7b(), HardwareSpec.h100())
    assert CURVE.a == pytest.approx(5.7e-3, rel=0.02)  # dec.q7b.h100.t_weights
    assert CURVE.b == pytest.approx(2.14e-8, rel=0.02)  # dec.q7b.h100.t_per_ctx_token
    assert 2.6e4 <= 1e4 / cost.prefill(1e4, 0) <= 3.9e4  # pf.q7b.h100.tok_s
    assert 6.5e3 <= 1e4 / cost.train(1e4, 1e4 * 512, 1) <= 9e3  # train.q7b.h100.tok_s
    assert cost.ref(1e4, 0, 1) == pytest.approx(cost.train(1e4, 0, 1) / 3)
    assert 0.3 <= cost.engine_wake() <= 0.44  # offload.q7b.full_copy_pcie
    assert 1.0 < cost.sync() < 2.0  # W / bcast + fixed


def test_rank_turn_timing_by_hand():
    cost = CostModel(ModelSpec.qwen25_7b(), HardwareSpec.h100())
    led = Ledger(1, 1.0)
    r = Rank(0, (0,), cost, 0.0, led)

    class G:
        uid = 0
        draw = wl.GroupDraw(0, 0, 100, [wl.Trajectory([50], [], [])])

    from tidejax.sim.rollout import SimTask

    task = SimTask(0, G, 0)
    r.join(task, 1.0, prefill_s=0.2, recompute_s=0.05)
    expect = 1.2 + CURVE.iters_time(1, 100, 50)
    assert r.next_event() == pytest.approx(expect)
    assert r.finish() == [task] and r.t0 == pytest.approx(expect)
    assert task.ctx == 150 and r.B == 0
    r.close_idle(expect + 1)
    assert led.totals["prefill"] == pytest.approx(0.15)
    assert led.totals["recompute"] == pytest.approx(0.05)


def test_workload_stream_is_deterministic_and_consistent():
    spec = wl.preset("text-7b")
    a, b = wl.TaskStream(spec), wl.TaskStream(spec)
    for i in range(20):
        ga, gb = a.group(i), b.group(i)
        assert ga.prompt == gb.prompt and ga.trajectories == gb.trajectories
        t = spec.types[ga.type_index]
        for tr in ga.trajectories:
            assert 1 <= tr.turns <= t.max_turns
            assert len(tr.obs) == len(tr.env) == tr.turns - 1
            assert all(1 <= r <= 512 for r in tr.responses)
            assert wl.context_after(t, ga.prompt, tr, tr.turns - 1) <= t.context_cap
    assert a.eval_group(0).is_eval and len(a.eval_group(0).trajectories) == 1


def test_windowed_workload_trains_every_turn():
    spec = wl.preset("osworld")
    g = wl.TaskStream(spec).group(0)
    t = spec.types[0]
    tr = max(g.trajectories, key=lambda x: x.turns)
    tok, _ = wl.train_tokens(t, g.prompt, tr)
    assert tok > tr.turns * g.prompt  # one sample per turn
    assert wl.context_after(t, g.prompt, tr, tr.turns - 1) < g.prompt + 4 * 4000


def test_workload_from_toml_and_json(tmp_path):
    toml = tmp_path / "w.toml"
    toml.write_text("""
name = "tiny"
model = "qwen2.5-7b"
batch_groups = 4
b_min_groups = 2
[[types]]
name = "t"
weight = 1.0
prompt_tokens = {median = 300, p99 = 400}
response_tokens = {median = 50, p99 = 200, lo = 1, hi = 512}
obs_tokens = 40
env_s = {median = 0.1, p99 = 1.0}
success_prob = 0.5
success_turns = {median = 3, p99 = 6, lo = 1, hi = 8}
max_turns = 8
context_cap = 4096
""")
    spec = wl.load(toml)
    assert spec.batch_groups == 4 and spec.types[0].obs_tokens.median == 40
    data = json.loads(json.dumps({**dataclasses.asdict(spec)}, default=str))
    jpath = tmp_path / "w.json"
    jpath.write_text(json.dumps(data))
    assert wl.load(jpath) == spec
    with pytest.raises(ValueError, match="unknown workload keys"):
        wl.from_dict({**data, "bogus": 1})


def test_ideal_bound_is_positive_and_scales():
    spec = dataclasses.replace(wl.preset("text-7b"), batch_groups=4, b_min_groups=2)
    from tidejax.sim.ideal import ideal

    one, two = ideal(spec, 2, 8), ideal(spec, 2, 16)
    assert one.goodput > 0 and math.isclose(two.wall_s, one.wall_s / 2)


def _hand_spec(batch_groups: int = 1) -> wl.WorkloadSpec:
    """Groups of 4 single-turn trajectories (prompt 1000, response 100) on Qwen2.5-7B."""
    one = wl.TaskType(
        name="one",
        weight=1.0,
        prompt_tokens=wl.Dist(1000, 1000),
        response_tokens=wl.Dist(100, 100),
        obs_tokens=wl.Dist(10, 10),
        env_s=wl.Dist(1, 1),
        success_prob=1.0,
        success_turns=wl.Dist(1, 1),
        max_turns=1,
        context_cap=8192,
    )
    return wl.WorkloadSpec(
        "hand",
        "qwen2.5-7b",
        (one,),
        batch_groups=batch_groups,
        group_size=4,
        b_min_groups=1,
        eval_every=0,
    )


def test_tight_bound_by_hand():
    """One group of 4 single-turn trajectories per step (prompt 1000, response 100), 2 steps
    on 4 GPUs of Qwen2.5-7B on H100, staleness bound 0 (quota: 1 group in flight)."""
    from tidejax.sim.ideal import tight

    spec = _hand_spec()
    n_params, w_bytes, kv, layers, d = 7.62e9, 1.5231e10, 57344, 28, 3584
    a, b = w_bytes / (0.8 * 3.35e12), kv / (0.8 * 3.35e12)  # decode curve per iteration
    c, ovh, derate = 2 * n_params / (0.5 * 989e12), 5e-4, 0.7
    prompt_s = (2 * n_params * 1000 + 4 * layers * d * 1000 * 500) / (0.5 * 989e12)
    actor = (6 * n_params * 1100 + 12 * layers * d * 1100**2) / (0.4 * 989e12)  # per trajectory
    train = 8 * actor * (1 + 1 / 3)  # 8 trajectories, Ref a third of the Actor
    sync = min(w_bytes / 2.5e10 + 1.0, w_bytes / 5.28e10 + 0.12 + w_bytes / 3.5e10)
    # work: batch 256 (the KV pool holds 920k tokens), memory-bound (a/256 + b*1050 > c);
    # mean context 1050 < 2048: derated
    assert a / 256 + b * 1050 > c
    decode = 800 * (a / 256 + b * 1050 + ovh / 256) / derate
    work = (decode + 2 * prompt_s + train) / 4 + 2 * sync
    # partition: only 1 rollout + 3 trainer GPUs fit (the train state needs 3); rollout time
    # 800 t/b + 2 prompt_s meets the quota's 2 (100 t + prompt_s) at b = 4, t = t_iter(4)
    t4 = (a + b * 4 * 1050 + ovh) / derate
    partition = max(200 * t4 + 2 * prompt_s, train / 3) + 2 * sync
    # quota: each group holds the one slot for prompt + 100 tokens at batch 1
    quota = 2 * (prompt_s + 100 * (a + ovh) + b * (100 * 1000 + 100 * 99 / 2))
    bound = tight(spec, steps=2, n_gpus=4, staleness_bound=0)
    assert bound.walls["work"] == pytest.approx(work, rel=1e-9)
    assert bound.walls["partition"] == pytest.approx(partition, rel=1e-6)
    assert bound.walls["quota"] == pytest.approx(quota, rel=1e-9)
    assert bound.wall_s == pytest.approx(max(work, partition, quota), rel=1e-6)
    assert bound.goodput == pytest.approx(800 / bound.wall_s)
    # every group's latency is the quota's per-group term; 4 steps of one group each:
    # bound 0 takes each group the step it was admitted in (4 latencies), bound 1 lets two
    # weight-sync intervals share one (versions 0 and 2 start disjoint windows)
    from tidejax.sim.ideal import stream_order_floor

    latency = quota / 2
    assert stream_order_floor(spec, 4, 0) == pytest.approx(4 * latency, rel=1e-9)
    assert stream_order_floor(spec, 4, 1) == pytest.approx(2 * latency, rel=1e-9)


def test_stream_order_floor_takes_each_versions_slowest_group(monkeypatch):
    """Batch 2, bound 1, 5 steps: version 0 admits the first 4 groups, each later version the
    next 2; windows of two intervals from versions 0, 2 or from 1, 3."""
    from tidejax.sim import ideal

    latencies = [1.0, 9.0, 2.0, 3.0, 7.0, 1.0, 4.0, 4.0, 5.0, 8.0]
    work = ideal._Work({}, group_latencies=latencies)
    monkeypatch.setattr(ideal, "_work", lambda spec, steps: work)
    # slowest per version: 9 (groups 0-3), 7, 4, 8; windows 9 + 4 = 13 and 7 + 8 = 15
    assert ideal.stream_order_floor(_hand_spec(batch_groups=2), 5, 1) == 15.0
    # bound 0: each version admits 2 groups and every interval is its own window
    assert ideal.stream_order_floor(_hand_spec(batch_groups=2), 5, 0) == 9 + 3 + 7 + 4 + 8
