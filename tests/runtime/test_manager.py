"""Rollout manager on mock engines: every task accounted, token-in/token-out, CTB vs baseline."""

import asyncio

import pytest

from tidejax.envs import EnvPool, PoolConfig, make_tasks
from tidejax.envs.faults import FaultConfig, FaultInjector
from tidejax.envs.latency import LatencyModel
from tidejax.envs.pool import local_env_factory
from tidejax.models.testing import tiny_tokenizer
from tidejax.runtime.buffer import GlobalBuffer
from tidejax.runtime.config import RolloutConfig
from tidejax.runtime.manager import RolloutManager
from tidejax.runtime.rollout import RolloutWorker
from tidejax.sched import request_level
from tidejax.serving import EngineConfig, MockEngine

GROUP = 2


def engine_config(num_pages=512):
    return EngineConfig(page_size=16, num_pages=num_pages, max_slots=4, max_pages_per_seq=96,
                        prefill_buckets=(256, 768))


async def run_groups(scheduler, n_groups=4, num_pages=512, faults=None, ranks=2, max_turns=3,
                     max_seq_len=1536, **rollout_overrides):
    tok = tiny_tokenizer()
    factory = local_env_factory()
    if faults is not None:
        factory = FaultInjector(factory, faults)
    pool = EnvPool(PoolConfig(capacity=32, step_timeout_s=2.0, max_retries=0), env_factory=factory,
                   latency=LatencyModel.default(time_scale=0.01, seed=0))
    workers = {r: RolloutWorker(r, MockEngine(engine_config(num_pages), vocab_size=tok.vocab_size),
                                pin_after_turn=scheduler == "ctb") for r in range(ranks)}
    buffer = GlobalBuffer(staleness_bound=8, micro_batch_tokens=4096)
    cfg = RolloutConfig(**{"scheduler": scheduler, "max_new_tokens": 8, "batch_groups": n_groups,
                           "staleness_bound": 8, "max_task_attempts": 2,
                           "retry_backoff_s": 0.001, **rollout_overrides})
    manager = RolloutManager(cfg, workers, pool, tok, buffer, "webshop", max_seq_len=max_seq_len)
    tasks = make_tasks("webshop", "train", n_groups, GROUP, seed=0, max_turns=max_turns)
    manager.add_groups(tasks, GROUP)
    await asyncio.wait_for(manager.wait_idle(), timeout=120)
    for w in workers.values():
        w.stop()
    await pool.aclose()
    return manager, buffer, tasks, tok


@pytest.mark.parametrize("scheduler", ["ctb", "request"])
def test_every_task_reaches_the_buffer_once(scheduler):
    manager, buffer, tasks, tok = asyncio.run(run_groups(scheduler))
    groups = buffer.take(100, trainer_version=0)
    seen = [tid for g in groups for tid in g.payload.task_ids]
    assert sorted(seen) == sorted(t.task_id for t in tasks)  # no loss, no duplicate
    assert not buffer.dropped
    for g in groups:
        for traj in g.payload.trajectories:
            assert len(traj.tokens) == len(traj.loss_mask) == len(traj.behaviour_logp)
            assert traj.loss_mask[0] == 0


