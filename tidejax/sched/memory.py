"""Memory model: per-device bytes of every role the job runs, and which layouts fit.

Pure arithmetic (no jax), so the start-up validation, ERS and the static planner can ask
it cheaply. For a model shape, a device memory size and a role layout it gives each step's
per-device peak as bytes by kind:

- ``params`` / ``optimizer`` / ``grads``: the trainer's float32 master weights, Adam's two
  float32 moments and the float32 gradient accumulator, sharded over the FSDP mesh
  (``TRAIN_RULES``: the vocabulary or the model dim over ``fsdp``). Exact.
- ``ref``: the reference's compute-dtype weights where a step holds them. Exact.
- ``activations``: what a trainer step allocates beyond its inputs (the new gradients
  before they join the accumulator, the FSDP all-gathered weights and their unsharded
  gradients, the layer activations remat keeps or recomputes, log-prob chunks).
- ``kv`` / ``engine_temp``: a rollout rank's KV pages (exact) and its prefill / decode
  temporaries.

``activations`` and ``engine_temp`` are linear in a few shape features
(:func:`trainer_features`, :func:`engine_features`) with coefficients fitted to the
compiled steps' ``memory_analysis()`` at Qwen2.5-0.5B and 7B shapes
(``python -m tidejax.bench.memory --calibrate``; jax 0.10.2, XLA CPU on fake devices, less
the float32 copies of bf16 operands only the CPU compiler makes). They are within 15% (or
0.25 GiB) of the compiled peaks at tiny, 0.5B, 7B and 14B shapes, fitted on or not
(``tests/sched/test_memory_calibration.py``); ``python -m tidejax.bench.memory`` reports
the error at the job's full shapes. The GPU compiler's buffer assignment differs, which is
what the default ``memory_fraction`` of 0.75 leaves room for; no GPU has checked it yet.

Trainers store the model dim padded (:func:`storage_dim`) so that it divides every
trainer mesh size the job may choose, within ``MAX_STORAGE_PADDING``; layouts are refused,
not silently replicated, when a sharded dimension still does not divide the mesh
(:func:`undivided`): the trainer's stored model dim over its devices, a rollout rank's
heads, KV heads, MLP and vocabulary over its tensor-parallel devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GIB = 1 << 30
UNBOUNDED_BYTES = float("inf")  # capacity when the device reports none (CPU)
MASTER_BYTES = 4  # float32 master weights, gradients and each Adam moment
TRAINER_STEPS = ("sft", "fused", "forward", "backward", "ref_colocated", "update")
ENGINE_STEPS = ("prefill", "decode")
DECODE_LOOP_POOL_COPIES = 2  # see engine_step
# Trainers pad the stored model dim by at most this share to make it divide more mesh
# sizes [A]: 1% of the state costs less than one mesh size lost to ERS (Qwen2.5-14B's
# 5,120 -> 5,160 is 0.8% and admits 3 and 6 devices; 7 would need 5,880, 15%).
MAX_STORAGE_PADDING = 0.01
# The training attention's query block and the row length from which its blocks run in a
# loop with one block's scores alive (``models.model.ATTENTION_BLOCK`` and
# ``ATTENTION_LOOP_FROM``; a test keeps them equal).
ATTENTION_BLOCK = 256
ATTENTION_LOOP_FROM = 2048


def storage_dim(d_model: int, mesh_sizes, max_padding: float | None = None) -> int:
    """The model dim a trainer stores: the smallest size >= ``d_model`` within
    ``max_padding`` (default ``MAX_STORAGE_PADDING``) that keeps every mesh size dividing
    ``d_model`` and adds the most of the others in ``mesh_sizes`` (``d_model`` itself when
    padding adds none)."""
    if max_padding is None:
        max_padding = MAX_STORAGE_PADDING
    sizes = sorted(set(mesh_sizes))
    kept = [n for n in sizes if d_model % n == 0]
    best, best_count = d_model, len(kept)
    for stored in range(d_model + 1, int(d_model * (1 + max_padding)) + 1):
        if any(stored % n for n in kept):
            continue
        count = sum(1 for n in sizes if stored % n == 0)
        if count > best_count:
            best, best_count = stored, count
    return best


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Qwen2-style decoder's dimensions (``ModelConfig`` fields, read by name)."""

    vocab: int
    d_model: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    compute_bytes: int  # 2 for bf16 compute, 4 for float32
    stored_d_model: int = 0  # the model dim trainers store (padded); 0: ``d_model``

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "ffn", "layers", "heads", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive")
        if self.compute_bytes not in (2, 4):
            raise ValueError("ModelShape.compute_bytes must be 2 or 4")
        if self.stored_d_model and self.stored_d_model < self.d_model:
            raise ValueError("ModelShape.stored_d_model must be 0 or >= d_model")

    @classmethod
    def of(cls, config) -> ModelShape:
        """From a ``tidejax.models.ModelConfig`` (duck-typed: this module imports no jax)."""
        return cls(vocab=config.vocab_size, d_model=config.hidden_size,
                   ffn=config.intermediate_size, layers=config.num_layers,
                   heads=config.num_heads, kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, tied=config.tie_word_embeddings,
                   compute_bytes=4 if config.dtype == "float32" else 2)

    @property
    def layer_params(self) -> int:
        d, q, kv = self.d_model, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = d * q + 2 * d * kv + q * d + q + 2 * kv  # q/k/v/o kernels, q/k/v biases
        return attention + 3 * d * self.ffn + 2 * d  # gate/up/down, two norms

    @property
    def table_params(self) -> int:
        """Embedding table plus the output head when it is not tied."""
        return self.vocab * self.d_model * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.table_params + self.d_model

    def stored_for(self, mesh_sizes) -> ModelShape:
        """This shape with the model dim trainers store for these mesh sizes
        (:func:`storage_dim`)."""
        return replace(self, stored_d_model=storage_dim(self.d_model, mesh_sizes))

    @property
    def trainer_d_model(self) -> int:
        return self.stored_d_model or self.d_model

    @property
    def stored_params(self) -> int:
        """Parameters a trainer stores (padded model dim)."""
        return replace(self, d_model=self.trainer_d_model, stored_d_model=0).params

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.compute_bytes


