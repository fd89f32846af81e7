"""The host controller: runs rollout and training as one system and reshapes it at each sync.

Threads and tasks:
- the asyncio loop (this module's `Controller.run`) hosts the controller coroutine, the
  `RolloutManager`'s per-task coroutines and the `EnvPool`'s awaits;
- one thread per rollout rank (`RolloutWorker`) runs its engine;
- trainer updates run in a worker thread (`asyncio.to_thread`), so the loop keeps serving
  env results and turn completions while the actor computes;
- the `GlobalBuffer` joins rollout (producer) and trainer (consumer).

One step is a sequence of named stages (`Controller.run`), each either decided by the
leader (process 0, `runtime/cluster.py`) and broadcast, or a collective every process runs
in the same order:
- wait for the batch (TWT; the leader decides how many groups each host's buffer gives);
- train: one RA2P update on the trainer submesh (`TrainerRunner.step`);
- boundary: evaluate (the leader says when the pending evaluation is over); plan (ERS,
  elastic systems only, made by the leader from every host's rollout signals; told when
  this boundary queues an evaluation, it lends the evaluation a trainer rank for the next
  step and reads no signals from its aftermath, as in the simulator); reshard
  (close/open rollout ranks: tasks of a closed rank are re-homed by CTB and re-prefilled
  with the new weights; place the actor and reference on their new submeshes); sync (the
  trainer casts the new weights to the compute dtype on its own mesh, each rank copies
  them onto its devices and flushes its KV: old-policy cache is invalid); queue the
  evaluation of the version just trained (it runs during the next step); checkpoint.
What a system does differently is data (`sched/systems.py`): `sync` is phased (roll out
exactly one batch with every device, then train), only `tide` is elastic and pins KV.

Checkpoints and resume: the checkpoint hook gets, besides the TrainState, a rollout snapshot
(`tidejax.runtime.resume`) taken on the loop thread at the boundary: ready groups and
in-flight training tasks. `run(state, start_step, rollout=...)` serves the restored
parameters from the first turn, puts ready groups back and restarts in-flight tasks. A
step's batch is sorted by group id, so it does not depend on the order groups finished in.
An elastic run's checkpoint also keeps ERS's last plan and move count (`elastic_meta`); a
resumed run starts from that partition when its topology admits it (`resume_elastic`),
else from the initial one. If every rollout rank is quarantined, the run raises
`AllRanksFailed` instead of waiting.

Stopping (`tidejax.runtime.stop`): when a stop is requested, a step still waiting for its
batch (or, in sync, for its rollout phase) is abandoned, an update under way finishes, and
the run checkpoints the last completed step (with its rollout snapshot) and returns with
`stopped_by` set; the evaluation still pending is skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import pickle
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tidejax.checkpoint import params_fingerprint
from tidejax.config import RunConfig
from tidejax.envs import make_tasks
from tidejax.metrics import GoodputMeter, MetricsWriter, TraceRecorder
from tidejax.models.config import ModelConfig
from tidejax.models.tokenizer import Tokenizer
from tidejax.rl.state import TrainState
from tidejax.runtime import layout, resume
from tidejax.runtime.buffer import GlobalBuffer, ReadyGroup
from tidejax.runtime.cluster import Decisions
from tidejax.runtime.manager import AllRanksFailed, RolloutManager
from tidejax.runtime.records import GroupPayload
from tidejax.runtime.rollout import RolloutWorker
from tidejax.runtime.stop import StopRequest
from tidejax.runtime.topology import Topology
from tidejax.runtime.trainer_runner import StepReport, TrainerRunner
from tidejax.sched import ers, ra2p
from tidejax.sched.staleness import batch_countable
from tidejax.sched.systems import SYSTEMS
from tidejax.serving.engine import make_engine

log = logging.getLogger(__name__)

NO_ARRIVALS_S = 1e9  # the seconds between arrivals ERS reads when none arrived last step


def return_stale_slots(buffer: GlobalBuffer, manager: RolloutManager) -> int:
    """Give the manager back the staleness-quota slots of groups the buffer dropped as stale
    since the last call (each once); without it admission stops for good. Returns them."""
    n = buffer.take_new_stale_drops()
    if n:
        manager.consumed(n)
    return n


def _deal(shares: list[int], caps: list[int], left: int) -> int:
    """Add to `shares` one group per host in turn, none past its cap, until `left` are dealt
    or every cap is reached; returns how many are left."""
    while left and any(s < c for s, c in zip(shares, caps)):
        for p, cap in enumerate(caps):
            if left and shares[p] < cap:
                shares[p] += 1
                left -= 1
    return left


def batch_shares(digests: list[dict], target: int, take_all: bool) -> dict:
    """The leader's batch decision from every process's digest ({"ready", "due_ready",
    "due_in_flight", "stop", "phase_over"}): stop if any process was asked to, else how many
    groups each process gives once `target` count toward the batch between them
    (`batch_countable`: deadline order keeps places for due groups still running on any
    host), dealt in turn so hosts share the batch, every host's due ready groups first; or
    with `take_all`, once every host's rollout phase is over, whatever each has (sync: the
    batch is what survived)."""
    stop = next((d["stop"] for d in digests if d["stop"] is not None), None)
    if stop is not None:
        return {"stop": stop}
    ready = [d["ready"] for d in digests]
    if take_all:
        return {"take": ready} if all(d["phase_over"] for d in digests) else {"wait": True}
    due_ready = [d["due_ready"] for d in digests]
    countable = batch_countable(target, sum(ready), sum(due_ready),
                                sum(d["due_in_flight"] for d in digests))
    if countable < target:
        return {"wait": True}
    shares = [0] * len(ready)
    _deal(shares, ready, _deal(shares, due_ready, target))
    return {"take": shares}


def _partition_json(p: ers.Partition | None) -> list[int] | None:
    return None if p is None else [p.rollout, p.actor, p.ref]


def _partition_from_json(value: list[int] | None) -> ers.Partition | None:
    return None if value is None else ers.Partition(*value)


def plan_to_json(plan: ers.Plan) -> dict:
    trial = plan.trial
    return {"partition": _partition_json(plan.partition),
            "mode": plan.mode.value, "batch_groups": plan.batch_groups, "retain": plan.retain,
            "reason": plan.reason, "pressure": plan.pressure,
            "eval_ranks_out": plan.eval_ranks_out, "loan_move": plan.loan_move,
            "trial": {f.name: getattr(trial, f.name) for f in dataclasses.fields(trial)}
            | {"origin": _partition_json(trial.origin)}}


def plan_from_json(value: dict) -> ers.Plan:
    trial = dict(value["trial"], origin=_partition_from_json(value["trial"]["origin"]))
    return ers.Plan(_partition_from_json(value["partition"]),
                    ra2p.Mode(value["mode"]), value["batch_groups"], value["retain"],
                    value["reason"], value["pressure"], ers.Trial(**trial),
                    value.get("eval_ranks_out", 0), value.get("loan_move", False))


def combine_rollout_digests(digests: list[dict]) -> dict:
    """Every host's rollout signals as one rollout's: ready work and drops add up, groups
    arrive at the sum of the hosts' rates, the oldest ready group is the oldest anywhere,
    and idleness is the hosts' mean (each host has as many ranks)."""
    if len(digests) == 1:
        return digests[0]
    rates = [1.0 / d["tprm_s"] if d["tprm_s"] > 0 else math.inf for d in digests
             if d["tprm_s"] < NO_ARRIVALS_S]
    return {"ready_tokens": sum(d["ready_tokens"] for d in digests),
            "ready_groups": sum(d["ready_groups"] for d in digests),
            "tprm_s": 1.0 / sum(rates) if rates else NO_ARRIVALS_S,
            "hol_s": max(d["hol_s"] for d in digests),
            "dropped_groups": sum(d["dropped_groups"] for d in digests),
            "idle_frac": float(np.mean([d["idle_frac"] for d in digests]))}


