"""Cost models of the virtual cluster: the perf curves bound to one model, GPU type and the
switching constants. Every constant cites calibration.md (or is marked [A]/[D])."""

from __future__ import annotations

from dataclasses import dataclass

from tidejax.sched import perf
from tidejax.sched.borrowing import SwitchCosts
from tidejax.sched.perf import DecodeCurve, HardwareSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class SwitchConstants:
    """Role-switch costs when a rank's processes stay alive (calibration §6.3)."""

    c_in: float = 6.3  # calibration switch.borrow_in, PEARL 8B [P, M]
    c_out: float = 3.8  # calibration switch.borrow_out, PEARL 3.2-4.4 midpoint [P, M]
    c_grad: float = 0.9  # calibration switch.trainer_on_rollpool.c_grad 0.66-1.21 [S, L]
    # ERS piggybacks on the post-update sync (TideRL): the switch costs only what does not fit
    # under t_sync. False charges c_in / c_out instead (calibration §6.3: "test both").
    ers_hidden_under_sync: bool = True

    def __post_init__(self) -> None:
        if min(self.c_in, self.c_out, self.c_grad) < 0:
            raise ValueError("SwitchConstants must be >= 0")

    def borrowing(self) -> SwitchCosts:
        return SwitchCosts(self.c_in, self.c_out, self.c_grad)


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelSpec
    hw: HardwareSpec
    tp: int = 1  # rollout tensor parallelism (GPUs per rollout rank)
    page_size: int = 256  # KV page, tokens [A]: the simulator's page granularity
    max_running: int = 256  # vLLM EngineArgs max_num_seqs default
    mb_tokens: int = 8192  # tokens per micro-batch per trainer GPU (TideRL RA2P micro-benchmark)
    switch: SwitchConstants = SwitchConstants()

    def __post_init__(self) -> None:
        if self.tp <= 0 or self.page_size <= 0 or self.max_running <= 0 or self.mb_tokens <= 0:
            raise ValueError("CostModel tp, page_size, max_running, mb_tokens must be positive")

    # rollout ---------------------------------------------------------------------
    @property
    def curve(self) -> DecodeCurve:
        return DecodeCurve.of(self.model, self.hw, self.tp)

    @property
    def kv_pages(self) -> int:
        return perf.kv_capacity_tokens(self.model, self.hw, self.tp) // self.page_size

    def prefill(self, n_new: float, n_cached: float) -> float:
        return perf.prefill_time(self.model, self.hw, n_new, n_cached, self.tp)

    # trainer ---------------------------------------------------------------------
    def train(self, tokens: float, sq: float, gpus: int) -> float:
        return perf.train_time(self.model, self.hw, tokens, sq, gpus)

    def ref(self, tokens: float, sq: float, gpus: int) -> float:
        return perf.ref_time(self.model, self.hw, tokens, sq, gpus)

    def swap(self, shards: int) -> float:
        return perf.swap_time(self.model, self.hw, shards)

    @property
    def min_train_gpus(self) -> int:
        return perf.min_train_gpus(self.model, self.hw)

    # sync and switching ------------------------------------------------------------
    def sync(self, cross_node: bool = True) -> float:
        return perf.sync_time(self.model, self.hw, cross_node)

    def colocated_sync(self) -> float:
        """veRL-style in-place reshard from the FSDP trainer into the co-located engine."""
        return 0.12  # calibration sync.q7b.intranode 0.02-0.12 s (upper end) [M]

    def engine_sleep(self) -> float:
        """Colocated rollout engine offloads its weights before training (D2H)."""
        return self.model.weight_bytes / self.tp / self.hw.pcie_d2h  # calibration offload.* [D]

    def engine_wake(self) -> float:
        """... and loads them back after (H2D)."""
        return perf.weight_load_time(self.model, self.hw, self.tp)  # calibration offload.* [D]

    def ers_switch(self, to_rollout: bool) -> float:
        """Extra time a rank moved by ERS spends beyond the sync window."""
        if not self.switch.ers_hidden_under_sync:
            return self.switch.c_out if to_rollout else self.switch.c_in
        # to trainer: load the Ref model (H2D) during the broadcast; to rollout: offload Ref
        # while the Actor backward finishes, then load Actor weights from the broadcast.
        load = perf.weight_load_time(self.model, self.hw)
        return max(0.0, load - self.sync())

    def reshard(self, new_actor_gpus: int) -> float:
        return perf.reshard_time(self.model, self.hw, new_actor_gpus)