@dataclass(frozen=True, slots=True)
class TrainerBatch:
    """The largest micro-batch a trainer step sees: ``rows`` rows of ``row_len`` tokens
    over the whole mesh (:func:`trainer_rows` of the token budget)."""

    rows: int
    row_len: int
    remat: bool

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.row_len <= 0:
            raise ValueError("TrainerBatch.rows and row_len must be positive")


def trainer_rows(micro_batch_tokens: int, row_len: int, data_parallel: int) -> int:
    """The most rows the trainer runner builds for one micro-batch: each rank's share of
    the token budget plus one row of packing slack, rounded up to the power of two the
    runner buckets rows to, times the data-parallel size."""
    per_rank = -(-micro_batch_tokens // (data_parallel * row_len)) + 1
    return data_parallel * (1 << max(0, math.ceil(math.log2(per_rank))))


@dataclass(frozen=True, slots=True)
class EngineShape:
    """One rollout rank's engine (``serving.EngineConfig`` fields, read by name)."""

    num_pages: int
    page_size: int
    max_slots: int
    max_seq_len: int
    prefill_chunk: int  # the largest prefill bucket
    decode_steps_per_call: int = 1  # tokens each decode dispatch runs on the device

    @classmethod
    def of(cls, engine_config) -> EngineShape:
        return cls(num_pages=engine_config.num_pages, page_size=engine_config.page_size,
                   max_slots=engine_config.max_slots, max_seq_len=engine_config.max_seq_len,
                   prefill_chunk=engine_config.prefill_buckets[-1],
                   decode_steps_per_call=engine_config.decode_steps_per_call)


@dataclass(frozen=True, slots=True)
class Footprint:
    """Per-device bytes of one step, by kind."""

    by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.by_kind.values())

    def fits(self, capacity_bytes: float) -> bool:
        return self.total <= capacity_bytes

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.by_kind.items() if v)
        return f"{self.total / GIB:.1f} GiB ({parts})"