@dataclasses.dataclass
class _Loop:
    """What the control loop carries from one step to the next."""
    state: TrainState
    partition: ers.Partition
    plan: ers.Plan  # the last ERS plan (elastic systems), else the initial one
    completed: int  # the last step whose update finished
    eval_pending: int | None = None  # the version whose evaluation is running
    stop_signal: int | None = None  # agreed by every process


@dataclasses.dataclass
class _Batch:
    groups: list[ReadyGroup]  # every host's, sorted by group id
    local_groups: int  # how many of them came from this process's buffer
    twt_s: float  # seconds the trainer waited for them
    filtered: int  # dynamic sampling: all-equal-reward groups dropped meanwhile


@dataclasses.dataclass
class StepRecord:
    step: int
    version: int
    mode: str
    partition: tuple[int, int, int]
    batch_groups: int
    filtered_groups: int  # dynamic sampling: all-equal-reward groups dropped for this batch
    consumed_tokens: int
    train_reward: float
    train_success: float
    twt_s: float
    rwt_s: float
    step_s: float
    goodput: float
    kv_hit_rate: float
    reason: str
    loss: dict


@dataclasses.dataclass
class RunSummary:
    system: str
    steps: int
    elapsed_s: float
    goodput: float
    consumed_tokens: int
    generated_tokens: int
    dropped_tokens: int
    kv_hit_rate: float
    twt_s: float
    rwt_s: float
    eval: dict[int, dict]
    records: list[StepRecord]
    counters: dict
    dropped_groups: list
    state: Any = None
    stopped_by: int | None = None  # the signal that stopped the run before its last step


def env_metrics(pool) -> dict:
    """The env pool's running counts (faults, replay divergences, unreadable actions) as
    `env/<name>` metrics; none for a pool that keeps no stats."""
    stats = getattr(pool, "stats", None)
    return {f"env/{k}": v for k, v in stats.as_dict().items()} if stats is not None else {}


