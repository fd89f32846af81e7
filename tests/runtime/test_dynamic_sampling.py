"""Dynamic sampling: all-equal-reward groups leave before the buffer, within a budget."""

import asyncio

import numpy as np

from tests.runtime.test_manager import run_groups
from tidejax.runtime.records import EvalTally, reward_standard_error


def test_zero_variance_groups_are_filtered_within_the_budget_and_counted():
    # The mock engine's actions never buy anything: every group's rewards are all 0. With a
    # batch of 2 groups and 2 sampling rounds, the step may filter 2 groups; the rest train.
    manager, buffer, tasks, _ = asyncio.run(run_groups(
        "ctb", n_groups=4, dynamic_sampling=True, dynamic_sampling_rounds=2, batch_groups=2))
    ready = buffer.take(100, trainer_version=0)
    filtered = [d for d in buffer.dropped if d.reason == "zero_variance"]
    assert len(filtered) == 2 and len(ready) == 2
    assert manager.counters["groups_filtered"] == 2
    assert manager.filtered_since_consumed == 2
    # nothing lost or duplicated: every group is either ready or filtered, once
    ids = sorted([g.group_id for g in ready] + [d.group_id for d in filtered])
    assert ids == sorted({t.group_id for t in tasks})
    # their generated tokens are recorded as dropped (not goodput)
    assert sum(d.generated_tokens for d in filtered) > 0
    # the quota slots went back: only the groups that reached the buffer are outstanding
    assert manager.outstanding_groups == 2
    manager.consumed(2)
    assert manager.filtered_since_consumed == 0 and manager.outstanding_groups == 0


def test_without_dynamic_sampling_zero_variance_groups_train():
    manager, buffer, _, _ = asyncio.run(run_groups("ctb", n_groups=3))
    assert len(buffer.take(100, trainer_version=0)) == 3
    assert manager.counters["groups_filtered"] == 0


def test_group_with_reward_spread_passes_the_filter():
    manager, *_ = asyncio.run(run_groups("ctb", n_groups=1, dynamic_sampling=True))
    assert manager._filters_out(np.array([0.0, 0.0, 0.0]))
    assert not manager._filters_out(np.array([0.0, 0.5, 0.0]))


def test_eval_standard_error_matches_numpy():
    rewards = np.array([0.0, 0.25, 1.0, 1.0, 0.6])
    tally = EvalTally(version=0, episodes=len(rewards), reward_sum=float(rewards.sum()),
                      reward_sq_sum=float((rewards ** 2).sum()))
    expected = rewards.std(ddof=1) / np.sqrt(len(rewards))
    assert np.isclose(tally.reward_se, expected)
    assert np.isclose(tally.reward, rewards.mean())
    assert np.isnan(reward_standard_error(1.0, 1.0, 1))
