"""Serving engine (installed as `tidejax.serving`): JetStream-style prefill / insert /
generate over a paged KV pool with a prefix cache and task-level pinning; a request-level
continuous-batching loop with policy hooks; a hand-checkable mock engine.

Names are loaded on first use (PEP 562), so importing a pure-Python submodule such as
``tidejax.serving.page_pool`` (the simulator does) does not import jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> submodule that defines it
_WHERE = {
    "EngineConfig": "config",
    "SamplingParams": "config",
    "Engine": "engine",
    "EngineMetrics": "engine",
    "OutOfPages": "engine",
    "Prefix": "engine",
    "make_engine": "engine",
    "KVPages": "kv_pool",
    "KVPool": "kv_pool",
    "TurnPlan": "kv_pool",
    "Completion": "loop",
    "EngineView": "loop",
    "Policy": "loop",
    "Request": "loop",
    "RequestLevelPolicy": "loop",
    "RequestLoop": "loop",
    "Running": "loop",
    "MockEngine": "mock_engine",
    "PagePool": "page_pool",
    "PoolFull": "page_pool",
    "PoolUsage": "page_pool",
    "KERNELS": "paged_attention",
    "sample_tokens": "sampling",
    "DecodeState": "steps",
    "HostResults": "steps",
    "ResultTokens": "steps",
}

__all__ = [
    "KERNELS",
    "Completion",
    "DecodeState",
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "EngineView",
    "HostResults",
    "KVPages",
    "KVPool",
    "MockEngine",
    "OutOfPages",
    "PagePool",
    "Policy",
    "PoolFull",
    "PoolUsage",
    "Prefix",
    "Request",
    "RequestLevelPolicy",
    "RequestLoop",
    "ResultTokens",
    "Running",
    "SamplingParams",
    "TurnPlan",
    "make_engine",
    "sample_tokens",
]


def __getattr__(name: str):
    sub = _WHERE.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static tools see the eager imports
    from tidejax.serving.config import EngineConfig, SamplingParams
    from tidejax.serving.engine import Engine, EngineMetrics, OutOfPages, Prefix, make_engine
    from tidejax.serving.kv_pool import KVPages, KVPool, TurnPlan
    from tidejax.serving.loop import (
        Completion,
        EngineView,
        Policy,
        Request,
        RequestLevelPolicy,
        RequestLoop,
        Running,
    )
    from tidejax.serving.mock_engine import MockEngine
    from tidejax.serving.page_pool import PagePool, PoolFull, PoolUsage
    from tidejax.serving.paged_attention import KERNELS
    from tidejax.serving.sampling import sample_tokens
    from tidejax.serving.steps import DecodeState, HostResults, ResultTokens
