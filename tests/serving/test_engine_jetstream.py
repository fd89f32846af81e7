"""JetStream's own orchestrator serving a tidejax engine through the optional adapter.

Runs only where the `[jetstream]` extra (google-jetstream 0.2.2) is installed.
"""

import asyncio
import logging

import pytest

_root_level = logging.getLogger().level
pytest.importorskip("jetstream.core.orchestrator")

from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2
from tidejax.serving import Request, RequestLoop, SamplingParams
from tidejax.serving.jetstream_adapter import JetStreamEngine
from tidejax.serving.testing import tiny_engine

# Importing the orchestrator sets the root logger to DEBUG with a stdout handler; undo it
# so the rest of the test session neither logs every jax compile nor writes to a closed
# capture stream at exit.
logging.getLogger().removeHandler(orchestrator.handler)
logging.getLogger().setLevel(_root_level)


async def decode(client, token_ids, max_tokens):
    request = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=token_ids),
        max_tokens=max_tokens)
    out = []
    async for response in client.Decode(request):
        out.extend(response.stream_content.samples[0].token_ids)
    return out


def test_jetstream_orchestrator_streams_the_engine_greedy_tokens():
    adapter = JetStreamEngine(tiny_engine())
    stop = adapter.tokenizer.stop_tokens
    driver = orchestrator.Driver(prefill_engines=[adapter], generate_engines=[adapter],
                                 prefill_params=[adapter.load_params()],
                                 generate_params=[adapter.load_params()], interleaved_mode=True)
    prompts = [[5, 9, 300, 41, 7], [400, 3, 3, 90]]
    try:
        client = orchestrator.LLMOrchestrator(driver=driver)

        async def both():
            return await asyncio.gather(*(decode(client, p, 6) for p in prompts))

        streamed = asyncio.run(asyncio.wait_for(both(), timeout=120))
    finally:
        driver.stop()
    # The same greedy requests straight through the engine; JetStream prepends BOS and
    # streams from the second token on (0.2.2 does not stream the prefill's token).
    loop = RequestLoop(tiny_engine())
    for i, p in enumerate(prompts):
        loop.submit(Request(i, None, [adapter.tokenizer.bos_id] + p, 7, SamplingParams.greedy()))
    for c in sorted(loop.run(), key=lambda c: c.request_id):
        want = []
        for token in c.token_ids[1:]:
            if token in stop:
                break
            want.append(token)
        assert streamed[c.request_id] == want
    assert all(len(s) > 0 for s in streamed)