# -- divisibility --------------------------------------------------------------------
def undivided(shape: ModelShape, trainer_devices: int = 1, tensor: int = 1) -> list[str]:
    """Sharded dimensions that a trainer mesh of ``trainer_devices`` (FSDP over the model
    dim) or a rollout rank of ``tensor`` devices does not divide; empty when it fits."""
    bad = []
    if trainer_devices > 1 and shape.trainer_d_model % trainer_devices:
        stored = ("" if shape.trainer_d_model == shape.d_model
                  else f" (stored as {shape.trainer_d_model})")
        bad.append(f"hidden_size {shape.d_model}{stored} over {trainer_devices} trainer devices")
    if tensor > 1:
        for name, dim in (("num_heads", shape.heads), ("num_kv_heads", shape.kv_heads),
                          ("intermediate_size", shape.ffn), ("vocab_size", shape.vocab)):
            if dim % tensor:
                bad.append(f"{name} {dim} over {tensor} tensor-parallel devices")
    return bad


# -- trainer ---------------------------------------------------------------------------
def trainer_features(shape: ModelShape, devices: int, batch: TrainerBatch,
                     logprob_chunk: int = 128) -> dict[str, float]:
    """Per-device shape features the trainer's temporaries are linear in (bytes)."""
    cb, d = shape.compute_bytes, shape.d_model
    tokens = batch.rows * batch.row_len / devices  # per device
    rows = batch.rows / devices
    saved = 0 if batch.remat else shape.layers  # layers whose insides stay alive
    layer_acts = cb * tokens * (4 * d + 3 * shape.ffn)  # q/k/v/o and MLP intermediates
    looped = (batch.row_len >= ATTENTION_LOOP_FROM and batch.row_len > ATTENTION_BLOCK
              and batch.row_len % ATTENTION_BLOCK == 0)
    if looped:  # one query block against every key; recomputed, never kept
        layer_scores = MASTER_BYTES * rows * shape.heads * ATTENTION_BLOCK * batch.row_len
    else:  # every causal block at once
        layer_scores = MASTER_BYTES * rows * shape.heads * batch.row_len ** 2 / 2
    saved_scores = 0 if looped else saved * layer_scores
    return {
        # gradients of the whole model before they join the accumulator (sharded)
        "grads": MASTER_BYTES * shape.stored_params / devices,
        # the tables in the compute dtype and their float32 gradients: sharded when the
        # vocabulary divides the mesh, else all-gathered whole (TRAIN_RULES)
        "tables": (cb + MASTER_BYTES) * shape.table_params / (
            devices if shape.vocab % devices == 0 else 1),
        # one layer all-gathered, and its unsharded float32 gradient
        "layer": (cb + MASTER_BYTES) * shape.layer_params,
        # the residual stream each layer keeps for the backward
        "carry": cb * tokens * d * shape.layers,
        # one layer's inside while it runs (or is recomputed under remat) ...
        "layer_acts": layer_acts,
        "layer_scores": layer_scores,
        # ... and every layer's, kept for the backward without remat
        "saved_acts": saved * layer_acts,
        "saved_scores": saved_scores,
        # one chunk of float32 logits
        "logits": MASTER_BYTES * rows * min(logprob_chunk, batch.row_len) * shape.vocab,
        # float32 copies of the final hidden states
        "hidden": MASTER_BYTES * tokens * d,
        "one": 1.0,
    }


