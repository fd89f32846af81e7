"""The processes of one job: launch settings, and decisions the leader makes for all.

A multi-host job runs the same control loop on every process (multi-controller SPMD, no
Pathways). Whatever must be identical everywhere (a partition, a batch's group ids, a
micro-batch plan, an evaluation or checkpoint trigger) is computed by the leader, process
0, and read by the others through `Decisions.decide`, in the same order on every process.
Each decision carries its stage name, so a process that has fallen out of step fails at
once naming both stages, and one that waits longer than `timeout_s` for the leader fails
naming the stage it waited in, instead of hanging in a collective until JAX's shutdown
barrier gives up.

Decisions travel through the coordination service's key-value store (host memory, not a
device collective), which is what the timeout needs. One process is the one-host case of
the same code: the leader computes and nothing is sent.

No threads or processes of its own: `jax.distributed` runs the coordination service.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import jax

log = logging.getLogger(__name__)

LEADER = 0
KEPT_POSITIONS = 1024  # decisions the store keeps before the leader deletes them


class StageError(RuntimeError):
    """The processes of a job disagree on where they are, or one stopped answering."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins the job. With nothing set, one process runs alone unless
    `auto` asks `jax.distributed.initialize()` to detect the cluster (SLURM, MPI, ...)."""

    coordinator: str | None = None  # host:port of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    # Heartbeat, shutdown and stage timeouts: a desynchronised or dead process is reported
    # within about this long (JAX's defaults are 100 s and 300 s).
    timeout_s: int = 30

    def __post_init__(self):
        explicit = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in explicit) and None in explicit:
            raise ValueError("a multi-process launch needs --coordinator, --num-processes and "
                             "--process-id together (or none of them, with --distributed, to "
                             "let jax.distributed detect the cluster)")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be in [0, {self.num_processes}), "
                             f"got {self.process_id}")
        if self.coordinator is not None and ":" not in self.coordinator:
            raise ValueError(f"--coordinator must be host:port, got {self.coordinator!r}")
        if self.timeout_s < 1:
            raise ValueError(f"the process timeout must be >= 1 s, got {self.timeout_s}")

    @property
    def distributed(self) -> bool:
        return self.auto or self.coordinator is not None

    def initialize(self) -> None:
        """Join the job (a no-op for one process launched alone)."""
        if not self.distributed:
            return
        # Collectives between CPU processes (tests on loopback); GPUs use NCCL regardless.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=self.coordinator, num_processes=self.num_processes,
            process_id=self.process_id, initialization_timeout=max(self.timeout_s, 60),
            # Heartbeats outlast a stage timeout, so a stuck peer is reported by the stage
            # (named) before the service declares it dead and aborts this process.
            heartbeat_timeout_seconds=2 * self.timeout_s,
            shutdown_timeout_seconds=self.timeout_s)
        log.info("process %d of %d joined (%d local devices of %d)", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())


def exit_now(code: int) -> NoReturn:
    """End this process at once, skipping JAX's shutdown barrier: after a `StageError` the
    other processes are gone or stuck elsewhere, and the barrier would wait for them and
    then abort the process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _coordination_client():
    # The coordination service's client, as Orbax reaches it; None when this process was
    # not started with jax.distributed.
    from jax._src import distributed

    return distributed.global_state.client


