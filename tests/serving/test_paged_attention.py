"""Paged attention against dense attention; prefill over a cached prefix against a cold one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from tidejax.models.model import gqa_attention, output_kernel
from tidejax.models.testing import tiny_config
from tidejax.serving.kv_pool import KVPool, init_kv_pages
from tidejax.serving.paged_attention import (
    bind_kernel,
    gather_kernel,
    packed_gather_attention,
    write_kv,
    write_slots,
)
from tidejax.serving.steps import paged_hidden
from tidejax.serving.testing import random_params

from tidejax import models



def scatter_into_pages(k_dense, v_dense, table, cached, num_pages, page_size):
    """The first `cached[b]` keys and values of each row, written into its table's pages."""
    batch, _, kv_heads, head_dim = k_dense.shape
    k_pages = np.zeros((num_pages, page_size, kv_heads, head_dim), np.float32)
    v_pages = np.zeros_like(k_pages)
    for b in range(batch):
        for pos in range(cached[b]):
            k_pages[table[b, pos // page_size], pos % page_size] = k_dense[b, pos]
            v_pages[table[b, pos // page_size], pos % page_size] = v_dense[b, pos]
    return k_pages, v_pages


def test_gather_kernel_matches_dense_causal_attention():
    rng = np.random.default_rng(0)
    batch, chunk, heads, kv_heads, head_dim, page_size, max_pages = 2, 3, 4, 2, 8, 4, 5
    num_pages = 12
    cached = np.array([6, 13])  # second sequence: a partly filled 4th page
    total = cached + chunk
    # Each sequence's keys at contiguous positions 0..total-1 (the dense reference).
    k_dense = rng.normal(size=(batch, max_pages * page_size, kv_heads, head_dim)).astype(np.float32)
    v_dense = rng.normal(size=k_dense.shape).astype(np.float32)
    q = rng.normal(size=(batch, chunk, heads, head_dim)).astype(np.float32)
    # Scatter the cached part into shuffled pool pages.
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    k_pages, v_pages = scatter_into_pages(k_dense, v_dense, table, cached, num_pages, page_size)
    k_new = np.stack([k_dense[b, cached[b]:total[b]] for b in range(batch)])
    v_new = np.stack([v_dense[b, cached[b]:total[b]] for b in range(batch)])
    got = jax.jit(gather_kernel)(q, k_new, v_new, k_pages, v_pages, table, cached)
    # Dense: every sequence's keys contiguous, causal mask up to each query's position.
    positions = cached[:, None] + np.arange(chunk)[None]
    mask = np.arange(k_dense.shape[1])[None, None, :] <= positions[:, :, None]
    want = jax.jit(gqa_attention)(q, k_dense, v_dense, mask)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_write_kv_puts_tokens_in_their_pages_and_padding_in_trash():
    layers, num_pages, page_size = 2, 6, 4
    pool = jnp.zeros((layers, num_pages + 1, page_size, 1, 1))
    table = jnp.array([[3, 1, 5]])
    positions = jnp.array([[3, 4, 5, 6]])
    valid = jnp.array([[True, True, True, False]])
    page, offset = write_slots(table, positions, valid, page_size, trash_page=num_pages)
    np.testing.assert_array_equal(page, [[3, 1, 1, num_pages]])
    np.testing.assert_array_equal(offset, [[3, 0, 1, 2]])
    new = jnp.arange(1.0, 5.0).reshape(1, 1, 4, 1, 1) * jnp.array([1.0, 10.0]).reshape(2, 1, 1, 1, 1)
    out = write_kv(pool, new, page, offset)
    assert float(out[1, 3, 3, 0, 0]) == 10.0 and float(out[0, 1, 1, 0, 0]) == 3.0
    assert float(out[:, :num_pages].sum()) == (1 + 2 + 3) * 11


def test_prefill_over_cached_prefix_matches_cold_prefill():
    """Two prompts share 3 full pages; the second computes only its own tokens."""
    cfg = tiny_config()
    params = random_params(cfg)
    page_size, num_pages, max_pages = 8, 16, 8
    rng = np.random.default_rng(3)
    shared = rng.integers(0, cfg.vocab_size, 27).tolist()  # 3 full pages + 3 tokens
    first = shared + rng.integers(0, cfg.vocab_size, 5).tolist()
    second = shared + rng.integers(0, cfg.vocab_size, 9).tolist()

    pool = KVPool(num_pages, page_size, max_pages)
    kv = init_kv_pages(cfg, num_pages, page_size)
    bucket = 64

    @functools.partial(jax.jit, donate_argnums=(0,))
    def prefill(kv, tokens_T, num_new, start, row):
        write = (jnp.arange(bucket) < num_new)[None]
        hidden, kv = paged_hidden(cfg, bind_kernel("gather"), page_size, params, kv,
                                  tokens_T[None],
                                  start[None], row[None], write)
        logits = jnp.einsum("btd,dv->btv", hidden, output_kernel(cfg, params))
        return kv, logits[0]

    def run(task, prompt):
        plan = pool.begin_turn(task, prompt)
        new = prompt[plan.start:]
        chunk = np.zeros(bucket, np.int32)
        chunk[: len(new)] = new
        return plan, chunk, len(new)

    plan_a, chunk_a, n_a = run("a", first)
    kv, logits_a = prefill(kv, chunk_a, np.int32(n_a), np.int32(plan_a.start),
                           pool.page_row("a"))
    pool.end_turn("a", first + [0], keep=False)  # release: pages stay cached
    plan_b, chunk_b, n_b = run("b", second)
    assert plan_b.start == 24 and plan_b.cached_tokens == 24  # three full pages hit
    kv, logits_b = prefill(kv, chunk_b, np.int32(n_b), np.int32(plan_b.start),
                           pool.page_row("b"))
    pool.check()

    def dense_forward(prompt):  # padded to one shape: causal, so padding changes nothing
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : len(prompt)] = prompt
        return forward(params, tokens)[0, : len(prompt)]

    forward = jax.jit(functools.partial(models.forward, cfg))
    np.testing.assert_allclose(logits_b[:n_b], dense_forward(second)[plan_b.start:],
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(logits_a[:n_a], dense_forward(first), rtol=1e-5, atol=1e-4)
    # A cold paged prefill of `second` in a fresh pool gives the same logits too.
    fresh = KVPool(num_pages, page_size, max_pages)
    plan_c = fresh.begin_turn("c", second)
    assert plan_c.start == 0
    chunk_c = np.zeros(bucket, np.int32)
    chunk_c[: len(second)] = second
    _, logits_c = prefill(init_kv_pages(cfg, num_pages, page_size), chunk_c,
                          np.int32(len(second)), np.int32(0), fresh.page_row("c"))
    np.testing.assert_allclose(logits_b[:n_b], logits_c[24:len(second)], rtol=1e-5, atol=1e-5)


def test_span_bounded_gather_matches_dense_for_ragged_shared_and_edge_rows():
    """Decode attention reading only the first `span` pages of each row (the engine's
    bucketed bound) equals dense attention, for ragged lengths, two rows sharing prefix
    pages, a row whose keys end exactly at the span's last page, and an empty row; and it
    equals the full-row gather up to float rounding (not bit for bit: the reduction over
    keys is shorter, which is why `attention_span="live"` is opt-in)."""
    rng = np.random.default_rng(5)
    heads, kv_heads, head_dim, page_size, max_pages, num_pages = 4, 2, 8, 4, 8, 40
    cached = np.array([5, 16, 11, 0, 9])  # row 1 fills pages 0-3: the edge of span 4
    batch, span = len(cached), 4
    total = cached + 1
    k_dense = rng.normal(size=(batch, max_pages * page_size, kv_heads, head_dim)).astype(np.float32)
    v_dense = rng.normal(size=k_dense.shape).astype(np.float32)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    # Row 4 shares row 2's first two pages (a prefix hit): same keys, same pool pages.
    k_dense[4, :8], v_dense[4, :8] = k_dense[2, :8], v_dense[2, :8]
    table[4, :2] = table[2, :2]
    k_pages, v_pages = scatter_into_pages(k_dense, v_dense, table, cached, num_pages, page_size)
    q = rng.normal(size=(batch, 1, heads, head_dim)).astype(np.float32)
    k_new = np.stack([k_dense[b, cached[b]:total[b]] for b in range(batch)])
    v_new = np.stack([v_dense[b, cached[b]:total[b]] for b in range(batch)])
    kernel = jax.jit(gather_kernel)
    bounded = kernel(q, k_new, v_new, k_pages, v_pages, table[:, :span], cached)
    full = kernel(q, k_new, v_new, k_pages, v_pages, table, cached)
    mask = np.arange(k_dense.shape[1])[None, None, :] <= cached[:, None, None]
    want = jax.jit(gqa_attention)(q, k_dense, v_dense, mask)
    np.testing.assert_allclose(bounded, want, atol=1e-5)
    np.testing.assert_allclose(bounded, full, rtol=1e-5, atol=1e-6)


def test_packed_rows_match_dense_attention_per_request():
    """A packed prefill call's attention (rows of C new tokens, each row one request's
    piece) equals dense causal attention request by request: ragged cached lengths, a
    piece spread over two rows, a piece of exactly one row, a partial last row, a cached
    prefix ending mid-page, two requests sharing prefix pages, and an empty row."""
    rng = np.random.default_rng(7)
    heads, kv_heads, head_dim, page_size, max_pages, num_pages, chunk = 4, 2, 8, 4, 8, 48, 4
    cached = np.array([6, 0, 13, 8])  # request 3 shares request 0's first two pages
    new = np.array([7, 4, 1, 3])  # request 0: rows of 4 + 3; request 1: exactly one row
    requests = len(cached)
    k_dense = rng.normal(size=(requests, max_pages * page_size, kv_heads, head_dim)
                         ).astype(np.float32)
    v_dense = rng.normal(size=k_dense.shape).astype(np.float32)
    table = rng.permutation(num_pages)[: requests * max_pages].reshape(requests, max_pages)
    k_dense[3, :8], v_dense[3, :8] = k_dense[0, :8], v_dense[0, :8]
    table[3, :2] = table[0, :2]
    k_pages, v_pages = scatter_into_pages(k_dense, v_dense, table, cached, num_pages, page_size)
    q_dense = rng.normal(size=(requests, max_pages * page_size, heads, head_dim)
                         ).astype(np.float32)
    # Lay the pieces out in rows; row 5 is empty (segment -1).
    rows = 6
    q_rows = np.zeros((rows, chunk, heads, head_dim), np.float32)
    k_rows = np.zeros((rows, chunk, kv_heads, head_dim), np.float32)
    v_rows = np.zeros_like(k_rows)
    segment = np.full(rows, -1, np.int32)
    position = np.zeros((rows, chunk), np.int32)
    real = np.zeros((rows, chunk), bool)
    row_table = np.zeros((rows, max_pages), np.int32)
    row_cached = np.zeros(rows, np.int32)
    placed = []  # (row, column, request, position)
    row = 0
    for r in range(requests):
        for start in range(0, new[r], chunk):
            count = min(chunk, new[r] - start)
            positions = cached[r] + start + np.arange(count)
            q_rows[row, :count] = q_dense[r, positions]
            k_rows[row, :count] = k_dense[r, positions]
            v_rows[row, :count] = v_dense[r, positions]
            segment[row], row_table[row], row_cached[row] = r, table[r], cached[r]
            position[row] = cached[r] + start + np.arange(chunk)
            real[row, :count] = True
            placed += [(row, c, r, p) for c, p in enumerate(positions)]
            row += 1
    assert row == rows - 1
    got = jax.jit(packed_gather_attention)(q_rows, k_rows, v_rows, k_pages, v_pages, row_table,
                                          row_cached, segment, position, real)
    mask = np.arange(k_dense.shape[1])[None, None, :] <= np.arange(k_dense.shape[1])[None, :, None]
    want = jax.jit(gqa_attention)(q_dense, k_dense, v_dense, np.broadcast_to(
        mask, (requests, *mask.shape[1:])))
    for row, column, r, p in placed:
        np.testing.assert_allclose(got[row, column], want[r, p], atol=1e-5,
                                   err_msg=f"row {row} column {column}")
