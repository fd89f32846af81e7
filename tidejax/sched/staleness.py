"""The staleness bound as an admission quota, shared by every asynchronous policy.

A training group admitted while rollout runs policy version ``v`` is consumed by an update
at trainer version ``v + s``; ``s`` is its staleness. With a bound ``eta`` and a trainer
consuming ``B`` groups per update, admitting at most ``(eta + 1) * B`` groups that are not yet
consumed keeps a FIFO-consumed stream within the bound (AReaL's rule,
``N_submitted <= (i + eta + 1) * B``, calibration ``stale.areal_eta``). Two conditions make
that hold: ``i`` is the version rollout runs, so a consumed group's slot comes back only
once the new weights reach rollout, and the trainer takes groups in admission order
(``runtime/buffer.py``). Rollout is throttled when the quota is used up: that is CTB's
"policy staleness" constraint.
"""

from __future__ import annotations


def max_outstanding(bound: int, batch_groups: int) -> int:
    """Groups that may be admitted but not yet consumed under staleness ``bound``."""
    if bound < 0:
        raise ValueError(f"bound must be >= 0, got {bound}")
    if batch_groups <= 0:
        raise ValueError(f"batch_groups must be positive, got {batch_groups}")
    return (bound + 1) * batch_groups


def admissible_groups(outstanding: int, quota: int) -> int:
    """New training groups that may be admitted now."""
    if outstanding < 0 or quota < 0:
        raise ValueError(f"outstanding and quota must be >= 0, got {outstanding}, {quota}")
    return max(0, quota - outstanding)


def is_due(trainer_version: int, group_version: int, bound: int) -> bool:
    """A group of ``group_version`` would be past ``bound`` at the next update's take: it must
    be in the batch the trainer at ``trainer_version`` takes now."""
    return trainer_version - group_version >= bound


def batch_countable(target: int, ready: int, due_ready: int, due_in_flight: int) -> int:
    """How many of ``ready`` groups count toward a batch of ``target`` when a place is kept
    for each of ``due_in_flight`` due groups still running; the ``due_ready`` ones always
    count (deadline consumption order: the runtime's buffer and the simulator's trainer)."""
    if due_in_flight == 0:
        return ready
    return max(due_ready, min(ready, target - due_in_flight))


def staleness(consumer_version: int, group_version: int) -> int:
    """Versions between the policy that started a group and the update consuming it."""
    if consumer_version < group_version:
        raise ValueError(f"group version {group_version} is newer than {consumer_version}")
    return consumer_version - group_version
