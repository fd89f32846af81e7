"""Logical axis names → mesh axes: one rules object for training, one for rollout.

Parameters and activations carry logical names (`embed`, `heads`, `mlp`, ...). A rules
object maps each name to mesh axes; a name whose dimension does not divide evenly over
its mesh axes stays replicated, so the same rules work on any submesh size. That costs
memory on meshes whose size divides nothing (3, 5 or 6 devices for Qwen2.5-7B's 3,584
model dim): `undivided_bytes` measures it, and the trainer warns when it matters. A
trainer can instead store the model dim padded (`stored_abstract`: Qwen2.5-14B's 5,120 as
5,160 shards over 3, 5 and 6 devices); the model cuts the padding off as it computes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tidejax.models.config import ModelConfig
from tidejax.models.model import Params, init_params, logical_axes

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Ordered (logical name, mesh axes) pairs; names not listed are replicated."""

    rules: tuple[tuple[str, tuple[str, ...]], ...]

    def priority(self, name: str | None) -> int:
        """Position of `name` in the rules (unlisted names last)."""
        for i, (logical, _) in enumerate(self.rules):
            if logical == name:
                return i
        return len(self.rules)

    def mesh_axes(self, name: str | None) -> tuple[str, ...]:
        for logical, axes in self.rules:
            if logical == name:
                return axes
        return ()


# FSDP over (data, fsdp) for the model dim, tensor parallel over heads / ffn / vocab. The
# output head (and a tied table) shard their vocabulary over fsdp first (rules are
# applied in this order): a head sharded on the model dim is all-gathered whole for the
# logits, with a whole float32 gradient beside it (6 B x 1.09e9 parameters at Qwen2.5-7B,
# ~6 GiB per device); sharded on the vocabulary it never is. A vocabulary that does not
# divide the mesh falls back to the model dim. An untied input table (`input_vocab`)
# shards on the model dim instead: its lookup's gradient then scatters each device's
# slice of the model dim, where a vocabulary-sharded table all-gathers the whole batch's
# float32 cotangent to every device (2 GiB per device at Qwen2.5-14B, 6 devices, 8,192
# tokens each).
TRAIN_RULES = LogicalRules((
    ("batch", ("data", "fsdp")),
    ("vocab", ("fsdp", "tensor")),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
))

