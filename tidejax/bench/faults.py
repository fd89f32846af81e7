"""Fault scenarios: every task ends trained or dropped with a reason, none lost or doubled.

    python -m tidejax.bench.faults

Rollout scenarios run the real rollout manager (CTB) and env pool over mock engines with
injected faults; `crash_resume` checkpoints the rollout state mid-run (some groups trained,
some ready, some in flight), drops everything else as SIGKILL would, and finishes the run
from the snapshot (the subprocess SIGKILL test is tests/runtime/test_crash_resume.py);
`nan_loss` runs the real trainer; `bad_config` feeds invalid settings.
"""

from __future__ import annotations

from tidejax.platform import configure_cpu_devices

configure_cpu_devices(8)

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from collections import Counter  # noqa: E402

from tidejax.config import run_config_from_dict  # noqa: E402
from tidejax.envs import EnvPool, PoolConfig, make_tasks  # noqa: E402
from tidejax.envs.faults import FaultConfig, FaultInjector  # noqa: E402
from tidejax.envs.latency import LatencyModel  # noqa: E402
from tidejax.envs.pool import local_env_factory  # noqa: E402
from tidejax.models.testing import tiny_tokenizer  # noqa: E402
from tidejax.runtime import resume  # noqa: E402
from tidejax.runtime.buffer import GlobalBuffer  # noqa: E402
from tidejax.runtime.config import RolloutConfig  # noqa: E402
from tidejax.runtime.manager import RolloutManager  # noqa: E402
from tidejax.runtime.rollout import RolloutWorker  # noqa: E402
from tidejax.serving import EngineConfig, MockEngine  # noqa: E402

GROUP = 2


@dataclasses.dataclass
class Row:
    scenario: str
    tasks: int
    trained: int
    dropped: int
    lost: int
    duplicated: int
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.trained + self.dropped == self.tasks


