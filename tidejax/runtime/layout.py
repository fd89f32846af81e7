"""The job's device layout judged by the memory model (`tidejax.sched.memory`).

One place turns a `RunConfig` and a model into the memory model's `JobMemory`, finds the
per-device capacity (the config's `memory_fraction` of what the device reports, or of
`device_memory_gib`), and refuses a layout at start with the config field to change. ERS
and the SFT warm start take their allowed mesh sizes from the same answer.

Partitions count ranks of `topology.rollout_tensor` devices (ERS's move unit); the memory
model is asked in devices.
"""

from __future__ import annotations


import jax

from tidejax.config import RunConfig
from tidejax.models.config import ModelConfig
from tidejax.rl.trainer import resolve_remat
from tidejax.sched import ers, memory
from tidejax.sched.systems import SYSTEMS


class LayoutError(ValueError):
    """A layout the job refuses at start; the message names the config field to change."""


def device_memory_bytes(device) -> float | None:
    """What the backend says one device holds (None on CPU, which reports nothing)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def capacity_bytes(cfg: RunConfig, devices) -> float:
    """Per-device bytes the job may plan with."""
    if cfg.device_memory_gib is not None:
        total = cfg.device_memory_gib * memory.GIB
    else:
        # Hosts are alike; a process can read only its own devices' memory.
        reported = [device_memory_bytes(d) for d in devices
                    if d.process_index == jax.process_index()]
        if any(r is None for r in reported):
            return memory.UNBOUNDED_BYTES
        total = min(reported)
    return cfg.memory_fraction * total


def job_memory(cfg: RunConfig, model_config: ModelConfig, capacity: float
               ) -> memory.JobMemory:
    """The memory model of this job; its shape's `stored_d_model` is the padded model dim
    every trainer of the job stores (one for all, so states move between them as they
    are), chosen to divide as many trainer mesh sizes as the job has devices."""
    mesh_sizes = range(1, cfg.topology.devices * jax.process_count() + 1)
    shape = memory.ModelShape.of(model_config).stored_for(mesh_sizes)
    return memory.JobMemory(
        shape=shape, micro_batch_tokens=cfg.micro_batch_tokens,
        row_len=cfg.row_len, remat=resolve_remat(model_config, cfg.rl),
        engine=memory.EngineShape.of(cfg.engine), capacity_bytes=capacity,
        rollout_tensor=cfg.topology.rollout_tensor)


def check_layout(jm: memory.JobMemory, rollout_ranks: int, ref_devices: int,
                 actor_devices: int, source: str) -> None:
    """Raise a LayoutError naming `source` (the config fields that chose the layout) when
    the layout does not divide the model or does not fit."""
    problems = jm.problems(rollout_ranks, actor_devices, ref_devices)
    if problems:
        raise LayoutError(f"{source}: {rollout_ranks} rollout rank(s), {ref_devices} reference "
                         f"and {actor_devices} actor device(s) cannot run: "
                         + "; ".join(problems))


def check_shared(jm: memory.JobMemory, actor_devices: int, source: str) -> None:
    """Sync: every device serves a rollout rank and the trainer runs beside its engine."""
    problems = jm.problems(0, actor_devices)
    if not problems and jm.capacity_bytes < memory.UNBOUNDED_BYTES:
        both = jm.actor(actor_devices).total + jm.rollout().total
        if both > jm.capacity_bytes:
            problems.append(f"an engine ({jm.rollout().describe()}) beside the actor "
                            f"({jm.actor(actor_devices).describe()}) needs "
                            f"{both / memory.GIB:.1f} GiB per device, over "
                            f"{jm.capacity_bytes / memory.GIB:.1f} GiB")
    if problems:
        raise LayoutError(f"{source}: a sync run training on {actor_devices} device(s) "
                         "cannot run: " + "; ".join(problems))


def ers_config(cfg: RunConfig, jm: memory.JobMemory, devices: int) -> ers.ErsConfig:
    """ERS's bounds: the batch range, the rank floors and the mesh sizes (in ranks) the
    model admits."""
    t = cfg.topology
    k = t.rollout_tensor

    def in_ranks(device_sizes: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n // k for n in device_sizes if n % k == 0)

    ranks = devices // k
    return ers.ErsConfig(b_min=cfg.min_batch_groups, b_ideal=cfg.batch_groups,
                         min_rollout=t.min_rollout, min_actor=t.min_actor,
                         actor_sizes=in_ranks(jm.actor_sizes((ranks - t.min_rollout) * k)),
                         ref_sizes=in_ranks(jm.ref_sizes((ranks - t.min_rollout - 1) * k)))


def sync_trainer_devices(cfg: RunConfig, devices: int) -> int:
    """Devices a sync run trains on: as many as the asynchronous systems' trainers get
    (what the rollout ranks leave), or every device when one rank holds them all."""
    left = devices - cfg.topology.rollout_ranks * cfg.topology.rollout_tensor
    return left if left > 0 else devices


def planned_partition(actor_wanted: int, ranks: int, bounds: ers.ErsConfig) -> ers.Partition:
    """An elastic run's first partition: the planned split (`topology.rollout_ranks`, what
    the fixed-split systems run), its actor rounded down to a mesh size ERS may choose (up
    to the smallest one when none is that small). The simulator's ERS also starts from a
    plan (the static planner's); its cold-start bootstrap, trainer devices lent to rollout
    until the first batch is ready, has no runtime counterpart: it would need rollout
    engines compiled on the trainer's devices for one step's wait, and starting at the
    largest rollout instead left the trainer on one rank for the rest of a short run."""
    fitting = [n for n in bounds.actor_sizes if bounds.smallest_actor <= n <= actor_wanted]
    actor = max(fitting) if fitting else bounds.smallest_actor
    if ranks - actor < bounds.min_rollout:
        raise LayoutError(f"topology.min_rollout: {ranks} rank(s) cannot hold an actor of "
                          f"{actor} and {bounds.min_rollout} rollout rank(s)")
    return ers.Partition(rollout=ranks - actor, actor=actor)


def initial_partition(cfg: RunConfig, jm: memory.JobMemory, devices: int) -> ers.Partition:
    """The run's first partition (in ranks); a LayoutError naming the config field if it
    cannot run."""
    t = cfg.topology
    k, ranks = t.rollout_tensor, devices // t.rollout_tensor
    spec = SYSTEMS[cfg.system]
    if spec.phased:
        # Phases share every device: engines stay up while the trainer runs beside them.
        check_shared(jm, sync_trainer_devices(cfg, devices), "topology.rollout_ranks")
        return ers.Partition(rollout=ranks, actor=ranks)
    if spec.elastic:
        bounds = ers_config(cfg, jm, devices)
        if not bounds.actor_sizes:  # no actor mesh ERS could choose: say why the largest
            # one that divides the model fails (or, if none divides, the largest)
            sizes = range((ranks - t.min_rollout) * k, 0, -k)
            actor = next((n for n in sizes if not memory.undivided(jm.shape, n)), sizes[0])
            check_layout(jm, ranks - actor // k, 0, actor,
                         f"{devices} devices (topology.devices)")
        partition = planned_partition(ranks - t.rollout_ranks, ranks, bounds)
        check_layout(jm, partition.rollout, 0, partition.actor * k,
                     "topology.rollout_ranks, topology.min_actor")
        return partition
    check_layout(jm, t.rollout_ranks, 0, devices - t.rollout_ranks * k, "topology.rollout_ranks")
    return ers.Partition(rollout=t.rollout_ranks, actor=ranks - t.rollout_ranks)


def resumable_partition(saved: ers.Partition, cfg: RunConfig, jm: memory.JobMemory,
                        devices: int) -> bool:
    """Whether an elastic run resumed on `devices` may start from a checkpoint's partition:
    it covers every rank and ERS could have chosen it here (its floors, the mesh sizes the
    memory model admits, a layout that fits)."""
    k, ranks = cfg.topology.rollout_tensor, devices // cfg.topology.rollout_tensor
    bounds = ers_config(cfg, jm, devices)
    return (saved.total == ranks and saved.rollout >= bounds.min_rollout
            and saved.actor >= bounds.min_actor
            and (not bounds.actor_sizes or saved.actor in bounds.actor_sizes)
            and (saved.ref == 0 or not bounds.ref_sizes or saved.ref in bounds.ref_sizes)
            and not jm.problems(saved.rollout, saved.actor * k, saved.ref * k))
