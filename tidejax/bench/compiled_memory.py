"""Per-device peak bytes of the job's compiled step functions, ahead of time.

Every step is lowered on abstract arrays (`jax.ShapeDtypeStruct` with the job's own
shardings) and compiled; nothing is materialised, so 7B and 14B shapes compile on CPU
fake devices. A step's peak is what its devices hold while it runs: the program's
arguments, temporaries and non-aliased outputs (`memory_analysis()`), plus what the job
keeps resident beside it that the program does not take as an argument (the Adam moments
during a gradient step; the forward's residuals during the deferred backward).

Depth: layers run under `lax.scan`, so a step's bytes are affine in the layer count.
`layers=(a, b)` compiles at two depths and extrapolates to the model's own depth; that
keeps a 48-layer compile at the cost of two shallow ones (`extrapolate`).
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tidejax.models.config import ModelConfig
from tidejax.models.model import abstract_params, cast_floating, unstack_layers
from tidejax.models.sharding import make_mesh
from tidejax.rl.batch import Batch
from tidejax.rl.config import RLConfig
from tidejax.rl.trainer import make_trainer
from tidejax.serving import steps as serving_steps
from tidejax.serving.config import EngineConfig
from tidejax.serving.engine import (
    _compiled_steps,
    empty_packed_call,
    engine_shardings,
    rank_mesh,
)
from tidejax.serving.kv_pool import KVPages



def device_bytes(tree) -> int:
    """Bytes one device holds of abstract (or concrete) sharded arrays."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


# XLA CPU runs some bf16 operations (dots inside loops, scatters) in float32: it inserts
# whole-array conversions of bf16 operands, hoisted out of the layer loop, so a bf16
# engine's CPU compile holds float32 copies of its stacked weights and KV pool that a GPU
# compile (native bf16) does not. They are top-level `wrapped_convert` fusions with a
# float32 result; `cpu_upcast_bytes` adds them up so the report can show both figures
# (an upper bound on what they add to the peak: liveness is not visible from here).
_UPCAST = re.compile(r"= f32\[([0-9,]*)\]\S* fusion\(%[\w.\-]+\), kind=kLoop, "
                     r"calls=%wrapped_convert")


def cpu_upcast_bytes(compiled) -> int:
    """Bytes of the float32 conversions XLA CPU adds at the top level of a program."""
    text = compiled.as_text()
    total = 0
    for match in _UPCAST.finditer(text[text.index("\nENTRY"):]):
        dims = [int(d) for d in match.group(1).split(",") if d]
        total += 4 * math.prod(dims)
    return total


class Peak(NamedTuple):
    """A program's per-device peak as compiled, and what of it is CPU-only upcasts."""

    compiled: int
    upcast: int

    @property
    def gpu_like(self) -> int:
        return self.compiled - self.upcast

    def plus(self, resident: int) -> Peak:
        return Peak(self.compiled + resident, self.upcast)


def _program(compiled) -> Peak:
    m = compiled.memory_analysis()
    raw = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
           - m.alias_size_in_bytes)
    # Not every conversion is live at the peak, so at most the temporaries come off: the
    # arguments and outputs stay whole whatever the compiler did in between.
    return Peak(raw, min(cpu_upcast_bytes(compiled), m.temp_size_in_bytes))


def _abstract_batch(rows: int, row_len: int, sharding) -> tuple[Batch, jax.ShapeDtypeStruct]:
    """A `[rows, row_len]` Batch and a float `[rows, row_len]` array, both abstract."""
    tokens = jax.ShapeDtypeStruct((rows, row_len), jnp.int32, sharding=sharding)
    values = jax.ShapeDtypeStruct((rows, row_len), jnp.float32, sharding=sharding)
    return Batch(tokens=tokens, positions=tokens, segment_ids=tokens, loss_mask=values,
                 advantages=values, behaviour_logp=values, policy_version=tokens), values


