"""Host driver: request-level continuous batching over an `Engine`, with policy hooks.

One host thread owns a `RequestLoop`. Each `step()` (1) asks the policy which waiting
requests to admit and prefills/inserts them (packed in shared calls) while slots, pages
and the step's prefill budget (`prefill_tokens_per_step` new tokens) allow, (2) dispatches
one `generate` (up to `decode_steps_per_call` tokens for all slots), preempting a running
request (policy's choice) when a slot cannot get its pages, and (3) only then reads the
*previous* dispatch's packed results (copied to the host asynchronously while the device
ran), appends tokens and behaviour log-probs, and completes finished requests. Results are
consumed one dispatch late, as JetStream's detokenize thread does, so host work overlaps
the device: a slot whose request finished still rides the dispatch in flight, inactive on
the device, and its pages reserved for it are given back when its turn ends. A dispatch
is skipped when no running request can still produce a token (all reached their max new
tokens in dispatches already made). On completion the policy says
whether the task's pages stay pinned for its next turn (pause) or are released to the
evictable cache (what request-level serving does, and how a paused multi-turn task loses
its cache: TideRL's challenge C1). A task's next turn is just another request with the
same `task_id`; admitting it first is the policy's resume decision.

The default `RequestLevelPolicy` is the baseline: FIFO admission with a page watermark,
release on completion, preempt the most recently admitted request. Task-level policies
(CTB, in `tidejax.sched`) implement the same `Policy` protocol. Requests and results are
plain data; the only clock is the injectable `clock` used to report decode tokens/s.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Protocol

import jax
import numpy as np
from tidejax.serving.config import SamplingParams
from tidejax.serving.engine import Engine, EngineMetrics, OutOfPages, steps_per_call_options
from tidejax.serving.page_pool import PoolFull, PoolUsage
from tidejax.serving.steps import DONE, LOGPROB, TOKEN, VALID


@dataclasses.dataclass(frozen=True)
class Request:
    """One turn of a task: generate up to `max_new_tokens` after `prompt_token_ids`."""

    request_id: Hashable
    task_id: Hashable | None
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("Request.prompt_token_ids must not be empty")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"Request.max_new_tokens must be a positive int, "
                             f"got {self.max_new_tokens!r}")


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: generated ids and their behaviour log-probs (float32)."""

    request_id: Hashable
    task_id: Hashable
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" or "length"
    cached_tokens: int  # prompt tokens served from the prefix cache
    preemptions: int  # times the request was preempted and recomputed
    pinned: bool  # the task's pages stayed pinned after this turn


@dataclasses.dataclass(frozen=True)
class EngineView:
    """What a policy sees: plain numbers, no engine handle."""

    free_slots: int
    available_pages: int  # free + evictable
    page_size: int
    usage: PoolUsage
    pinned_tasks: dict[Hashable, int]  # task -> tokens its pinned pages hold


@dataclasses.dataclass(frozen=True)
class Running:
    """A request in a decode slot, as a policy sees it."""

    slot: int
    request: Request
    admitted_step: int
    generated: int


class Policy(Protocol):
    """Where a task-level policy decides instead of request-level serving."""

    def admission_order(self, waiting: Sequence[Request], view: EngineView) -> Sequence[Request]:
        """Requests to try to admit now, in order (admission stops at the first that does not fit)."""

    def headroom_pages(self, request: Request, view: EngineView) -> int:
        """Pages that must stay available after admitting `request` (decode growth)."""

    def keep_pinned(self, completion: Completion, view: EngineView) -> bool:
        """Pause: pin the task's pages for its next turn (True) or release them (False)."""

    def preemption_victim(self, running: Sequence[Running], view: EngineView) -> int:
        """Slot to preempt when a running request cannot get its next page."""


class RequestLevelPolicy:
    """The baseline: FIFO, a page watermark, release on completion, preempt newest."""

    def __init__(self, watermark_pages: int = 1):
        self.watermark_pages = watermark_pages

    def admission_order(self, waiting: Sequence[Request], view: EngineView) -> Sequence[Request]:
        return waiting

    def headroom_pages(self, request: Request, view: EngineView) -> int:
        return self.watermark_pages

    def keep_pinned(self, completion: Completion, view: EngineView) -> bool:
        return False

    def preemption_victim(self, running: Sequence[Running], view: EngineView) -> int:
        return max(running, key=lambda r: (r.admitted_step, r.slot)).slot


@dataclasses.dataclass
class _Active:
    request: Request
    task_id: Hashable
    admitted_step: int
    cached_tokens: int
    preemptions: int
    first: jax.Array | None  # the prefill's [1, 6] result until read
    first_dispatch: int  # the first generate dispatch this request rides in
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class LoopMetrics:
    engine: EngineMetrics
    steps: int
    completed: int
    preemptions: int
    decode_tokens: int  # tokens appended by generate steps (excludes prefill's first)
    decode_seconds: float  # wall time in generate + result reads
    admission_stalls: int  # steps where requests waited and none could be admitted

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def kv_hit_rate(self) -> float:
        return self.engine.kv_hit_rate