# Fitted by `python -m tidejax.bench.memory --calibrate` (least squares, relative error)
# over compiled peaks at Qwen2.5-0.5B and 7B shapes, 7B and 14B also at full depth and the
# GPU configs' batch (`TRAINER_CALIBRATION`, `ENGINE_CALIBRATION` there; packed prefill,
# layer-by-layer deferred backward, looped attention from 2,048 tokens), on jax 0.10.2,
# 2026-12-04; see the module docstring.
TRAINER_COEFFS: dict[str, dict[str, float]] = {
    "sft": {"tables": 0.5808, "carry": 0.09799, "layer_acts": 1.921, "layer_scores": 4.168,
        "saved_acts": 1.086, "saved_scores": 0.8067, "grads": 1.0},
    "fused": {"tables": 0.4899, "layer": 0.06198, "layer_acts": 1.665,
        "layer_scores": 4.245, "saved_acts": 1.034, "saved_scores": 0.8313, "hidden": 3.7,
        "grads": 1.0},
    "forward": {"grads": 0.8226, "tables": 0.3321, "layer": 0.3394, "carry": 1.266,
        "layer_acts": 1.048, "saved_acts": 2.286, "saved_scores": 2.408, "logits": 0.8415,
        "hidden": 1.005, "one": 37710000.0},
    "backward": {"tables": 0.5167, "layer": 0.814, "carry": 3.187, "layer_acts": 1.25,
        "layer_scores": 4.716, "saved_acts": 2.748, "saved_scores": 1.097, "hidden": 8.24,
        "grads": 1.0},
    "ref_colocated": {"tables": 0.3003, "layer_acts": 1.279, "layer_scores": 1.035,
        "saved_acts": 0.003771},
    "update": {"tables": 1.905e-06, "layer": 5.639e-05, "carry": 0.001255,
        "saved_acts": 1.516e-05, "one": 8172.0, "grads": 1.0},
    "ref": {"tables": 0.2642, "layer": 0.04488, "layer_acts": 1.147, "layer_scores": 1.148,
        "saved_acts": 0.02135},
}
ENGINE_COEFFS: dict[str, dict[str, float]] = {
    "prefill": {"slots_gather": 0.1091, "prefill_acts": 3.731, "prefill_scores": 3.055},
    "decode": {"slots_gather": 0.8771, "seq_gather": 6.55, "prefill_acts": 0.1286,
        "prefill_scores": 0.03566, "slot_logits": 3.74},
}


def _linear(coeffs: dict[str, float], features: dict[str, float]) -> float:
    return max(0.0, sum(coeffs.get(k, 0.0) * v for k, v in features.items()))


def trainer_step(shape: ModelShape, devices: int, batch: TrainerBatch, step: str,
                 coeffs: dict[str, dict[str, float]] | None = None) -> Footprint:
    """Per-device peak of one trainer step on an FSDP mesh of ``devices``."""
    if step not in TRAINER_STEPS:
        raise ValueError(f"unknown trainer step {step!r}; known: {TRAINER_STEPS}")
    coeffs = TRAINER_COEFFS if coeffs is None else coeffs
    state = MASTER_BYTES * shape.stored_params / devices
    kinds = {"params": state, "optimizer": 2 * state, "grads": state}
    if step in ("sft",):
        kinds["grads"] = 0.0  # the SFT step folds gradients into the update
    if step == "ref_colocated":
        kinds["ref"] = shape.compute_bytes * shape.stored_params / devices
    # eight [B, T] 4-byte arrays (the batch and the reference log-probs); not the update's
    batch_bytes = 0.0 if step == "update" else 32.0 * batch.rows * batch.row_len / devices
    kinds["activations"] = batch_bytes + _linear(coeffs.get(step, {}),
                                                 step_features(shape, devices, batch, step))
    return Footprint(kinds)


def step_features(shape: ModelShape, devices: int, batch: TrainerBatch, step: str
                  ) -> dict[str, float]:
    """`trainer_features` as one step sees them: under remat the deferred backward adds
    each layer's gradients into the accumulator in place (``deferred.
    actor_backward_layerwise``), so it holds no whole new gradient tree."""
    features = trainer_features(shape, devices, batch)
    if step == "backward" and batch.remat:
        features["grads"] = 0.0
    return features


def ref_step(shape: ModelShape, devices: int, batch: TrainerBatch,
             coeffs: dict[str, dict[str, float]] | None = None) -> Footprint:
    """Per-device peak of a decoupled reference forward on its own ``devices``."""
    coeffs = TRAINER_COEFFS if coeffs is None else coeffs
    kinds = {"ref": shape.compute_bytes * shape.stored_params / devices,
             "activations": 32.0 * batch.rows * batch.row_len / devices + _linear(
                 coeffs.get("ref", {}), trainer_features(shape, devices, batch))}
    return Footprint(kinds)


