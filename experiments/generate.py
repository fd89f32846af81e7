"""Greedy text generation from a Qwen2-family model: `python -m tidejax.experiments.generate`.

With no arguments it uses the tiny preset with random weights and a small BPE tokenizer,
so it runs anywhere; `--hf-path DIR` loads a real HF Qwen2 checkpoint and its tokenizer.
"""

from __future__ import annotations

import argparse
import functools
import logging

import jax
import jax.numpy as jnp

from tidejax import models
from tidejax.models.dense_cache import dense_attend, init_dense_cache
from tidejax.models.testing import tiny_tokenizer

log = logging.getLogger("tidejax.generate")


@functools.lru_cache(maxsize=8)
def _cached_step(config):
    """One jitted forward per model config, so repeated calls reuse its compilations."""
    return jax.jit(functools.partial(models.forward_with_cache, config, attend=dense_attend))


def greedy_generate(config, params, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Prefill the prompt into a dense cache, then decode one token per step."""
    max_len = len(prompt_ids) + max_new_tokens
    step = _cached_step(config)
    cache = init_dense_cache(config, 1, max_len)
    tokens = jnp.asarray([prompt_ids], jnp.int32)
    positions = jnp.arange(len(prompt_ids))[None]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits, cache = step(params, tokens, positions, cache=cache, aux=positions)
        next_id = int(jnp.argmax(logits[0, -1]))
        out.append(next_id)
        if next_id in stop_ids:
            break
        positions = positions[:, -1:] + 1
        tokens = jnp.asarray([[next_id]], jnp.int32)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="i need a pair of red running shoes")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--hf-path", default=None, help="HF Qwen2 checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.hf_path:
        config, params = models.load_hf(args.hf_path)
        tokenizer = models.load_tokenizer(args.hf_path)
    else:
        config = models.presets["tiny"]
        params = models.init_params(config, jax.random.key(args.seed))
        tokenizer = tiny_tokenizer()
    prompt = tokenizer.turn("user", args.prompt) + tokenizer.turn_prefix("assistant")
    ids = greedy_generate(config, params, prompt, args.max_new_tokens, tokenizer.eos_ids)
    print(f"prompt: {args.prompt}\ncompletion ({len(ids)} tokens): {tokenizer.decode(ids)!r}")


if __name__ == "__main__":
    main()
