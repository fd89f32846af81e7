"""Same seeds, same tokens: the engine reproduces the tokens recorded from the engine of
commit f663e89 (before the overlapped, multi-token, bounded-attention engine), greedy and
sampled, through continuous batching, chunked prefill, stop ids and a pinned resume.
The RL job's reproducibility rests on this."""

import json
import pathlib

import numpy as np
import pytest
from tidejax.serving.testing import tiny_engine, tiny_engine_config

from golden_tokens import run_golden

FIXTURE = pathlib.Path(__file__).parent / "data" / "golden_tokens.json"


@pytest.mark.parametrize("changes", [{}, {"decode_steps_per_call": 1},
                                     {"decode_steps_per_call": 3, "attention_span": "live"},
                                     {"prefill_packing": False}, {"attention": "pallas"}],
                         ids=["default", "k1", "k3-live-span", "one-request-prefill",
                              "pallas-decode-interpreted"])
def test_same_tokens_as_recorded_engine(changes):
    """Every variant: the same tokens and cached-prefix counts as the recorded engine, and
    log-probs equal up to float rounding. Not bit for bit: bit-identical held on a quiet
    machine but not with other jobs sharing the 2 cores (the pinned resume's log-probs
    moved by ~5e-7, tokens unchanged), most likely because what shares a call follows host
    timing; the live attention span, packed prefill (the default) and the Pallas decode
    kernel (run in Pallas's interpreter here) move logits by rounding too."""
    expected = json.loads(FIXTURE.read_text())
    got = run_golden(tiny_engine(tiny_engine_config(**changes)))
    assert sorted(got) == sorted(expected)
    for rid, want in expected.items():
        assert got[rid]["tokens"] == want["tokens"], rid
        assert got[rid]["cached_tokens"] == want["cached_tokens"], rid
        np.testing.assert_allclose(got[rid]["logprobs"], want["logprobs"], rtol=1e-5,
                                   atol=1e-5, err_msg=rid)
