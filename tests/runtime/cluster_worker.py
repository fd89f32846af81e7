"""One process of the two-process tests in test_cluster.py (not collected by pytest).

    python cluster_worker.py PORT PROCESS_ID SCENARIO TIMEOUT_S

Scenarios: "agree" (leader decisions), "skip" (process 1 skips a decision), "train" (a
trainer mesh over both processes' devices updates, then each process's own rollout engine
loads the new weights). Prints one JSON line of what it saw; a StageError is printed to
stderr, exit code 3.
"""

import json
import sys

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(4)

import jax
import numpy as np

from tidejax.runtime.cluster import Decisions, Launch, StageError, exit_now


def decisions_scenario(scenario: str, timeout_s: int) -> dict:
    decisions = Decisions(run_id="test", timeout_s=timeout_s)
    seen = {}
    try:
        # The leader's value wins: each process would compute its own pid here.
        if not (scenario == "skip" and jax.process_index() == 1):
            seen["plan"] = decisions.decide("plan", lambda: {"from": jax.process_index()})
        decisions.barrier("train")
        seen["ready"] = decisions.decide_from(
            "ready", {"ready": 2 + jax.process_index()},
            lambda digests: [d["ready"] for d in digests])
        seen["batch"] = decisions.decide("batch", lambda: [3, 1, 2])
    except StageError as e:
        print(f"StageError: {e}", file=sys.stderr, flush=True)
        exit_now(3)
    return seen


def fingerprint(tree) -> float:
    return float(sum(np.abs(np.asarray(x, np.float64)).sum()
                     for x in jax.tree.leaves(jax.device_get(tree))))


def train_scenario() -> dict:
    from tidejax.models.testing import tiny_config, tiny_params
    from tidejax.serving.config import EngineConfig
    from tidejax.serving.engine import make_engine

    from tidejax.rl.config import LossConfig, OptimConfig, RLConfig
    from tidejax.rl.testing import FAST_COMPILE, random_trajectory
    from tidejax.runtime.topology import Topology
    from tidejax.runtime.trainer_runner import TrainerRunner
    from tidejax.sched import ers

    config = tiny_config()
    rl = RLConfig(loss=LossConfig(kl_coef=0.05), optim=OptimConfig(lr=1e-3, total_steps=10))
    params = jax.device_get(tiny_params(config))
    runner = TrainerRunner(config, rl, row_len=64, micro_batch_tokens=64,
                           ref_params_host=params, compiler_options=FAST_COMPILE)
    rng = np.random.default_rng(0)  # the same batch on every process
    trajectories = [random_trajectory(config, rng, int(rng.integers(20, 60))) for _ in range(4)]
    topology = Topology.of(jax.devices(), per_process=4, rank_size=1)
    rollout, _, actor = topology.roles(ers.Partition(rollout=2, actor=2))
    runner.place(None, actor)
    state = runner.actor.init_state(0, params)
    state, report = runner.step(state, trajectories, [1.0, -1.0, 0.5, -0.5], "colocated")
    local = [rank for rank in rollout if rank[0].process_index == jax.process_index()]
    weights = runner.actor.rollout_copy(state.params)
    engine = make_engine(config, weights, local[0],
                         EngineConfig(page_size=16, num_pages=8, max_slots=1,
                                      max_pages_per_seq=8, prefill_buckets=(64,)))
    trainer_params = runner.actor.rollout_copy(state.params)  # the trainer's view, gathered
    return {"actor_processes": sorted({d.process_index for d in actor}),
            "engine_devices": sorted({d.id for x in jax.tree.leaves(engine.params)
                                      for d in x.devices()}),
            "local_ids": sorted(d.id for d in jax.local_devices()),
            "loss": report.metrics["loss"], "engine": fingerprint(engine.params),
            "trainer": fingerprint(trainer_params)}


def main() -> None:
    port, process_id, scenario, timeout_s = sys.argv[1:5]
    process_id, timeout_s = int(process_id), int(timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    Launch(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
           timeout_s=timeout_s).initialize()
    seen = {"process": jax.process_index(), "processes": jax.process_count(),
            "local_devices": jax.local_device_count(), "devices": jax.device_count()}
    seen.update(train_scenario() if scenario == "train"
                else decisions_scenario(scenario, timeout_s))
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
