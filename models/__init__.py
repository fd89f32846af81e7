"""Qwen2-family decoder in Flax NNX, HF loading, tokenizers (installed as `tidejax.models`)."""

from tidejax.models.chat_template import CHATML, ChatTemplate, load_chat_template
from tidejax.models.config import ModelConfig, get_preset, presets
from tidejax.models.hf import CheckpointError, load_hf
from tidejax.models.logprobs import token_logprobs
from tidejax.models.model import (
    abstract_params,
    forward,
    forward_with_cache,
    hidden_states,
    init_params,
    logical_axes,
    param_count,
)
from tidejax.models.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh, param_shardings
from tidejax.models.tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "CHATML", "ChatTemplate", "CheckpointError", "ModelConfig", "ROLLOUT_RULES", "TRAIN_RULES",
    "Tokenizer", "abstract_params", "forward", "forward_with_cache", "get_preset",
    "hidden_states", "init_params", "load_chat_template", "load_hf", "load_tokenizer",
    "logical_axes", "make_mesh", "param_count", "param_shardings", "presets", "token_logprobs",
    "train_bpe",
]
