"""The serving engine of one rollout rank: JetStream's prefill / insert / generate over a
paged KV pool with a prefix cache and task-level pinning.

`Engine` is a thin host shell around the pure steps in `serving.steps`, compiled once at
construction with the KV pages and the decode state donated. It owns the rank's KV pages
(prefill and generate both write them, so they cannot live in a caller-held pytree) and
the host `KVPool` that decides which pages hold which tokens.

A request's turn: `prefill` (allocate pages, reuse cached prefix pages, compute the rest,
sample the first token; `begin_prefill` + `finish_prefills` do it for several requests,
packed in shared calls with `prefill_packing`) -> `insert` (into a decode slot) ->
`generate` (up to `decode_steps_per_call` tokens per slot per dispatch, pages reserved
ahead) until the host sees `done` -> `free_slot(tokens=...)`, which indexes the sequence's full pages for reuse and
then either releases them (evictable: request-level serving) or keeps them pinned for the
task's next turn (`pin`, the mechanism CTB uses). `accounting()` is what a scheduler reads.

Not thread-safe: one host thread drives an engine. Engines on several threads may load the
same source weights at once (a sync hands every rollout rank the trainer's copy), so weight
placement takes a process-wide lock (`_PLACEMENT_LOCK`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Hashable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tidejax.models.config import ModelConfig
from tidejax.models.model import Params, cast_floating
from tidejax.models.sharding import ROLLOUT_RULES, make_mesh, param_shardings
from tidejax.serving import steps
from tidejax.serving.config import EngineConfig, SamplingParams
from tidejax.serving.kv_pool import KVPages, KVPool, init_kv_pages
from tidejax.serving.page_pool import PoolFull, PoolUsage
from tidejax.serving.paged_attention import bind_kernel
from tidejax.serving.sampling import sampling_mode
from tidejax.serving.steps import DecodeState, ResultTokens, SlotRow


class OutOfPages(PoolFull):
    """`generate` found no page for the next token of `slots`; nothing was dispatched."""

    def __init__(self, slots: Sequence[int]):
        super().__init__(f"no free or evictable page for decode slots {list(slots)}")
        self.slots = tuple(slots)


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled request, ready to `insert`: its K/V is already in the pool."""

    request_id: Hashable
    task_id: Hashable
    prompt: tuple[int, ...]
    sampling: SamplingParams
    first: ResultTokens  # [1, 6] on device: the first sampled token
    row: SlotRow  # host values for the decode slot
    cached_tokens: int  # prompt tokens served from the prefix cache
    computed_tokens: int  # prompt tokens this prefill computed


@dataclasses.dataclass(frozen=True)
class PendingPrefill:
    """A request whose pages `begin_prefill` took; `finish_prefills` computes it."""

    request_id: Hashable
    task_id: Hashable
    prompt: tuple[int, ...]
    sampling: SamplingParams
    start: int  # first prompt token to compute (the rest is cached)
    write: bool  # False: the whole prompt was cached; only the last token's logits run
    cached_tokens: int
    page_row: np.ndarray  # [Pmax] the task's pages, trash-padded


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    """Cumulative engine counters. Hit rate = prompt tokens served from cache / needed."""

    prompt_tokens: int
    cached_prompt_tokens: int
    prefill_tokens_computed: int  # real tokens through the model in prefill
    prefill_tokens_padded: int  # the same plus bucket padding
    prefill_calls: int
    decode_steps: int
    decode_tokens: int
    evicted_pages: int
    pages_used: int
    pages_pinned: int
    pages_cached: int
    pages_free: int

    @property
    def kv_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# JAX 0.10's resharding `device_put` is not safe when several threads read one sharded
# source array at once (it fails with a safe_zip length mismatch, seen when four rollout ranks
# loaded the trainer's weights together); held while dispatching, not while copying.
_PLACEMENT_LOCK = threading.Lock()


@dataclasses.dataclass
class _Slot:
    request_id: Hashable
    task_id: Hashable
    max_new: int
    steps_dispatched: int = 0  # generate steps dispatched since insert

    def steps_left(self, max_seq_len: int, prompt_len: int) -> int:
        """Steps that can still produce a token: until max new tokens or the max length,
        counting the steps already dispatched (a stop id, unknown here, ends it sooner)."""
        return max(0, min(self.max_new - 1, max_seq_len - prompt_len) - self.steps_dispatched)


