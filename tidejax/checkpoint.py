"""Orbax checkpoints of the trainer: TrainState plus JSON metadata, saved asynchronously.

One checkpoint step holds two items: `state` (the TrainState arrays, Orbax standard
format) and `meta` (JSON: reference-model identity, data cursor, controller metadata, a
fingerprint of every array and, optionally, the rollout snapshot of `tidejax.runtime.resume`:
ready groups and in-flight tasks). Restoring takes an abstract target whose leaves carry the
*new* shardings, so a state saved on one submesh comes back on another. With no explicit
step, restore walks back from the latest: a checkpoint that fails to read, lacks an item,
or whose arrays do not match their fingerprint is skipped with a warning.

Threads: Orbax writes in a background thread after `save` returns (device arrays are
copied to host first, so the caller may donate the state right away); `wait` joins it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """No readable checkpoint, or a checkpoint failed verification."""


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    ref_model: dict[str, Any]
    data_cursor: Any
    controller: dict[str, Any]
    rollout: dict[str, Any] | None = None


def _as_uint32(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    bits = x.dtype.itemsize * 8
    if bits not in (8, 16, 32):
        raise TypeError(f"cannot fingerprint dtype {x.dtype}")
    x = jax.lax.bitcast_convert_type(x, {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits])
    return x.astype(jnp.uint32)


@jax.jit
def _fingerprint(tree) -> list[jax.Array]:
    """Per leaf: (sum of bit patterns, index-weighted sum), both mod 2**32.

    Integer addition is associative, so the result is exact whatever the sharding or
    reduction order, and any change to a single element changes the first sum.
    """
    out = []
    for leaf in jax.tree.leaves(tree):
        bits = _as_uint32(leaf)
        # Flat index + 1 from per-axis iotas: no reshape, so sharded leaves stay sharded.
        weights = jnp.ones(bits.shape, jnp.uint32)
        stride = 1
        for axis in reversed(range(bits.ndim)):
            iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
            weights = weights + iota * jnp.uint32(stride % 2**32)
            stride *= bits.shape[axis]
        out.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                              jnp.sum(bits * weights, dtype=jnp.uint32)]))
    return out


def _as_ints(host_fingerprint) -> list[list[int]]:
    return [[int(v) for v in np.asarray(f)] for f in host_fingerprint]


def fingerprint(tree) -> list[list[int]]:
    return _as_ints(jax.device_get(_fingerprint(tree)))


def params_fingerprint(params) -> list[list[int]]:
    """`fingerprint` of the model parameters in their stacked form, also when `layers` is
    held per layer (an engine's): per-layer fingerprints combine exactly, nothing stacks.
    Stacked, element j of layer i weighs `1 + i*n + j` (n the layer's element count)."""
    if not isinstance(params["layers"], tuple):
        return fingerprint(params)
    # One device-to-host transfer for all of them.
    combined, *per_layer = map(_as_ints, jax.device_get(
        [_fingerprint(params["embedder"])] + [_fingerprint(layer) for layer in params["layers"]]))
    sizes = [leaf.size for leaf in jax.tree.leaves(params["layers"][0])]
    for j, size in enumerate(sizes):
        total = sum(fp[j][0] for fp in per_layer)
        weighted = sum(fp[j][1] + i * size * fp[j][0] for i, fp in enumerate(per_layer))
        combined.append([total % 2**32, weighted % 2**32])
    return combined


class Checkpointer:
    """Async save / verified restore over `ocp.CheckpointManager`, keeping the last N."""

    def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True,
                 verify: bool = True):
        if max_to_keep <= 0:
            raise ValueError(f"max_to_keep must be > 0, got {max_to_keep}")
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        # Orbax accepts only absolute paths; callers may pass one relative to the cwd.
        directory = os.path.abspath(directory)
        self.directory = directory
        self.verify = verify
        self._manager = ocp.CheckpointManager(directory, options=options,
                                              item_names=("state", "meta"))

    def save(self, step: int, state: Any, *, ref_model: dict[str, Any], data_cursor: Any = None,
             controller: dict[str, Any] | None = None, rollout: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Start saving `state` and metadata at `step`; returns once arrays are on the host."""
        meta = {"format": FORMAT_VERSION, "ref_model": ref_model, "data_cursor": data_cursor,
                "controller": controller or {}, "rollout": rollout,
                "fingerprint": fingerprint(state) if self.verify else None}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta))
        return self._manager.save(step, args=args, force=force)

    def wait(self) -> None:
        """Block until background writes (and old-checkpoint deletion) have finished."""
        self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> Restored:
        """Restore onto the shardings in `abstract_state`: a tree of ShapeDtypeStruct, or a
        function of a step's controller metadata giving that tree (a resumed run whose
        partition, and so its actor mesh, is recorded in the checkpoint).

        With `step=None`, the newest readable checkpoint is restored and unreadable newer
        ones are skipped with a warning; an explicit `step` raises instead.
        """
        self.wait()
        candidates = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        for s in candidates:
            try:
                return self._restore_step(abstract_state, s)
            except Exception as err:
                if step is not None:
                    raise CheckpointError(f"checkpoint step {s} is unreadable: {err}") from err
                warnings.warn(f"skipping checkpoint step {s} in {self.directory}: "
                              f"{type(err).__name__}: {str(err)[:300]}", stacklevel=2)
        raise CheckpointError(f"no readable checkpoint in {self.directory} "
                              f"(tried steps {candidates})")

    def _read_meta(self, step: int) -> dict:
        meta = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"step {step}: metadata missing or of an unknown format")
        return meta

    def _restore_step(self, abstract_state: Any, step: int) -> Restored:
        meta = self._read_meta(step)
        if callable(abstract_state):
            abstract_state = abstract_state(meta["controller"])
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))
        state = restored.state
        if (self.verify and meta.get("fingerprint") is not None
                and fingerprint(state) != meta["fingerprint"]):
            raise CheckpointError(f"step {step}: arrays do not match their fingerprint")
        return Restored(step=step, state=state, ref_model=meta["ref_model"],
                        data_cursor=meta["data_cursor"], controller=meta["controller"],
                        rollout=meta.get("rollout"))

    def close(self) -> None:
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
