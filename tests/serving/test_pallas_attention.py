"""The Pallas decode kernel: parity with dense attention (in Pallas's interpreter on CPU),
lowering for a GPU through Triton at Qwen2.5 shapes, and a tensor-parallel rank."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tidejax.models.model import gqa_attention
from tidejax.serving.pallas_attention import paged_decode_attention
from tidejax.serving.testing import tiny_engine, tiny_engine_config

from golden_tokens import run_golden

GOLDEN = pathlib.Path(__file__).parent / "data" / "golden_tokens.json"


def test_kernel_matches_dense_attention_for_ragged_shared_and_edge_rows():
    """Rows with no cached token, a cached length ending exactly on a page edge, one
    ending mid-page, a full row, and two rows sharing prefix pages; layer 1 of a 3-layer
    pool (the kernel indexes the stacked pool itself)."""
    rng = np.random.default_rng(11)
    layers, heads, kv_heads, head_dim, page_size, max_pages, num_pages = 3, 6, 2, 16, 4, 6, 40
    cached = np.array([0, 8, 13, 23, 6], np.int32)  # row 3 fills its 6 pages but one slot
    batch, layer = len(cached), 1
    k_dense = rng.normal(size=(batch, max_pages * page_size, kv_heads, head_dim)
                         ).astype(np.float32)
    v_dense = rng.normal(size=k_dense.shape).astype(np.float32)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    k_dense[4, :4], v_dense[4, :4] = k_dense[2, :4], v_dense[2, :4]  # a shared first page
    table[4, 0] = table[2, 0]
    k_pool = rng.normal(size=(layers, num_pages, page_size, kv_heads, head_dim)
                        ).astype(np.float32)  # other layers and unused pages: noise
    v_pool = rng.normal(size=k_pool.shape).astype(np.float32)
    for b in range(batch):
        for position in range(cached[b]):
            page, offset = table[b, position // page_size], position % page_size
            k_pool[layer, page, offset] = k_dense[b, position]
            v_pool[layer, page, offset] = v_dense[b, position]
    q = rng.normal(size=(batch, heads, head_dim)).astype(np.float32)
    k_new = np.stack([k_dense[b, cached[b]] for b in range(batch)])
    v_new = np.stack([v_dense[b, cached[b]] for b in range(batch)])
    got = paged_decode_attention(q, k_new, v_new, k_pool, v_pool, jnp.int32(layer),
                                 table.astype(np.int32), cached, interpret=True)
    mask = np.arange(k_dense.shape[1])[None, None, :] <= cached[:, None, None]
    want = gqa_attention(q[:, None], k_dense, v_dense, mask)[:, 0]
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("shape", [(24, 14, 2, 64), (28, 28, 4, 128), (48, 40, 8, 128)],
                         ids=["qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b"])
def test_kernel_lowers_for_a_gpu_through_triton(shape):
    """Lowered for CUDA on this CPU machine: Pallas's Triton lowering checks the kernel's
    block shapes and operations without a GPU (bf16, 64 slots, 16-token pages)."""
    layers, heads, kv_heads, head_dim = shape
    bf16, slots, pages, per_seq = jnp.bfloat16, 64, 4097, 256
    spec = jax.ShapeDtypeStruct
    args = (spec((slots, heads, head_dim), bf16), spec((slots, kv_heads, head_dim), bf16),
            spec((slots, kv_heads, head_dim), bf16),
            spec((layers, pages, 16, kv_heads, head_dim), bf16),
            spec((layers, pages, 16, kv_heads, head_dim), bf16), spec((), jnp.int32),
            spec((slots, per_seq), jnp.int32), spec((slots,), jnp.int32))
    text = paged_decode_attention.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "tidejax_paged_decode" in text


def test_two_device_rank_runs_the_kernel_per_device_with_the_recorded_tokens():
    """On a tensor-parallel rank each device runs the kernel on its own KV heads (a
    shard_map); the tokens are the recorded engine's."""
    expected = json.loads(GOLDEN.read_text())
    got = run_golden(tiny_engine(tiny_engine_config(attention="pallas"),
                                 devices=jax.devices()[:2]))
    for rid, want in expected.items():
        assert got[rid]["tokens"] == want["tokens"], rid
        np.testing.assert_allclose(got[rid]["logprobs"], want["logprobs"], rtol=1e-5,
                                   atol=1e-5, err_msg=rid)