# Rollout ranks hold full weights per tensor-parallel group; KV pages shard on kv heads.
ROLLOUT_RULES = LogicalRules((
    ("batch", ("data",)),
    ("vocab", ("tensor",)),
    ("input_vocab", ("tensor",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
))


def make_mesh(devices: Sequence[jax.Device], data: int = 1, fsdp: int = -1,
              tensor: int = 1) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices`; one size may be -1 (takes the rest)."""
    sizes = [data, fsdp, tensor]
    known = math.prod(s for s in sizes if s != -1)
    if sizes.count(-1) > 1 or known <= 0 or len(devices) % known:
        raise ValueError(f"mesh sizes data={data} fsdp={fsdp} tensor={tensor} do not fit "
                         f"{len(devices)} devices")
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh sizes {sizes} need {math.prod(sizes)} devices, "
                         f"got {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def spec_for(names: Sequence[str | None], shape: Sequence[int], rules: LogicalRules,
             mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for one array; skips mesh axes that are absent, used or don't divide.
    Dimensions claim mesh axes in the order their names appear in `rules`."""
    used: set[str] = set()
    parts: list = [None] * len(shape)
    for i in sorted(range(len(shape)), key=lambda i: rules.priority(names[i])):
        axes = tuple(a for a in rules.mesh_axes(names[i])
                     if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        size = math.prod(mesh.shape[a] for a in axes)
        if not axes or shape[i] % size:
            continue
        used.update(axes)
        parts[i] = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*parts)


def undivided_bytes(config: ModelConfig, mesh: Mesh, rules: LogicalRules,
                    abstract: Params | None = None) -> dict[str, int]:
    """Per parameter that the rules would shard but whose dimensions do not divide the
    mesh: the bytes each device holds beyond an even share. Empty when nothing is lost."""
    if abstract is None:
        abstract = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    lost: dict[str, int] = {}

    def check(path, names, leaf):
        wanted = {a for n in names for a in rules.mesh_axes(n)
                  if a in mesh.shape and mesh.shape[a] > 1}
        spec = spec_for(names, leaf.shape, rules, mesh)
        got = {a for part in spec if part is not None
               for a in ((part,) if isinstance(part, str) else part)}
        missing = math.prod(mesh.shape[a] for a in wanted - got)
        if missing > 1:
            held = leaf.size * leaf.dtype.itemsize // math.prod(mesh.shape[a] for a in got)
            lost[jax.tree_util.keystr(path)] = held - held // missing

    jax.tree_util.tree_map_with_path(check, logical_axes(config), abstract,
                                     is_leaf=lambda x: isinstance(x, tuple))
    return lost


def stored_abstract(config: ModelConfig, abstract: Params, stored_d_model: int) -> Params:
    """`abstract` with every `embed` dimension padded from the model dim to
    `stored_d_model` (the trainer's storage; `model.crop_to` cuts it back)."""
    if stored_d_model < config.hidden_size:
        raise ValueError(f"stored_d_model={stored_d_model} is below hidden_size "
                         f"{config.hidden_size}")

    def pad(names, leaf):
        shape = tuple(stored_d_model if name == "embed" else n
                      for name, n in zip(names, leaf.shape))
        return jax.ShapeDtypeStruct(shape, leaf.dtype)

    return jax.tree.map(pad, logical_axes(config), abstract,
                        is_leaf=lambda x: isinstance(x, tuple))


def padded_block(host: np.ndarray, index: tuple[slice, ...], shape: Sequence[int]
                 ) -> np.ndarray:
    """The block `index` of `host` zero-padded to `shape` (what one device of a padded
    sharding holds; `jax.make_array_from_callback` asks for it)."""
    starts = [s.start or 0 for s in index]
    stops = [shape[i] if s.stop is None else s.stop for i, s in enumerate(index)]
    inside = tuple(slice(min(a, n), min(b, n)) for a, b, n in zip(starts, stops, host.shape))
    block = np.asarray(host[inside])
    return np.pad(block, [(0, (b - a) - m) for a, b, m in zip(starts, stops, block.shape)])


def param_shardings(config: ModelConfig, mesh: Mesh, rules: LogicalRules,
                    abstract: Params | None = None) -> Params:
    """A NamedSharding per parameter, from the model's logical axis names."""
    if abstract is None:
        abstract = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    return jax.tree.map(
        lambda names, leaf: NamedSharding(mesh, spec_for(names, leaf.shape, rules, mesh)),
        logical_axes(config), abstract, is_leaf=lambda x: isinstance(x, tuple))


def reshard(tree, shardings):
    """`jax.device_put(tree, shardings)`, also between meshes over different devices of
    several processes, where a plain device_put cannot go (multi-controller JAX moves data
    between processes only inside a program both sides run).

    Trainer meshes list devices host by host and ERS resizes them alike on every host, so
    an array sharded the same way on both meshes keeps each host's block on that host:
    each process moves its block between its own devices. Leaves that are sharded
    differently on the two meshes go through the host (every process gathers the whole
    array): correct, slower, and logged."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    return jax.tree.map(_reshard_leaf, tree, shardings)


def _reshard_leaf(x: jax.Array, target: NamedSharding) -> jax.Array:
    from jax.experimental import multihost_utils

    source = x.sharding
    if source.device_set == target.device_set:
        return jax.device_put(x, target)
    if (isinstance(source, NamedSharding) and source.spec == target.spec
            and source.mesh.axis_names == target.mesh.axis_names):
        local = multihost_utils.global_array_to_host_local_array(x, source.mesh, source.spec)
        local = jax.device_put(local, NamedSharding(target.mesh.local_mesh, target.spec))
        return multihost_utils.host_local_array_to_global_array(local, target.mesh,
                                                                target.spec)
    logging.getLogger(__name__).info(
        "resharding a %s array from %s to %s through the host", x.shape, source, target.spec)
    whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.make_array_from_callback(x.shape, target, lambda index: whole[index])
