"""Trainer runner: RA2P modes agree on the update; a non-finite loss skips the update."""

import jax
import numpy as np

from tidejax.models.testing import tiny_config, tiny_params
from tidejax.rl.config import LossConfig, OptimConfig, RLConfig
from tidejax.rl.testing import FAST_COMPILE, random_trajectory
from tidejax.runtime.trainer_runner import TrainerRunner

CFG = tiny_config()
RL = RLConfig(loss=LossConfig(kl_coef=0.05), optim=OptimConfig(lr=1e-3, total_steps=10))


def make_runner():
    params = tiny_params(CFG)
    runner = TrainerRunner(CFG, RL, row_len=64, micro_batch_tokens=64,
                           ref_params_host=jax.device_get(params),
                           compiler_options=FAST_COMPILE)
    return runner, params


def trajectories(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [random_trajectory(CFG, rng, int(rng.integers(20, 60))) for _ in range(n)]


def test_colocated_alternating_and_decoupled_give_the_same_update():
    runner, params = make_runner()
    trajs = trajectories()
    adv = [1.0, -1.0, 0.5, -0.5]
    results = {}
    for mode, ref in (("colocated", []), ("alternating", []), ("decoupled", jax.devices()[2:3])):
        state = runner.place(None, jax.devices()[:2], ref)
        state = runner.actor.init_state(0, params)
        state, report = runner.step(state, trajs, adv, mode)
        assert report.mode == mode and report.micro_batches >= 2
        results[mode] = jax.device_get(state.params)
    for mode in ("alternating", "decoupled"):
        for a, b in zip(jax.tree.leaves(results["colocated"]), jax.tree.leaves(results[mode])):
            np.testing.assert_allclose(a, b, atol=2e-6)


def test_non_finite_loss_skips_the_update():
    runner, params = make_runner()
    runner.place(None, jax.devices()[:1])
    state = runner.actor.init_state(0, params)
    before = jax.device_get(state.params)
    trajs = trajectories(2)
    adv = [float("nan"), 1.0]  # a NaN advantage poisons the loss
    state, report = runner.step(state, trajs, adv, "colocated")
    assert report.metrics == {"skipped_update": 1.0} and runner.skipped_updates == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b)


def test_the_reference_stays_on_the_actor_mesh_only_where_the_memory_model_allows():
    """Allowed: copied in once per actor mesh and reused by every later step (no swap);
    not allowed (or a capacity the device does not report): copied in every step."""
    params = tiny_params(CFG)
    trajs, adv = trajectories(), [1.0, -1.0, 0.5, -0.5]
    for allowed in (True, False):
        asked = []

        def stays(devices, allowed=allowed):
            asked.append(devices)
            return allowed

        runner = TrainerRunner(CFG, RL, row_len=64, micro_batch_tokens=64,
                               ref_params_host=jax.device_get(params),
                               compiler_options=FAST_COMPILE, ref_stays_beside=stays)
        runner.place(None, jax.devices()[:2])
        state = runner.actor.init_state(0, params)
        swaps = []
        for mode in ("colocated", "alternating", "colocated"):
            state, report = runner.step(state, trajs, adv, mode)
            swaps.append(report.swap_seconds)
        assert asked and set(asked) == {2}
        if allowed:
            assert swaps[0] > 0 and swaps[1:] == [0.0, 0.0]
            resident = runner._resident_ref
            assert resident is not None
            runner.place(state, jax.devices()[2:4])  # a new actor mesh: placed again
            assert runner._resident_ref is None
        else:
            assert all(s > 0 for s in swaps) and runner._resident_ref is None
