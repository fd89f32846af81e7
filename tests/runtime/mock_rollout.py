"""A rollout manager on one mock-engine rank, for tests that drive an env's tasks end to end."""

import asyncio

from tidejax.envs import EnvPool, PoolConfig
from tidejax.models.testing import tiny_tokenizer
from tidejax.runtime.buffer import GlobalBuffer
from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.manager import RolloutManager
from tidejax.runtime.rollout import RolloutWorker
from tidejax.serving import EngineConfig, MockEngine


def run_on_one_mock_rank(env_name, tasks, group_size, *, env_retries=0, **rollout_overrides):
    """Run `tasks` (groups of `group_size`) to the end; returns (manager, buffer, the pool's
    stats, tokenizer)."""
    tok = tiny_tokenizer()

    async def run():
        pool = EnvPool(PoolConfig(capacity=8, max_retries=env_retries))
        engine_cfg = EngineConfig(page_size=16, num_pages=256, max_slots=4, max_pages_per_seq=32,
                                  prefill_buckets=(256,))
        workers = {0: RolloutWorker(0, MockEngine(engine_cfg, vocab_size=tok.vocab_size),
                                    pin_after_turn=True)}
        buffer = GlobalBuffer(staleness_bound=8, micro_batch_tokens=4096)
        cfg = RolloutConfig(**{"max_new_tokens": 4, "batch_groups": len(tasks) // group_size,
                               "staleness_bound": 8, **rollout_overrides})
        manager = RolloutManager(cfg, workers, pool, tok, buffer, env_name, max_seq_len=512)
        manager.add_groups(tasks, group_size)
        await asyncio.wait_for(manager.wait_idle(), timeout=120)
        for w in workers.values():
            w.stop()
        await pool.aclose()
        return manager, buffer, pool.stats

    manager, buffer, stats = asyncio.run(run())
    return manager, buffer, stats, tok
