"""Test doubles that ship with the package: a tiny config, params and tokenizer."""

from __future__ import annotations

import functools

import jax

from tidejax.models.config import ModelConfig, presets
from tidejax.models.model import Params, init_params
from tidejax.models.tokenizer import Tokenizer, train_bpe

_CORPUS = [
    "i need a pair of red running shoes that is lightweight, and price lower than 50 dollars",
    "search[red running shoes] click[buy now] click[next >] click[< prev] click[back to search]",
    "you are in the kitchen. you see a mug, a sink and a cabinet. go to cabinet 1",
    "the quick brown fox jumps over the lazy dog 0123456789",
]


def tiny_config(**changes) -> ModelConfig:
    return presets["tiny"].replace(**changes)


def tiny_params(config: ModelConfig | None = None, seed: int = 0) -> Params:
    return init_params(config or tiny_config(), jax.random.key(seed))


@functools.lru_cache(maxsize=4)
def tiny_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """A byte-level BPE trained on a few lines; deterministic, builds in milliseconds."""
    return train_bpe(_CORPUS * 4, vocab_size)
