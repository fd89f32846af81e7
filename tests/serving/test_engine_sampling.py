"""Sampling: greedy, temperature, top-k, top-p, behaviour log-probs, explicit keys."""

import jax
import jax.numpy as jnp
import numpy as np
from tidejax.serving.sampling import sample_tokens

sample = jax.jit(sample_tokens)


ROWS, VOCAB = 4000, 8  # one shape for every call: one compilation


def draw(logits_V, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """n draws for one row of logits: n slots, same seed, positions 0..n-1."""
    padded = np.full(VOCAB, -1e9, np.float32)  # padding tokens have probability 0
    padded[: len(logits_V)] = logits_V
    logits = jnp.broadcast_to(jnp.asarray(padded), (ROWS, VOCAB))
    keys = jnp.broadcast_to(jax.random.key_data(jax.random.key(seed)), (ROWS, 2))
    tokens, logprobs = sample(logits, keys, jnp.arange(ROWS, dtype=jnp.int32),
                              jnp.full((ROWS,), temperature), jnp.full((ROWS,), top_k, jnp.int32),
                              jnp.full((ROWS,), top_p))
    return np.asarray(tokens)[:n], np.asarray(logprobs)[:n]


def test_greedy_is_argmax_with_untempered_logprob():
    logits = np.array([0.1, 2.0, -1.0, 1.9], np.float32)
    tokens, logprobs = draw(logits, 4, temperature=0.0, top_k=2, top_p=0.1)
    assert (np.asarray(tokens) == 1).all()
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(logits)[1], rtol=1e-6)


def test_top_k_and_top_p_keep_only_their_sets():
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (by hand: log2 steps)
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625], np.float32))
    tokens, _ = draw(logits, 400, top_k=2, seed=1)
    assert set(np.asarray(tokens).tolist()) == {0, 1}
    # top_p=0.7: mass ahead of token 1 is 0.5 < 0.7 (kept), ahead of token 2 is 0.75 (dropped).
    tokens, _ = draw(logits, 400, top_p=0.7, seed=2)
    assert set(np.asarray(tokens).tolist()) == {0, 1}
    # top_k=1 is greedy whatever the temperature.
    tokens, _ = draw(logits, 50, temperature=5.0, top_k=1, seed=3)
    assert (np.asarray(tokens) == 0).all()


def test_temperature_sampling_follows_softmax_and_logprob_is_tempered():
    logits = np.array([1.0, 0.0, -1.0, 0.5], np.float32)
    temperature = 2.0
    n = 4000
    tokens, logprobs = draw(logits, n, temperature=temperature, seed=4)
    tokens = np.asarray(tokens)
    want = np.asarray(jax.nn.softmax(logits / temperature))
    freq = np.bincount(tokens, minlength=4) / n
    assert np.abs(freq - want).max() < 0.03  # ~4 standard errors at n=4000
    np.testing.assert_allclose(logprobs, np.log(want)[tokens], rtol=1e-5)


def test_draws_depend_on_seed_and_position_only():
    logits = np.zeros(VOCAB, np.float32)
    a, _ = draw(logits, 16, seed=7)
    b, _ = draw(logits, 16, seed=7)
    c, _ = draw(logits, 16, seed=8)
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()
    assert len(set(np.asarray(a).tolist())) > 3  # positions give different draws


def test_sampling_has_no_conditionals():
    """A `cond` predicate is copied to the host on GPU: the sampler uses selects only."""
    import jax
    import jax.numpy as jnp
    from tidejax.serving.sampling import sample_tokens

    b, v = 3, 11
    jaxpr = jax.make_jaxpr(sample_tokens)(
        jnp.zeros((b, v)), jnp.zeros((b, 2), jnp.uint32), jnp.zeros((b,), jnp.int32),
        jnp.ones((b,)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)))

    def primitives(jaxpr):  # nested jaxprs too (jitted helpers appear as pjit)
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from primitives(inner)

    names = set(primitives(jaxpr.jaxpr))
    assert "cond" not in names and "while" not in names, names
