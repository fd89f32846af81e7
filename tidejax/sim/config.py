"""What a simulated run is: a system (which mechanisms) and a config (cluster, bound, steps)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidejax.runtime.config import CONSUME_ORDERS, DEFAULT_CONSUME_ORDER
from tidejax.sim.costs import SwitchConstants

ROLLOUT_POLICIES = ("request", "ctb")
TRAINER_MODES = ("batch", "stream", "ra2p")


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """Which mechanisms a system uses. Presets live in :mod:`tidejax.sim.systems`."""

    name: str
    sync: bool = False  # veRL-like: every GPU alternates rollout and training phases
    rollout: str = "request"  # request-level batching or CTB
    trainer: str = "batch"  # batch (wait for the batch) | stream (per micro-batch) | ra2p
    rollout_fraction: float | None = None  # fixed split (None: planner or ERS decides)
    ers: bool = False
    planner: bool = False
    borrowing: bool = False

    def __post_init__(self) -> None:
        if self.rollout not in ROLLOUT_POLICIES:
            raise ValueError(f"SystemSpec.rollout must be one of {ROLLOUT_POLICIES}")
        if self.trainer not in TRAINER_MODES:
            raise ValueError(f"SystemSpec.trainer must be one of {TRAINER_MODES}")
        if self.rollout_fraction is not None and not 0 < self.rollout_fraction < 1:
            raise ValueError("SystemSpec.rollout_fraction must be in (0, 1)")
        if not self.sync and not (self.rollout_fraction or self.planner):
            raise ValueError("SystemSpec: an async system needs rollout_fraction or planner")


@dataclass(frozen=True, slots=True)
class SimConfig:
    steps: int = 100
    n_gpus: int = 32  # TideRL testbed: 4 nodes x 8 H100
    # calibration stale.onestep: one-step off-policy (StreamRL, PEARL, RollArt, NeMo RL);
    # enforced at admission as AReaL's quota, (bound + 1) * batch groups outstanding
    staleness_bound: int = 1
    # True: a group more than staleness_bound versions behind the trainer when the trainer
    # takes it is dropped and counted, as the runtime's GlobalBuffer does; False keeps it
    drop_stale: bool = True
    # The order the trainer takes finished groups in, as the runtime's GlobalBuffer
    # (RolloutConfig.consume_order). "deadline" (the default here and in the runtime)
    # takes fastest first but keeps a place in the batch for every group in flight that
    # would be stale by the next update, so none is dropped. "admission" waits for the
    # oldest admitted group. "completion" takes the oldest version ready, fastest first,
    # never waiting: slow groups are passed over until stale and dropped (the tables'
    # order up to 2026-12-06, which overstated async goodput about 25% on text-7b).
    consume_order: str = DEFAULT_CONSUME_ORDER
    # True: an evaluation of version v holds the next weight sync until it finishes, as the
    # runtime's boundary waits for it (Controller._wait_eval). False is a what-if: the sync
    # goes ahead and the evaluation's tasks carry on (re-prefilled like any running
    # sequence), as if evaluation kept its own copy of the weights (--unanchored-eval)
    anchored_eval: bool = True
    tick_s: float = 0.2  # admission scheduling period, virtual seconds [A]
    bin_s: float = 10.0  # timeline resolution
    page_size: int = 256  # KV page, tokens [A] (engine-configurable; coarse keeps the sim fast)
    ers_tau: float = 1.0  # head-of-line threshold in average step times [A]
    switch: SwitchConstants = field(default_factory=SwitchConstants)
    max_sim_s: float = 1e7  # safety stop

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.n_gpus <= 0:
            raise ValueError("SimConfig.steps and n_gpus must be positive")
        if self.staleness_bound < 0:
            raise ValueError("SimConfig.staleness_bound must be >= 0")
        if self.consume_order not in CONSUME_ORDERS:
            raise ValueError(f"SimConfig.consume_order must be one of {CONSUME_ORDERS}, "
                             f"got {self.consume_order!r}")
        if self.tick_s <= 0 or self.bin_s <= 0 or self.page_size <= 0 or self.ers_tau <= 0:
            raise ValueError("SimConfig tick_s, bin_s, page_size, ers_tau must be positive")