class Decisions:
    """Values the leader decides for every process, agreed in one global order.

    `decide(stage, compute)` runs `compute` on the leader only and returns its JSON value on
    every process; `decide_from(stage, digest, compute)` first brings every process's
    digest to the leader. `barrier(stage)` waits until every process reaches the stage."""

    def __init__(self, run_id: str = "job", timeout_s: float = 30.0, client=None,
                 process_id: int | None = None, num_processes: int | None = None):
        self.process_id = jax.process_index() if process_id is None else process_id
        self.num_processes = jax.process_count() if num_processes is None else num_processes
        self.client = client if client is not None else (
            _coordination_client() if self.num_processes > 1 else None)
        if self.num_processes > 1 and self.client is None:
            raise StageError("several processes but no coordination service: start each "
                             "with jax.distributed (Launch.initialize) first")
        self.run_id = run_id
        self.timeout_ms = int(timeout_s * 1000)
        self.count = 0  # decisions and barriers so far: the position in the global order

    @property
    def leader(self) -> bool:
        return self.process_id == LEADER

    def _get(self, key: str, stage: str, position: int, whom: str, raw: bool = False):
        get = (self.client.blocking_key_value_get_bytes if raw
               else self.client.blocking_key_value_get)
        try:
            return get(key, self.timeout_ms)
        except Exception as e:  # the service raises its own error type on a timeout
            raise StageError(
                f"process {self.process_id} waited {self.timeout_ms / 1000:.0f} s at stage "
                f"{stage!r} (position {position}) and {whom} posted nothing: it stopped, or "
                f"is elsewhere ({type(e).__name__}: {e})") from e

    def _agree(self, stage: str, compute: Callable[[], Any]) -> Any:
        """The leader's record for the next position in the order: its stage and value."""
        position = self.count
        self.count += 1
        key = f"tidejax/{self.run_id}/{position}"
        if self.leader:
            value = compute()
            self.client.key_value_set(key, json.dumps({"stage": stage, "value": value}))
            self._forget(position - KEPT_POSITIONS)
            return value
        record = json.loads(self._get(key, stage, position, "the leader"))
        if record["stage"] != stage:
            raise StageError(
                f"processes out of step at position {position}: process {self.process_id} "
                f"is at stage {stage!r}, the leader is at {record['stage']!r}")
        return record["value"]

    def decide(self, stage: str, compute: Callable[[], Any]) -> Any:
        """The leader's `compute()` (JSON-serialisable), on every process."""
        if self.client is None:
            self.count += 1
            return compute()
        return self._agree(stage, compute)

    def decide_from(self, stage: str, digest: Any, compute: Callable[[list], Any]) -> Any:
        """Every process's `digest` (JSON-serialisable) reaches the leader, which returns
        `compute(digests)` (digests in process order) to every process."""
        if self.client is None:
            self.count += 1
            return compute([digest])
        position = self.count
        prefix = f"tidejax/{self.run_id}/{position}/digest"
        self.client.key_value_set(f"{prefix}/{self.process_id}", json.dumps(digest))
        return self._agree(stage, lambda: compute([
            json.loads(self._get(f"{prefix}/{p}", stage, position, f"process {p}"))
            for p in range(self.num_processes)]))

    def all_gather(self, stage: str, data: bytes) -> list[bytes]:
        """Every process's `data`, in process order, on every process."""
        if self.client is None:
            self.count += 1
            return [data]
        self._agree(stage, lambda: None)  # every process at this stage, in this position
        position = self.count - 1
        prefix = f"tidejax/{self.run_id}/{position}/{stage}"
        self.client.key_value_set_bytes(f"{prefix}/{self.process_id}", data)
        return [data if p == self.process_id else
                self._get(f"{prefix}/{p}", stage, position, f"process {p}", raw=True)
                for p in range(self.num_processes)]

    def _forget(self, position: int) -> None:
        # The store keeps every key for the job's life; a control loop that polls would
        # grow it without end. Every process has long read a position this old: each
        # digest round waits for all of them.
        if position >= 0:
            for key in (f"tidejax/{self.run_id}/{position}", f"tidejax/{self.run_id}/{position}/"):
                self.client.key_value_delete(key)

    def barrier(self, stage: str, timeout_s: float | None = None) -> None:
        """Wait until every process reaches `stage` at the same position in the order."""
        if self.client is None:
            self.count += 1
            return
        self._agree(stage, lambda: None)
        timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        try:
            self.client.wait_at_barrier(f"tidejax/{self.run_id}/barrier/{self.count - 1}",
                                        timeout_ms)
        except Exception as e:
            raise StageError(
                f"process {self.process_id}: not every process reached stage {stage!r} "
                f"(position {self.count - 1}) within {timeout_ms / 1000:.0f} s: one "
                f"stopped, or is at another stage ({type(e).__name__}: {e})") from e
