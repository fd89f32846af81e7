"""Trainer runner: one RL update from ready groups, in either RA2P mode, on any submesh.

- decoupled: the reference model lives on its own submesh; for each micro-batch the ref
  forward (ref submesh) and the actor forward (actor submesh) are dispatched together
  (JAX dispatch is asynchronous, so the two submeshes compute at the same time) and the
  reference log-probs are streamed into the actor's deferred-KL backward.
- colocated: ready-batch aggregation. The reference weights wait in host memory; they are
  copied onto the actor submesh once per step, run over every ready micro-batch, and
  dropped, then the actor runs fused forward+backward per micro-batch. One swap in and
  out per step instead of one per micro-batch.

Micro-batches come from the pure `tidejax.sched.microbatch` planner and are packed into
fixed `[dp * rows, row_len]` shapes (a few row buckets), so nothing recompiles per step.
Compiled `Trainer`s are cached per device set, so ERS moving a rank costs one compile the
first time a partition is seen.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.metrics import TraceRecorder
from tidejax.models.config import ModelConfig
from tidejax.models.model import cast_floating
from tidejax.models.sharding import make_mesh, reshard
from tidejax.rl.batch import Batch, Trajectory, build_batch, loss_denominator
from tidejax.rl.config import RLConfig
from tidejax.rl.state import TrainState
from tidejax.rl.trainer import Trainer, make_trainer
from tidejax.sched import microbatch
from tidejax.sched.microbatch import pack_rows

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepReport:
    mode: str
    micro_batches: int
    sequences: int
    tokens: int
    generated_tokens: int
    seconds: float
    ref_seconds: float  # colocated: swap-in + ref forward over all micro-batches
    swap_seconds: float  # colocated: host -> device copy of the reference weights
    metrics: dict


@jax.jit
def _all_finite(accum) -> jax.Array:
    leaves = jax.tree.leaves(accum.grads) + [accum.metrics["loss"]]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _bucket_rows(rows: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(rows, 1))))


class TrainerRunner:
    def __init__(self, model_config: ModelConfig, rl_config: RLConfig, row_len: int,
                 micro_batch_tokens: int, ref_params_host, trace: TraceRecorder | None = None,
                 compiler_options: dict | None = None, stored_d_model: int | None = None,
                 ref_stays_beside: Callable[[int], bool] = lambda actor_devices: False):
        """`ref_stays_beside(n)`: whether the reference's compute copy may stay resident on
        an `n`-device actor mesh beside every actor step (the memory model's answer); when
        it may not, colocated modes copy it in from the host each time they need it."""
        self.model_config = model_config
        self.rl_config = rl_config
        self.row_len = row_len
        self.micro_batch_tokens = micro_batch_tokens
        # The reference never changes: it waits on the host in the compute dtype (half the
        # bytes of float32 masters for a bf16 model, and half the swap-in traffic).
        self.ref_params_host = cast_floating(ref_params_host, model_config.jnp_dtype)
        self.trace = trace
        self.compiler_options = compiler_options
        self.stored_d_model = stored_d_model  # every trainer's padded model dim (one per job)
        self.ref_stays_beside = ref_stays_beside
        self._resident_ref = None  # the reference kept on the actor mesh, when allowed
        self._trainers: dict[tuple, Trainer] = {}
        self._ref_on: dict[tuple, object] = {}
        self.actor: Trainer | None = None
        self.ref: Trainer | None = None
        self.actor_devices: tuple = ()
        self.ref_devices: tuple = ()
        self.skipped_updates = 0

    # ------------------------------------------------------------------ placement
    def trainer_for(self, devices: Sequence[jax.Device]) -> Trainer:
        key = tuple(d.id for d in devices)
        if key not in self._trainers:
            mesh = make_mesh(list(devices), data=1, fsdp=-1, tensor=1)
            self._trainers[key] = make_trainer(self.model_config, self.rl_config, mesh,
                                               compiler_options=self.compiler_options,
                                               stored_d_model=self.stored_d_model)
        return self._trainers[key]

    def place(self, state: TrainState | None, actor_devices: Sequence[jax.Device],
              ref_devices: Sequence[jax.Device] = ()) -> TrainState | None:
        """Move the actor (and a decoupled reference) onto new submeshes; returns the state."""
        self.actor_devices, self.ref_devices = tuple(actor_devices), tuple(ref_devices)
        self.actor = self.trainer_for(actor_devices)
        self.ref = self.trainer_for(ref_devices) if ref_devices else None
        self._ref_on = {}
        self._resident_ref = None  # the actor mesh may have changed: placed again on demand
        if self.ref is not None:
            self._ref_on[tuple(d.id for d in ref_devices)] = self.ref.put_params(
                self.ref_params_host)
        if state is None:
            return None
        return reshard(state, self.actor.state_shardings)

    # ------------------------------------------------------------------ batching
    def micro_batches(self, trajectories: Sequence[Trajectory], advantages: Sequence[float],
                      mode: str) -> list[Batch]:
        dp = self.actor.data_parallel
        lengths = [len(t) for t in trajectories]
        too_long = [n for n in lengths if n > self.row_len]
        if too_long:
            raise ValueError(f"trajectory of {too_long[0]} tokens exceeds row_len {self.row_len}")
        plan = microbatch.plan_micro_batches(lengths, self.micro_batch_tokens, dp, mode)
        batches = []
        for per_rank in plan.micro_batches:
            rank_rows = [[[idx[i] for i in row] for row in pack_rows([lengths[i] for i in idx],
                                                                    self.row_len)]
                         for idx in per_rank]
            rows_each = _bucket_rows(max(len(r) for r in rank_rows))
            rows: list[list[int]] = []
            for r in rank_rows:  # rank r's rows fill the r-th block of the batch axis
                rows += r + [[] for _ in range(rows_each - len(r))]
            batches.append(build_batch(trajectories, advantages, rows, self.row_len,
                                       num_rows=dp * rows_each))
        return batches

    # ------------------------------------------------------------------ one update
    def begin(self):
        """A fresh gradient accumulator on the actor submesh."""
        return self.actor.zero_accum()

    def accumulate(self, state: TrainState, accum, trajectories: Sequence[Trajectory],
                   advantages: Sequence[float], mode: str, denom: float | None = None):
        """Add the gradients of `trajectories` into `accum`; returns (accum, timings).

        mode: "decoupled" (ref on its own submesh, deferred-KL backward), "colocated"
        (ready-batch aggregation: one ref swap for all micro-batches) or "alternating"
        (one ref swap per micro-batch: streaming without RA2P, the StreamRL-like baseline).
        `denom` normalises the loss over the whole step (defaults to these trajectories).
        """
        if mode not in ("decoupled", "colocated", "alternating"):
            raise ValueError(f"unknown trainer mode {mode!r}")
        if mode == "decoupled" and self.ref is None:
            mode = "colocated"  # no ref submesh this step: ERS gave it back to rollout
        batches = self.micro_batches(trajectories, advantages,
                                     "decoupled" if mode == "decoupled" else "colocated")
        if denom is None:
            denom = loss_denominator(batches, self.rl_config.loss.loss_agg)
        actor = self.actor
        need_ref = self.rl_config.loss.kl_coef > 0
        timings = {"ref_s": 0.0, "swap_s": 0.0, "micro_batches": len(batches), "mode": mode}

        def zeros(mb):
            return actor.put(np.zeros(mb.tokens.shape, np.float32))

        def swap_in():
            if self._resident_ref is not None:
                return self._resident_ref
            t = time.perf_counter()
            params = actor.put_params(self.ref_params_host)
            jax.block_until_ready(params)
            timings["swap_s"] += time.perf_counter() - t
            if self.ref_stays_beside(actor.mesh.size):
                self._resident_ref = params
            return params

        if mode == "decoupled":
            ref_params = self._ref_on[tuple(d.id for d in self.ref_devices)]
            for mb in batches:
                ref_logp = (self.ref.ref_logprobs(ref_params, self.ref.put(mb)) if need_ref
                            else np.zeros(mb.tokens.shape, np.float32))
                batch = actor.put(mb)
                logp, pullback = actor.actor_forward(state.params, batch)
                accum = actor.actor_backward(pullback, logp, actor.put(ref_logp), batch, denom,
                                             accum)
        elif mode == "colocated":
            ref_logps = []
            if need_ref:
                t = time.perf_counter()
                ref_params = swap_in()  # once per step: ready-batch aggregation
                ref_logps = [actor.ref_logprobs(ref_params, actor.put(mb)) for mb in batches]
                jax.block_until_ready(ref_logps)
                del ref_params
                timings["ref_s"] += time.perf_counter() - t
            for i, mb in enumerate(batches):
                ref_logp = ref_logps[i] if need_ref else zeros(mb)
                accum = actor.actor_grads(state.params, actor.put(mb), ref_logp, denom, accum)
        else:
            for mb in batches:
                ref_logp = zeros(mb)
                if need_ref:
                    t = time.perf_counter()
                    ref_params = swap_in()  # per micro-batch: the thrashing RA2P avoids
                    ref_logp = actor.ref_logprobs(ref_params, actor.put(mb))
                    jax.block_until_ready(ref_logp)
                    del ref_params
                    timings["ref_s"] += time.perf_counter() - t
                accum = actor.actor_grads(state.params, actor.put(mb), ref_logp, denom, accum)
        return accum, timings

    def finish(self, state: TrainState, accum) -> tuple[TrainState, dict]:
        """Apply the accumulated update, unless the loss or a gradient is not finite: then
        the update is skipped (parameters and optimizer state untouched) and reported."""
        if not bool(_all_finite(accum)):
            self.skipped_updates += 1
            log.warning("non-finite loss or gradient: update skipped (%d so far)",
                        self.skipped_updates)
            return state, {"skipped_update": 1.0}
        state, metrics = self.actor.apply_update(state, accum)
        return state, {k: float(v) for k, v in jax.device_get(metrics).items()}

    def step(self, state: TrainState, trajectories: Sequence[Trajectory],
             advantages: Sequence[float], mode: str) -> tuple[TrainState, StepReport]:
        """One whole update from the given trajectories."""
        start = time.perf_counter()
        t0 = self.trace.now_us() if self.trace else 0.0
        accum, timings = self.accumulate(state, self.begin(), trajectories, advantages, mode)
        state, metrics = self.finish(state, accum)
        seconds = time.perf_counter() - start
        self.record_trace(timings["mode"], t0, timings["micro_batches"])
        report = StepReport(
            mode=timings["mode"], micro_batches=timings["micro_batches"],
            sequences=len(trajectories), tokens=sum(len(t) for t in trajectories),
            generated_tokens=sum(t.generated_tokens for t in trajectories), seconds=seconds,
            ref_seconds=timings["ref_s"], swap_seconds=timings["swap_s"], metrics=metrics)
        return state, report

    def record_trace(self, mode: str, start_us: float, micro_batches: int) -> None:
        if not self.trace:
            return
        end = self.trace.now_us()
        for dev in self.actor_devices:
            self.trace.complete(f"train:{mode}", f"cpu:{dev.id}", start_us, end, lane="trainer",
                                micro_batches=micro_batches)
        if mode == "decoupled":
            for dev in self.ref_devices:
                self.trace.complete("ref", f"cpu:{dev.id}", start_us, end, lane="trainer")
