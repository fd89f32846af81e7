"""Load a HF Qwen2 checkpoint (`config.json` + safetensors, single or sharded) into tidejax."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tidejax.models.config import ModelConfig
from tidejax.models.model import Params, abstract_params
from tidejax.models.safetensors_io import SafetensorsFile
from tidejax.models.sharding import LogicalRules, param_shardings


class CheckpointError(ValueError):
    """A HF checkpoint that does not match what the config says."""


def _hf_sources(cfg: ModelConfig):
    """tidejax param path → (HF tensor name per layer or None, transform to our layout)."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lay = "model.layers.{i}."
    table: dict[tuple[str, ...], tuple[str, Callable]] = {
        ("embedder", "embedding"): ("model.embed_tokens.weight", lambda w: w),
        ("embedder", "final_norm", "scale"): ("model.norm.weight", lambda w: w),
        ("layers", "input_norm", "scale"): (lay + "input_layernorm.weight", lambda w: w),
        ("layers", "post_norm", "scale"): (lay + "post_attention_layernorm.weight", lambda w: w),
        ("layers", "attn", "q_kernel"): (lay + "self_attn.q_proj.weight",
                                         lambda w: w.T.reshape(d, n, h)),
        ("layers", "attn", "k_kernel"): (lay + "self_attn.k_proj.weight",
                                         lambda w: w.T.reshape(d, k, h)),
        ("layers", "attn", "v_kernel"): (lay + "self_attn.v_proj.weight",
                                         lambda w: w.T.reshape(d, k, h)),
        ("layers", "attn", "o_kernel"): (lay + "self_attn.o_proj.weight",
                                         lambda w: w.T.reshape(n, h, d)),
        ("layers", "mlp", "gate_kernel"): (lay + "mlp.gate_proj.weight", lambda w: w.T),
        ("layers", "mlp", "up_kernel"): (lay + "mlp.up_proj.weight", lambda w: w.T),
        ("layers", "mlp", "down_kernel"): (lay + "mlp.down_proj.weight", lambda w: w.T),
    }
    if cfg.qkv_bias:
        table[("layers", "attn", "q_bias")] = (lay + "self_attn.q_proj.bias",
                                               lambda w: w.reshape(n, h))
        table[("layers", "attn", "k_bias")] = (lay + "self_attn.k_proj.bias",
                                               lambda w: w.reshape(k, h))
        table[("layers", "attn", "v_bias")] = (lay + "self_attn.v_proj.bias",
                                               lambda w: w.reshape(k, h))
    if not cfg.tie_word_embeddings:
        table[("embedder", "lm_head")] = ("lm_head.weight", lambda w: w.T)
    return table


class _TensorIndex:
    """Name → file across one or many safetensors shards."""

    def __init__(self, path: str):
        index_path = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: no 'weight_map' object")
            for name, fname in weight_map.items():
                if fname not in files:
                    shard = os.path.join(path, fname)
                    if not os.path.exists(shard):
                        raise CheckpointError(f"{index_path} names shard {fname}, which is missing")
                    files[fname] = SafetensorsFile(shard)
                self.where[name] = files[fname]
        elif os.path.exists(single):
            st = SafetensorsFile(single)
            self.where = {name: st for name in st.names()}
        else:
            raise CheckpointError(f"{path}: neither model.safetensors nor "
                                  "model.safetensors.index.json found")

    def get(self, name: str) -> np.ndarray:
        return self.where[name].get(name)


def read_config(path: str, dtype: str | None = "float32") -> ModelConfig:
    """The checkpoint's ModelConfig computing in `dtype` (None: its own `torch_dtype`)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path}: config.json not found")
    with open(cfg_path) as f:
        hf = json.load(f)
    if dtype is None:
        dtype = {"bfloat16": "bfloat16", "float16": "float16"}.get(hf.get("torch_dtype"),
                                                                   "float32")
    return ModelConfig.from_hf(hf, dtype=dtype)


def load_hf(path: str | os.PathLike, dtype: str | None = "float32", mesh: Mesh | None = None,
            rules: LogicalRules | None = None) -> tuple[ModelConfig, Params]:
    """Read a Qwen2 HF checkpoint directory into `(config, params)`.

    With `mesh` and `rules`, each parameter is placed straight onto its sharding and
    each device reads (and converts to `dtype`) only its own slice of the memory-mapped
    files. Without, the parameters are host (numpy) arrays for the caller to place: the
    job keeps the reference's copy on the host anyway, and a whole 14B model on the
    default device would sit beside that device's rollout engine. `dtype=None` keeps the
    checkpoint's `torch_dtype` (bfloat16 for Qwen2.5).
    """
    path = os.fspath(path)
    cfg = read_config(path, dtype)
    index = _TensorIndex(path)
    sources = _hf_sources(cfg)
    needed = [tmpl.format(i=i) for tmpl, _ in sources.values()
              for i in (range(cfg.num_layers) if "{i}" in tmpl else [None])]
    missing = [n for n in needed if n not in index.where]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}{more}")

    abstract = abstract_params(cfg)
    shardings = param_shardings(cfg, mesh, rules, abstract) if mesh is not None else None
    np_dtype = np.dtype(cfg.jnp_dtype)
    params: dict = {}
    for key_path, (tmpl, transform) in sources.items():
        target = abstract
        for part in key_path:
            target = target[part]
        stacked = "{i}" in tmpl

        want = tuple(target.shape[1:] if stacked else target.shape)
        # Check every shape from the headers alone, before reading or allocating anything.
        for i in (range(cfg.num_layers) if stacked else [None]):
            name = tmpl.format(i=i)
            stored = index.where[name].shape(name)
            try:
                got = jax.eval_shape(transform, jax.ShapeDtypeStruct(stored, jnp.float32)).shape
            except (TypeError, ValueError):
                got = None
            if got != want:
                raise CheckpointError(f"{path}: tensor {name} has shape {stored}, which does "
                                      f"not fit the config (want {want} in tidejax layout)")

        def read(i, idx, tmpl=tmpl, transform=transform):
            # The transforms are views of the memory-mapped file and the slice is taken
            # before the dtype conversion, so a device reads and converts only its part.
            return np.asarray(transform(index.get(tmpl.format(i=i)))[idx], dtype=np_dtype)

        if stacked:
            def fetch(idx, read=read):
                layers = range(cfg.num_layers)[idx[0]]
                return np.stack([read(i, idx[1:]) for i in layers])
        else:
            def fetch(idx, read=read):
                return read(None, idx)

        if shardings is None:
            value = fetch(tuple(slice(None) for _ in target.shape))
        else:
            sharding = shardings
            for part in key_path:
                sharding = sharding[part]
            value = jax.make_array_from_callback(target.shape, sharding, fetch)
        node = params
        for part in key_path[:-1]:
            node = node.setdefault(part, {})
        node[key_path[-1]] = value
    return cfg, params