def trainer_peaks(model_config: ModelConfig, rl_config: RLConfig, devices, rows: int,
                  row_len: int, stored_d_model: int | None = None) -> dict[str, Peak]:
    """Per-device peak bytes of each trainer step on an FSDP mesh over `devices` (storing
    the model dim padded to `stored_d_model`, as the job's trainers do)."""
    mesh = make_mesh(list(devices), data=1, fsdp=-1, tensor=1)
    trainer = make_trainer(model_config, rl_config, mesh, stored_d_model=stored_d_model)
    state = trainer.abstract_state()
    accum = jax.eval_shape(trainer._zero)  # carries the jit's out_shardings
    batch, values = _abstract_batch(rows, row_len, trainer.batch_sharding)
    denom = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    compute = _abstract(jax.eval_shape(functools.partial(
        cast_floating, dtype=model_config.jnp_dtype), state.params), trainer.param_shardings)
    opt_bytes = device_bytes(state.opt_state)
    params_bytes = device_bytes(state.params)
    accum_bytes = device_bytes(accum)

    peaks = {}
    # SFT: the whole state goes in (donated) and comes out; nothing else is resident.
    peaks["sft"] = _program(trainer._sft_step.lower(state, batch, denom).compile())
    # Colocated: the reference's compute copy visits the actor mesh beside the state.
    ref = trainer._ref.lower(compute, batch).compile()
    peaks["ref_colocated"] = _program(ref).plus(params_bytes + opt_bytes + accum_bytes)
    fused = trainer._fused.lower(state.params, batch, values, denom, accum).compile()
    peaks["fused"] = _program(fused).plus(opt_bytes)
    forward = trainer._forward.lower(state.params, batch).compile()
    peaks["forward"] = _program(forward).plus(opt_bytes + accum_bytes)
    # The backward takes the pullback; its residuals that are the parameters themselves are
    # the state's buffers (jit forwards them), so count each buffer once.
    out_shapes = jax.eval_shape(trainer._forward, state.params, batch)
    logp, pullback = _abstract(out_shapes, forward.output_shardings)
    backward = trainer._backward.lower(pullback, logp, values, batch, denom, accum).compile()
    forwarded = max(0, device_bytes(pullback) - forward.memory_analysis().output_size_in_bytes)
    peaks["backward"] = _program(backward).plus(opt_bytes + params_bytes - forwarded)
    peaks["update"] = _program(trainer._update.lower(state, accum).compile())
    return peaks


def ref_peak(model_config: ModelConfig, rl_config: RLConfig, devices, rows: int,
             row_len: int, stored_d_model: int | None = None) -> Peak:
    """Per-device peak bytes of a decoupled reference forward on its own mesh (its compute
    copy of the weights is the argument that stays resident)."""
    mesh = make_mesh(list(devices), data=1, fsdp=-1, tensor=1)
    trainer = make_trainer(model_config, rl_config, mesh, stored_d_model=stored_d_model)
    compute = _abstract(jax.eval_shape(functools.partial(
        cast_floating, dtype=model_config.jnp_dtype), trainer.stored_params),
        trainer.param_shardings)
    batch, values = _abstract_batch(rows, row_len, trainer.batch_sharding)
    return _program(trainer._ref.lower(compute, batch).compile())


def engine_peaks(model_config: ModelConfig, engine_config: EngineConfig, devices
                 ) -> dict[str, Peak]:
    """Per-device peak bytes of one rollout rank's prefill (largest bucket) and decode."""
    ec = engine_config
    params_sharding, kv_sharding, replicated = engine_shardings(model_config, rank_mesh(devices))
    params = _abstract(jax.eval_shape(unstack_layers, abstract_params(model_config)),
                       params_sharding)  # the engine's per-layer layout
    page = jax.ShapeDtypeStruct(
        (model_config.num_layers, ec.num_pages + 1, ec.page_size, model_config.num_kv_heads,
         model_config.head_dim), model_config.jnp_dtype, sharding=kv_sharding)
    kv = KVPages(page, page)
    prefill, generate, _, _, packed_prefill = _compiled_steps(
        model_config, ec.attention, ec.page_size, ec.max_seq_len, kv_sharding, replicated)

    def scalar(dtype, shape=()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    i32, f32 = jnp.int32, jnp.float32
    chunk = ec.prefill_buckets[-1]
    if ec.prefill_packing:  # rows of the largest bucket
        row_args = [scalar(a.dtype, a.shape) for a in empty_packed_call(ec, chunk, 0)]
        pre = packed_prefill.lower((True, True), params, kv, *row_args).compile()
    else:
        pre = prefill.lower((True, True), params, kv, scalar(i32, (chunk,)), scalar(i32),
                            scalar(i32), scalar(i32, (ec.max_pages_per_seq,)),
                            scalar(jnp.bool_), scalar(jnp.uint32), scalar(f32), scalar(i32),
                            scalar(f32), scalar(i32), scalar(i32, (ec.max_stop_tokens,))
                            ).compile()
    state = jax.eval_shape(lambda: serving_steps.init_decode_state(
        ec.max_slots, ec.max_pages_per_seq, ec.max_stop_tokens, 0))
    state = jax.tree.map(lambda a: scalar(a.dtype, a.shape), state)
    gen = generate.lower(ec.decode_steps_per_call, ec.max_pages_per_seq, (True, True), params,
                         kv, state,
                         scalar(i32, (ec.max_slots, ec.max_pages_per_seq))).compile()
    return {"prefill": _program(pre), "decode": _program(gen)}


def extrapolate(measure, model_config: ModelConfig, layers: tuple[int, int] | None
                ) -> dict[str, Peak]:
    """`measure(config)` at the model's depth, or affinely from two shallower depths."""
    if layers is None or model_config.num_layers <= max(layers):
        return measure(model_config)
    a, b = layers
    low = measure(model_config.replace(num_layers=a))
    high = measure(model_config.replace(num_layers=b))
    scale = (model_config.num_layers - a) / (b - a)
    return {k: Peak(*(int(lo + (hi - lo) * scale) for lo, hi in zip(low[k], high[k])))
            for k in low}
