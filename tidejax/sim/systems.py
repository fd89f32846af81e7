"""The compared systems, all on the same cluster, workload and constants.

* ``sync`` (veRL-like): colocated, phase barriers, request-level engine.
* ``areal@x`` (AReaL-like): fixed rollout fraction ``x``, request-level engine, the trainer
  waits for the whole batch (one aggregated Ref phase).
* ``streamrl@x`` (StreamRL-like): fixed fraction, request-level engine, per-micro-batch
  Ref/Actor alternation with swaps.
* ``bidirl`` (BiDiRL-like): static planner partition, request-level engine, batch trainer,
  bidirectional borrowing.
* ``tidejax``: CTB + RA2P + ERS from the static planner's partition (cold start at maximum
  rollout until ``B_min`` groups are ready).
* ``tidejax+bidirl``: the same plus bidirectional borrowing.
* ``tidejax-fixed@x``: CTB + RA2P held at rollout fraction ``x``, no ERS (what tidejax's
  mechanisms give without adapting the split; ``--table headroom``).
"""

from __future__ import annotations

import time

from tidejax.sim.cluster import Cluster
from tidejax.sim.config import SimConfig, SystemSpec
from tidejax.sim.elastic import Elastic
from tidejax.sim.metrics import RunResult
from tidejax.sim.workload import WorkloadSpec

RATIOS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)  # TideRL sweeps 0.125 ... 0.75


def sync() -> SystemSpec:
    return SystemSpec("sync", sync=True)


def areal(x: float) -> SystemSpec:
    return SystemSpec(f"areal@{x:g}", rollout_fraction=x, trainer="batch")


def streamrl(x: float) -> SystemSpec:
    return SystemSpec(f"streamrl@{x:g}", rollout_fraction=x, trainer="stream")


def bidirl() -> SystemSpec:
    return SystemSpec("bidirl", planner=True, trainer="batch", borrowing=True)


def tidejax() -> SystemSpec:
    """ERS starts from the static planner's partition (no sweep) and adapts one rank a step."""
    return SystemSpec("tidejax", rollout="ctb", trainer="ra2p", ers=True, planner=True)


def tidejax_bidirl() -> SystemSpec:
    return SystemSpec(
        "tidejax+bidirl", rollout="ctb", trainer="ra2p", ers=True, planner=True, borrowing=True
    )


def tidejax_fixed(x: float) -> SystemSpec:
    return SystemSpec(f"tidejax-fixed@{x:g}", rollout="ctb", trainer="ra2p", rollout_fraction=x)


def build(system: SystemSpec, spec: WorkloadSpec, cfg: SimConfig) -> Cluster:
    cl = Cluster(system, spec, cfg)
    if not system.sync:
        cl.elastic = Elastic(cl)
    return cl


def run(system: SystemSpec, spec: WorkloadSpec, cfg: SimConfig) -> RunResult:
    """One simulation; ``extra["sim_s"]`` / ``extra["sim_cpu_s"]`` say what it cost to run."""
    w0, c0 = time.perf_counter(), time.process_time()
    res = build(system, spec, cfg).run()
    res.extra["sim_s"] = round(time.perf_counter() - w0, 2)
    res.extra["sim_cpu_s"] = round(time.process_time() - c0, 2)
    return res
