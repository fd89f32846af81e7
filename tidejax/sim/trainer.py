"""The simulated trainer: a global buffer of ready groups, micro-batches, four execution modes.

Ready groups wait in a buffer, taken in ``consume_order`` (:class:`SimConfig`): oldest
version ready first, fastest first within it (``"completion"``); in admission order
(:meth:`Trainer.admit`), waiting for the oldest still in flight (``"admission"``); or fastest
first keeping places for groups in flight that would be stale by the next update
(``"deadline"``). A group past the staleness bound when its turn comes is dropped.

A step takes ``batch`` groups; their tokens are cut into global micro-batches of
``mb_tokens`` per Actor GPU (the last one is whatever remains). Modes:

* ``batch`` (AReaL-like): wait for the whole batch, then one aggregated Ref phase (one
  swap) and the Actor passes;
* ``stream`` (StreamRL-like): every micro-batch on arrival: swap, Ref, swap back, Actor;
* ``colocated`` (RA2P CM): whenever free, all ready micro-batches as one burst with one swap;
  dedicated Ref GPUs, if any, share the Ref work;
* ``decoupled`` (RA2P DM): Ref GPUs and Actor GPUs pipeline each micro-batch; the Actor's
  forward overlaps Ref, its backward waits for the ref log-probs; no swaps.

Borrowed GPUs (BiDiRL ``to_train``) join the Actor data-parallel group from the time they are
ready, for bursts starting after it.
"""

from __future__ import annotations

import heapq
from collections import deque

from tidejax.sched import staleness
from tidejax.sched.ra2p import Ra2pCosts
from tidejax.sim.costs import CostModel
from tidejax.sim.metrics import Ledger

MODES = ("batch", "stream", "colocated", "decoupled")


