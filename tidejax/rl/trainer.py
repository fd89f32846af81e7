"""`Trainer`: the RL core's pure steps compiled once for one (sub)mesh.

The class holds compiled functions and shardings, never the state: `TrainState` and the
gradient `Accum` are passed in and returned (and donated, so an update reuses their
buffers). Parameters are born sharded from the model's logical-axis rules; batches are
`[B, T]` with B split over the mesh's batch axes (data x fsdp), so B must be a multiple of
`trainer.data_parallel`.

RA2P decoupled mode, as the runtime drives it (one Trainer per submesh):

    ref = make_trainer(cfg, rl, ref_mesh);  actor = make_trainer(cfg, rl, actor_mesh)
    accum = actor.zero_accum()
    for mb in micro_batches:                        # ref and actor run concurrently
        ref_logp = ref.ref_logprobs(ref_params, ref.put(mb))         # on the ref submesh
        logp, pullback = actor.actor_forward(state.params, actor.put(mb))  # needs no ref
        accum = actor.actor_backward(pullback, logp, actor.put(ref_logp), actor.put(mb),
                                     denom, accum)
    state, metrics = actor.apply_update(state, accum)

Colocated mode replaces forward + backward by `actor_grads(params, mb, ref_logp, denom,
accum)`. JAX dispatch is asynchronous, so these calls return at once and the devices
overlap them; only reading a metric waits.

Precision: the state always holds float32 master weights and float32 Adam moments; steps
compute in `model_config.dtype` (bf16 for the Qwen presets), casting layer by layer inside
the model, so gradients arrive in float32. `compute_copy` makes the low-precision copy a
frozen reference uses and `rollout_copy` the one the engines load, on this mesh, without a
host round trip.

Storage: with `stored_d_model` above the model dim, every parameter (and so every Adam
moment and gradient) is stored with its model dim zero-padded to it, so that a mesh size
that does not divide the model dim still shards evenly (Qwen2.5-14B's 5,120 on 6 devices).
The model cuts the padding off inside each layer; its gradient is zero, so it stays zero.
Parameters enter (`put_params`, `init_state`) and leave (`rollout_copy`, `host_params`)
at the model's real shapes; states and accumulators move between trainers of one job
unchanged, since every trainer of the job stores the same padded shapes.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tidejax.models import ModelConfig, init_params
from tidejax.models.model import abstract_params, cast_floating, crop_to, param_count
from tidejax.models.sharding import (TRAIN_RULES, LogicalRules, padded_block, param_shardings,
                                     stored_abstract, undivided_bytes)
from tidejax.rl import deferred, steps
from tidejax.rl.batch import Batch
from tidejax.rl.config import RLConfig
from tidejax.rl.losses import empty_metrics
from tidejax.rl.state import Accum, TrainState, add_to_accum, init_train_state, make_optimizer

Params = dict[str, Any]

# Per-layer remat by default above this size. At Qwen2.5-7B shapes one layer's saved
# activations for a 6,144-token micro-batch are several GiB (q/k/v, the float32 attention
# scores of each 256-query block, three [T, F] MLP tensors), times 28 layers: more than an
# 80 GB card holds beside the state. Recomputing costs about one extra forward (~33% of a
# step's FLOPs); below ~1B parameters activations fit and the extra forward is pure cost.
REMAT_ABOVE_PARAMS = 1_000_000_000
# Replication a mesh size forces (dimensions that do not divide it) is reported above this
# many bytes per device: at Qwen2.5-7B on 6 devices it is ~95 GiB of state, at tiny sizes
# a few KiB that nobody needs to hear about.
WARN_UNDIVIDED_BYTES = 1 << 30

log = logging.getLogger(__name__)


def resolve_remat(model_config: ModelConfig, rl_config: RLConfig) -> bool:
    if rl_config.remat is not None:
        return rl_config.remat
    return param_count(abstract_params(model_config)) > REMAT_ABOVE_PARAMS


class Trainer:
    """Compiled ref / actor / update / SFT functions for one mesh."""

    def __init__(self, model_config: ModelConfig, rl_config: RLConfig, mesh: Mesh,
                 rules: LogicalRules = TRAIN_RULES, *, jit: bool = True,
                 compiler_options: dict[str, Any] | None = None,
                 stored_d_model: int | None = None):
        """`jit=False` runs the pure functions eagerly (debugging); `compiler_options` go to
        every `jax.jit` (tests pass a low XLA optimisation level to compile faster);
        `stored_d_model` pads the stored model dim (see the module docstring)."""
        self.model_config, self.rl_config, self.mesh, self.rules = (
            model_config, rl_config, mesh, rules)
        # Master weights (and so Adam's moments) are float32 whatever the compute dtype.
        self.master_config = master = model_config.replace(dtype="float32")
        repl = NamedSharding(mesh, PartitionSpec())
        logical = abstract_params(master)
        self.logical_shapes = jax.tree.map(lambda a: a.shape, logical)
        master_params = stored_abstract(master, logical, stored_d_model or
                                        model_config.hidden_size)
        self.stored_params = master_params  # shapes and dtypes as stored
        self.padded = any(a.shape != b.shape for a, b in zip(jax.tree.leaves(logical),
                                                               jax.tree.leaves(master_params)))
        self.param_shardings = param_shardings(model_config, mesh, rules, master_params)
        self._warn_undivided(master_params)
        tx = make_optimizer(rl_config.optim)
        opt_shardings = optax.tree_map_params(
            tx, lambda _, s: s, jax.eval_shape(tx.init, master_params), self.param_shardings,
            transform_non_params=lambda _: repl)
        self.state_shardings = TrainState(params=self.param_shardings, opt_state=opt_shardings,
                                          step=repl, policy_version=repl, key=repl)
        self.accum_shardings = Accum(grads=self.param_shardings, metrics=repl)
        axes = tuple(a for a in rules.mesh_axes("batch") if mesh.shape.get(a, 1) > 1)
        self.data_parallel = math.prod(mesh.shape[a] for a in axes)
        self.batch_sharding = NamedSharding(
            mesh, PartitionSpec(axes if axes else None, None))
        activations = NamedSharding(mesh, PartitionSpec(axes if axes else None, None, None))

        cfg, rl, loss = model_config, rl_config, rl_config.loss
        self.remat = resolve_remat(model_config, rl_config)
        kw = {"chunk": rl.logprob_chunk, "remat": self.remat,
              "activation_sharding": activations}
        rl_kw = {**kw, "temperature": rl.temperature}  # SFT's log-probs stay at T = 1
        ps, ss, acs = self.param_shardings, self.state_shardings, self.accum_shardings
        bs = self.batch_sharding
        if jit:
            compile_ = functools.partial(jax.jit, compiler_options=compiler_options)
        else:
            compile_ = lambda f, **_: f

        # Under remat the deferred pair walks the layers itself and adds each layer's
        # gradients into the accumulator in place (no whole gradient tree beside it).
        def forward(params, batch):
            if self.remat:
                logp, pullback = deferred.actor_forward_layerwise(
                    cfg, params, batch, chunk=rl.logprob_chunk, activation_sharding=activations,
                    temperature=rl.temperature)
            else:
                logp, pullback = deferred.actor_forward(cfg, params, batch, **rl_kw)
            return jax.lax.with_sharding_constraint(logp, bs), pullback

        def backward(pullback, logp, ref_logp, batch, denom, accum):
            if self.remat:
                return deferred.actor_backward_layerwise(
                    cfg, pullback, logp, ref_logp, batch, loss, denom, accum,
                    activation_sharding=activations)
            return add_to_accum(accum, *deferred.actor_backward(pullback, logp, ref_logp, batch,
                                                                loss, denom))

        def fused(params, batch, ref_logp, denom, accum):
            return add_to_accum(accum, *steps.actor_grads(cfg, params, batch, ref_logp, loss,
                                                          denom, **rl_kw))

        def sft(params, batch, denom, accum):
            return add_to_accum(accum, *steps.sft_grads(cfg, params, batch, denom, **kw))

        def zeros():
            return Accum(grads=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                                            master_params), metrics=empty_metrics())

        def init(key):
            params = init_params(master, jax.random.wrap_key_data(key))
            return init_train_state(jax.tree.map(_pad_to, params, master_params), rl.optim,
                                    key)

        self._abstract_init = init

        def init_from(key, params):
            return init_train_state(cast_floating(params, jnp.float32), rl.optim, key)

        self._init = compile_(init, in_shardings=(repl,), out_shardings=ss)
        self._init_from = compile_(init_from, in_shardings=(repl, ps), out_shardings=ss)
        self._zero = compile_(zeros, out_shardings=acs)
        self._ref = compile_(functools.partial(steps.ref_logprobs, cfg, chunk=rl.logprob_chunk,
                                               activation_sharding=activations,
                                               temperature=rl.temperature),
                             in_shardings=(ps, bs), out_shardings=bs)
        self._compute_copy = compile_(
            functools.partial(cast_floating, dtype=cfg.jnp_dtype), in_shardings=(ps,),
            out_shardings=ps)
        logical_shapes = self.logical_shapes

        def logical_copy(params):
            return cast_floating(crop_to(params, logical_shapes), cfg.jnp_dtype)

        self._gathered_copy = compile_(logical_copy, in_shardings=(ps,),
                                       out_shardings=jax.tree.map(lambda _: repl, ps))
        # A padded model dim does not divide the mesh once cut off: the real-shaped copy
        # shards another dimension that divides it (the layer axis at Qwen2.5-14B on 6),
        # or is replicated where none does.
        self._logical_copy = compile_(logical_copy, in_shardings=(ps,), out_shardings=jax.tree.map(
            lambda a: NamedSharding(mesh, _dividing_spec(a.shape, mesh)), logical))
        self._forward = compile_(forward, in_shardings=(ps, bs))
        # The pullback is not donated: among its residuals are the parameter arrays
        # themselves, which the state still owns. Its shardings are whatever the forward
        # produced (None = take the argument's).
        self._backward = compile_(backward, in_shardings=(None, bs, bs, bs, repl, acs),
                                  out_shardings=acs, donate_argnums=(5,))
        self._fused = compile_(fused, in_shardings=(ps, bs, bs, repl, acs), out_shardings=acs,
                               donate_argnums=(4,))
        self._sft = compile_(sft, in_shardings=(ps, bs, repl, acs), out_shardings=acs,
                             donate_argnums=(3,))
        self._update = compile_(functools.partial(steps.apply_update, optim_config=rl.optim),
                                in_shardings=(ss, acs), out_shardings=(ss, repl),
                                donate_argnums=(0,))
        self._sft_step = compile_(
            functools.partial(steps.sft_step, cfg, optim_config=rl.optim, **kw),
            in_shardings=(ss, bs, repl), out_shardings=(ss, repl), donate_argnums=(0,))

    def _warn_undivided(self, master_params: Params) -> None:
        lost = undivided_bytes(self.model_config, self.mesh, self.rules, master_params)
        # Master weights, two Adam moments and the float32 gradient accumulator.
        extra = 4 * sum(lost.values())
        if extra > WARN_UNDIVIDED_BYTES:
            worst = max(lost, key=lost.get)
            log.warning("a %d-device trainer mesh cannot shard %d parameters evenly (e.g. "
                        "%s): each device holds %.1f GiB of state beyond an even share; a "
                        "mesh size that divides the model's dimensions avoids it",
                        self.mesh.size, len(lost), worst, extra / 2**30)

    # -- placement -------------------------------------------------------------------
    def put(self, x):
        """Place a `Batch` or a `[B, T]` array (host or another submesh) on this mesh."""
        for leaf in jax.tree.leaves(x):
            if leaf.shape[0] % self.data_parallel:
                raise ValueError(f"batch size {leaf.shape[0]} is not a multiple of the "
                                 f"data-parallel size {self.data_parallel}")
        return jax.device_put(x, self.batch_sharding)

    def put_params(self, params: Params) -> Params:
        """Reshard parameters (from the host or another submesh, at the model's real or
        this job's stored shapes) onto this mesh, padded as the trainer stores them."""
        if all(x.shape == a.shape for x, a in zip(jax.tree.leaves(params),
                                                  jax.tree.leaves(self.stored_params))):
            return jax.device_put(params, self.param_shardings)

        # Real shapes into padded storage: each device's block cut from the host copy.
        def place(x, a, sharding):
            host = np.asarray(x)
            return jax.make_array_from_callback(
                a.shape, sharding, lambda index: padded_block(host, index, a.shape))

        return jax.tree.map(place, params, self.stored_params, self.param_shardings)

    def host_params(self, params: Params) -> Params:
        """Numpy copies at the model's real shapes (the padding cut off on the host)."""
        host = jax.device_get(params)
        return crop_to(host, self.logical_shapes)

    def compute_copy(self, params: Params) -> Params:
        """`params` in the compute dtype, sharded on this mesh (a bf16 model's rollout
        weights and frozen reference). Device to device: nothing passes through the host."""
        return self._compute_copy(self.put_params(params))

    def rollout_copy(self, params: Params) -> Params:
        """The compute-dtype copy this process's rollout ranks load, device to device. On a
        mesh that spans processes every device gathers the whole copy (a collective over
        the mesh) and this process reads it from one of its own devices, since a
        cross-process `device_put` is not something to build on."""
        if not self.mesh.is_multi_process:
            if self.padded:
                return self._logical_copy(self.put_params(params))
            return self.compute_copy(params)
        gathered = self._gathered_copy(self.put_params(params))
        return jax.tree.map(lambda x: x.addressable_data(0), gathered)

    def init_state(self, seed: int = 0, params: Params | None = None) -> TrainState:
        """A TrainState born sharded: random params from `seed`, or the given `params`."""
        key = jax.random.key_data(jax.random.key(seed))
        if params is None:
            return self._init(key)
        return self._init_from(key, self.put_params(params))

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and this mesh's shardings of a TrainState (for restoring)."""
        shapes = jax.eval_shape(self._abstract_init, jax.random.key_data(jax.random.key(0)))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.state_shardings)

    # -- steps -----------------------------------------------------------------------
    def zero_accum(self) -> Accum:
        return self._zero()

    def ref_logprobs(self, ref_params: Params, batch: Batch) -> jax.Array:
        """Reference log-probs `[B, T]`, sharded like the batch."""
        return self._ref(ref_params, batch)

    def actor_forward(self, params: Params, batch: Batch):
        """`(logp_BT, pullback)`; needs no reference input (see `tidejax.rl.deferred`)."""
        return self._forward(params, batch)

    def actor_backward(self, pullback, logp_BT, ref_logp_BT, batch: Batch,
                       denom: float | None, accum: Accum) -> Accum:
        """Add this micro-batch's gradients (KL included) into `accum` (donated)."""
        return self._backward(pullback, logp_BT, ref_logp_BT, batch, _denom(denom), accum)

    def actor_grads(self, params: Params, batch: Batch, ref_logp_BT, denom: float | None,
                    accum: Accum) -> Accum:
        """Fused forward + backward (colocated mode); adds into `accum` (donated)."""
        return self._fused(params, batch, ref_logp_BT, _denom(denom), accum)

    def sft_grads(self, params: Params, batch: Batch, denom: float | None,
                  accum: Accum) -> Accum:
        return self._sft(params, batch, _denom(denom), accum)

    def apply_update(self, state: TrainState, accum: Accum):
        """`(state, metrics)` after one AdamW update; `state` and `accum` are donated."""
        return self._update(state, accum)

    def sft_step(self, state: TrainState, batch: Batch, denom: float | None = None):
        """One supervised update (masked next-token loss); `state` is donated."""
        return self._sft_step(state, batch, _denom(denom))


def _pad_to(x: jax.Array, like) -> jax.Array:
    if x.shape == like.shape:
        return x
    return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, like.shape)])


def _dividing_spec(shape, mesh: Mesh) -> PartitionSpec:
    """The first dimension the whole mesh divides, sharded over it; else replicated."""
    axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    for i, n in enumerate(shape):
        if axes and n % mesh.size == 0:
            return PartitionSpec(*([None] * i), axes if len(axes) > 1 else axes[0])
    return PartitionSpec()


def _denom(denom):
    # A fixed dtype keeps one compiled version whether the caller passes an int or a float.
    return None if denom is None else np.float32(denom)


def make_trainer(model_config: ModelConfig, rl_config: RLConfig, mesh: Mesh,
                 rules: LogicalRules = TRAIN_RULES, *, jit: bool = True,
                 compiler_options: dict[str, Any] | None = None,
                 stored_d_model: int | None = None) -> Trainer:
    """The factory the runtime calls per submesh (topology is data: any mesh works)."""
    return Trainer(model_config, rl_config, mesh, rules, jit=jit,
                   compiler_options=compiler_options, stored_d_model=stored_d_model)