def trainer_peak(shape: ModelShape, devices: int, batch: TrainerBatch,
                 coeffs: dict[str, dict[str, float]] | None = None) -> Footprint:
    """The largest step footprint of an actor mesh of ``devices``."""
    return max((trainer_step(shape, devices, batch, s, coeffs) for s in TRAINER_STEPS),
               key=lambda f: f.total)


# -- rollout ---------------------------------------------------------------------------
def engine_features(shape: ModelShape, tensor: int, engine: EngineShape) -> dict[str, float]:
    cb = shape.compute_bytes
    kv_per_layer_token = 2 * shape.kv_heads * shape.head_dim * cb / tensor
    return {
        # decode gathers every slot's pages over the whole max sequence, one layer at a time
        "slots_gather": engine.max_slots * engine.max_seq_len * kv_per_layer_token,
        # prefill gathers its one sequence's pages
        "seq_gather": engine.max_seq_len * kv_per_layer_token,
        "prefill_acts": engine.prefill_chunk * (shape.d_model + shape.ffn / tensor) * cb,
        "prefill_scores": (engine.prefill_chunk * engine.max_seq_len * shape.heads / tensor
                           * MASTER_BYTES),
        "slot_logits": engine.max_slots * shape.vocab / tensor * MASTER_BYTES,
        "one": 1.0,
    }


def engine_step(shape: ModelShape, tensor: int, engine: EngineShape, step: str,
                coeffs: dict[str, dict[str, float]] | None = None) -> Footprint:
    """Per-device peak of a rollout rank of ``tensor`` devices: weights, KV pages, temps."""
    if step not in ENGINE_STEPS:
        raise ValueError(f"unknown engine step {step!r}; known: {ENGINE_STEPS}")
    coeffs = ENGINE_COEFFS if coeffs is None else coeffs
    kv_split = tensor if shape.kv_heads % tensor == 0 else 1
    kv = ((engine.num_pages + 1) * engine.page_size * shape.kv_bytes_per_token() / kv_split)
    temp = _linear(coeffs.get(step, {}), engine_features(shape, tensor, engine))
    if step == "decode" and engine.decode_steps_per_call > 1:
        # Two more copies of the pool, as compiled on CPU by bench.memory on 2026-12-02 (7B,
        # 12,288 pages: 46.1 GiB against 25.3 without them). They may be the CPU compiler's
        # alone: it runs bf16 pool updates in float32 (a float32 copy of the pool converted
        # in and back inside the loop), and a float32 engine compiles with no pool-sized
        # temporaries (0.5B at 2 layers, 32,768 pages, 1 or 8 tokens per call: 74 / 78 MiB
        # of temporaries in float32, 1,676 / 1,679 MiB in bf16 beside a 512 MiB bf16 pool).
        # Kept, so no plan overfills a GPU, until scripts/gpu_check.sh compiles it on one.
        temp += DECODE_LOOP_POOL_COPIES * kv
    return Footprint({"params": shape.compute_bytes * shape.params / tensor, "kv": kv,
                      "engine_temp": temp})


def max_pages(shape: ModelShape, tensor: int, engine: EngineShape, capacity_bytes: float
              ) -> int:
    """The largest KV pool (pages) a rollout rank holds within ``capacity_bytes`` (every
    step's footprint grows with the pool, at its own rate: a bisection)."""
    def fits(pages: int) -> bool:
        return engine_peak(shape, tensor, replace(engine, num_pages=pages)).fits(capacity_bytes)

    if not fits(0):
        return 0
    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def engine_peak(shape: ModelShape, tensor: int, engine: EngineShape,
                coeffs: dict[str, dict[str, float]] | None = None) -> Footprint:
    return max((engine_step(shape, tensor, engine, s, coeffs) for s in ENGINE_STEPS),
               key=lambda f: f.total)


