"""The golden-token workload: requests whose generated tokens are pinned across engine
changes (`test_engine_golden.py`). Run as a script to (re)record the fixture, only from
an engine whose tokens are the reference:

    python -m tests.serving.golden_tokens tests/serving/data/golden_tokens.json
"""

from __future__ import annotations

import json
import sys

import numpy as np
from tidejax.serving import Request, RequestLoop, SamplingParams
from tidejax.serving.testing import tiny_engine, tiny_engine_config


def golden_requests() -> list[tuple[str, Request]]:
    """(phase, request): greedy, temperature, top-k, top-p and stop ids in one mixed batch,
    more requests than slots, a prompt past the largest bucket (chunked prefill)."""
    rng = np.random.default_rng(1234)
    samplings = [
        SamplingParams.greedy(),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, top_k=20, seed=12),
        SamplingParams(temperature=1.3, top_p=0.8, seed=13),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=14),
        SamplingParams(temperature=1.0, seed=15, stop_token_ids=(282, 3)),
        SamplingParams.greedy(stop_token_ids=(25,)),
        SamplingParams(temperature=0.9, seed=16),
    ]
    lengths = [5, 17, 40, 70, 9, 33, 12, 3]
    requests = []
    for i, (sampling, n) in enumerate(zip(samplings, lengths)):
        prompt = rng.integers(0, 512, n).tolist()
        requests.append(("mixed", Request(f"r{i}", None, prompt, 10 + 3 * i, sampling)))
    return requests

def run_golden(engine=None) -> dict[str, dict]:
    """Serve the workload; then a pinned two-turn task (resume on pinned pages) and the
    same two turns unpinned. Returns request id -> tokens and log-probs."""
    engine = engine or tiny_engine(tiny_engine_config())
    loop = RequestLoop(engine)
    for _, request in golden_requests():
        loop.submit(request)
    out = {c.request_id: c for c in loop.run()}
    rng = np.random.default_rng(99)
    for task, pin in (("pinned", True), ("released", False)):
        prompt = rng.integers(0, 512, 21).tolist()
        sampling = SamplingParams(temperature=1.0, seed=77)
        if pin:
            loop.pin(task)
        loop.submit(Request(f"{task}/0", task, prompt, 12, sampling))
        first = {c.request_id: c for c in loop.run()}[f"{task}/0"]
        observation = rng.integers(0, 512, 9).tolist()
        second_prompt = list(prompt) + list(first.token_ids) + observation
        loop.submit(Request(f"{task}/1", task, second_prompt, 14, sampling.replace(seed=78)))
        out.update({f"{task}/0": first})
        out.update({c.request_id: c for c in loop.run()})
    return {rid: {"tokens": list(c.token_ids), "logprobs": [float(x) for x in c.logprobs],
                  "cached_tokens": c.cached_tokens}
            for rid, c in sorted(out.items())}

if __name__ == "__main__":
    result = run_golden()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    print({rid: len(r["tokens"]) for rid, r in result.items()})