class Controller:
    def __init__(self, cfg: RunConfig, model_config: ModelConfig, params, tokenizer: Tokenizer,
                 pool, devices: list | None = None, writer: MetricsWriter | None = None,
                 trace: TraceRecorder | None = None, checkpoint: Callable | None = None,
                 progress: Callable[[StepRecord], None] | None = None,
                 stop: StopRequest | None = None, decisions: Decisions | None = None):
        self.cfg = cfg
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.pool = pool
        # `devices`: the job's devices (default every visible one); topology.devices of
        # each process's are used, cut into ranks (ERS's move units).
        self.topology = Topology.of(devices or jax.devices(), cfg.topology.devices,
                                    cfg.topology.rollout_tensor)
        self.devices = self.topology.devices
        self.ranks = [rank for host in self.topology.hosts for rank in host]
        # Every process runs this loop; what must be the same everywhere (a batch's groups,
        # a plan, a stop, an evaluation's end) is decided by process 0 (runtime/cluster.py).
        # Rollout, CTB, the env pool and the buffer stay per process, on its own devices.
        self.decisions = decisions or Decisions(run_id="run")
        self.process, self.hosts = jax.process_index(), jax.process_count()
        self.writer = writer
        self.trace = trace or TraceRecorder()
        self.checkpoint = checkpoint
        self.progress = progress
        self.stop = stop
        self._saved_step: int | None = None  # the step of the last checkpoint written
        # What a rank opened before any live rank exists loads: the warm start (host), or on
        # resume the restored policy's compute copy (device). Later ranks copy a live one.
        self.params_host = jax.device_get(params)
        self.first_rollout_weights = self.params_host
        self.spec = SYSTEMS[cfg.system]
        bound = self.spec.staleness_bound(cfg.rollout.staleness_bound)
        # Each host fills its share of a batch (and of the staleness quota).
        self.host_batch_groups = math.ceil(cfg.batch_groups / self.hosts)
        # Sync's rollout phase generates exactly the batch between the hosts.
        self.host_phase_groups = (cfg.batch_groups // self.hosts
                                  + int(self.process < cfg.batch_groups % self.hosts))
        self.rollout_config = dataclasses.replace(cfg.rollout, scheduler=self.spec.scheduler,
                                                  staleness_bound=bound,
                                                  batch_groups=self.host_batch_groups)
        self.buffer = GlobalBuffer(bound, cfg.micro_batch_tokens,
                                   consume_order=cfg.rollout.consume_order)
        # The memory model admits the mesh sizes ERS may choose and refuses, at start, a
        # layout that does not divide the model or fit (initial_partition); it also picks
        # the padded model dim every trainer stores.
        self.job_memory = layout.job_memory(cfg, model_config,
                                            layout.capacity_bytes(cfg, self.devices))
        self.runner = TrainerRunner(model_config, cfg.trainer_rl(), cfg.row_len,
                                    cfg.micro_batch_tokens, self.params_host, self.trace,
                                    stored_d_model=self.job_memory.shape.stored_d_model,
                                    ref_stays_beside=self.job_memory.ref_stays_beside)
        self.meter = GoodputMeter()
        self._engines: dict[int, Any] = {}
        self.version = 0
        self.data_cursor = 0  # training groups issued so far (resume point)
        self.records: list[StepRecord] = []
        self.ers_config = layout.ers_config(cfg, self.job_memory, cfg.topology.devices)
        self._step_times: list[float] = []
        self._since_move = 1 << 30  # boundaries since ERS last changed the partition
        self._elastic_meta: dict | None = None  # ERS's state at the last checkpoint
        self._resumed_elastic: tuple[ers.Plan, int] | None = None  # (plan, since_move)
        self._move_s = 0.0  # measured seconds of the last partition change
        self._stale_in_step = 0  # groups dropped as stale during the current step
        self.task_rows = cfg.task_rows()  # dataset rows per split ([task_data]), if any

    # ------------------------------------------------------------------ topology
    def initial_partition(self) -> ers.Partition:
        """The first partition, refused (LayoutError naming the field) if it cannot run."""
        return layout.initial_partition(self.cfg, self.job_memory, self.cfg.topology.devices)

    def elastic_meta(self) -> dict | None:
        """ERS's state at the last checkpoint boundary, for the checkpoint's metadata."""
        return self._elastic_meta

    def _resumable_plan(self, saved: dict | None) -> ers.Plan | None:
        """The checkpoint's last ERS plan when this elastic run may start from its partition
        on these devices (`layout.resumable_partition`), else None."""
        if not (saved and self.spec.elastic):
            return None
        plan = plan_from_json(saved["plan"])
        if not layout.resumable_partition(plan.partition, self.cfg, self.job_memory,
                                          self.cfg.topology.devices):
            return None
        return plan

    def resume_abstract_state(self, controller_meta: dict):
        """The train state's abstract tree on the actor mesh a run resumed from a checkpoint
        with this controller metadata starts on (`Checkpointer.restore` takes this)."""
        plan = self._resumable_plan(controller_meta.get("elastic"))
        partition = plan.partition if plan else self.initial_partition()
        _, _, actor = self._roles(partition)
        return self.runner.trainer_for(actor).abstract_state()

    def resume_elastic(self, saved: dict | None) -> None:
        """Let a resumed elastic run start from the checkpoint's ERS partition, with the plan
        and move count ERS had there, when this topology admits it (not when resumed on
        other devices); else it starts from the initial partition. The state must have been
        restored onto that partition's actor mesh (`resume_abstract_state`)."""
        plan = self._resumable_plan(saved)
        self._resumed_elastic = (plan, int(saved["since_move"])) if plan else None
        if plan:
            log.info("resuming ERS at partition %s (last plan: %s)", plan.partition,
                     plan.reason)
        elif saved and self.spec.elastic:
            log.warning("the checkpoint's partition %s does not fit %d devices; resuming "
                        "from the initial partition", saved["plan"].get("partition"),
                        self.cfg.topology.devices)

    def _sync_partition(self) -> tuple[int, int, int]:
        """What a sync step's record shows: every rank rolls out, then trains on the
        devices `layout.sync_trainer_devices` gives it (in ranks per host)."""
        devices = self.cfg.topology.devices
        return (self.topology.ranks_per_host, 0,
                layout.sync_trainer_devices(self.cfg, devices) // self.cfg.topology.rollout_tensor)

    def _roles(self, partition: ers.Partition):
        if self.spec.phased:
            # Phases share the devices: every rank rolls out; training uses the same number
            # of devices as the asynchronous trainers, so no system gets a bigger trainer
            # (on fake CPU devices a wider FSDP mesh only adds collectives).
            n_train = layout.sync_trainer_devices(self.cfg, self.cfg.topology.devices)
            actor = [d for host in self.topology.hosts
                     for d in [d for rank in host for d in rank][-n_train:]]
            return self.ranks, [], actor
        return self.topology.roles(partition)

    def _rollout_source(self, manager: RolloutManager, state: TrainState | None
                        ) -> tuple[Any, int]:
        """(weights, version) a newly opened rank starts from: what a live rank serves
        (copied device to device), else the first weights (warm start or restored), else
        the trainer's current policy."""
        for worker in manager.workers.values():
            if worker.alive:
                return worker.engine.params, worker.version
        if self.first_rollout_weights is None:
            return self.runner.actor.rollout_copy(state.params), self.version
        return self.first_rollout_weights, self.version

    def _worker(self, rank_devices: list, weights, version: int) -> RolloutWorker:
        # A fresh engine per opening: the closed one freed its memory, and its compiled
        # steps are cached per device, so nothing recompiles. A rank is named by its first
        # device and runs its engine tensor-parallel over all of its devices.
        rank = rank_devices[0].id
        engine = self._engines[rank] = make_engine(self.model_config, weights, rank_devices,
                                                   self.cfg.engine)
        track = "dev:" + ",".join(str(d.id) for d in rank_devices)
        return RolloutWorker(rank, engine, pin_after_turn=self.spec.pins_kv,
                             version=version, trace=self.trace, track=track)

    async def _apply_partition(self, partition: ers.Partition, manager: RolloutManager,
                               state: TrainState | None) -> TrainState | None:
        rollout, ref, actor = self._roles(partition)
        rollout = [rank for rank in rollout if rank[0].process_index == self.process
                   and rank[0].id not in manager.quarantined]
        want = {rank[0].id for rank in rollout}
        source = self._rollout_source(manager, state)  # taken before any rank closes
        for rank in [r for r in manager.workers if r not in want]:
            manager.close_rank(rank)
        for rank in [r for r in list(manager.workers) if r not in want]:
            while not manager.rank_drained(rank):
                await asyncio.sleep(0.005)
            manager.remove_rank(rank).stop()
            engine = self._engines.pop(rank, None)  # its devices may train next
            if engine is not None:
                engine.release()
        for rank_devices in rollout:
            if rank_devices[0].id not in manager.workers:
                manager.open_rank(rank_devices[0].id, self._worker(rank_devices, *source))
        if not manager.workers:
            manager.failure = manager.failure or AllRanksFailed(
                f"no rollout rank left to serve (quarantined: {sorted(manager.quarantined)})")
            raise manager.failure
        if tuple(actor) != self.runner.actor_devices or tuple(ref) != self.runner.ref_devices:
            await self._enter_collective("reshard")
            state = await asyncio.to_thread(self.runner.place, state, actor, ref)
        return state

    async def _enter_collective(self, stage: str) -> None:
        # A process that skipped a decision would otherwise wait in a JAX collective its
        # peers never join, with no timeout and nothing naming where it went astray.
        if self.hosts > 1:
            await asyncio.to_thread(self.decisions.barrier, stage)

    async def _sync_weights(self, manager: RolloutManager, state: TrainState) -> float:
        """Push the new policy to every rollout rank with no host round trip: cast to the
        compute dtype on the actor mesh, then each rank copies it onto its own devices."""
        start = time.perf_counter()
        await self._enter_collective("sync")
        weights = await asyncio.to_thread(self.runner.actor.rollout_copy, state.params)
        events = [w.update_weights(weights, self.version) for w in manager.workers.values()]
        await asyncio.to_thread(lambda: [e.wait() for e in events])
        if self.hosts > 1:  # the collective path: prove each host's ranks got the update
            await asyncio.to_thread(self._check_synced, manager, weights)
        return time.perf_counter() - start

    def _check_synced(self, manager: RolloutManager, weights) -> None:
        expected = params_fingerprint(weights)
        for rank, worker in manager.workers.items():
            if worker.alive and params_fingerprint(worker.engine.params) != expected:
                raise RuntimeError(f"rollout rank {rank} on process {self.process} does not "
                                   f"hold version {self.version}'s weights after the sync")
        log.info("sync v%d: %d rollout rank(s) on process %d hold the trainer's weights "
                 "(fingerprint %08x)", self.version, len(manager.workers), self.process,
                 zlib.crc32(repr(expected).encode()))

    # ------------------------------------------------------------------ data
    def _train_tasks(self, n_groups: int):
        cfg = self.cfg
        # Each process draws its own stream (process 0's is the single-process one); its
        # ids carry the process, so a batch's groups sort the same way everywhere.
        host = f"p{self.process}." if self.process else ""
        tasks = make_tasks(cfg.env_type, "train", n_groups, cfg.group_size,
                           seed=cfg.seed * 100_003 + self.data_cursor + self.process * 1_000_003,
                           max_turns=cfg.max_turns, long_tail_fraction=cfg.long_tail_fraction,
                           prefix=f"{host}train{self.data_cursor}", env_kwargs=cfg.env_kwargs(),
                           rows=self.task_rows.get("train"))
        self.data_cursor += n_groups
        return tasks

    def _top_up(self, manager: RolloutManager) -> None:
        """Keep enough training groups queued that rollout never runs dry for lack of work."""
        quota = (self.rollout_config.staleness_bound + 2) * self.host_batch_groups
        missing = quota - manager.pending_groups - manager.outstanding_groups
        if missing > 0:
            manager.add_groups(self._train_tasks(missing), self.cfg.group_size)

    def _evaluates_after(self, step: int) -> bool:
        """Whether the boundary after `step` queues an evaluation (it runs in the next step)."""
        return bool(self.cfg.eval_every) and step % self.cfg.eval_every == 0

    def _queue_eval(self, manager: RolloutManager) -> None:
        if self.process:  # the leader's rollout ranks evaluate; the others train on
            return
        cfg = self.cfg
        tasks = make_tasks(cfg.env_type, cfg.eval_split, cfg.eval_groups, cfg.eval_samples,
                           seed=cfg.seed + 7, max_turns=cfg.max_turns,
                           prefix=f"eval_v{self.version}", env_kwargs=cfg.env_kwargs(),
                           rows=self.task_rows.get(cfg.eval_split))
        manager.add_groups(tasks, cfg.eval_samples, is_eval=True, eval_version=self.version)

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    async def _sync_rollout(self, manager: RolloutManager) -> None:
        """Sync's rollout phase on this host: generate its share of the batch and wait for
        all of it; with dynamic sampling, refill the groups it dropped, for at most
        `dynamic_sampling_rounds` rounds. Ends early if a stop comes."""
        rc, missing = self.rollout_config, self.host_phase_groups
        for _ in range(rc.dynamic_sampling_rounds if rc.dynamic_sampling else 1):
            if missing > 0:
                manager.add_groups(self._train_tasks(missing), self.cfg.group_size)
            if not await self._wait_idle_or_stop(manager):
                return
            missing = self.host_phase_groups - len(self.buffer)
            if missing <= 0:
                return

    async def _wait_idle_or_stop(self, manager: RolloutManager) -> bool:
        """Wait for the rollout phase to finish; False if a stop came first."""
        idle = asyncio.ensure_future(manager.wait_idle())
        try:
            while not idle.done():
                if self._stopping():
                    return False
                await asyncio.wait({idle}, timeout=0.05)
            idle.result()  # re-raises AllRanksFailed
            return True
        finally:
            idle.cancel()

    async def _save(self, step: int, loop: _Loop, manager: RolloutManager) -> None:
        # consistent: no await before it
        snap = resume.snapshot(manager, self.buffer) | {"data_cursor": self.data_cursor}
        self._elastic_meta = ({"plan": plan_to_json(loop.plan), "since_move": self._since_move}
                              if self.spec.elastic else None)
        if self.hosts > 1:  # every host's snapshot goes into the checkpoint process 0 writes
            snap = resume.combine([json.loads(data) for data in self.decisions.all_gather(
                "checkpoint", json.dumps(snap).encode())])
        await asyncio.to_thread(self.checkpoint, step, loop.state, self, snap)
        self._saved_step = step

    async def _wait_eval(self, manager: RolloutManager, version: int, timeout: float = 600.0):
        deadline = time.monotonic() + timeout

        def over() -> bool:  # on the leader, whose ranks evaluate
            tally = manager.eval_tallies.get(version)
            return (time.monotonic() >= deadline or self._stopping()
                    or (tally is not None and tally.groups >= self.cfg.eval_groups))

        while not self.decisions.decide("eval", over):
            manager.raise_if_failed()
            await asyncio.sleep(0.01)

    def _agreed_stop(self, stage: str) -> int | None:
        """The signal that stops the run, if any process got one (every process agrees)."""
        mine = self.stop.signum if self._stopping() else None
        return self.decisions.decide_from(
            stage, mine, lambda signals: next((s for s in signals if s is not None), None))

    async def _wait_batch(self, manager: RolloutManager, target: int,
                          phase: asyncio.Future | None) -> tuple[list[ReadyGroup], int] | int:
        """The step's batch, the same on every process: groups from every host's buffer
        (the leader decides how many each gives), sorted by id; with how many are this
        process's. A phased system's batch is every host's whole rollout `phase`, once all
        have ended. Returns the agreed stop signal instead if a stop came first."""
        try:
            while True:
                if phase is not None and phase.done():
                    phase.result()  # re-raises AllRanksFailed
                mine = self.stop.signum if self._stopping() else None
                decision = self.decisions.decide_from(
                    "batch", self.buffer.batch_digest(self.version)
                    | {"stop": mine, "phase_over": phase is None or phase.done()},
                    lambda digests: batch_shares(digests, target, take_all=self.spec.phased))
                if "stop" in decision:
                    return decision["stop"]
                if "take" in decision:
                    break
                manager.raise_if_failed()
                if phase is None:  # before topping up the queue
                    self._stale_in_step += return_stale_slots(self.buffer, manager)
                await asyncio.sleep(0.005 if self.hosts == 1 else 0.05)
                if phase is None:
                    self._top_up(manager)
        finally:
            if phase is not None:
                phase.cancel()
        share = decision["take"][self.process]
        local = self.buffer.take(share, self.version)
        if self.hosts == 1:
            return sorted(local, key=lambda g: g.group_id), len(local)
        gathered = self.decisions.all_gather("batch_groups", pickle.dumps(local))
        # Pickles from this job's own processes, through its coordination service.
        groups = [g for data in gathered for g in pickle.loads(data)]
        return sorted(groups, key=lambda g: g.group_id), len(local)

    # ------------------------------------------------------------------ the run
    async def run(self, state: TrainState | None = None, start_step: int = 0,
                  evaluate_initial: bool = True,
                  rollout: dict | None = None) -> RunSummary:
        """Train from `start_step` to `cfg.steps`. Each step is a sequence of stages, every
        one either decided by the leader (process 0) and broadcast, or a collective every
        process runs in the same order: wait for the batch (leader: each host's share) ->
        train (collective) -> boundary: evaluate (leader: when it is over) -> plan (leader,
        elastic systems) -> reshard (collective) -> sync weights (collective) -> checkpoint
        (collective)."""
        loop = await self._start(state, start_step, evaluate_initial, rollout)
        manager = self.manager
        try:
            for step in range(start_step, self.cfg.steps):
                step_start = time.perf_counter()
                busy_before = {r: w.stats.busy_s for r, w in manager.workers.items()}
                batch = await self._stage_batch(loop, step_start)
                if batch is None:
                    break  # a stop came first: nothing of this step was trained
                report, train_s = await self._stage_train(loop, batch)
                loop.completed = step + 1
                sync_s = await self._stage_boundary(loop, batch, report, train_s)
                self._record_step(loop, batch, report, dict(
                    report.metrics, sync_s=sync_s, train_s=train_s), step_start, busy_before)
            await self._stage_last(loop)
        finally:
            await manager.aclose()
            for worker in list(manager.workers.values()):
                worker.stop()
        return self._summary(loop)

    async def _start(self, state: TrainState | None, start_step: int, evaluate_initial: bool,
                     rollout: dict | None) -> _Loop:
        """Open the first partition, restore the rollout snapshot, and queue the first
        evaluation."""
        cfg = self.cfg
        resumed = self._resumed_elastic if state is not None else None
        partition = resumed[0].partition if resumed else self.initial_partition()
        manager = RolloutManager(self.rollout_config, {}, self.pool, self.tokenizer, self.buffer,
                                 cfg.env_type, cfg.rl.advantage, seed=cfg.seed,
                                 max_seq_len=cfg.row_len)
        self.manager = manager
        self.version = start_step
        if state is not None:  # resuming: rollout serves the restored policy, not the warm start
            _, _, actor = self._roles(partition)  # restored onto this mesh already
            self.first_rollout_weights = await asyncio.to_thread(
                self.runner.trainer_for(actor).rollout_copy, state.params)
        state = await self._apply_partition(partition, manager, state)
        self.first_rollout_weights = None  # live ranks are the source from now on
        for i, snap in enumerate(resume.assigned(rollout, self.process, self.hosts)):
            if i == 0 and "data_cursor" in snap:  # this process's own stream
                self.data_cursor = snap["data_cursor"]
            restored = resume.restore(snap, manager, self.buffer)
            log.info("restored rollout: %d ready groups, %d in-flight tasks restarted, "
                     "%d queued tasks re-queued", restored["ready_groups"],
                     restored["restarted_tasks"], restored["requeued_tasks"])
        if state is None:
            state = await asyncio.to_thread(self.runner.actor.init_state, cfg.seed,
                                            self.params_host)
        self.meter = GoodputMeter()
        evaluate = evaluate_initial and bool(cfg.eval_every)
        if evaluate:
            self._queue_eval(manager)
        if resumed:  # ERS goes on where it was: its trial, its reverts, a loan to hand back
            plan, self._since_move = resumed
        else:
            plan = ers.Plan(partition, ra2p.Mode.COLOCATED, cfg.batch_groups, False, "initial",
                            trial=ers.Trial())
        if evaluate:  # the first step holds the evaluation
            plan = dataclasses.replace(plan, trial=dataclasses.replace(plan.trial, since_eval=0))
        return _Loop(state=state, partition=partition, plan=plan, completed=start_step,
                     eval_pending=self.version if evaluate else None)

    async def _stage_batch(self, loop: _Loop, step_start: float) -> _Batch | None:
        """Stage "wait for batch" (leader-decided): the step's groups from every host; None,
        with `loop.stop_signal` set, if a stop came first."""
        manager = self.manager
        loop.stop_signal = self._agreed_stop("step")
        if loop.stop_signal is not None:
            return None
        if self.spec.phased:  # every host rolls out its share; the batch waits for all
            phase = asyncio.ensure_future(self._sync_rollout(manager))
        else:
            phase = None
            self._top_up(manager)
        self.buffer.begin_step()
        wait_start = time.perf_counter()
        target = loop.plan.batch_groups if self.spec.elastic else self.cfg.batch_groups
        taken = await self._wait_batch(manager, target, phase)
        if not isinstance(taken, tuple):
            loop.stop_signal = taken
            return None
        groups, local_groups = taken
        # A phased system's trainer waited for the whole rollout phase.
        twt = time.perf_counter() - (step_start if self.spec.phased else wait_start)
        filtered = manager.filtered_since_consumed
        self._stale_in_step += return_stale_slots(self.buffer, manager)  # dropped by take
        return _Batch(groups=groups, local_groups=local_groups, twt_s=twt, filtered=filtered)

    async def _stage_train(self, loop: _Loop, batch: _Batch) -> tuple[StepReport, float]:
        """Stage "train" (collective): one update from the batch's kept trajectories."""
        payloads = [g.payload for g in batch.groups]
        trajectories = [t for p in payloads for t, k in zip(p.trajectories, p.keep) if k]
        advantages = [a for p in payloads for a, k in zip(p.advantages, p.keep) if k]
        mode = self.spec.trainer_mode or loop.plan.mode.value
        start = time.perf_counter()
        if trajectories:
            loop.state, report = await asyncio.to_thread(
                self.runner.step, loop.state, trajectories, advantages, mode)
        else:  # every group of the batch was filtered: nothing to learn from
            report = StepReport(mode=mode, micro_batches=0, sequences=0, tokens=0,
                                generated_tokens=0, seconds=0.0, ref_seconds=0.0,
                                swap_seconds=0.0, metrics={})
        self.meter.add_consumed(sum(g.generated_tokens for g in batch.groups))
        self.version += 1
        return report, time.perf_counter() - start

    async def _stage_boundary(self, loop: _Loop, batch: _Batch, report: StepReport,
                              train_s: float) -> float:
        """The post-update boundary: evaluate, plan, reshard, sync, checkpoint. Returns the
        seconds the weight sync took."""
        cfg, manager, step = self.cfg, self.manager, loop.completed
        if loop.eval_pending is not None:  # evaluate (leader: when it is over)
            await self._wait_eval(manager, loop.eval_pending)
            if not self._stopping():
                self._report_eval(manager, loop.eval_pending, step - 1)
            loop.eval_pending = None
        if self.spec.elastic:
            loop.plan = self._agreed_plan(loop, report, train_s, batch)  # plan (leader)
            self._since_move = ers.since_move_after(self._since_move, loop.partition, loop.plan)
            if loop.plan.partition != loop.partition:  # reshard (collective)
                loop.partition = loop.plan.partition
                move_start = time.perf_counter()
                loop.state = await self._apply_partition(loop.partition, manager, loop.state)
                self._move_s = time.perf_counter() - move_start
        self._stale_in_step = 0
        sync_s = await self._sync_weights(manager, loop.state)  # sync (collective)
        # The taken groups' quota slots come back only now that rollout runs the new
        # version: a group admitted during the update would otherwise start on the old
        # weights yet be consumed a whole batch later, one version past the bound (AReaL's
        # N_submitted <= (i + eta + 1) * B counts i in rollout versions).
        manager.consumed(batch.local_groups)
        if self._evaluates_after(step):
            self._queue_eval(manager)
            loop.eval_pending = self.version
        if self.checkpoint and cfg.checkpoint_every and (
                step % cfg.checkpoint_every == 0 or step == cfg.steps):
            await self._save(step, loop, manager)  # checkpoint (collective)
        return sync_s

    async def _stage_last(self, loop: _Loop) -> None:
        """After the last step: checkpoint a stopped run, or report the last evaluation."""
        cfg, manager = self.cfg, self.manager
        if loop.stop_signal is not None and loop.completed < cfg.steps:
            log.info("stopping after step %d of %d", loop.completed, cfg.steps)
            if self.checkpoint and self._saved_step != loop.completed:
                await self._save(loop.completed, loop, manager)
        elif loop.eval_pending is not None:
            await self._wait_eval(manager, loop.eval_pending)
            if not self._stopping():  # a stop after the last update skips only this
                self._report_eval(manager, loop.eval_pending, cfg.steps)

    def _record_step(self, loop: _Loop, batch: _Batch, report: StepReport, loss: dict,
                     step_start: float, busy_before: dict) -> None:
        manager = self.manager
        step_s = time.perf_counter() - step_start
        self._step_times.append(step_s)
        payloads = [g.payload for g in batch.groups]
        rewards = [t.reward for p in payloads for t, k in zip(p.trajectories, p.keep) if k]
        partition = loop.partition
        record = StepRecord(
            step=loop.completed, version=self.version, mode=report.mode,
            partition=self._sync_partition() if self.spec.phased
            else (partition.rollout, partition.ref, partition.actor),
            batch_groups=len(batch.groups), filtered_groups=batch.filtered,
            consumed_tokens=sum(g.generated_tokens for g in batch.groups),
            train_reward=float(np.mean(rewards)) if rewards else 0.0,
            train_success=self._success(payloads), twt_s=batch.twt_s,
            rwt_s=self._rwt(manager, busy_before, step_s), step_s=step_s,
            goodput=self.meter.goodput(), kv_hit_rate=manager.hit_rate(),
            reason=loop.plan.reason if self.spec.elastic else self.spec.name, loss=loss)
        self.records.append(record)
        if self.hosts > 1:  # what every process must agree on, for comparing logs
            log.info("step %d digest: version=%d partition=%s actor_processes=%s "
                     "micro_batches=%d groups=%s", record.step, record.version,
                     record.partition,
                     sorted({d.process_index for d in self.runner.actor_devices}),
                     report.micro_batches, ",".join(g.group_id for g in batch.groups))
        if self.writer:
            self.writer.write(record.step, "step", {
                k: v for k, v in dataclasses.asdict(record).items() if k != "loss"}
                | {f"loss/{k}": v for k, v in record.loss.items()}
                | env_metrics(self.pool))
        if self.progress:
            self.progress(record)

    def _summary(self, loop: _Loop) -> RunSummary:
        manager = self.manager
        return RunSummary(
            system=self.spec.name, steps=len(self.records), elapsed_s=self.meter.elapsed(),
            goodput=self.meter.goodput(), consumed_tokens=self.meter.consumed,
            generated_tokens=manager.counters["generated_tokens"],
            dropped_tokens=sum(d.generated_tokens for d in self.buffer.dropped),
            kv_hit_rate=manager.hit_rate(),
            twt_s=sum(r.twt_s for r in self.records), rwt_s=sum(r.rwt_s for r in self.records),
            eval={v: {k: x for k, x in dataclasses.asdict(t).items() if k != "transcripts"}
                  | {"reward": t.reward, "reward_se": t.reward_se}
                  for v, t in manager.eval_tallies.items()},
            records=self.records, counters=dict(manager.counters),
            dropped_groups=[dataclasses.asdict(d) for d in self.buffer.dropped],
            state=loop.state,
            stopped_by=loop.stop_signal if loop.completed < self.cfg.steps else None)

    # ------------------------------------------------------------------ ERS
    def _rollout_digest(self) -> dict:
        """This host's rollout signals for the leader's plan."""
        sig = self.buffer.signals()
        last = self.records[-1] if self.records else None
        return {"ready_tokens": sig.ready_tokens, "ready_groups": sig.ready_groups,
                "tprm_s": min(sig.tprm_s, NO_ARRIVALS_S), "hol_s": sig.hol_latency_s,
                "dropped_groups": self._stale_in_step,
                "idle_frac": min(1.0, last.rwt_s / max(last.step_s, 1e-6)) if last else 0.0}

    def _agreed_plan(self, loop: _Loop, report: StepReport, train_s: float,
                     batch: _Batch) -> ers.Plan:
        """ERS's plan for every process, made by the leader from every host's rollout
        signals and the trainer's (alike on every host: it is one collective)."""
        return plan_from_json(self.decisions.decide_from(
            "plan", self._rollout_digest(), lambda digests: plan_to_json(self._plan(
                combine_rollout_digests(digests), loop, report, train_s, batch))))

    def _plan(self, rollout: dict, loop: _Loop, report: StepReport, train_s: float,
              batch: _Batch) -> ers.Plan:
        partition, last = loop.partition, loop.plan
        n_mb = max(1, report.micro_batches)
        n_actor = max(1, partition.actor)
        w_act = max(train_s - report.ref_seconds, 1e-6) * n_actor / n_mb
        w_ref = (max(report.ref_seconds - report.swap_seconds, 1e-6) / n_mb
                 if report.ref_seconds else w_act / 3)  # ref fwd ≈ 1/3 of fwd+bwd (2N vs 6N)
        costs = ra2p.Ra2pCosts(w_act=w_act, w_ref=w_ref, t_swap=report.swap_seconds,
                               n_actor=n_actor, n_ref=partition.ref)
        last_record = self.records[-1] if self.records else None
        step_avg = float(np.mean(self._step_times)) if self._step_times else train_s
        signals = ers.Signals(
            ras_mb=int(rollout["ready_tokens"] // self.cfg.micro_batch_tokens),
            ready_groups=rollout["ready_groups"], tprm_s=rollout["tprm_s"],
            hol_s=rollout["hol_s"], t_step_s=step_avg, mb_per_step=n_mb, costs=costs,
            prev_batch=len(batch.groups), twt_frac=min(1.0, batch.twt_s / max(step_avg, 1e-6)),
            # the evaluation this boundary queues runs in the next step: ERS lends it a
            # trainer rank (returned at the next boundary) and reads no signals from it
            eval_phase=self._evaluates_after(loop.completed),
            eval_ranks_out=last.eval_ranks_out,
            rollout_scaled_down=last_record is not None
            and partition.rollout < last_record.partition[0],
            # what the previous plan saw and did, measured: its deficit (hysteresis), how
            # long since a move, the share of the last whole step rollout ranks idled, what
            # a move cost when one was last made, and groups that arrived too stale
            last_pressure=last.pressure, since_move=min(self._since_move, 1 << 30),
            rollout_idle_frac=rollout["idle_frac"],
            last_step_s=last_record.step_s if last_record else train_s,
            last_step_tokens=last_record.consumed_tokens if last_record else 0,
            mean_step_tokens=(float(np.mean([r.consumed_tokens for r in self.records]))
                              if self.records else 0.0),
            move_cost_s=self._move_s, dropped_groups=rollout["dropped_groups"],
            trial=last.trial)
        return ers.plan(signals, partition, self.ers_config)

    def _rwt(self, manager, busy_before, step_s) -> float:
        """Mean seconds a rollout rank had no turn to compute during the step."""
        idle = []
        for rank, worker in manager.workers.items():
            busy = worker.stats.busy_s - busy_before.get(rank, worker.stats.busy_s)
            idle.append(max(0.0, step_s - busy))
        return float(np.mean(idle)) if idle else 0.0

    @staticmethod
    def _success(payloads: list[GroupPayload]) -> float:
        rewards = [t.reward for p in payloads for t in p.trajectories]
        return float(np.mean([r >= 1.0 for r in rewards])) if rewards else 0.0

    def _report_eval(self, manager, version: int, step: int) -> None:
        tally = manager.eval_tallies.get(version)
        if tally is None or not tally.episodes:
            return
        values = {"version": version, "episodes": tally.episodes, "reward": tally.reward,
                  "reward_se": tally.reward_se, "success": tally.wins / tally.episodes}
        log.info("eval v%d: success %.3f reward %.3f (se %.3f) over %d episodes", version,
                 values["success"], values["reward"], values["reward_se"], tally.episodes)
        if self.writer:
            self.writer.write(step, "eval", values)
            for transcript in tally.transcripts:  # what the policy did, for reading
                self.writer.write(step, "eval_episode", {"version": version, **transcript},
                                  scalars=False)
