"""Qwen2-family model configuration and presets."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (Qwen2 naming). Shapes: D model, F ffn, N/K heads, H head dim."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = True
    max_position_embeddings: int = 32768
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError("ModelConfig.hidden_size must be divisible by num_heads "
                                 "when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be a positive even int, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"ModelConfig.rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """K and V bytes one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
        """Build from a HF `config.json` dict; only Qwen2-architecture models are accepted."""
        model_type = hf.get("model_type")
        if model_type not in ("qwen2",):
            raise ValueError(f"unsupported model_type {model_type!r}: tidejax loads 'qwen2' models")
        if hf.get("rope_scaling"):
            raise ValueError("config.json: rope_scaling is not supported")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # newer transformers nest it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim"),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            dtype=dtype,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _qwen25(hidden, inter, layers, heads, kv, tied, vocab, eps=1e-6):
    # Values from each model's published HF config.json (Qwen/Qwen2.5-*).
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       rope_theta=1_000_000.0, rms_norm_eps=eps, tie_word_embeddings=tied,
                       dtype="bfloat16")


presets: dict[str, ModelConfig] = {
    # CPU tests and the default job: small enough to compile and train in seconds.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, rope_theta=10_000.0,
                        tie_word_embeddings=True, max_position_embeddings=4096),
    # Twice tiny's width (hidden and MLP sizes), about four times its parameters per layer.
    "small": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2, rope_theta=10_000.0,
                         tie_word_embeddings=True, max_position_embeddings=4096),
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, True, 151936),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, True, 151936),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, True, 151936),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, False, 152064),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, False, 152064, eps=1e-5),
}


def get_preset(name: str) -> ModelConfig:
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(presets)}")
    return presets[name]
