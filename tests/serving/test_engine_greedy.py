"""Engine decoding equals the model's full-sequence forward; prefix hits change nothing."""

import functools

import jax
import numpy as np
import pytest
from tidejax.models.testing import tiny_config
from tidejax.serving import Request, RequestLoop, SamplingParams
from tidejax.serving.testing import random_params, tiny_engine, tiny_engine_config

from tidejax import models

REF_LEN = 128  # one padded shape for every reference forward: one compilation


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_config()
    params = random_params(cfg)
    forward = jax.jit(functools.partial(models.forward, cfg))

    def logprobs(sequence):
        """log p(next | prefix) at every position of `sequence` (causal, padding inert)."""
        tokens = np.zeros((1, REF_LEN), np.int32)
        tokens[0, : len(sequence)] = sequence
        return np.asarray(jax.nn.log_softmax(forward(params, tokens)[0, : len(sequence)], -1))

    return params, logprobs


def check_greedy(completion, logprobs):
    """Each generated token is the argmax of the full forward over everything before it,
    and its behaviour log-prob is that forward's log-softmax at the token."""
    prompt, generated = list(completion.prompt_token_ids), list(completion.token_ids)
    lp = logprobs(prompt + generated)
    for i, token in enumerate(generated):
        row = lp[len(prompt) + i - 1]
        # Exact argmax unless the top two are tied to float32 noise.
        assert row[token] >= row.max() - 1e-5, (i, token, int(row.argmax()))
        np.testing.assert_allclose(completion.logprobs[i], row[token], rtol=1e-5, atol=2e-5)


def test_greedy_continuous_batching_matches_full_forward(reference):
    params, logprobs = reference
    engine = tiny_engine(params=params)
    loop = RequestLoop(engine)
    rng = np.random.default_rng(0)
    # Varied lengths, including one past the largest bucket (chunked prefill, 64 + 16),
    # more requests than slots (admitted as slots free up), different max_new_tokens.
    lengths = [5, 17, 40, 70, 9, 33]
    for i, n in enumerate(lengths):
        prompt = rng.integers(0, 512, n).tolist()
        loop.submit(Request(i, None, prompt, max_new_tokens=6 + 3 * i,
                            sampling=SamplingParams.greedy()))
    done = {c.request_id: c for c in loop.run()}
    assert sorted(done) == list(range(len(lengths)))
    for i, completion in done.items():
        assert len(completion.token_ids) == 6 + 3 * i and completion.finish_reason == "length"
        check_greedy(completion, logprobs)
    assert engine.metrics().decode_tokens == sum(6 + 3 * i - 1 for i in range(len(lengths)))
    engine.pool.check()


def test_multi_turn_resume_from_pinned_pages_matches_cold(reference):
    """Turn 2 of a pinned task reuses its whole turn-1 sequence (partial page included)."""
    params, logprobs = reference
    engine = tiny_engine(params=params)
    loop = RequestLoop(engine)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 512, 21).tolist()
    loop.submit(Request("t1", "task", prompt, 7, SamplingParams.greedy()))
    loop.pin("task")  # applied when the turn completes
    (turn1,) = list(loop.run())
    assert turn1.pinned
    assert engine.accounting().pinned_tokens > 0
    observation = rng.integers(0, 512, 6).tolist()
    prompt2 = prompt + list(turn1.token_ids) + observation
    loop.submit(Request("t2", "task", prompt2, 5, SamplingParams.greedy()))
    (turn2,) = list(loop.run())
    # Everything but the last generated token of turn 1 had K/V in the pinned pages.
    assert turn2.cached_tokens == len(prompt) + len(turn1.token_ids) - 1
    check_greedy(turn2, logprobs)
    engine.pool.check()


