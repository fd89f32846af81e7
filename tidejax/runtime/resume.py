"""What a checkpoint keeps of rollout, and how a resumed run takes it back.

The controller takes the snapshot on its asyncio loop thread at a post-update boundary,
with no await in between, so the buffer, the rollout manager and the data cursor agree:
every training group issued so far is trained, dropped, ready in the buffer, or in flight.
It is plain JSON (arrays as base64 of their bytes, so they come back bit for bit) stored in
the checkpoint's metadata. On `--resume`:

- ready groups go back into the buffer unchanged and count toward the staleness quota
  again (the buffer's bound still applies when they are taken);
- in-flight training groups restart from scratch under the restored policy. A group that
  was part-way through mixes tokens of policy versions the resumed run never serves, and
  GRPO needs all G trajectories, so every task of a started group restarts (counted in
  `restarted_tasks`); groups still queued are re-queued (`requeued_tasks`). Sampling seeds
  depend on (run seed, task id, turn, attempt) only, so a restarted task draws the same
  seeds it would have drawn;
- drop records ("dropped with reason") carry over, so the run's record stays complete.

Evaluation tasks are not kept: a resumed run evaluates its starting version again.

A run of several processes keeps one snapshot per process, each with that process's data
cursor (`combine`); each resumed process restores its own, and a run resumed on fewer
processes re-homes the missing ones' groups (`assigned`).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np

from tidejax.envs import Task
from tidejax.rl.batch import Trajectory
from tidejax.runtime.buffer import DropRecord, GlobalBuffer, ReadyGroup
from tidejax.runtime.manager import RolloutManager
from tidejax.runtime.records import GroupPayload

SNAPSHOT_VERSION = 1


def _array(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x)
    return {"dtype": x.dtype.str, "shape": list(x.shape),
            "data": base64.b64encode(x.tobytes()).decode("ascii")}


def _unarray(d: dict) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"]))
    return flat.reshape(d["shape"]).copy()


def _group_to_json(g: ReadyGroup) -> dict:
    p: GroupPayload = g.payload
    return {
        "group_id": g.group_id, "generated_tokens": g.generated_tokens,
        "total_tokens": g.total_tokens, "min_version": g.min_version,
        "advantages": [float(a) for a in p.advantages], "keep": [bool(k) for k in p.keep],
        "task_ids": list(p.task_ids),
        "trajectories": [{"tokens": _array(t.tokens), "loss_mask": _array(t.loss_mask),
                          "behaviour_logp": _array(t.behaviour_logp),
                          "policy_version": _array(t.policy_version),
                          "reward": float(t.reward), "group_id": int(t.group_id)}
                         for t in p.trajectories]}


def _group_from_json(d: dict) -> ReadyGroup:
    trajectories = [Trajectory(tokens=_unarray(t["tokens"]), loss_mask=_unarray(t["loss_mask"]),
                               behaviour_logp=_unarray(t["behaviour_logp"]),
                               policy_version=_unarray(t["policy_version"]),
                               reward=t["reward"], group_id=t["group_id"])
                    for t in d["trajectories"]]
    payload = GroupPayload(trajectories, list(d["advantages"]), list(d["keep"]),
                           list(d["task_ids"]))
    return ReadyGroup(group_id=d["group_id"], payload=payload,
                      generated_tokens=d["generated_tokens"], total_tokens=d["total_tokens"],
                      min_version=d["min_version"])


def snapshot(manager: RolloutManager, buffer: GlobalBuffer) -> dict[str, Any]:
    """Ready groups, in-flight training groups and drop records, as JSON-able data.

    Call on the loop thread that runs `manager` (buffer puts happen there too)."""
    return {
        "version": SNAPSHOT_VERSION,
        "ready": [_group_to_json(g) for g in buffer.snapshot()],
        "inflight": [{"started": started, "tasks": [dataclasses.asdict(t) for t in tasks]}
                     for tasks, started in manager.inflight_training_groups()],
        "dropped_groups": [dataclasses.asdict(d) for d in buffer.dropped],
        "dropped_tasks": [list(x) for x in manager.dropped_tasks],
    }


def counts(snap: dict[str, Any] | None) -> dict[str, int]:
    """Sizes of a snapshot, for logs and tests."""
    snap = snap or {}
    inflight = snap.get("inflight", [])
    return {"ready_groups": len(snap.get("ready", [])),
            "restarted_tasks": sum(len(g["tasks"]) for g in inflight if g["started"]),
            "requeued_tasks": sum(len(g["tasks"]) for g in inflight if not g["started"])}


def restore(snap: dict[str, Any] | None, manager: RolloutManager,
            buffer: GlobalBuffer) -> dict[str, int]:
    """Put a snapshot back into a fresh manager and buffer; returns `counts(snap)`."""
    if not snap:
        return counts(None)
    if snap.get("version") != SNAPSHOT_VERSION:
        raise ValueError(f"rollout snapshot version {snap.get('version')!r} is not "
                         f"{SNAPSHOT_VERSION}")
    for d in snap["dropped_groups"]:
        buffer.dropped.append(DropRecord(**d))
    manager.dropped_tasks.extend(tuple(x) for x in snap["dropped_tasks"])
    for d in snap["ready"]:
        buffer.put(_group_from_json(d))
    manager.outstanding_groups += len(snap["ready"])  # they wait in the staleness quota
    for g in snap["inflight"]:
        tasks = [Task(**t) for t in g["tasks"]]
        manager.add_groups(tasks, len(tasks))
    n = counts(snap)
    for key in ("restarted_tasks", "requeued_tasks"):
        manager.counters[key] = manager.counters.get(key, 0) + n[key]
    manager.counters["restored_ready_groups"] = (manager.counters.get("restored_ready_groups", 0)
                                                 + n["ready_groups"])
    return n


def combine(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One checkpoint's rollout from every process's snapshot (a single process's as is)."""
    return snapshots[0] if len(snapshots) == 1 else {"hosts": snapshots}


def assigned(rollout: dict[str, Any] | None, process: int, processes: int
             ) -> list[dict[str, Any]]:
    """The snapshots process `process` of `processes` restores: its own, and when fewer
    processes resume than saved, those of the ones now missing (their tasks re-homed)."""
    snapshots = [] if not rollout else rollout.get("hosts", [rollout])
    return [snap for i, snap in enumerate(snapshots) if i % processes == process]