class Engine:
    """One rank's engine. Build with `make_engine`; see the module docstring."""

    def __init__(self, config: ModelConfig, engine_config: EngineConfig, mesh: jax.sharding.Mesh,
                 params: Params):
        self.config = config
        self.engine_config = ec = engine_config
        self._mesh = mesh
        self._param_shardings, self.kv_sharding, self._replicated = engine_shardings(
            config, mesh)
        self._init_host(ec)
        self._kv = init_kv_pages(config, ec.num_pages, ec.page_size, self.kv_sharding)
        self.params = self.load_params(params)
        (self._prefill, self._generate, self._insert, self._free,
         self._packed_prefill) = _compiled_steps(
            config, ec.attention, ec.page_size, ec.max_seq_len, self.kv_sharding,
            self._replicated)

    def _init_host(self, engine_config: EngineConfig) -> None:
        """Host bookkeeping, shared with `MockEngine` so both account identically."""
        ec = engine_config
        self.pool = KVPool(ec.num_pages, ec.page_size, ec.max_pages_per_seq)
        self._slots: list[_Slot | None] = [None] * ec.max_slots
        self._request_ids = itertools.count()
        self._last_state: DecodeState | None = None
        # The host's copy of every slot's page table, sent whole with each generate call
        # (a multi-token call may need several new pages per slot).
        self._page_table_BP = np.full((ec.max_slots, ec.max_pages_per_seq), self.pool.trash_page,
                                      np.int32)
        self._span_buckets = (span_buckets(ec.max_pages_per_seq) if ec.attention_span == "live"
                              else (ec.max_pages_per_seq,))
        self._prompt_lens = [0] * ec.max_slots
        # Each slot's (temperature, top_k, top_p) as the device state holds them: set by
        # insert, kept after free (as on the device), so the sampling mode matches.
        self._slot_sampling = [(0.0, 0, 1.0)] * ec.max_slots
        self._counts = {"prompt": 0, "cached": 0, "computed": 0, "padded": 0, "prefills": 0,
                        "steps": 0}

    # ------------------------------------------------------------ JetStream API
    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine_config.max_slots

    @property
    def max_prefill_length(self) -> int:
        return self.engine_config.max_seq_len

    def load_params(self, params: Params) -> Params:
        """Place `params` (stacked or per-layer) on this rank's mesh (ROLLOUT_RULES
        shardings) in the model's dtype, held per layer (`unstack_layers`: decode reads each
        layer's weights where they lie, with no slice copied out of a stack). Host arrays
        are cast before they travel; device arrays (a trainer's `compute_copy`) move device
        to device and are cast there if they still need it. A stacked leaf is split as it
        lands, so the transient is one leaf, not a second copy of the model."""
        with _PLACEMENT_LOCK:
            return self._place_params(params)

    def _place_params(self, params: Params) -> Params:
        dtype = self.config.jnp_dtype
        shardings = self._param_shardings

        def place(tree, sharding):
            tree = jax.tree.map(
                lambda x: x if isinstance(x, jax.Array) else cast_floating(x, dtype), tree)
            placed = jax.device_put(tree, sharding)
            if all(x.dtype == dtype for x in jax.tree.leaves(placed)
                   if np.issubdtype(x.dtype, np.floating)):
                return placed
            return _cast_on_device(placed, dtype)

        layers = params["layers"]
        if isinstance(layers, tuple):
            per_layer = tuple(place(layer, sharding)
                              for layer, sharding in zip(layers, shardings["layers"]))
        else:
            def split(stacked, layer_sharding):
                whole = place(stacked, NamedSharding(layer_sharding.mesh,
                                                     PartitionSpec(None, *layer_sharding.spec)))
                return [jax.device_put(whole[i], layer_sharding)
                        for i in range(whole.shape[0])]

            columns = jax.tree.map(split, layers, shardings["layers"][0])
            per_layer = tuple(jax.tree.map(lambda column, i=i: column[i], columns,
                                           is_leaf=lambda x: isinstance(x, list))
                              for i in range(self.config.num_layers))
        return {**params, "embedder": place(params["embedder"], shardings["embedder"]),
                "layers": per_layer}

    def release(self) -> None:
        """Free this rank's weights and KV pages (its rank closed); the engine is unusable
        afterwards. Compiled steps stay cached for the next engine on these devices."""
        if any(s is not None for s in self._slots):
            raise ValueError("release needs every decode slot free")
        self.pool.flush()
        self.params = None
        self._kv = None
        self._last_state = None

    def init_decode_state(self) -> DecodeState:
        ec = self.engine_config
        state = steps.init_decode_state(ec.max_slots, ec.max_pages_per_seq, ec.max_stop_tokens,
                                        self.pool.trash_page)
        self._last_state = jax.device_put(state, self._replicated)
        return self._last_state

    def prefill(self, params: Params, tokens: Sequence[int], task_id: Hashable = None,
                sampling: SamplingParams | None = None, request_id: Hashable = None) -> Prefix:
        """Compute the K/V of `tokens` not already cached and sample the first token.

        `task_id` names the multi-turn task (its pinned pages are reused); None makes the
        request its own task. Prompts longer than the largest bucket run in chunks. Raises
        `PoolFull` if the pool cannot hold the prompt (nothing changed).
        """
        pending = self.begin_prefill(tokens, task_id, sampling, request_id)
        return self.finish_prefills(params, [pending])[0]

    def begin_prefill(self, tokens: Sequence[int], task_id: Hashable = None,
                      sampling: SamplingParams | None = None, request_id: Hashable = None
                      ) -> PendingPrefill:
        """Host half of `prefill`: take the prompt's pages (reusing cached ones) now, so the
        next request's `can_prefill` sees them gone; `finish_prefills` computes. Raises
        `PoolFull` (nothing changed)."""
        ec = self.engine_config
        sampling = sampling or ec.sampling
        if len(sampling.stop_token_ids) > ec.max_stop_tokens:
            raise ValueError(f"at most {ec.max_stop_tokens} stop tokens per request")
        prompt = tuple(int(t) for t in tokens)
        if request_id is None:
            request_id = ("request", next(self._request_ids))
        if task_id is None:
            task_id = request_id
        if any(s is not None and s.task_id == task_id for s in self._slots):
            raise ValueError(f"task {task_id!r} is decoding in a slot")
        plan = self.pool.begin_turn(task_id, prompt)
        return PendingPrefill(request_id, task_id, prompt, sampling, plan.start, plan.write,
                              plan.cached_tokens, self.pool.page_row(task_id))

    def finish_prefills(self, params: Params, pending: Sequence[PendingPrefill]) -> list[Prefix]:
        """Compute begun prefills and sample their first tokens, in order. With
        `prefill_packing`, several requests' new tokens share each call (segment ids);
        otherwise one request at a time, padded to its bucket. On error every one of them
        is aborted (its pages released)."""
        try:
            if self.engine_config.prefill_packing:
                firsts = self._run_packed_prefills(params, pending)
            else:
                firsts = [self._run_prefill(params, p.prompt, p.start, p.write, p.page_row,
                                            p.sampling) for p in pending]
        except Exception:
            for p in pending:
                self.pool.abort_turn(p.task_id, kv_written=False)
            raise
        prefixes = []
        for p, first in zip(pending, firsts):
            self._counts["prompt"] += len(p.prompt)
            self._counts["cached"] += p.cached_tokens
            self._counts["computed"] += len(p.prompt) - p.start
            sampling = p.sampling
            row = SlotRow(length=np.int32(len(p.prompt)), page_row_P=p.page_row,
                          max_new=np.int32(sampling.max_new_tokens),
                          stop_S=self._stop_row(sampling),
                          temperature=np.float32(sampling.temperature),
                          top_k=np.int32(sampling.top_k), top_p=np.float32(sampling.top_p),
                          seed=np.uint32(sampling.seed))
            prefixes.append(Prefix(p.request_id, p.task_id, p.prompt, sampling, first, row,
                                   p.cached_tokens, len(p.prompt) - p.start))
        return prefixes

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Start decoding `prefix` in the free `slot` (donates `decode_state`)."""
        if self._slots[slot] is not None:
            raise ValueError(f"slot {slot} is busy; free_slot it first")
        if not self.pool.in_turn(prefix.task_id):
            raise ValueError(f"prefix of task {prefix.task_id!r} is no longer live")
        self._last_state = self._insert(decode_state, np.int32(slot), prefix.first, prefix.row)
        self._slots[slot] = _Slot(prefix.request_id, prefix.task_id,
                                  prefix.sampling.max_new_tokens)
        self._prompt_lens[slot] = len(prefix.prompt)
        s = prefix.sampling
        self._slot_sampling[slot] = (s.temperature, s.top_k, s.top_p)
        self._page_table_BP[slot] = prefix.row.page_row_P
        return self._last_state

    def generate(self, params: Params, decode_state: DecodeState, num_steps: int | None = None
                 ) -> tuple[DecodeState, ResultTokens]:
        """Up to `num_steps` (default `decode_steps_per_call`) tokens for every busy slot in
        one dispatch (donates `decode_state`; writes the KV pages). Results `[num_steps, B, 6]`.

        Pages for all `num_steps` tokens are reserved first; what a slot that stopped early
        did not use is given back when its turn ends. Raises `OutOfPages` (nothing
        dispatched) when a slot needs a page and none is free or evictable; the caller
        frees or preempts a slot and retries.
        """
        ec = self.engine_config
        num_steps = num_steps or ec.decode_steps_per_call
        pool, pages = self.pool, self.pool.pages
        plan, short, available = [], [], pool.available_pages()
        for slot, entry in enumerate(self._slots):
            if entry is None:
                continue
            held = pages.tokens(entry.task_id)
            # Never past what the slot can still write: its max new tokens, the max length.
            left = entry.max_new - 1 - entry.steps_dispatched
            reserve = max(0, min(num_steps, ec.max_seq_len - held, left))
            new_pages = pages.pages_for(held + reserve) - len(pages.pages(entry.task_id))
            if new_pages > available:
                short.append(slot)
            else:
                available -= new_pages
                plan.append((slot, entry.task_id, reserve))
        if short:
            raise OutOfPages(short)
        span = 1
        for slot, task, reserve in plan:
            if reserve > 0 and pool.grow(task, reserve):
                row = pages.pages(task)
                self._page_table_BP[slot, :len(row)] = row
            span = max(span, len(pages.pages(task)))
        span = next(b for b in self._span_buckets if b >= span)
        self._kv, state, result = self._generate(num_steps, span,
                                                 sampling_mode(self._slot_sampling), params,
                                                 self._kv, decode_state, self._page_table_BP.copy())
        self._counts["steps"] += num_steps
        for slot, _, _ in plan:
            self._slots[slot].steps_dispatched += num_steps
        self._last_state = state
        return state, result

    # ------------------------------------------------------------ slots and tasks
    def free_slot(self, decode_state: DecodeState, slot: int, tokens: Sequence[int] | None = None,
                  keep: bool | None = None) -> DecodeState:
        """End the request in `slot` (donates `decode_state`).

        `tokens`: the whole sequence (prompt + generated); its full pages are indexed for
        prefix reuse. `keep`: pin the task's pages for its next turn (True), release them
        to the evictable cache (False), or do what `pin`/`unpin` said during the turn (None).
        """
        entry = self._slots[slot]
        if entry is None:
            raise ValueError(f"slot {slot} is already free")
        # Pages may be handed out again right away: safe, because every later K/V writer
        # is ordered after this slot's last write through the donated pool.
        self.pool.end_turn(entry.task_id, tokens, keep)
        self._slots[slot] = None
        self._page_table_BP[slot] = self.pool.trash_page
        self._last_state = self._free(decode_state, np.int32(slot))
        return self._last_state

    def discard(self, prefix: Prefix) -> None:
        """Drop a prefilled request that will not be inserted (its pages are released)."""
        if any(s is not None and s.task_id == prefix.task_id for s in self._slots):
            raise ValueError("the prefix is inserted; use free_slot")
        self.pool.abort_turn(prefix.task_id)

    def preempt_slot(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop the request in `slot` without keeping anything it generated (recompute later)."""
        entry = self._slots[slot]
        if entry is None:
            raise ValueError(f"slot {slot} is already free")
        self._slots[slot] = None
        self._page_table_BP[slot] = self.pool.trash_page
        self._last_state = self._free(decode_state, np.int32(slot))
        self.pool.abort_turn(entry.task_id)
        return self._last_state

    def pin(self, task_id: Hashable) -> None:
        """Keep the task's pages resident across its env wait (at turn end if mid-turn)."""
        self.pool.pin(task_id)

    def unpin(self, task_id: Hashable) -> None:
        """The task's pages become evictable (still reusable until evicted)."""
        self.pool.unpin(task_id)

    def evict(self, task_id: Hashable) -> None:
        """Free the task's pages now (the task must not be decoding)."""
        self.pool.evict(task_id)

    def flush(self) -> tuple[Hashable, ...]:
        """Drop every cached prefix and pinned task (slots must be free). Returns the tasks."""
        if any(s is not None for s in self._slots):
            raise ValueError("flush needs every decode slot free")
        return self.pool.flush()

    def sync_weights(self, params: Params) -> tuple[Hashable, ...]:
        """New policy weights: place them and flush the K/V they make stale (on-policy RL
        flushes at every update). Returns the tasks whose pages were dropped."""
        dropped = self.flush()
        self.params = self.load_params(params)
        return dropped

    def slot_task(self, slot: int) -> Hashable | None:
        entry = self._slots[slot]
        return None if entry is None else entry.task_id

    def slot_steps_left(self, slot: int) -> int:
        """Generate steps that could still produce a token for `slot` (host-side bound:
        max new tokens and max length; a stop id ends it earlier on the device)."""
        entry = self._slots[slot]
        return 0 if entry is None else entry.steps_left(self.engine_config.max_seq_len,
                                                        self._prompt_lens[slot])

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is None]

    def can_prefill(self, task_id: Hashable, tokens: Sequence[int], headroom_pages: int = 0
                    ) -> bool:
        """Whether `prefill` would find pages now, leaving `headroom_pages` for decode."""
        need = self.pool.pages_needed(task_id, tokens)
        return need + headroom_pages <= self.pool.available_pages()

    # ------------------------------------------------------------ accounting
    def available_pages(self) -> int:
        """Pages obtainable for new tokens now: free + cached (evictable)."""
        return self.pool.available_pages()

    def pinned_tasks(self) -> tuple[Hashable, ...]:
        return tuple(t for t in self.pool.tasks() if self.pool.is_pinned(t))

    def accounting(self) -> PoolUsage:
        """Token counts of this rank: used (active), pinned, cached (evictable), free."""
        return self.pool.usage()

    def task_tokens(self, task_id: Hashable) -> int:
        """Tokens the task's live sequence holds on this rank (0 if none)."""
        return self.pool.pages.tokens(task_id)

    def metrics(self) -> EngineMetrics:
        """Counters; reads the device decode-token counter (a host sync, not for hot loops)."""
        usage = self.pool.usage()
        ps = self.engine_config.page_size
        decode_tokens = 0
        counter = None if self._last_state is None else self._last_state.decode_tokens
        if counter is not None and not getattr(counter, "is_deleted", lambda: False)():
            decode_tokens = int(counter)
        c = self._counts
        return EngineMetrics(
            prompt_tokens=c["prompt"], cached_prompt_tokens=c["cached"],
            prefill_tokens_computed=c["computed"], prefill_tokens_padded=c["padded"],
            prefill_calls=c["prefills"], decode_steps=c["steps"], decode_tokens=decode_tokens,
            evicted_pages=self.pool.counters().evicted_pages,
            pages_used=usage.used_tokens // ps, pages_pinned=usage.pinned_tokens // ps,
            pages_cached=usage.cached_tokens // ps, pages_free=usage.free_tokens // ps)

    def warm_up(self, params: Params | None = None,
                modes: Sequence[tuple[bool, bool]] = ((False, False), (False, True), (True, True)),
                steps_per_call: Sequence[int] | None = None) -> None:
        """Compile every shape steady serving can hit (each prefill bucket; generate at
        each attention span for each of `steps_per_call_options`; each sampling
        mode in `modes`: greedy, sampled, top-k/top-p) now, not in the middle of serving.
        `steps_per_call` narrows the tokens-per-call options (a benchmark timing one).
        Every write goes to the trash page; no slot may be busy."""
        if any(s is not None for s in self._slots):
            raise ValueError("warm_up needs every decode slot free")
        ec = self.engine_config
        params = self.params if params is None else params
        trash_row = np.full((ec.max_pages_per_seq,), self.pool.trash_page, np.int32)
        if ec.prefill_packing:
            for mode, bucket in itertools.product(modes, ec.prefill_buckets):
                self._kv, _ = self._packed_prefill(
                    mode, params, self._kv, *empty_packed_call(ec, bucket, self.pool.trash_page))
        else:
            for mode, bucket in itertools.product(modes, ec.prefill_buckets):
                self._kv, _ = self._prefill(
                    mode, params, self._kv, np.zeros((bucket,), np.int32), np.int32(1),
                    np.int32(0), trash_row, np.bool_(False), np.uint32(0), np.float32(0),
                    np.int32(0), np.float32(1), np.int32(1), self._stop_row(ec.sampling))
        for mode, num_steps, span in itertools.product(
                modes, steps_per_call or steps_per_call_options(ec.decode_steps_per_call),
                self._span_buckets):
            idle = jax.device_put(steps.init_decode_state(
                ec.max_slots, ec.max_pages_per_seq, ec.max_stop_tokens,
                self.pool.trash_page), self._replicated)
            self._kv, _, result = self._generate(num_steps, span, mode, params, self._kv, idle,
                                                 self._page_table_BP.copy())
        jax.block_until_ready(result.data)

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per step function (flat in steady state)."""
        return {name: fn._cache_size() for name, fn in (
            ("prefill", self._prefill), ("generate", self._generate), ("insert", self._insert),
            ("free", self._free), ("packed_prefill", self._packed_prefill))}

    # ------------------------------------------------------------ internals
    def _run_prefill(self, params, prompt, start, write, page_row, sampling) -> ResultTokens:
        ec = self.engine_config
        first = None
        biggest = ec.prefill_buckets[-1]
        while True:
            num_new = min(len(prompt) - start, biggest)
            bucket = ec.bucket_for(num_new)
            chunk = np.zeros((bucket,), np.int32)
            chunk[:num_new] = prompt[start:start + num_new]
            self._kv, first = self._prefill(
                sampling_mode([(sampling.temperature, sampling.top_k, sampling.top_p)]), params, self._kv, chunk, np.int32(num_new), np.int32(start), page_row,
                np.bool_(write), np.uint32(sampling.seed), np.float32(sampling.temperature),
                np.int32(sampling.top_k), np.float32(sampling.top_p),
                np.int32(sampling.max_new_tokens), self._stop_row(sampling))
            self._counts["padded"] += bucket
            self._counts["prefills"] += 1
            start += num_new
            if start >= len(prompt):
                return first

    def _run_packed_prefills(self, params, pending: Sequence[PendingPrefill]) -> list[ResultTokens]:
        """Pack the requests' new tokens into calls of rows of `prefill_row_tokens` (a call
        holds at most the largest bucket), splitting a request across calls where a call
        fills. A request pads only its last row; a call's unused rows pad it to its bucket.
        A request whose cached prefix lies on pages an earlier request has still to write
        (a GRPO sibling admitted with it) waits for a later call; the calls fill with the
        requests after it meanwhile. Returns each request's first token."""
        ec = self.engine_config
        row_tokens, ps = ec.prefill_row_tokens, ec.page_size
        capacity = ec.prefill_buckets[-1] // row_tokens  # rows per call
        firsts: list[ResultTokens | None] = [None] * len(pending)
        done = [p.start for p in pending]

        def pages_to_write(index: int) -> set[int]:
            p = pending[index]
            if not p.write or done[index] >= len(p.prompt):
                return set()
            return set(p.page_row[done[index] // ps:-(-len(p.prompt) // ps)].tolist())

        while any(d < len(p.prompt) for d, p in zip(done, pending)):
            call: list[tuple[int, int, int]] = []  # (request index, first token, tokens)
            room, written, unwritten = capacity, set(), set()
            for index, p in enumerate(pending):
                if room == 0:
                    break
                if done[index] < len(p.prompt):
                    cached_pages = set(p.page_row[:-(-done[index] // ps)].tolist())
                    if not cached_pages & (written | unwritten):
                        take = min(len(p.prompt) - done[index], room * row_tokens)
                        call.append((index, done[index], take))
                        if p.write:
                            written.update(p.page_row[done[index] // ps:
                                                      -(-(done[index] + take) // ps)].tolist())
                        done[index] += take
                        room -= -(-take // row_tokens)
                # What this request still writes after the call: later ones may not read it.
                unwritten |= pages_to_write(index)
            self._packed_call(params, pending, call, firsts)
        return firsts

    def _packed_call(self, params, pending, call, firsts) -> None:
        """One packed prefill call of `call`'s pieces, each over consecutive rows."""
        ec = self.engine_config
        row_tokens = ec.prefill_row_tokens
        used_rows = sum(-(-take // row_tokens) for _, _, take in call)
        arrays = empty_packed_call(ec, ec.bucket_for(used_rows * row_tokens),
                                   self.pool.trash_page)
        (tokens_RC, segment_R, position_R, num_real_R, cached_R, table_RP, write_R, sample_R,
         seed_R, temperature_R, top_k_R, top_p_R, max_new_R, stop_RS) = arrays
        row, sample_rows = 0, []
        for segment, (index, first, take) in enumerate(call):
            p = pending[index]
            s, stop = p.sampling, self._stop_row(p.sampling)
            for at in range(first, first + take, row_tokens):
                real = min(row_tokens, first + take - at)
                tokens_RC[row, :real] = p.prompt[at:at + real]
                segment_R[row], position_R[row], num_real_R[row] = segment, at, real
                cached_R[row], table_RP[row], write_R[row] = first, p.page_row, p.write
                seed_R[row], temperature_R[row], top_k_R[row], top_p_R[row] = (
                    s.seed, s.temperature, s.top_k, s.top_p)
                max_new_R[row], stop_RS[row] = s.max_new_tokens, stop
                row += 1
            if first + take == len(p.prompt):
                sample_R[row - 1] = True
                sample_rows.append((index, row - 1))
        mode = sampling_mode(zip(temperature_R.tolist(), top_k_R.tolist(), top_p_R.tolist()))
        self._kv, result = self._packed_prefill(mode, params, self._kv, *arrays)
        self._counts["padded"] += tokens_RC.size
        self._counts["prefills"] += 1
        for index, row in sample_rows:
            firsts[index] = ResultTokens(result.data[row:row + 1])

    def _stop_row(self, sampling: SamplingParams) -> np.ndarray:
        stop = np.full((self.engine_config.max_stop_tokens,), -1, np.int32)
        stop[: len(sampling.stop_token_ids)] = sampling.stop_token_ids
        return stop


# One compiled cast per (tree structure, dtype): a jit built per call would recompile at
# every weight load. Outputs keep the inputs' shardings.
_cast_on_device = jax.jit(cast_floating, static_argnums=1)


@functools.lru_cache(maxsize=16)
def _compiled_steps(config: ModelConfig, attention: str, page_size: int, max_seq_len: int,
                    kv_sharding: NamedSharding, replicated: NamedSharding):
    """The jitted steps, shared by engines of equal shapes so a rebuilt engine (new rank,
    new weights) does not recompile. Compiled lazily, once per input shape (bucket)."""
    kv_out = KVPages(kv_sharding, kv_sharding)
    attention = bind_kernel(attention, kv_sharding.mesh)
    # Static arguments: the sampling mode (all steps), and (num_steps, span_pages) of
    # generate. One executable per combination in use.
    prefill = jax.jit(
        functools.partial(steps.prefill_step, config, attention, page_size, max_seq_len),
        static_argnums=(0,), donate_argnums=(2,), out_shardings=(kv_out, replicated))
    generate = jax.jit(
        functools.partial(steps.generate_step, config, attention, page_size, max_seq_len),
        static_argnums=(0, 1, 2), donate_argnums=(4, 5),
        out_shardings=(kv_out, replicated, replicated))
    insert = jax.jit(steps.insert_step, donate_argnums=(0,), out_shardings=replicated)
    free = jax.jit(steps.free_step, donate_argnums=(0,), out_shardings=replicated)
    packed_prefill = jax.jit(
        functools.partial(steps.packed_prefill_step, config, page_size, max_seq_len),
        static_argnums=(0,), donate_argnums=(2,), out_shardings=(kv_out, replicated))
    return prefill, generate, insert, free, packed_prefill


def empty_packed_call(engine_config: EngineConfig, bucket: int, trash_page: int
                      ) -> tuple[np.ndarray, ...]:
    """The host arguments of a packed prefill call of `bucket` tokens (those of
    `steps.packed_prefill_step` after `kv`), every row empty: its writes go to the trash
    page."""
    ec = engine_config
    rows = bucket // ec.prefill_row_tokens
    return (np.zeros((rows, ec.prefill_row_tokens), np.int32),  # tokens
            np.full((rows,), -1, np.int32),  # segment
            np.zeros((rows,), np.int32),  # position of the row's first token
            np.zeros((rows,), np.int32),  # real tokens
            np.zeros((rows,), np.int32),  # cached length
            np.full((rows, ec.max_pages_per_seq), trash_page, np.int32),  # page table
            np.zeros((rows,), bool),  # write
            np.zeros((rows,), bool),  # sample
            np.zeros((rows,), np.uint32),  # seed
            np.zeros((rows,), np.float32),  # temperature
            np.zeros((rows,), np.int32),  # top_k
            np.ones((rows,), np.float32),  # top_p
            np.ones((rows,), np.int32),  # max new tokens
            np.full((rows, ec.max_stop_tokens), -1, np.int32))  # stop ids


def steps_per_call_options(most: int) -> tuple[int, ...]:
    """Tokens per generate call the loop may ask for: `most`, halved down to 1."""
    options = [most]
    while options[-1] > 1:
        options.append(options[-1] // 2)
    return tuple(options)


def span_buckets(max_pages_per_seq: int) -> tuple[int, ...]:
    """Attention spans (pages) a generate call compiles for: powers of two, then the max.
    A call reads the smallest holding its longest live sequence, so short batches read
    little and a growing batch compiles at most log2(Pmax) + 1 shapes."""
    spans, span = [], 1
    while span < max_pages_per_seq:
        spans.append(span)
        span *= 2
    return tuple(spans) + (max_pages_per_seq,)


def engine_shardings(config: ModelConfig, mesh: jax.sharding.Mesh):
    """(parameter shardings, KV page sharding, replicated) of a rank's engine on `mesh`;
    the parameters' in the engine's per-layer layout (`unstack_layers`)."""
    tensor = mesh.shape.get("tensor", 1)
    kv_spec = (PartitionSpec(None, None, None, "tensor", None)
               if tensor > 1 and config.num_kv_heads % tensor == 0 else PartitionSpec())
    stacked = param_shardings(config, mesh, ROLLOUT_RULES)
    # ROLLOUT_RULES leave the stacked layer axis unsplit: a layer's spec is the rest.
    layer = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s.spec[1:])),
                         stacked["layers"])
    return ({"embedder": stacked["embedder"], "layers": (layer,) * config.num_layers},
            NamedSharding(mesh, kv_spec), NamedSharding(mesh, PartitionSpec()))


def rank_mesh(devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """A rollout rank's mesh: its devices in one tensor-parallel group."""
    return make_mesh(list(devices), data=1, fsdp=1, tensor=len(devices))


def make_engine(config: ModelConfig, params: Params, devices: Sequence[jax.Device] | None = None,
                engine_config: EngineConfig | None = None) -> Engine:
    """An engine on one rollout rank: `devices` form a tensor-parallel mesh (topology is
    data). Parameters shard by ROLLOUT_RULES; KV pages on kv heads when they divide."""
    devices = list(devices) if devices is not None else jax.devices()[:1]
    return Engine(config, engine_config or EngineConfig(), rank_mesh(devices), params)
