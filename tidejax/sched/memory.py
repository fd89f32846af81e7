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

Layouts are refused, not silently replicated, when a sharded dimension does not divide
the mesh (:func:`undivided`): the trainer's model dim over its devices, a rollout rank's
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

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "ffn", "layers", "heads", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive")
        if self.compute_bytes not in (2, 4):
            raise ValueError("ModelShape.compute_bytes must be 2 or 4")

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
    if trainer_devices > 1 and shape.d_model % trainer_devices:
        bad.append(f"hidden_size {shape.d_model} over {trainer_devices} trainer devices")
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
    layer_scores = MASTER_BYTES * rows * shape.heads * batch.row_len ** 2 / 2  # causal blocks
    return {
        # gradients of the whole model before they join the accumulator (sharded)
        "grads": MASTER_BYTES * shape.params / devices,
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
        "saved_scores": saved * layer_scores,
        # one chunk of float32 logits
        "logits": MASTER_BYTES * rows * min(logprob_chunk, batch.row_len) * shape.vocab,
        # float32 copies of the final hidden states
        "hidden": MASTER_BYTES * tokens * d,
        "one": 1.0,
    }


# Fitted by `python -m tidejax.bench.memory --calibrate` (least squares, relative error)
# over compiled peaks at Qwen2.5-0.5B and 7B shapes, 7B also at full depth and the GPU
# config's batch (`TRAINER_CALIBRATION`, `ENGINE_CALIBRATION` there; packed prefill), on
# jax 0.10.2, 2026-12-04; see the module docstring.
TRAINER_COEFFS: dict[str, dict[str, float]] = {
    "sft": {"tables": 0.5923, "layer_scores": 2.463, "saved_acts": 1.864, "logits": 1.767,
        "hidden": 18.27, "grads": 1.0},
    "fused": {"tables": 0.4836, "layer_scores": 2.225, "saved_acts": 1.826, "logits": 1.566,
        "hidden": 26.41, "grads": 1.0},
    "forward": {"grads": 0.2843, "tables": 0.3177, "layer": 0.4471, "carry": 2.424,
        "layer_scores": 2.452, "saved_acts": 1.754, "saved_scores": 2.684, "logits": 0.559},
    "backward": {"tables": 0.5157, "layer": 0.2443, "carry": 2.791, "layer_scores": 2.189,
        "saved_acts": 3.86, "saved_scores": 0.4246, "logits": 1.112, "hidden": 31.58,
        "grads": 1.0},
    "ref_colocated": {"tables": 0.2952, "layer": 0.2823, "layer_scores": 1.423,
        "saved_scores": 0.02353, "logits": 0.4217},
    "update": {"tables": 2.285e-06, "layer": 5.915e-05, "carry": 0.001196,
        "saved_scores": 1.316e-05, "one": 8436.0, "grads": 1.0},
    "ref": {"tables": 0.2528, "layer": 0.3296, "layer_scores": 1.312, "saved_scores": 0.03102,
        "logits": 0.5296},
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
    state = MASTER_BYTES * shape.params / devices
    kinds = {"params": state, "optimizer": 2 * state, "grads": state}
    if step in ("sft",):
        kinds["grads"] = 0.0  # the SFT step folds gradients into the update
    if step == "ref_colocated":
        kinds["ref"] = shape.compute_bytes * shape.params / devices
    # eight [B, T] 4-byte arrays (the batch and the reference log-probs); not the update's
    batch_bytes = 0.0 if step == "update" else 32.0 * batch.rows * batch.row_len / devices
    kinds["activations"] = batch_bytes + _linear(coeffs.get(step, {}),
                                                 trainer_features(shape, devices, batch))
    return Footprint(kinds)


def ref_step(shape: ModelShape, devices: int, batch: TrainerBatch,
             coeffs: dict[str, dict[str, float]] | None = None) -> Footprint:
    """Per-device peak of a decoupled reference forward on its own ``devices``."""
    coeffs = TRAINER_COEFFS if coeffs is None else coeffs
    kinds = {"ref": shape.compute_bytes * shape.params / devices,
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