def test_token_in_token_out_no_retokenization():
    """Generated ids are kept exactly; observations are appended as tokenized once."""
    manager, buffer, _, tok = asyncio.run(run_groups("ctb", n_groups=1))
    traj = buffer.take(1, 0)[0].payload.trajectories[0]
    tokens, mask = list(traj.tokens), list(traj.loss_mask)
    # The mock engine's next token is last + 1: inside each generated run, ids step by one,
    # so any decode/re-encode of the history would break this exact pattern.
    runs, current = [], []
    for i, m in enumerate(mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    assert runs
    for run in runs:
        first = run[0]
        expected = [(tokens[first - 1] + 1 + k) % tok.vocab_size for k in range(len(run))]
        assert [tokens[i] for i in run] == expected


def test_ctb_respects_rank_budgets_under_pressure():
    """A small pool forces pauses; CTB must pause/resume, never exceed a rank's budget
    with pinned tokens, and still finish every group."""
    manager, buffer, tasks, _ = asyncio.run(run_groups("ctb", n_groups=6, num_pages=160))
    assert manager.counters["pauses"] > 0 and manager.counters["resumes"] > 0
    assert manager.max_pinned_fraction <= 1.0
    seen = [tid for g in buffer.take(100, 0) for tid in g.payload.task_ids]
    assert sorted(seen) == sorted(t.task_id for t in tasks)


def test_failing_env_drops_whole_groups_with_reason():
    faults = FaultConfig(p_exception=0.3, p_hang=0.0, p_garbage=0.0)
    manager, buffer, tasks, _ = asyncio.run(run_groups("ctb", n_groups=6, faults=faults))
    trained = [tid for g in buffer.take(100, 0) for tid in g.payload.task_ids]
    dropped_groups = {d.group_id for d in buffer.dropped}
    assert all(d.reason.startswith("task_failed") for d in buffer.dropped)
    by_group = {}
    for t in tasks:
        by_group.setdefault(t.group_id, []).append(t.task_id)
    for gid, ids in by_group.items():
        # Each group is either trained whole or dropped whole: never half.
        assert (set(ids) <= set(trained)) != (gid in dropped_groups)
    assert manager.counters["task_failures"] > 0


def test_an_opening_prompt_past_the_context_fails_its_task_not_the_ranks():
    # WebShop's first observation is longer than 40 tokens, so no task can open.
    manager, buffer, _, _ = asyncio.run(run_groups("ctb", n_groups=2, max_seq_len=40))
    assert not buffer.take(100, 0)
    reasons = {reason for _, reason in manager.dropped_tasks}
    assert "prompt_too_long" in reasons and reasons <= {"prompt_too_long", "group_failed"}
    assert not manager.counters.get("turns_reissued")
    assert all(w.failed is None for w in manager.workers.values())


class FailingEngine(MockEngine):
    """A mock engine whose device step starts raising after `fail_after` decode steps."""

    def __init__(self, *args, fail_after=5, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_after = fail_after
        self.calls = 0

    def generate(self, params, decode_state, num_steps=None):
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("injected device failure")
        return super().generate(params, decode_state, num_steps)


@pytest.mark.parametrize("scheduler", ["ctb", "request"])
def test_failed_rank_is_quarantined_and_every_task_still_trains(scheduler):
    async def go():
        tok = tiny_tokenizer()
        pool = EnvPool(PoolConfig(capacity=32), env_factory=local_env_factory(),
                       latency=LatencyModel.default(time_scale=0.01, seed=0))
        engines = {0: MockEngine(engine_config(), vocab_size=tok.vocab_size),
                   # One token per generate call: it fails after 6 decode steps.
                   1: FailingEngine(engine_config().replace(decode_steps_per_call=1),
                                    vocab_size=tok.vocab_size, fail_after=6),
                   2: MockEngine(engine_config(), vocab_size=tok.vocab_size)}
        workers = {r: RolloutWorker(r, e, pin_after_turn=scheduler == "ctb")
                   for r, e in engines.items()}
        buffer = GlobalBuffer(staleness_bound=8, micro_batch_tokens=4096)
        cfg = RolloutConfig(scheduler=scheduler, max_new_tokens=8, batch_groups=6,
                            staleness_bound=8)
        manager = RolloutManager(cfg, workers, pool, tok, buffer, "webshop", max_seq_len=1536)
        tasks = make_tasks("webshop", "train", 6, GROUP, seed=3, max_turns=3)
        manager.add_groups(tasks, GROUP)
        await asyncio.wait_for(manager.wait_idle(), timeout=120)
        for w in manager.workers.values():
            w.stop()
        await pool.aclose()
        return manager, buffer, tasks

    manager, buffer, tasks = asyncio.run(go())
    assert manager.quarantined == {1} and 1 not in manager.workers
    trained = [tid for g in buffer.take(100, 0) for tid in g.payload.task_ids]
    assert sorted(trained) == sorted(t.task_id for t in tasks)  # none lost, none twice
    assert manager.counters["turns_reissued"] >= 1


def test_request_level_routes_whole_groups_to_the_least_loaded_rank(monkeypatch):
    """The runtime's baseline routes through sched.request_level.decide, as the simulator's
    does: each group goes whole to one rank, ranks take turns by load, within the quota."""
    starts = []
    original = RolloutManager.start_next_task

    def record(self, group, rank):
        starts.append((group.uid, rank))
        original(self, group, rank)

    monkeypatch.setattr(RolloutManager, "start_next_task", record)
    routed = []
    decide = request_level.decide

    def counting_decide(snap):
        decisions = decide(snap)
        routed.extend(decisions.route)
        return decisions

    monkeypatch.setattr(request_level, "decide", counting_decide)
    manager, buffer, tasks, _ = asyncio.run(run_groups("request", n_groups=4, ranks=2))
    assert sorted(uid for uid, _ in routed) == sorted({uid for uid, _ in starts})
    by_group: dict[int, set[int]] = {}
    for uid, rank in starts:
        by_group.setdefault(uid, set()).add(rank)
    assert len(by_group) == 4 and all(len(r) == 1 for r in by_group.values())
    ranks = [next(iter(r)) for _, r in sorted(by_group.items())]
    assert sorted(ranks) == [0, 0, 1, 1]
    assert len(buffer.take(100, trainer_version=0)) == 4


def test_aclose_ends_a_task_that_lost_its_first_cancellation():
    """Python 3.11's `wait_for` can swallow a cancellation (its future completing in the
    same loop turn); aclose cancels again until no task is left instead of hanging."""
    async def scenario():
        async def lost_cancel():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # what a swallowed cancellation looks like from here
            await asyncio.sleep(3600)

        manager = RolloutManager.__new__(RolloutManager)  # aclose needs only its task set
        manager._running = set()
        task = asyncio.get_running_loop().create_task(lost_cancel())
        manager._running.add(task)
        task.add_done_callback(manager._running.discard)
        await asyncio.sleep(0)
        await asyncio.wait_for(manager.aclose(), timeout=10)
        assert task.cancelled() and not manager._running

    asyncio.run(scenario())


def test_ctb_charges_admitted_tasks_before_their_prompt_exists(monkeypatch):
    """A task admitted but still resetting its env holds no KV yet; CTB must still count
    it at its admission charge, or every scheduling call sees free room and admits past
    the budget (once: 48 tasks on two ranks that held about 7 each)."""
    from tidejax.runtime import scheduling

    seen = []
    decide = scheduling.ctb.decide

    def watched(snap):
        for r in snap.ranks:
            on = [t for t in snap.resident if t.rank == r.rank]
            seen.append((len(on), min((t.tokens for t in on), default=1), r.budget_tokens))
        return decide(snap)

    monkeypatch.setattr(scheduling.ctb, "decide", watched)
    manager, buffer, tasks, _ = asyncio.run(run_groups("ctb", n_groups=8, num_pages=100,
                                                       probe_default_tokens=256))
    assert seen and all(smallest > 0 for _, smallest, _ in seen)  # nothing resident weighs 0
    # 100 pages x 16 x 0.9 = 1,440 tokens: at most five 256-token charges, never all 16 tasks
    assert max(n for n, _, _ in seen) <= 1440 // 256
    seen_ids = [tid for g in buffer.take(100, 0) for tid in g.payload.task_ids]
    assert sorted(seen_ids) == sorted(t.task_id for t in tasks)


def test_ctb_footprint_counts_each_token_once():
    """The KV a task's next turn needs is its episode plus the response: an observation
    already appended to the episode is not charged again, nor is the opening prompt."""
    from tidejax.runtime.episode import EpisodeTokens
    from tidejax.runtime.records import GroupRecord, TaskRecord, TaskState
    from tidejax.runtime.scheduling import CtbScheduler

    task = make_tasks("webshop", "train", 1, 1, seed=0)[0]
    rec = TaskRecord(task=task, uid=0, group=GroupRecord("g", 0, [], False), charge_tokens=300)
    rec.group.tasks.append(rec)
    assert CtbScheduler.footprint(rec, 24) == (300, 0)  # admitted, env reset pending
    rec.episode = EpisodeTokens()
    rec.episode.extend_context(list(range(200)))  # the opening prompt
    rec.state = TaskState.READY
    assert CtbScheduler.footprint(rec, 24) == (200, 24)
    rec.state = TaskState.GENERATING
    assert CtbScheduler.footprint(rec, 24) == (224, 0)
    rec.episode.extend_generated(list(range(20)), [0.0] * 20, 0)
    rec.state = TaskState.ENV
    assert CtbScheduler.footprint(rec, 24) == (220, 0)
    rec.episode.extend_context(list(range(50)))  # the observation
    rec.state = TaskState.READY
    assert CtbScheduler.footprint(rec, 24) == (270, 24)