class _DyingEngine(MockEngine):
    def __init__(self, *args, fail_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_after, self.calls = fail_after, 0

    def generate(self, params, decode_state, num_steps=None):
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("injected rank failure")
        return super().generate(params, decode_state, num_steps)


async def _rollout(name: str, faults: FaultConfig | None, kill_rank: bool, n_groups=12) -> Row:
    tok = tiny_tokenizer()
    factory = local_env_factory()
    if faults is not None:
        factory = FaultInjector(factory, faults)
    pool = EnvPool(PoolConfig(capacity=32, step_timeout_s=0.5, reset_timeout_s=0.5,
                              max_retries=1), env_factory=factory,
                   latency=LatencyModel.default(time_scale=0.005, seed=0))
    ec = EngineConfig(page_size=16, num_pages=512, max_slots=4, max_pages_per_seq=96,
                      prefill_buckets=(256, 768))
    engines = {r: MockEngine(ec, vocab_size=tok.vocab_size) for r in range(3)}
    if kill_rank:
        engines[1] = _DyingEngine(ec, vocab_size=tok.vocab_size, fail_after=10)
    workers = {r: RolloutWorker(r, e, pin_after_turn=True) for r, e in engines.items()}
    buffer = GlobalBuffer(staleness_bound=100, micro_batch_tokens=4096)
    cfg = RolloutConfig(scheduler="ctb", max_new_tokens=8, batch_groups=n_groups,
                        staleness_bound=100, max_task_attempts=3, retry_backoff_s=0.001)
    manager = RolloutManager(cfg, workers, pool, tok, buffer, "webshop", max_seq_len=1536)
    tasks = make_tasks("webshop", "train", n_groups, GROUP, seed=11, max_turns=3)
    manager.add_groups(tasks, GROUP)
    await asyncio.wait_for(manager.wait_idle(), timeout=600)
    for w in manager.workers.values():
        w.stop()
    await pool.aclose()
    trained = [tid for g in buffer.take(10_000, 0) for tid in g.payload.task_ids]
    dropped = [tid for tid, _ in manager.dropped_tasks]
    # Tasks of a dropped group that finished fine are dropped with the group's reason.
    dropped_groups = {d.group_id for d in buffer.dropped}
    dropped += [t.task_id for t in tasks if t.group_id in dropped_groups
                and t.task_id not in dropped]
    counts = Counter(trained + dropped)
    ids = {t.task_id for t in tasks}
    reasons = Counter(d.reason.split(":")[-1] for d in buffer.dropped)
    detail = (f"faults={_fault_counts(pool)} "
              f"quarantined={sorted(manager.quarantined)} drop_reasons={dict(reasons)}")
    return Row(name, len(tasks), len(trained), len(set(dropped)),
               lost=len(ids - set(counts)), duplicated=sum(c > 1 for c in counts.values()),
               detail=detail)


async def _crash_resume(n_groups=12) -> Row:
    tok = tiny_tokenizer()
    ec = EngineConfig(page_size=16, num_pages=512, max_slots=4, max_pages_per_seq=96,
                      prefill_buckets=(256, 768))
    cfg = RolloutConfig(scheduler="ctb", max_new_tokens=8, batch_groups=2, env_capacity=6,
                        staleness_bound=100)

    def start():
        pool = EnvPool(PoolConfig(capacity=32), env_factory=local_env_factory(),
                       latency=LatencyModel.default(time_scale=0.005, seed=0))
        workers = {r: RolloutWorker(r, MockEngine(ec, vocab_size=tok.vocab_size),
                                    pin_after_turn=True) for r in range(3)}
        buffer = GlobalBuffer(staleness_bound=100, micro_batch_tokens=4096)
        manager = RolloutManager(cfg, workers, pool, tok, buffer, "webshop", max_seq_len=1536)
        return manager, buffer, pool

    async def stop(manager, pool):
        await manager.aclose()
        for w in manager.workers.values():
            w.stop()
        await pool.aclose()

    tasks = make_tasks("webshop", "train", n_groups, GROUP, seed=13, max_turns=3)
    manager, buffer, pool = start()
    manager.add_groups(tasks, GROUP)
    while len(buffer) < 3:
        await asyncio.sleep(0.002)
    trained = [tid for g in buffer.take(2, 0) for tid in g.payload.task_ids]  # step 1
    manager.consumed(2)
    before_crash = len(trained)
    snap = json.loads(json.dumps(resume.snapshot(manager, buffer)))  # the checkpoint
    await stop(manager, pool)  # the crash: whatever the snapshot does not hold is gone

    manager, buffer, pool = start()
    n = resume.restore(snap, manager, buffer)
    await asyncio.wait_for(manager.wait_idle(), timeout=600)
    await stop(manager, pool)
    trained += [tid for g in buffer.take(10_000, 0) for tid in g.payload.task_ids]
    dropped = [tid for tid, _ in manager.dropped_tasks]
    counts = Counter(trained + dropped)
    ids = {t.task_id for t in tasks}
    return Row("crash_resume", len(tasks), len(trained), len(set(dropped)),
               lost=len(ids - set(counts)), duplicated=sum(c > 1 for c in counts.values()),
               detail=f"trained_before_crash={before_crash} restored_ready_groups={n['ready_groups']} "
                      f"restarted_tasks={n['restarted_tasks']} "
                      f"requeued_tasks={n['requeued_tasks']}")


def _fault_counts(pool) -> dict:
    stats = pool.stats
    return {k: getattr(stats, k) for k in ("exception", "timeout", "malformed_observation")
            if hasattr(stats, k)}


def _bad_configs() -> Row:
    cases = {
        "steps": {"steps": 0}, "group_size": {"group_size": 1}, "system": {"system": "x"},
        "min_batch_groups": {"min_batch_groups": 9, "batch_groups": 4},
        "engine.num_pages": {"engine": {"num_pages": 0}},
        "rollout.max_new_tokens": {"rollout": {"max_new_tokens": 0}},
        "rollout.scheduler": {"rollout": {"scheduler": "fifo"}},
        "rl.loss.kl_estimator": {"rl": {"loss": {"kl_estimator": "k7"}}},
        "rl.optim.lr": {"rl": {"optim": {"lr": -1.0}}},
        "topology.rollout_ranks": {"topology": {"rollout_ranks": 8}},
        "row_len": {"row_len": 99999},
        "webshop.catalogue.n_products": {"webshop": {"catalogue": {"n_products": 3}}},
        "unknown field": {"learning_rate": 1.0},
    }
    named = 0
    for field, over in cases.items():
        try:
            run_config_from_dict(over)
        except ValueError as e:
            leaf = field.split(".")[-1].split()[0]
            named += leaf in str(e) or (field == "unknown field" and "learning_rate" in str(e))
    return Row("bad_config", len(cases), 0, named, lost=len(cases) - named, duplicated=0,
               detail=f"{named}/{len(cases)} errors name the field")


def _nan_loss() -> Row:
    import jax
    import numpy as np

    from tidejax.models.testing import tiny_config, tiny_params
    from tidejax.rl.config import RLConfig
    from tidejax.rl.testing import FAST_COMPILE, random_trajectory
    from tidejax.runtime.trainer_runner import TrainerRunner

    cfg = tiny_config()
    params = tiny_params(cfg)
    runner = TrainerRunner(cfg, RLConfig(), 64, 64, jax.device_get(params),
                           compiler_options=FAST_COMPILE)
    runner.place(None, jax.devices()[:1])
    state = runner.actor.init_state(0, params)
    rng = np.random.default_rng(0)
    steps, skipped_ok = 3, 0
    for step in range(steps):
        trajs = [random_trajectory(cfg, rng, 40) for _ in range(2)]
        adv = [float("nan"), 1.0] if step == 1 else [1.0, -1.0]
        state, report = runner.step(state, trajs, adv, "colocated")
        skipped_ok += (step == 1) == ("skipped_update" in report.metrics)
    return Row("nan_loss", steps, skipped_ok, 0, lost=steps - skipped_ok, duplicated=0,
               detail=f"skipped={runner.skipped_updates} run continued")


def main() -> None:
    logging.basicConfig(level=logging.ERROR, force=True)
    scenarios = [
        ("env_exceptions", FaultConfig(p_exception=0.2, p_hang=0.0, p_garbage=0.0), False),
        ("env_hangs", FaultConfig(p_exception=0.0, p_hang=0.2, p_garbage=0.0, hang_s=2.0), False),
        ("env_garbage", FaultConfig(p_exception=0.0, p_hang=0.0, p_garbage=0.2), False),
        ("rank_failure", None, True),
        ("everything", FaultConfig(p_exception=0.07, p_hang=0.07, p_garbage=0.06, hang_s=2.0),
         True),
    ]
    rows = [asyncio.run(_rollout(name, f, kill)) for name, f, kill in scenarios]
    rows.append(asyncio.run(_crash_resume()))
    rows += [_nan_loss(), _bad_configs()]
    print(f"{'scenario':16s} {'tasks':>5s} {'trained':>7s} {'dropped':>7s} {'lost':>4s} "
          f"{'dup':>3s} passed  detail")
    for r in rows:
        print(f"{r.scenario:16s} {r.tasks:5d} {r.trained:7d} {r.dropped:7d} {r.lost:4d} "
              f"{r.duplicated:3d} {str(r.passed):6s}  {r.detail}")
    lost = sum(r.lost for r in rows if r.scenario not in ("bad_config", "nan_loss"))
    dup = sum(r.duplicated for r in rows)
    passed = sum(r.passed for r in rows)
    print(f"lost={lost} duplicated={dup} scenarios_passed={passed}/{len(rows)}")


if __name__ == "__main__":
    main()
