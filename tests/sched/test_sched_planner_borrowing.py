"""Static planner, bidirectional borrowing, request-level baseline, staleness quota."""

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidejax.sched import borrowing, planner, request_level, staleness
from tidejax.sched.borrowing import BorrowState, Direction, SwitchCosts
from tidejax.sched.perf import HardwareSpec, ModelSpec, min_train_gpus
from tidejax.sched.planner import WorkloadProfile

M7, H100 = ModelSpec.qwen25_7b(), HardwareSpec.h100()
WL = WorkloadProfile(
    batch_groups=128,
    group_size=8,
    mean_turns=10,
    mean_prompt_tokens=800,
    mean_response_tokens=150,
    mean_obs_tokens=160,
    mean_env_s=0.3,
    mean_sq_len=2.0e7,
)


def test_planner_picks_the_min_max_split():
    choice = planner.initial_partition(M7, H100, WL, total_gpus=32)
    assert choice.rollout_gpus + choice.train_gpus == 32
    assert choice.train_gpus >= min_train_gpus(M7, H100)
    best = min(max(r, t) for _, r, t in choice.candidates if math.isfinite(t))
    assert max(choice.t_rollout, choice.t_train) == pytest.approx(best)
    # monotone models: more rollout GPUs never slow rollout, fewer trainer GPUs never speed it
    rows = [r for r in choice.candidates if math.isfinite(r[2])]
    assert all(a[1] >= b[1] and a[2] <= b[2] for a, b in itertools.pairwise(rows))


def test_planner_shifts_toward_training_when_training_is_heavier():
    heavy = dataclasses.replace(WL, mean_train_tokens=40_000)
    a = planner.initial_partition(M7, H100, WL, 32)
    b = planner.initial_partition(M7, H100, heavy, 32)
    assert b.train_gpus > a.train_gpus


SW = SwitchCosts(c_in=6.3, c_out=3.8, c_grad=0.9)


def test_borrow_only_when_gain_beats_switching():
    short = BorrowState(
        8, 24, idle_train=24, idle_rollout=0, rollout_window_s=8.0, train_window_s=0.0
    )
    assert borrowing.decide(short, SW) is None  # window shorter than c_in + c_out
    long = BorrowState(
        8, 24, idle_train=24, idle_rollout=0, rollout_window_s=120.0, train_window_s=0.0
    )
    b = borrowing.decide(long, SW)
    assert b.direction is Direction.TO_ROLLOUT and b.ranks == 24 and b.gain_s > 0
    to_train = BorrowState(
        8, 24, idle_train=0, idle_rollout=4, rollout_window_s=0.0, train_window_s=200.0
    )
    b = borrowing.decide(to_train, SW)
    assert b.direction is Direction.TO_TRAIN and b.ranks == 4


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 32), st.integers(1, 32), st.data(), st.floats(0, 500), st.floats(0, 500))
def test_borrow_rule(n_r, n_t, data, win_r, win_t):
    idle_t = data.draw(st.integers(0, n_t))
    idle_r = data.draw(st.integers(0, n_r))
    s = BorrowState(n_r, n_t, idle_t, idle_r, win_r, win_t)
    b = borrowing.decide(s, SW)
    assert b == borrowing.decide(s, SW)
    if b is not None:
        assert b.gain_s > 0 and b.window_s > SW.c_in + SW.c_out
        assert b.ranks <= (idle_t if b.direction is Direction.TO_ROLLOUT else idle_r)


def test_request_level_fifo_and_routing():
    assert request_level.admit_fifo(100, [30, 30, 50, 10], running=0, max_running=8) == 2
    assert request_level.admit_fifo(100, [30, 30], running=7, max_running=8) == 1
    snap = request_level.RequestSnapshot(
        engines=(
            request_level.EngineState(0, 500, (100, 100), assigned_tasks=9),
            request_level.EngineState(1, 50, (100,), assigned_tasks=2),
        ),
        new_groups=(
            request_level.NewGroup(1, 8),
            request_level.NewGroup(2, 8),
            request_level.NewGroup(3, 1, is_eval=True),
        ),
        outstanding_groups=3,
        quota_groups=4,
    )
    d = request_level.decide(snap)
    assert d.start == ((0, 2),)
    assert d.route == ((1, 1), (3, 0))  # quota admits one training group; eval always


def test_staleness_quota():
    assert staleness.max_outstanding(1, 64) == 128
    assert staleness.admissible_groups(130, 128) == 0
    assert staleness.staleness(5, 4) == 1
    with pytest.raises(ValueError):
        staleness.staleness(3, 4)
