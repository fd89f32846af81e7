"""Discrete-event simulator of a GPU cluster running asynchronous multi-turn agentic RL.

It drives the same :mod:`tidejax.sched` policies and the same page bookkeeping
(:mod:`tidejax.serving.page_pool`) the live runtime uses, with cost models calibrated from
published figures (``shared/calibration.md``). Entry points: :func:`systems.run`,
:mod:`tables` (the paper's comparisons) and ``python -m tidejax.experiments.simulate``.
"""

from tidejax.sim.config import SimConfig, SystemSpec
from tidejax.sim.costs import CostModel, SwitchConstants
from tidejax.sim.ideal import IdealBound
from tidejax.sim.metrics import RunResult
from tidejax.sim.systems import run
from tidejax.sim.workload import Dist, TaskType, WorkloadSpec

__all__ = [
    "CostModel",
    "Dist",
    "IdealBound",
    "RunResult",
    "SimConfig",
    "SwitchConstants",
    "SystemSpec",
    "TaskType",
    "WorkloadSpec",
    "run",
]
