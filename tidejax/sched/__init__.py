"""Pure scheduling policies: snapshots in, decisions out. No jax, no I/O, no clocks.

Modules: :mod:`ctb` (Continuous Task Batching), :mod:`request_level` (the request-level
baseline), :mod:`ra2p` (Ref/Actor mode choice), :mod:`ers` (elastic resource scaling),
:mod:`planner` and :mod:`borrowing` (BiDiRL), :mod:`staleness` (the admission quota) and
:mod:`perf` (time-performance models shared with the simulator).
"""

from tidejax.sched import borrowing, ctb, ers, perf, planner, ra2p, request_level, staleness
from tidejax.sched.borrowing import Borrow, BorrowState, Direction, SwitchCosts
from tidejax.sched.ctb import (
    Admission,
    CtbConfig,
    CtbSnapshot,
    Decisions,
    PendingGroup,
    RankState,
    TaskState,
)
from tidejax.sched.ers import ErsConfig, Partition, Plan, Signals
from tidejax.sched.perf import DecodeCurve, HardwareSpec, ModelSpec
from tidejax.sched.planner import PlanChoice, WorkloadProfile, initial_partition
from tidejax.sched.ra2p import Mode, ModeCosts, Ra2pCosts, choose_mode
from tidejax.sched.request_level import EngineState, NewGroup, RequestDecisions, RequestSnapshot

__all__ = [
    "Admission",
    "Borrow",
    "BorrowState",
    "CtbConfig",
    "CtbSnapshot",
    "Decisions",
    "DecodeCurve",
    "Direction",
    "EngineState",
    "ErsConfig",
    "HardwareSpec",
    "Mode",
    "ModeCosts",
    "ModelSpec",
    "NewGroup",
    "Partition",
    "PendingGroup",
    "Plan",
    "PlanChoice",
    "Ra2pCosts",
    "RankState",
    "RequestDecisions",
    "RequestSnapshot",
    "Signals",
    "SwitchCosts",
    "TaskState",
    "WorkloadProfile",
    "borrowing",
    "choose_mode",
    "ctb",
    "ers",
    "initial_partition",
    "perf",
    "planner",
    "ra2p",
    "request_level",
    "staleness",
]