# -- layouts ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JobMemory:
    """What the memory model needs to judge the job's layouts on one kind of device."""

    shape: ModelShape
    micro_batch_tokens: int
    row_len: int
    remat: bool
    engine: EngineShape
    capacity_bytes: float  # per device: the memory fraction of the device's memory
    rollout_tensor: int = 1  # devices per rollout rank

    def batch(self, trainer_devices: int) -> TrainerBatch:
        rows = trainer_rows(self.micro_batch_tokens, self.row_len, trainer_devices)
        return TrainerBatch(rows, self.row_len, self.remat)

    def actor(self, devices: int) -> Footprint:
        return trainer_peak(self.shape, devices, self.batch(devices))

    def ref(self, devices: int) -> Footprint:
        return ref_step(self.shape, devices, self.batch(devices))

    def rollout(self) -> Footprint:
        return engine_peak(self.shape, self.rollout_tensor, self.engine)

    def actor_fits(self, devices: int) -> bool:
        return (not undivided(self.shape, trainer_devices=devices)
                and self.actor(devices).fits(self.capacity_bytes))

    def ref_fits(self, devices: int) -> bool:
        return (not undivided(self.shape, trainer_devices=devices)
                and self.ref(devices).fits(self.capacity_bytes))

    def rollout_fits(self) -> bool:
        return (not undivided(self.shape, tensor=self.rollout_tensor)
                and self.rollout().fits(self.capacity_bytes))

    def ref_stays_beside(self, actor_devices: int) -> bool:
        """Whether the reference's compute copy can stay on an actor mesh of
        ``actor_devices`` beside its largest step. Only with a known capacity: where the
        device reports none (CPU) the reference is copied in when needed, as where it does
        not fit."""
        if self.capacity_bytes >= UNBOUNDED_BYTES:
            return False
        return (self.actor(actor_devices).total + self.ref_copy_bytes(actor_devices)
                <= self.capacity_bytes)

    def ref_copy_bytes(self, devices: int) -> float:
        """Per-device bytes of the reference's compute copy on a trainer mesh."""
        return self.shape.compute_bytes * self.shape.stored_params / devices

    def actor_sizes(self, max_devices: int) -> tuple[int, ...]:
        """Actor mesh sizes (devices) whose every step fits and divides the model."""
        return tuple(n for n in range(1, max_devices + 1) if self.actor_fits(n))

    def ref_sizes(self, max_devices: int) -> tuple[int, ...]:
        return tuple(n for n in range(1, max_devices + 1) if self.ref_fits(n))

    def partitions(self, devices: int, min_rollout: int = 1) -> list[tuple[int, int, int]]:
        """Every (rollout ranks, ref devices, actor devices) layout of ``devices`` that
        fits: the partitions ERS may choose."""
        if not self.rollout_fits():
            return []
        refs = (0, *self.ref_sizes(devices))
        out = []
        for actor in self.actor_sizes(devices):
            for ref in refs:
                left = devices - actor - ref
                ranks = left // self.rollout_tensor
                if ranks >= min_rollout and ranks * self.rollout_tensor == left:
                    out.append((ranks, ref, actor))
        return out

    def problems(self, rollout_ranks: int, actor_devices: int, ref_devices: int = 0
                 ) -> list[str]:
        """Why a layout does not fit (empty when it does): each names the role and bytes."""
        cap = self.capacity_bytes / GIB
        roles = [("actor", actor_devices, undivided(self.shape, trainer_devices=actor_devices),
                  self.actor)]
        if ref_devices:
            roles.append(("reference", ref_devices,
                          undivided(self.shape, trainer_devices=ref_devices), self.ref))
        if rollout_ranks:
            roles.append(("rollout rank", self.rollout_tensor,
                          undivided(self.shape, tensor=self.rollout_tensor),
                          lambda _: self.rollout()))
        out = []
        for role, n, bad, footprint in roles:
            out += [f"{role}: {p}" for p in bad]
            peak = footprint(n)
            if not bad and not peak.fits(self.capacity_bytes):
                out.append(f"{role} on {n} device(s) needs {peak.describe()} per device, "
                           f"over {cap:.1f} GiB")
        return out