def test_cached_prefix_gives_same_first_token_and_logprob():
    engine = tiny_engine()
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 512, 35).tolist()
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=7, max_new_tokens=4)
    cold = engine.prefill(engine.params, prompt, "a", sampling)
    engine.discard(cold)  # released: its full pages stay in the prefix cache
    warm = engine.prefill(engine.params, prompt, "b", sampling)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 32
    a, b = cold.first.to_host(), warm.first.to_host()
    assert a.tokens[0] == b.tokens[0]  # same seed and position: same draw
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    engine.discard(warm)
    engine.pool.check()


def test_full_prompt_hit_recomputes_only_the_last_token():
    engine = tiny_engine()
    prompt = list(range(1, 33))  # exactly 4 full pages
    first = engine.prefill(engine.params, prompt, "x", SamplingParams.greedy())
    engine.discard(first)
    again = engine.prefill(engine.params, prompt, "y", SamplingParams.greedy())
    assert again.computed_tokens == 1 and again.cached_tokens == 31
    assert first.first.to_host().tokens[0] == again.first.to_host().tokens[0]
    np.testing.assert_allclose(first.first.to_host().logprobs, again.first.to_host().logprobs,
                               atol=1e-5)
    engine.discard(again)
    engine.pool.check()


def test_two_device_engine_shards_kv_heads_and_matches_one_device(reference):
    params, _ = reference
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    one, two = tiny_engine(params=params), tiny_engine(params=params, devices=jax.devices()[:2])
    assert two.kv_sharding.spec[3] == "tensor"
    prompt = np.random.default_rng(4).integers(0, 512, 12).tolist()
    outs = []
    for engine in (one, two):
        loop = RequestLoop(engine)
        loop.submit(Request(0, None, prompt, 4, SamplingParams.greedy()))
        outs.extend(loop.run())
    assert outs[0].token_ids == outs[1].token_ids
    np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-5)


def test_engine_config_validation_names_the_field():
    with pytest.raises(ValueError, match="page_size"):
        tiny_engine_config(page_size=0)
    with pytest.raises(ValueError, match="prefill_buckets"):
        tiny_engine_config(prefill_buckets=(64, 16))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_packed_prefill_matches_full_forward_and_pads_less(reference):
    """Four prompts admitted at once share packed prefill calls: a GRPO group of three on
    one prompt (the 2nd and 3rd hit pages the 1st writes in the same batch, so they start
    a new call), and a prompt longer than the largest bucket (split across calls). Then a
    pinned task's next turn (CTB's resume path) prefills only its new tokens, packed."""
    params, logprobs = reference
    packed = tiny_engine(tiny_engine_config(prefill_packing=True), params=params)
    rng = np.random.default_rng(8)
    group = rng.integers(0, 512, 27).tolist()
    long_prompt = rng.integers(0, 512, 70).tolist()
    loop = RequestLoop(packed)
    for i in range(3):
        loop.submit(Request(f"g{i}", f"g{i}", group, 6, SamplingParams.greedy()))
    loop.submit(Request("long", "long", long_prompt, 5, SamplingParams.greedy()))
    loop.pin("long")
    done = {c.request_id: c for c in loop.run()}
    for completion in done.values():
        check_greedy(completion, logprobs)
    assert done["g1"].cached_tokens == done["g2"].cached_tokens == 24  # three full pages
    metrics = packed.metrics()
    # 27 + 3 + 3 + 70 new tokens in calls of <= 64: far fewer padded tokens than one
    # request per call (64 + 16 + 16 + 64 + 16 = 176).
    assert metrics.prefill_tokens_computed == 27 + 3 + 3 + 70
    assert metrics.prefill_tokens_padded < 176 and metrics.prefill_calls < 5
    observation = rng.integers(0, 512, 9).tolist()
    prompt2 = long_prompt + list(done["long"].token_ids) + observation
    loop.submit(Request("long/2", "long", prompt2, 4, SamplingParams.greedy()))
    (turn2,) = list(loop.run())
    assert turn2.cached_tokens == len(long_prompt) + len(done["long"].token_ids) - 1
    check_greedy(turn2, logprobs)
    packed.pool.check()
