"""A simulated rollout rank: continuous-batching decode timing plus the shared page pool.

Time moves in *segments*: between two changes of the running batch (a sequence joins or
leaves) the batch size ``B`` is fixed and total context grows by ``B`` per iteration, so the
time of ``k`` iterations is closed-form (:class:`~tidejax.sched.perf.DecodeCurve`). The rank
keeps an iteration counter; each running sequence finishes its turn at a known iteration,
so one event per turn end suffices. Joins take effect at the next iteration boundary after
their prefill, which stalls decode (prefill is charged inside the decode loop, as chunked
prefill does).

Tasks carry synthetic token streams: page ``i`` of a group's shared prompt has key
``(0, group, i)``, later pages ``(1, task, epoch, i)`` (``epoch`` changes when a sliding
history window rewrites the context), chained with :func:`serving.page_pool.hash_page`.
"""

from __future__ import annotations

import heapq

from tidejax.serving.page_pool import ROOT_HASH, PagePool, hash_page
from tidejax.sim.costs import CostModel
from tidejax.sim.metrics import USEFUL, Ledger


class SimTask:
    """Mutable per-task state owned by the cluster."""

    __slots__ = (
        "active_entry",
        "chain",
        "ctx",
        "dead",
        "epoch",
        "footprint",
        "group",
        "home",
        "idx",
        "new_tokens",
        "paused",
        "rank",
        "ready",
        "resp_left",
        "task_id",
        "traj",
        "turn",
    )

    def __init__(self, task_id: int, group, idx: int) -> None:
        self.task_id = task_id
        self.group = group  # sim.cluster.SimGroup
        self.idx = idx
        self.traj = group.draw.trajectories[idx]
        self.turn = 0  # current (or next) turn
        self.ctx = group.draw.prompt  # context tokens before the current turn's response
        self.new_tokens = group.draw.prompt  # tokens this turn adds that were never computed
        self.resp_left = self.traj.responses[0]
        self.chain: list[int] = []  # page keys of the context's full pages
        self.epoch = 0
        self.rank: Rank | None = None
        self.home: int | None = None
        self.footprint = 0  # tokens charged against the rank's CTB budget
        self.ready = True  # its environment has answered (or it has not started)
        self.paused = False
        self.dead = False
        self.active_entry = None

    def keys(self, n_tokens: int, page_size: int) -> list[int]:
        """Page keys of the first ``n_tokens`` tokens' full pages (extends the cached chain)."""
        want = n_tokens // page_size
        chain = self.chain
        if len(chain) > want:
            del chain[want:]
        if len(chain) < want:
            g = self.group
            shared = g.draw.prompt // page_size
            parent = chain[-1] if chain else ROOT_HASH
            for i in range(len(chain), want):
                key = (0, g.uid, i) if i < shared else (1, self.task_id, self.epoch, i)
                parent = hash_page(parent, key)
                chain.append(parent)
        return chain

    def rewrite_history(self, page_size: int) -> None:
        """The context changed beyond the prompt (history window slid): new keys from there."""
        self.epoch += 1
        del self.chain[self.group.draw.prompt // page_size :]


class Rank:
    """One rollout instance (``tp`` GPUs), its decode loop and its KV page pool."""

    def __init__(
        self, rid: int, gpus: tuple[int, ...], cost: CostModel, t: float, ledger: Ledger
    ) -> None:
        self.rid = rid
        self.gpus = gpus
        self.cost = cost
        self.curve = cost.curve
        self.pool = PagePool(cost.kv_pages, cost.page_size)
        self.budget = cost.kv_pages * cost.page_size
        self.open = True
        self.B = 0  # running sequences
        self.S = 0.0  # their total context at the segment start
        self.I = 0  # iterations done at the segment start
        self.t0 = t  # segment start (after any prefill stall)
        self.heap: list[tuple[int, int, SimTask]] = []
        self.stamp = 0  # bumps whenever the next event time may have changed
        self.resident: set[SimTask] = set()  # CTB: tasks holding budget here
        self.used = 0  # CTB: sum of resident footprints
        self.type_counts: dict[str, int] = {}  # CTB: resident tasks per task type
        self.group_counts: dict[int, int] = {}  # CTB: resident tasks per group
        self.ctb_version = 0  # CTB: bumped when type_counts / group_counts change
        self.ctb_state = None  # CTB: (key, RankState) last built by the driver
        self.queue: list[SimTask] = []  # request-level: turns waiting for memory (FIFO)
        self.assigned = 0  # request-level: tasks routed here and unfinished
        self.idle_since: float | None = t
        self.idle: list[tuple[float, float]] = []
        self.ledger = ledger
        self._span = [-1.0, -1.0]  # contiguous useful interval not yet in the timeline bins
        self._kind_s: dict[str, float] = {}  # busy seconds per kind not yet in the ledger
        self._seq = 0
        self._memo = (-1, 0.0, 0, 0.0)  # (B, S, k, iters_time(B, S, k)) last computed
        # decode so far: iterations, tokens, and context summed over tokens (ERS's signals)
        self.dec_iters = self.dec_tokens = 0
        self.dec_ctx = 0.0

    # ----------------------------------------------------------------- ledger
    def _log(self, t0: float, t1: float, kind: str) -> None:
        """Busy interval: totals per kind stay here until flushed; contiguous useful spans
        (decode, prefill) merge before they are spread over the timeline bins."""
        if t1 <= t0:
            return
        kind_s = self._kind_s
        kind_s[kind] = kind_s.get(kind, 0.0) + (t1 - t0)
        if kind not in USEFUL:
            return
        span = self._span
        if span[1] >= 0 and abs(span[1] - t0) < 1e-9:
            span[1] = t1
            return
        if span[1] >= 0:
            self.ledger.bin_useful(self.gpus, span[0], span[1])
        span[0], span[1] = t0, t1

    def flush_log(self) -> None:
        span = self._span
        if span[1] >= 0:
            self.ledger.bin_useful(self.gpus, span[0], span[1])
            span[0] = span[1] = -1.0
        n = len(self.gpus)
        for kind, sec in self._kind_s.items():
            self.ledger.add_total(kind, sec * n)
        self._kind_s.clear()

    # --------------------------------------------------------------- timing core
    def _next_finish(self) -> int | None:
        heap = self.heap
        while heap and heap[0][2].active_entry is not heap[0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _run(self, k: int) -> None:
        if k <= 0:
            return
        # _memo remembers the last iters_time answer: a turn end's event time (next_event)
        # and the run up to it ask the same question
        m, B, S = self._memo, self.B, self.S
        if m[2] == k and m[0] == B and m[1] == S:
            dt = m[3]
        else:
            dt = self.curve.iters_time(B, S, k)
        self._log(self.t0, self.t0 + dt, "decode")
        self.t0 += dt
        self.I += k
        self.dec_iters += k
        self.dec_tokens += k * B
        self.dec_ctx += k * S + B * k * (k - 1) / 2
        self.S += k * B

    def catch_up(self, t: float, before_finish: bool = False) -> None:
        """Advance to the first iteration boundary at or after ``t``, never past the next
        finish (``before_finish``: stop one iteration short of it)."""
        if self.B == 0:
            self.t0 = max(self.t0, t)
            return
        if t <= self.t0:
            return
        k, t_k = self.curve.iters_reaching(self.B, self.S, t - self.t0)
        nxt = self._next_finish()
        if nxt is not None and k > nxt - self.I - before_finish:
            k = nxt - self.I - before_finish
        else:
            self._memo = (self.B, self.S, k, t_k)
        self._run(k)

    def next_event(self) -> float | None:
        nxt = self._next_finish()
        if nxt is None:
            return None
        k, B, S = nxt - self.I, self.B, self.S
        m = self._memo
        if m[2] == k and m[0] == B and m[1] == S:
            return self.t0 + m[3]
        dt = self.curve.iters_time(B, S, k)
        self._memo = (B, S, k, dt)
        return self.t0 + dt

    def stall(self, t: float, seconds: float, kind: str) -> None:
        """Occupy the rank for ``seconds`` from the next boundary (prefill, sync, ...)."""
        self.catch_up(t)
        start = max(self.t0, t)
        self._wake(start)
        if seconds > 0:
            self._log(start, start + seconds, kind)
        self.t0 = start + seconds
        if self.B == 0:
            self.idle_since = self.t0
        self.stamp += 1

    def _wake(self, t: float) -> None:
        if self.idle_since is not None:
            if t > self.idle_since:
                self.idle.append((self.idle_since, t))
            self.idle_since = None

    def join(self, task: SimTask, t: float, prefill_s: float, recompute_s: float) -> None:
        """``task`` starts generating ``task.resp_left`` tokens after its prefill."""
        self.stall(t, prefill_s - recompute_s, "prefill")
        if recompute_s > 0:
            self._log(self.t0, self.t0 + recompute_s, "recompute")
            self.t0 += recompute_s
        self.idle_since = None
        self._seq += 1
        entry = (self.I + task.resp_left, self._seq, task)
        task.active_entry = entry
        heapq.heappush(self.heap, entry)
        self.B += 1
        self.S += task.ctx
        self.stamp += 1

    def finish(self) -> list[SimTask]:
        """Run to the earliest finish; return the tasks whose turn ended (their ctx grown)."""
        nxt = self._next_finish()
        if nxt is None:
            return []
        self._run(nxt - self.I)
        done = []
        heap = self.heap
        while heap and heap[0][0] <= self.I:
            entry = heapq.heappop(heap)
            task = entry[2]
            if task.active_entry is not entry:
                continue  # stale: the task left this batch (paused, moved) since
            task.active_entry = None
            self.B -= 1
            self.S -= task.ctx + task.resp_left
            task.ctx += task.resp_left
            task.resp_left = 0
            done.append(task)
        if self.B == 0:
            self.idle_since = self.t0
        self.stamp += 1
        return done

    def remove(self, task: SimTask, t: float) -> None:
        """Take a running task out mid-turn; what it generated so far joins its context."""
        self.catch_up(t, before_finish=True)
        entry = task.active_entry
        generated = self.I - (entry[0] - task.resp_left)
        task.active_entry = None
        self.B -= 1
        self.S -= task.ctx + generated
        task.ctx += generated
        task.resp_left -= generated
        if self.B == 0:
            self.idle_since = max(self.t0, t)
        self.stamp += 1

    def running(self) -> list[SimTask]:
        return [e[2] for e in self.heap if e[2].active_entry is e]

    def generated(self, task: SimTask) -> int:
        """Tokens ``task`` produced so far in its current turn (after ``catch_up``)."""
        entry = task.active_entry
        return self.I - (entry[0] - task.resp_left)

    def close_idle(self, t: float) -> None:
        self.flush_log()
        if self.idle_since is not None and t > self.idle_since:
            self.idle.append((self.idle_since, t))
        self.idle_since = None
