"""The systems the job runs, as data: what each one's control loop does differently.

One control loop (`runtime/controller.py`) runs every system; a `SystemSpec` says which of
its stages a system uses and how, so the loop asks the spec instead of comparing names.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    name: str
    # Rollout generates a whole batch on every device, then the trainer runs (phases take
    # turns); otherwise rollout and training run at once on separate devices.
    phased: bool
    # ERS re-plans the partition, the batch size and the trainer mode at each boundary;
    # otherwise the partition is fixed by topology.rollout_ranks.
    elastic: bool
    # Rollout admission: "ctb" (whole tasks, KV pinned between turns) or "request".
    scheduler: str
    # The trainer's mode when it is fixed; None when RA2P's plan chooses it each step.
    trainer_mode: str | None

    @property
    def pins_kv(self) -> bool:
        """Whether a task's KV stays pinned on its rank between turns."""
        return self.scheduler == "ctb"

    def staleness_bound(self, configured: int) -> int:
        """A phased system trains only on the version that generated its batch."""
        return 0 if self.phased else configured


SYSTEMS: dict[str, SystemSpec] = {
    spec.name: spec for spec in (
        SystemSpec("sync", phased=True, elastic=False, scheduler="request",
                   trainer_mode="colocated"),
        # AReaL-like: a fixed split, one ref swap per step (ready-batch aggregation).
        SystemSpec("async", phased=False, elastic=False, scheduler="request",
                   trainer_mode="colocated"),
        # StreamRL-like: a fixed split, the ref swapped in for every micro-batch.
        SystemSpec("stream", phased=False, elastic=False, scheduler="request",
                   trainer_mode="alternating"),
        SystemSpec("tide", phased=False, elastic=True, scheduler="ctb", trainer_mode=None),
    )}
