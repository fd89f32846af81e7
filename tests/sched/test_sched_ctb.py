"""CTB: hand-checked decisions plus properties over random snapshots (hypothesis)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tidejax.sched import ctb, staleness
from tidejax.sched.ctb import CtbConfig, CtbSnapshot, PendingGroup, RankState, TaskState

CFG = CtbConfig()


def rank(rid, budget, used=0, open=True, groups=(), types=()):
    return RankState(rid, budget, used, open, tuple(types), frozenset(groups))


def test_priority_hierarchy():
    base = {"task_id": 0, "group_id": 0, "rank": 0, "tokens": 100}
    ev = ctb.priority(TaskState(**base, is_eval=True), CFG)
    grp = ctb.priority(TaskState(**base, group_completion=0.9, active=True), CFG)
    act = ctb.priority(TaskState(**base, active=True), CFG)
    long = ctb.priority(TaskState(**{**base, "tokens": 8000}), CFG)
    assert ev > grp > act > long > ctb.priority(TaskState(**base), CFG)


def test_overflow_pauses_lowest_priority_first():
    tasks = (
        TaskState(1, 10, 0, 300, need_tokens=200, active=False, group_completion=0.5),
        TaskState(2, 11, 0, 300, active=False),  # lowest: idle, group 0%, short
        TaskState(3, 12, 0, 300, active=True),
    )
    snap = CtbSnapshot(ranks=(rank(0, 1000, used=900),), resident=tasks)
    d = ctb.decide(snap)
    assert d.pause == (2,)
    assert d.admit == ()  # resume before admit: something was just pushed out


def test_probe_then_siblings_with_affinity():
    snap = CtbSnapshot(
        ranks=(rank(0, 4000), rank(1, 4000, groups=(7,))),
        pending=(
            PendingGroup(7, 7, probe_tokens=500, started=True, task_type="w"),
            PendingGroup(8, 8, probe_tokens=None, task_type="w"),
        ),
        probe_default_tokens=1000,
    )
    d = ctb.decide(snap)
    first = d.admit[0]
    assert (first.group_id, first.rank) == (7, 1)  # siblings join the probe's rank
    assert sum(a.count for a in d.admit if a.group_id == 7) == 7
    probes = [a for a in d.admit if a.group_id == 8]
    assert len(probes) == 1 and probes[0].probe and probes[0].count == 1


def test_siblings_go_with_the_probe_unless_memory_binds():
    # room for 8 x 1000 tokens on rank 0: the probe and its 7 siblings go at once
    roomy = CtbSnapshot(
        ranks=(rank(0, 8000),), pending=(PendingGroup(3, 8, None),), probe_default_tokens=1000
    )
    d = ctb.decide(roomy)
    assert sum(a.count for a in d.admit) == 8
    assert [a.probe for a in d.admit] == [True, False] and d.admit[0].count == 1
    # room for 7: KV memory binds at the default footprint, so only the probe goes ...
    tight = CtbSnapshot(
        ranks=(rank(0, 7000),), pending=(PendingGroup(3, 8, None),), probe_default_tokens=1000
    )
    d = ctb.decide(tight)
    assert [(a.count, a.probe) for a in d.admit] == [(1, True)]
    # ... and while its first turn runs, the siblings wait for the measured footprint
    waiting = CtbSnapshot(
        ranks=(rank(0, 7000, used=1000, groups=(3,)),),
        pending=(PendingGroup(3, 7, None, started=True),),
        probe_default_tokens=1000,
    )
    assert ctb.decide(waiting).admit == ()


def test_paused_resume_home_before_admission():
    paused = (TaskState(5, 3, None, 600, home=1),)
    snap = CtbSnapshot(
        ranks=(rank(0, 1000), rank(1, 1000, used=300)),
        paused=paused,
        pending=(PendingGroup(9, 8, probe_tokens=None),),
        probe_default_tokens=500,
    )
    d = ctb.decide(snap)
    assert d.resume == ((5, 1),)
    assert len(d.admit) == 1  # the probe of group 9 fits after the resume


def test_closing_rank_rehomes_or_pauses():
    tasks = (TaskState(1, 1, 0, 500), TaskState(2, 1, 0, 800))
    snap = CtbSnapshot(ranks=(rank(0, 5000, used=1300, open=False), rank(1, 900)), resident=tasks)
    d = ctb.decide(snap)
    moved = dict(d.resume)
    assert set(moved) | set(d.pause) == {1, 2} and not set(moved) & set(d.pause)
    assert all(r == 1 for r in moved.values())


def test_staleness_quota_stops_training_groups_not_eval():
    snap = CtbSnapshot(
        ranks=(rank(0, 10**6),),
        pending=(PendingGroup(1, 8, None), PendingGroup(2, 1, None, is_eval=True)),
        outstanding_groups=staleness.max_outstanding(1, 4),
        quota_groups=staleness.max_outstanding(1, 4),
    )
    d = ctb.decide(snap)
    assert [a.group_id for a in d.admit] == [2]


# ----------------------------------------------------------------------------- properties
@st.composite
def snapshots(draw):
    n_ranks = draw(st.integers(1, 4))
    opens = [draw(st.booleans()) or i == 0 for i in range(n_ranks)]
    budgets = [draw(st.integers(0, 6000)) for _ in range(n_ranks)]
    resident, used = [], [0] * n_ranks
    tid = 0
    for _ in range(draw(st.integers(0, 12))):
        r = draw(st.integers(0, n_ranks - 1))
        tok = draw(st.integers(0, 2500))
        resident.append(
            TaskState(
                tid,
                draw(st.integers(0, 5)),
                r,
                tok,
                need_tokens=draw(st.integers(0, 800)),
                active=draw(st.booleans()),
                is_eval=draw(st.booleans()),
                group_completion=draw(st.sampled_from([0.0, 0.25, 0.5, 0.875])),
                task_type=draw(st.sampled_from(["webshop", "alfworld"])),
                home=r,
            )
        )
        used[r] += tok
        tid += 1
    paused = []
    for _ in range(draw(st.integers(0, 5))):
        paused.append(
            TaskState(
                tid,
                draw(st.integers(0, 5)),
                None,
                draw(st.integers(0, 2500)),
                home=draw(st.one_of(st.none(), st.integers(0, n_ranks - 1))),
            )
        )
        tid += 1
    groups = {}
    for t in resident:
        groups.setdefault(t.rank, set()).add(t.group_id)
    ranks = tuple(rank(i, budgets[i], used[i], opens[i], groups.get(i, ())) for i in range(n_ranks))
    pending = []
    for g in range(draw(st.integers(0, 6))):
        started = draw(st.booleans())
        probe = draw(st.one_of(st.none(), st.integers(1, 2000))) if started else None
        pending.append(
            PendingGroup(
                100 + g,
                draw(st.integers(1, 8)),
                probe,
                started,
                draw(st.sampled_from(["webshop", "alfworld"])),
                draw(st.booleans()),
            )
        )
    quota = draw(st.integers(0, 10))
    return CtbSnapshot(
        ranks=ranks,
        resident=tuple(resident),
        paused=tuple(paused),
        pending=tuple(pending),
        env_capacity=draw(st.integers(0, 40)),
        env_in_use=draw(st.integers(0, 20)),
        outstanding_groups=draw(st.integers(0, quota + 2)),
        quota_groups=quota,
        probe_default_tokens=draw(st.integers(1, 1500)),
    )


def _after(snap, d):
    """Each open rank's tokens once the decisions are carried out."""
    load = {r.rank: r.used_tokens for r in snap.ranks}
    tasks = {t.task_id: t for t in snap.resident + snap.paused}
    for t in snap.resident:
        load[t.rank] += t.need_tokens
    leaving = set(d.pause) | {tid for tid, _ in d.resume}
    for t in snap.resident:
        if t.task_id in leaving:
            load[t.rank] -= t.tokens + t.need_tokens
    for tid, r in d.resume:
        load[r] += tasks[tid].tokens + tasks[tid].need_tokens
    for a in d.admit:
        load[a.rank] += a.count * a.tokens_each
    return load


