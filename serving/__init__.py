"""Serving engine (installed as `tidejax.serving`): JetStream-style prefill / insert /
generate over a paged KV pool with a prefix cache and task-level pinning; a request-level
continuous-batching loop with policy hooks; a hand-checkable mock engine."""

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

__all__ = [
    "KERNELS", "Completion", "DecodeState", "Engine", "EngineConfig", "EngineMetrics",
    "EngineView", "HostResults", "KVPages", "KVPool", "MockEngine", "OutOfPages", "PagePool",
    "Policy", "PoolFull", "PoolUsage", "Prefix", "Request", "RequestLevelPolicy", "RequestLoop",
    "ResultTokens", "Running", "SamplingParams", "TurnPlan", "make_engine", "sample_tokens",
]