class RequestLoop:
    """Continuous batching over one engine; see the module docstring."""

    def __init__(self, engine: Engine, params=None, policy: Policy | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.params = params if params is not None else engine.params
        self.policy = policy or RequestLevelPolicy(engine.engine_config.admission_watermark_pages)
        self._clock = clock
        self._state = engine.init_decode_state()
        self._waiting: collections.deque[tuple[Request, int]] = collections.deque()
        self._active: dict[int, _Active] = {}
        self._steps = 0
        self._completed = 0
        self._preemptions = 0
        self._decode_tokens = 0
        self._decode_seconds = 0.0
        self._stalls = 0
        self._dispatches = 0
        self._pending: tuple[int, jax.Array] | None = None  # (dispatch, results) unread
        self._pin_intent: set[Hashable] = set()
        self.stalled = False

    # ------------------------------------------------------------------ inputs
    def submit(self, request: Request) -> None:
        ec = self.engine.engine_config
        if len(request.prompt_token_ids) >= ec.max_seq_len:
            raise ValueError(f"request {request.request_id!r}: prompt does not fit max_seq_len "
                             f"{ec.max_seq_len}")
        self._waiting.append((request, 0))

    def pin(self, task_id: Hashable) -> None:
        """Pin the task's pages when its running (or else its next) turn completes."""
        if self.engine.pool.in_turn(task_id):
            self.engine.pin(task_id)
        else:
            self._pin_intent.add(task_id)

    def unpin(self, task_id: Hashable) -> None:
        self._pin_intent.discard(task_id)
        if self.engine.pool.has(task_id):
            self.engine.unpin(task_id)

    def evict(self, task_id: Hashable) -> None:
        self.engine.evict(task_id)

    # ------------------------------------------------------------------ queries
    @property
    def idle(self) -> bool:
        return not self._waiting and not self._active

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def decode_tokens(self) -> int:
        """Tokens appended by generate dispatches so far (host count, no device read)."""
        return self._decode_tokens

    def view(self) -> EngineView:
        engine = self.engine
        return EngineView(
            free_slots=len(engine.free_slots()), available_pages=engine.available_pages(),
            page_size=engine.engine_config.page_size, usage=engine.accounting(),
            pinned_tasks={t: engine.task_tokens(t) for t in engine.pinned_tasks()})

    def metrics(self) -> LoopMetrics:
        return LoopMetrics(self.engine.metrics(), self._steps, self._completed,
                           self._preemptions, self._decode_tokens, self._decode_seconds,
                           self._stalls)

    # ------------------------------------------------------------------ driving
    def step(self) -> list[Completion]:
        """Admit, dispatch one generate, return what the previous dispatch finished."""
        admitted = self._admit()
        # Nothing runs and nothing could start: only the caller (unpin, evict) can help.
        self.stalled = not admitted and not self._active and bool(self._waiting)
        if not self._active:
            self._pending = None  # results of requests already completed or preempted
            return []
        start = self._clock()
        previous = self._pending
        steps_left = [self.engine.slot_steps_left(slot) for slot in self._active]
        if any(steps_left):
            num_steps = self._steps_per_call(steps_left)
            while True:
                try:
                    self._state, result = self.engine.generate(self.params, self._state,
                                                               num_steps)
                    break
                except OutOfPages:
                    self._preempt_one()
                    if not self._active:
                        self._pending = None
                        return []
            if isinstance(result.data, jax.Array):  # (a MockEngine's results are numpy)
                result.data.copy_to_host_async()
            self._pending = (self._dispatches, result.data)
            self._dispatches += 1
        else:
            self._pending = None
        done = self._consume(previous) if previous is not None else []
        if self._pending is None:
            # Nothing more is dispatched for the running requests: read what remains (the
            # prefill tokens of requests that end on their first token).
            done += self._consume((self._dispatches, None))
        self._decode_seconds += self._clock() - start
        self._steps += 1
        return done

    def _steps_per_call(self, steps_left: list[int]) -> int:
        """`decode_steps_per_call`, halved (to an option the engine compiled) while requests
        wait and a running one would finish by length inside the call: its slot would idle
        for the rest of the call and, results being read a call late, the next one too."""
        options = steps_per_call_options(self.engine.engine_config.decode_steps_per_call)
        if not self._waiting:
            return options[0]
        soonest = min(n for n in steps_left if n > 0)
        return next((k for k in options if k <= soonest), options[-1])

    def _consume(self, pending: tuple[int, jax.Array]) -> list[Completion]:
        """Append one dispatch's tokens (each request's prefill token first)."""
        dispatch, result = pending
        riding = {slot: a for slot, a in self._active.items() if a.first_dispatch <= dispatch}
        firsts = [(slot, a) for slot, a in riding.items() if a.first is not None]
        data_KB6, *first_data = jax.device_get([result] + [a.first for _, a in firsts])
        data_KB6 = () if data_KB6 is None else data_KB6
        done: list[Completion] = []
        for (slot, active), first in zip(firsts, first_data):
            active.first = None
            if self._append(slot, active, first[0]):
                done.append(self._complete(slot, active))
                del riding[slot]
        if len(data_KB6) == 0:
            return done
        # Columns as Python lists once per call: per-token numpy scalar indexing was the
        # largest host cost of a decode step (64 slots x 8 tokens per call).
        data_KB6 = np.asarray(data_KB6)
        tokens_KB = data_KB6[..., TOKEN].tolist()
        logprobs_KB = np.ascontiguousarray(data_KB6[..., LOGPROB]).view(np.float32).tolist()
        valid_KB, done_KB = data_KB6[..., VALID].tolist(), data_KB6[..., DONE].tolist()
        for k in range(len(tokens_KB)):
            for slot, active in list(riding.items()):
                if not valid_KB[k][slot]:  # the slot did not decode at this step
                    continue
                self._decode_tokens += 1
                active.tokens.append(tokens_KB[k][slot])
                active.logprobs.append(logprobs_KB[k][slot])
                if done_KB[k][slot]:
                    done.append(self._complete(slot, active))
                    del riding[slot]
        return done

    def run(self, max_steps: int | None = None) -> Iterator[Completion]:
        """Step until idle (or `max_steps`), yielding completions as they finish."""
        steps = 0
        while not self.idle and (max_steps is None or steps < max_steps):
            yield from self.step()
            steps += 1
            if self.stalled:
                raise RuntimeError("waiting requests cannot be admitted into an idle engine "
                                   "(pinned pages or the policy hold them back)")

    # ------------------------------------------------------------------ internals
    def _admit(self) -> int:
        if not self._waiting:
            return 0
        engine = self.engine
        admitted = 0
        order = self.policy.admission_order([r for r, _ in self._waiting], self.view())
        batch, claimed, new_tokens = [], set(), 0
        budget = engine.engine_config.prefill_tokens_per_step
        running = {a.task_id for a in self._active.values()}
        for request in order:
            free = [slot for slot in engine.free_slots() if slot not in claimed]
            if not free or new_tokens >= budget:
                break
            task_id = request.task_id if request.task_id is not None else request.request_id
            if task_id in running:
                continue  # a task runs one turn at a time
            headroom = self.policy.headroom_pages(request, self.view())
            if not engine.can_prefill(task_id, request.prompt_token_ids, headroom):
                break
            sampling = (request.sampling or engine.engine_config.sampling).replace(
                max_new_tokens=request.max_new_tokens)
            try:
                begun = engine.begin_prefill(request.prompt_token_ids, task_id, sampling,
                                             request.request_id)
            except PoolFull:
                break
            batch.append((self._pop_waiting(request), free[0], begun))
            new_tokens += len(begun.prompt) - begun.start
            claimed.add(free[0])
            running.add(task_id)
        if batch:
            # One call for all admitted prompts (packed when the engine packs prefills).
            prefixes = engine.finish_prefills(self.params, [b for _, _, b in batch])
            for (entry, slot, _), prefix in zip(batch, prefixes):
                request = entry[0]
                self._state = engine.insert(prefix, self._state, slot)
                self._active[slot] = _Active(request, prefix.task_id, self._steps,
                                             prefix.cached_tokens, entry[1], prefix.first.data,
                                             self._dispatches)
                admitted += 1
        if not admitted and self._waiting:
            self._stalls += 1
        return admitted

    def _pop_waiting(self, request: Request) -> tuple[Request, int]:
        for i, entry in enumerate(self._waiting):
            if entry[0] is request:
                del self._waiting[i]
                return entry
        raise KeyError(request.request_id)

    def _append(self, slot: int, active: _Active, row: np.ndarray) -> bool:
        active.tokens.append(int(row[TOKEN]))
        active.logprobs.append(float(np.asarray(row[LOGPROB], np.int32).view(np.float32)))
        return bool(row[DONE])

    def _complete(self, slot: int, active: _Active) -> Completion:
        del self._active[slot]
        request = active.request
        sampling = request.sampling or self.engine.engine_config.sampling
        reason = "stop" if active.tokens[-1] in sampling.stop_token_ids else "length"
        completion = Completion(request.request_id, active.task_id, request.prompt_token_ids,
                                tuple(active.tokens), tuple(active.logprobs), reason,
                                active.cached_tokens, active.preemptions, False)
        keep = bool(self.policy.keep_pinned(completion, self.view()))
        if active.task_id in self._pin_intent:
            self._pin_intent.discard(active.task_id)
            keep = True
        # keep=None lets a `pin`/`unpin` issued to the engine during the turn decide.
        self._state = self.engine.free_slot(self._state, slot,
                                            request.prompt_token_ids + completion.token_ids,
                                            True if keep else None)
        self._completed += 1
        return dataclasses.replace(completion, pinned=self.engine.pool.is_pinned(active.task_id))

    def _preempt_one(self) -> None:
        running = [Running(slot, a.request, a.admitted_step, len(a.tokens))
                   for slot, a in self._active.items()]
        slot = self.policy.preemption_victim(running, self.view())
        active = self._active.pop(slot)
        self._state = self.engine.preempt_slot(self._state, slot)
        self._preemptions += 1
        self._waiting.appendleft((active.request, active.preemptions + 1))