class Trainer:
    def __init__(self, cost: CostModel, ledger: Ledger, on_step_end,
                 consume_order: str) -> None:
        self.consume_order = consume_order  # validated by SimConfig
        # admitted groups not yet offered, oldest first: uid -> (place in admission order, group)
        self._in_flight: dict[int, tuple[int, object]] = {}
        self._next_seq = 0
        self.cost = cost
        self.ledger = ledger
        self.on_step_end = on_step_end  # callback(t)
        self.actor: list[int] = []
        self.ref: list[int] = []
        self.borrowed: list[tuple[float, tuple[int, ...]]] = []  # (ready time, gpus)
        # (order key, ready_t, uid, group); the key is the admission place or the version
        self.buffer: list[tuple[int, float, int, object]] = []
        self.mode = "batch"
        self.in_step = False
        self.need = self.taken = 0
        self.acc = [0, 0]
        self.acc_groups: list = []
        self.mbs: deque[tuple[int, int, float]] = deque()  # closed, unprocessed (tok, sq, t)
        self.step_groups: list = []
        self.free_at = 0.0
        self.ref_done = self.act_done = 0.0
        self.mb_closed: list[float] = []
        self.step_start = 0.0
        self.ras = 0
        self.pending_end = False
        self.blocked_until = 0.0  # trainer GPUs lent to rollout (BiDiRL) until then
        self.on_blocked_work = None  # callback(t) when work arrives while GPUs are lent
        self.events = None  # set by the cluster: push(t, fn, *args)
        # the staleness bound, as the runtime's GlobalBuffer.take applies it: a group found
        # stale when the trainer takes it is dropped (set by the cluster)
        self.is_stale = lambda group: False
        self.is_due = lambda group: False  # stale unless taken in this step
        self.on_drop = None  # callback(group, t)

    # ------------------------------------------------------------------ buffer
    def admit(self, group) -> None:
        """A training group was admitted: its place in the admission order."""
        self._in_flight[group.uid] = (self._next_seq, group)
        self._next_seq += 1

    def offer(self, group, t: float) -> None:
        seq, _ = self._in_flight.pop(group.uid)
        key = seq if self.consume_order == "admission" else group.version
        heapq.heappush(self.buffer, (key, t, group.uid, group))
        if self.in_step:
            self._pull(t)
            self._kick(t)

    def ready_groups(self) -> list:
        return [entry[3] for entry in self.buffer]

    @property
    def mb_global(self) -> int:
        return self.cost.mb_tokens * len(self.actor)

    # -------------------------------------------------------------------- step
    def start_step(self, t: float, mode: str, batch: int) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown trainer mode {mode!r}")
        self.mode = mode
        self.in_step = True
        self.need, self.taken = batch, 0
        self.acc = [0, 0]
        self.step_groups = []
        self.mb_closed = []
        self.step_start = t
        self.free_at = max(self.free_at, t)
        self.ref_done = self.act_done = t
        self.pending_end = False
        self._pull(t)
        self.ras = len(self.mbs)
        self._kick(t)

    def _pull(self, t: float) -> None:
        while self.taken < self.need and self.buffer and self._may_take(self.buffer[0]):
            _, _, _, g = heapq.heappop(self.buffer)
            if self.is_stale(g):
                self.on_drop(g, t)
                continue
            self.taken += 1
            self.step_groups.append(g)
            self.acc[0] += g.train_tokens
            self.acc[1] += g.train_sq
            if self.acc[0] >= self.mb_global or self.taken == self.need:
                self._close(t)

    def _may_take(self, entry) -> bool:
        """Whether the buffer's first group may be taken now or must wait for one in flight."""
        if self.consume_order == "completion":
            return True
        if self.consume_order == "admission":  # no older admitted group still in flight
            return not self._in_flight or next(iter(self._in_flight.values()))[0] > entry[0]
        # deadline: leave a place in this batch for every group in flight that would be stale
        # by the next step (admission order is version order, so they lead the dict)
        if self.is_due(entry[3]):
            return True
        due = 0
        for _, g in self._in_flight.values():
            if not self.is_due(g):
                break
            due += 1
        # the top group counts toward what this step still needs (the runtime's rule)
        return staleness.batch_countable(self.need - self.taken, 1, 0, due) >= 1

    def _close(self, t: float) -> None:
        # a group larger than one micro-batch still forms whole micro-batches
        tokens, sq = self.acc
        if self.taken < self.need:
            n = max(1, tokens // self.mb_global)
        else:  # the step's last tokens: full micro-batches, then a small remainder
            n = max(1, -(-tokens // self.mb_global))
        for _ in range(n):
            self.mbs.append((tokens // n, sq // n, t))
            if t > self.step_start:
                self.mb_closed.append(t)
        self.acc = [0, 0]

    def _actor_gpus(self, t: float) -> tuple[int, ...]:
        extra = tuple(g for ready, gpus in self.borrowed if ready <= t for g in gpus)
        return tuple(self.actor) + extra

    def unblock(self, t: float) -> None:
        self.blocked_until = 0.0
        self._kick(t)

    def _kick(self, t: float) -> None:
        if not self.in_step or self.pending_end:
            return
        if t < self.blocked_until:
            ready = self.mbs and (self.mode != "batch" or self.taken == self.need)
            if ready and self.on_blocked_work is not None:
                self.on_blocked_work(t)
            return
        if self.mode == "decoupled":
            while self.mbs:
                tok, sq, ready = self.mbs.popleft()
                self._pipeline(tok, sq, max(ready, t))
        elif self.free_at <= t + 1e-12 and self.mbs:
            if self.mode == "batch" and self.taken < self.need:
                return
            take = 1 if self.mode == "stream" else len(self.mbs)
            batch = [self.mbs.popleft() for _ in range(take)]
            self._burst(max(t, self.free_at), batch)
        if self.taken == self.need and not self.mbs and self.acc[0] == 0:
            end = max(self.free_at, self.act_done)
            self.pending_end = True
            self.events(end, self._end, end)

    def _burst(self, t: float, batch: list[tuple[int, int, float]]) -> None:
        tokens = sum(b[0] for b in batch)
        sq = sum(b[1] for b in batch)
        actor = self._actor_gpus(t)
        helpers = tuple(self.ref) if self.mode == "colocated" else ()
        c = self.cost
        t_swap = c.swap(len(actor))
        t_ref = c.ref(tokens, sq, len(actor) + len(helpers))
        t_act = c.train(tokens, sq, len(actor))
        led = self.ledger
        led.add(actor, t, t + t_swap, "swap")
        led.add(actor + helpers, t + t_swap, t + t_swap + t_ref, "ref")
        end = t + t_swap + t_ref + t_act
        led.add(actor, t + t_swap + t_ref, end, "actor")
        self.free_at = end
        self.events(end, self._on_free, end)

    def _pipeline(self, tokens: int, sq: int, t_ready: float) -> None:
        c = self.cost
        start = max(self.ref_done, t_ready)
        self.ref_done = start + c.ref(tokens, sq, len(self.ref))
        self.ledger.add(self.ref, start, self.ref_done, "ref")
        actor = self._actor_gpus(t_ready)
        work = c.train(tokens, sq, len(actor))
        fwd = work / 3  # forward share of 6N: 2N [D]
        f0 = max(self.act_done, t_ready)
        b0 = max(f0 + fwd, self.ref_done)
        self.ledger.add(actor, f0, f0 + fwd, "actor")
        self.ledger.add(actor, b0, b0 + work - fwd, "actor")
        self.act_done = b0 + work - fwd
        self.free_at = self.act_done

    def _on_free(self, t: float) -> None:
        self._kick(t)

    def _end(self, t: float) -> None:
        self.in_step = False
        self.on_step_end(t)

    # ----------------------------------------------------------------- signals
    def tprm(self) -> float:
        """Seconds per micro-batch that became ready after the step started, averaged over
        the step so far (a group completing yields several micro-batches at one instant, so
        gaps between neighbours would read as a flood); inf if none arrived."""
        times = self.mb_closed
        if not times:
            return float("inf")
        return (times[-1] - self.step_start) / len(times)

    def ra2p_costs(self, tokens_per_mb: float, sq_per_mb: float) -> Ra2pCosts:
        c = self.cost
        return Ra2pCosts(
            w_act=c.train(tokens_per_mb, sq_per_mb, 1),
            w_ref=c.ref(tokens_per_mb, sq_per_mb, 1),
            t_swap=c.swap(max(1, len(self.actor))),
            n_actor=max(1, len(self.actor)),
            n_ref=len(self.ref),
        )