@settings(max_examples=100, deadline=None)
@given(snapshots())
def test_token_budgets_respected(snap):
    d = ctb.decide(snap)
    load = _after(snap, d)
    for r in snap.ranks:
        if r.open:
            assert load[r.rank] <= r.budget_tokens
    closed = {r.rank for r in snap.ranks if not r.open}
    assert not {r for _, r in d.resume} & closed
    assert not {a.rank for a in d.admit} & closed


@settings(max_examples=100, deadline=None)
@given(snapshots())
def test_no_task_lost_or_duplicated(snap):
    d = ctb.decide(snap)
    moved = [tid for tid, _ in d.resume]
    assert len(set(moved)) == len(moved) and len(set(d.pause)) == len(d.pause)
    assert not set(moved) & set(d.pause)
    resident = {t.task_id for t in snap.resident}
    assert set(d.pause) <= resident | {t.task_id for t in snap.paused}
    assert set(moved) <= resident | {t.task_id for t in snap.paused}
    ranks = {r.rank: r for r in snap.ranks}
    for t in snap.resident:  # a closing rank keeps nobody
        if not ranks[t.rank].open:
            assert (t.task_id in moved) != (t.task_id in d.pause)
    counts = Counter()
    for a in d.admit:
        counts[a.group_id] += a.count
        assert a.count >= 1
    for g in snap.pending:
        assert counts[g.group_id] <= g.remaining
        mine = [a for a in d.admit if a.group_id == g.group_id]
        if mine and not g.started:  # a new group's first task is its probe, alone
            assert mine[0].probe and mine[0].count == 1
            assert not any(a.probe for a in mine[1:])
        if g.probe_tokens is None:  # footprint unknown: charged the default
            assert all(a.tokens_each == snap.probe_default_tokens for a in mine)


@settings(max_examples=100, deadline=None)
@given(snapshots())
def test_staleness_and_env_bounds(snap):
    d = ctb.decide(snap)
    pending = {g.group_id: g for g in snap.pending}
    new_train = {
        a.group_id
        for a in d.admit
        if not pending[a.group_id].started and not pending[a.group_id].is_eval
    }
    assert len(new_train) <= staleness.admissible_groups(snap.outstanding_groups, snap.quota_groups)
    admitted = sum(a.count for a in d.admit)
    assert admitted <= max(0, snap.env_capacity - snap.env_in_use)


@settings(max_examples=100, deadline=None)
@given(snapshots())
def test_pauses_take_lowest_priority_and_block_admission(snap):
    d = ctb.decide(snap)
    ranks = {r.rank: r for r in snap.ranks}
    paused = set(d.pause)
    for rid, r in ranks.items():
        if not r.open:
            continue
        here = [t for t in snap.resident if t.rank == rid]
        out = [ctb.priority(t, CFG) for t in here if t.task_id in paused]
        kept = [ctb.priority(t, CFG) for t in here if t.task_id not in paused]
        if out and kept:
            assert max(out) <= min(kept)
    placed = {tid for tid, _ in d.resume}
    if any(t.task_id not in placed for t in snap.paused) or any(
        t.task_id in paused for t in snap.resident if ranks[t.rank].open
    ):
        assert d.admit == ()


@settings(max_examples=100, deadline=None)
@given(snapshots())
def test_same_input_same_decision(snap):
    assert ctb.decide(snap) == ctb.decide(snap)
