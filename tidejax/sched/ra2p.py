"""Resource-Aware Ref-Actor Pipelining (TideRL §RA2P): decoupled vs colocated, by cost.

Signals: **RAS**, ready-at-start work (micro-batches already in the buffer when a step
starts), and **TPRM**, time per ready micro-batch afterwards (seconds between arrivals).
Micro-batch ``i`` arrives at ``0`` if ``i < RAS`` else ``(i - RAS + 1) * TPRM``.

* **Decoupled** (``T_dec``): Ref runs on its own ``n_ref`` GPUs, the Actor on ``n_actor``; a
  streaming pipeline with the loss deferred to the backward pass, so the Actor's forward
  of micro-batch ``i`` overlaps Ref's work and only its backward waits for the ref
  log-probs. No swaps; the first Ref pass (plus ``t_fill``) is the pipeline-fill cost.
* **Colocated** (``T_col``): Ref and Actor share the Actor GPUs. Ready-batch aggregation:
  whenever the trainer is free it takes *every* ready micro-batch, swaps Ref in once, runs
  all their Ref passes (dedicated Ref GPUs, if any, share that work), swaps back, then runs
  the Actor passes. One ``t_swap`` per burst instead of per micro-batch.

Costs ``C_dec``/``C_col`` are GPU-seconds (latency x GPUs held), so a mode that holds GPUs
idle pays for them; :func:`choose_mode` takes the cheaper. Vanilla per-micro-batch
alternation (what streaming RL systems do) is :func:`alternating_latency`, for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Mode(str, Enum):
    DECOUPLED = "decoupled"
    COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class Ra2pCosts:
    """Measured costs of the current trainer; work terms are GPU-seconds per micro-batch."""

    w_act: float  # Actor forward+backward of one micro-batch, GPU-seconds
    w_ref: float  # Ref forward of one micro-batch, GPU-seconds
    t_swap: float  # one Ref<->Actor alternation on the Actor GPUs, seconds
    n_actor: int  # Actor GPUs
    n_ref: int = 0  # dedicated Ref GPUs (0: decoupled mode unavailable)
    t_fill: float = 0.0  # extra pipeline latency (ref log-prob hand-off), seconds
    actor_fwd_share: float = 1 / 3  # forward share of Actor time (2N of 6N FLOPs) [D]
    mb_parallel: int = 1  # micro-batches in flight at once: n_actor for replicated DP, 1 FSDP

    def __post_init__(self) -> None:
        for name in ("w_act", "w_ref", "t_swap", "t_fill"):
            if getattr(self, name) < 0:
                raise ValueError(f"Ra2pCosts.{name} must be >= 0")
        if self.n_actor <= 0 or self.n_ref < 0:
            raise ValueError("Ra2pCosts.n_actor must be positive and n_ref >= 0")
        if not 0 <= self.actor_fwd_share <= 1:
            raise ValueError("Ra2pCosts.actor_fwd_share must be in [0, 1]")
        if self.mb_parallel <= 0:
            raise ValueError("Ra2pCosts.mb_parallel must be positive")


@dataclass(frozen=True, slots=True)
class ModeCosts:
    t_dec: float  # decoupled latency, s (inf when n_ref == 0)
    t_col: float  # colocated latency, s
    c_dec: float  # GPU-seconds
    c_col: float


def arrivals(ras: int, tprm: float, n_total: int) -> list[float]:
    """Arrival time of each of the step's ``n_total`` micro-batches."""
    if ras < 0 or n_total < 0 or tprm < 0:
        raise ValueError("arrivals: ras, tprm and n_total must be >= 0")
    return [0.0 if i < ras else (i - ras + 1) * tprm for i in range(n_total)]


def decoupled_latency(costs: Ra2pCosts, ras: int, tprm: float, n_total: int) -> float:
    if costs.n_ref == 0:
        return float("inf")
    s_ref = costs.w_ref / costs.n_ref
    s_fwd = costs.actor_fwd_share * costs.w_act / costs.n_actor
    s_bwd = costs.w_act / costs.n_actor - s_fwd
    ref_done = actor_done = 0.0
    for a in arrivals(ras, tprm, n_total):
        ref_done = max(ref_done, a) + s_ref
        fwd_done = max(actor_done, a) + s_fwd
        actor_done = max(fwd_done, ref_done + costs.t_fill) + s_bwd
    return actor_done


def colocated_latency(costs: Ra2pCosts, ras: int, tprm: float, n_total: int) -> float:
    arr = arrivals(ras, tprm, n_total)
    ref_rate = costs.w_ref / (costs.n_actor + costs.n_ref)
    act_rate = costs.w_act / costs.n_actor
    t, done = 0.0, 0
    while done < n_total:
        ready = done
        while ready < n_total and arr[ready] <= t:
            ready += 1
        if ready == done:
            t = arr[done]
            continue
        k = ready - done
        t += costs.t_swap + k * (ref_rate + act_rate)
        done = ready
    return t


def alternating_latency(costs: Ra2pCosts, ras: int, tprm: float, n_total: int) -> float:
    """Vanilla streaming: Ref then Actor for every micro-batch, one swap each (a round of
    ``mb_parallel`` micro-batches shares one swap on each GPU)."""
    arr = arrivals(ras, tprm, n_total)
    k = costs.mb_parallel
    t = 0.0
    for i in range(0, n_total, k):
        n = min(k, n_total - i)
        per = costs.t_swap + n * (costs.w_ref + costs.w_act) / costs.n_actor
        t = max(t, arr[i + n - 1]) + per
    return t


def mode_costs(costs: Ra2pCosts, ras: int, tprm: float, n_total: int) -> ModeCosts:
    gpus = costs.n_actor + costs.n_ref
    t_dec = decoupled_latency(costs, ras, tprm, n_total)
    t_col = colocated_latency(costs, ras, tprm, n_total)
    return ModeCosts(t_dec=t_dec, t_col=t_col, c_dec=t_dec * gpus, c_col=t_col * gpus)


def choose_mode(ras: int, tprm: float, costs: Ra2pCosts, n_total: int) -> Mode:
    """The cheaper mode for a step of ``n_total`` micro-batches; ties go to colocated."""
    mc = mode_costs(costs, ras, tprm, n_total)
    return Mode.DECOUPLED if mc.c_dec < mc.c_col else Mode.COLOCATED


def break_even_ras(dec: Ra2pCosts, col: Ra2pCosts, tprm: float, n_total: int) -> int | None:
    """Smallest RAS at which decoupled on ``dec`` costs fewer GPU-seconds than colocated on
    ``col`` (e.g. ``dec`` = the trainer plus one reclaimed rank serving Ref), or None."""
    gd, gc = dec.n_actor + dec.n_ref, col.n_actor + col.n_ref
    for ras in range(n_total + 1):
        if (
            decoupled_latency(dec, ras, tprm, n_total) * gd
            < colocated_latency(col, ras, tprm, n_total) * gc
        ):
            return ras
    return None
