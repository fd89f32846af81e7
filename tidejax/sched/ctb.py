"""Continuous Task Batching (TideRL §CTB): task-level admission, pausing and resuming.

Each rollout rank is a token budget. :func:`decide` takes a :class:`CtbSnapshot` and returns
:class:`Decisions`, in this order:

1. **Pause** where a rank would overflow: its resident tasks' footprints plus the growth
   they request now exceed its budget. Victims are the lowest
   ``P(t) = w1*I_eval + w2*G_completion + w3*I_active + w4*L_context`` (L normalised to
   [0, 1]); ties broken by task id. Tasks on a closing rank all leave it.
2. **Resume** paused (and re-homed) tasks, highest priority first, before any admission:
   to their last rank if it has room, else to a rank holding their group (shared prefix),
   else to the rank with most headroom.
3. **Admit** new tasks, only if nothing paused is still waiting: a group's first task is
   its probe, whose first turn measures the group's footprint. Its siblings go with it,
   charged ``probe_default_tokens`` each, unless KV memory binds (the open ranks cannot
   hold them all at that default): then only the probe goes and the siblings wait for its
   measured footprint. Tasks go where their group already is (prefix sharing) or where
   headroom is largest, with a penalty for piling one task type on one rank (diversity). Admission stops at the env-concurrency cap, and training groups stop at the
   staleness quota (:mod:`tidejax.sched.staleness`).

Budgets hold after the decisions: for every open rank, held + requested growth - paused +
resumed + admitted <= budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CtbConfig:
    """Weights and knobs. Defaults keep the paper's hierarchy eval > group > active > length."""

    w_eval: float = 8.0
    w_group: float = 4.0
    w_active: float = 2.0
    w_context: float = 1.0
    # L_context = min(1, tokens / context_norm_tokens); calibration env.context_cap (TideRL text)
    context_norm_tokens: int = 8192
    max_type_share: float = 0.75  # diversity: a type above this share of a rank is penalised
    diversity_penalty: float = 0.5  # headroom fraction lost by a penalised placement

    def __post_init__(self) -> None:
        for name in ("w_eval", "w_group", "w_active", "w_context", "diversity_penalty"):
            if getattr(self, name) < 0:
                raise ValueError(f"CtbConfig.{name} must be >= 0")
        if self.context_norm_tokens <= 0:
            raise ValueError("CtbConfig.context_norm_tokens must be positive")
        if not 0 < self.max_type_share <= 1:
            raise ValueError("CtbConfig.max_type_share must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class RankState:
    """One rollout rank as CTB sees it. Tokens are KV tokens."""

    rank: int
    budget_tokens: int  # tokens this rank may hold (its KV pool, or a chosen share of it)
    used_tokens: int  # tokens its resident tasks hold now (sum of their footprints)
    open: bool = True  # False while ERS closes it: nothing is placed here, residents leave
    type_counts: tuple[tuple[str, int], ...] = ()  # resident tasks per task type
    groups: frozenset[int] = frozenset()  # groups with a resident member

    def __post_init__(self) -> None:
        if self.budget_tokens < 0 or self.used_tokens < 0:
            raise ValueError(f"RankState {self.rank}: budget_tokens/used_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class TaskState:
    """One admitted task: resident on a rank, or paused (rank None)."""

    task_id: int
    group_id: int
    rank: int | None  # rank holding its KV; None when paused
    tokens: int  # footprint: context tokens held now (paused: tokens it needs to resume)
    need_tokens: int = 0  # growth its next turn requests beyond `tokens`, resident only
    active: bool = False  # I_active: generating right now
    is_eval: bool = False  # I_eval
    group_completion: float = 0.0  # finished / total trajectories of its group, in [0, 1]
    task_type: str = ""
    home: int | None = None  # rank it last ran on (affinity for resume)

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.need_tokens < 0:
            raise ValueError(f"TaskState {self.task_id}: tokens/need_tokens must be >= 0")
        if not 0.0 <= self.group_completion <= 1.0:
            raise ValueError(f"TaskState {self.task_id}: group_completion must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class PendingGroup:
    """A group with tasks not yet admitted, in dispatch order."""

    group_id: int
    remaining: int  # tasks of the group still to admit
    probe_tokens: int | None  # probed first-turn footprint; None until the probe's turn ends
    started: bool = False  # a task (the probe) was admitted: counted against the quota
    task_type: str = ""
    is_eval: bool = False

    def __post_init__(self) -> None:
        if self.remaining <= 0:
            raise ValueError(f"PendingGroup {self.group_id}: remaining must be positive")
        if self.probe_tokens is not None and self.probe_tokens <= 0:
            raise ValueError(f"PendingGroup {self.group_id}: probe_tokens must be positive")


@dataclass(frozen=True, slots=True)
class CtbSnapshot:
    """Everything CTB reads. The runtime fills it at each scheduling point."""

    ranks: tuple[RankState, ...]
    resident: tuple[TaskState, ...] = ()  # tasks holding KV (at least on ranks under pressure)
    paused: tuple[TaskState, ...] = ()  # paused tasks waiting for room
    pending: tuple[PendingGroup, ...] = ()
    env_capacity: int = 1 << 30  # tasks the environment cluster can run at once
    env_in_use: int = 0  # tasks admitted and not finished (resident + paused)
    outstanding_groups: int = 0  # training groups admitted and not yet consumed
    quota_groups: int = 1 << 30  # staleness.max_outstanding(bound, batch)
    probe_default_tokens: int = 1024  # charged for a probe (prompt + response cap)
    config: CtbConfig = field(default_factory=CtbConfig)

    def __post_init__(self) -> None:
        ids = [r.rank for r in self.ranks]
        if len(set(ids)) != len(ids):
            raise ValueError("CtbSnapshot.ranks has duplicate rank ids")
        known = set(ids)
        for t in self.resident:
            if t.rank not in known:
                raise ValueError(f"CtbSnapshot.resident task {t.task_id} on unknown rank")
        tids = [t.task_id for t in self.resident] + [t.task_id for t in self.paused]
        if len(set(tids)) != len(tids):
            raise ValueError("CtbSnapshot lists a task twice")
        if min(self.env_capacity, self.env_in_use, self.outstanding_groups) < 0:
            raise ValueError("CtbSnapshot counters must be >= 0")
        if self.probe_default_tokens <= 0:
            raise ValueError("CtbSnapshot.probe_default_tokens must be positive")


@dataclass(frozen=True, slots=True)
class Admission:
    """``count`` new tasks of ``group_id`` go to ``rank``, each charged ``tokens_each``."""

    group_id: int
    rank: int
    count: int
    probe: bool
    tokens_each: int


@dataclass(frozen=True, slots=True)
class Decisions:
    pause: tuple[int, ...] = ()  # task ids that give up their KV, lowest priority first
    resume: tuple[tuple[int, int], ...] = ()  # (task_id, rank), paused or re-homed tasks
    admit: tuple[Admission, ...] = ()


def priority(task: TaskState, cfg: CtbConfig) -> float:
    """P(t) = w1*I_eval + w2*G_completion + w3*I_active + w4*L_context."""
    length = min(1.0, task.tokens / cfg.context_norm_tokens)
    return (
        cfg.w_eval * task.is_eval
        + cfg.w_group * task.group_completion
        + cfg.w_active * task.active
        + cfg.w_context * length
    )


def decide(snap: CtbSnapshot) -> Decisions:
    """Pause, then resume, then admit (see the module docstring)."""
    ranks = {r.rank: r for r in snap.ranks}
    load = {r.rank: r.used_tokens for r in snap.ranks}
    for t in snap.resident:
        load[t.rank] += t.need_tokens
    pushed_out, leaving = _pauses(snap, ranks, load)
    resumes, unplaced = _resumes(snap, ranks, load, leaving + list(snap.paused))
    unplaced_ids = {t.task_id for t in unplaced}
    # A task leaving a closing rank that found no room elsewhere is paused too.
    pauses = [t.task_id for t in pushed_out]
    pauses += [t.task_id for t in leaving if t.task_id in unplaced_ids]
    waiting = pushed_out or unplaced  # resume before admit: nothing new while tasks wait
    admits = () if waiting else _admits(snap, ranks, load)
    return Decisions(pause=tuple(pauses), resume=tuple(resumes), admit=admits)


def _pauses(snap, ranks, load):
    """Victims on overflowing open ranks, and every task of a closing rank."""
    cfg = snap.config
    by_rank: dict[int, list[TaskState]] = {}
    for t in snap.resident:
        by_rank.setdefault(t.rank, []).append(t)
    pushed_out: list[TaskState] = []
    leaving: list[TaskState] = []
    for rank_id, tasks in sorted(by_rank.items()):
        rank = ranks[rank_id]
        order = sorted(tasks, key=lambda t: (priority(t, cfg), t.task_id))
        if not rank.open:
            leaving.extend(order)
            load[rank_id] = 0
            continue
        for t in order:
            if load[rank_id] <= rank.budget_tokens:
                break
            pushed_out.append(t)
            load[rank_id] -= t.tokens + t.need_tokens
    return pushed_out, leaving


def _fits(rank: RankState, load: dict[int, int], tokens: int) -> bool:
    return rank.open and load[rank.rank] + tokens <= rank.budget_tokens


def _resumes(snap, ranks, load, to_place):
    if not to_place:
        return [], []
    cfg = snap.config
    order = sorted(to_place, key=lambda t: (-priority(t, cfg), t.task_id))
    placed: list[tuple[int, int]] = []
    unplaced: list[TaskState] = []
    group_ranks: dict[int, set[int]] = {}
    for r in snap.ranks:
        for g in r.groups:
            group_ranks.setdefault(g, set()).add(r.rank)
    for t in order:
        need = t.tokens + t.need_tokens
        target = None
        if t.home is not None and t.home in ranks and _fits(ranks[t.home], load, need):
            target = t.home
        if target is None:
            near = sorted(group_ranks.get(t.group_id, ()))
            fits = [r for r in near if _fits(ranks[r], load, need)]
            if fits:
                target = max(fits, key=lambda r: (ranks[r].budget_tokens - load[r], -r))
        if target is None:
            fits = [r.rank for r in snap.ranks if _fits(r, load, need)]
            if fits:
                target = max(fits, key=lambda r: (ranks[r].budget_tokens - load[r], -r))
        if target is None:
            unplaced.append(t)
            continue
        load[target] += need
        group_ranks.setdefault(t.group_id, set()).add(target)
        placed.append((t.task_id, target))
    return placed, unplaced


def _room(snap, load: dict[int, int], each: int) -> int:
    """Tasks of ``each`` tokens the open ranks can still take, packed rank by rank."""
    return sum(max(0, r.budget_tokens - load[r.rank]) // each for r in snap.ranks if r.open)


def _admits(snap, ranks, load):
    env_free = snap.env_capacity - snap.env_in_use
    quota_left = snap.quota_groups - snap.outstanding_groups
    types: dict[int, dict[str, int]] | None = None  # built when a group is first placed
    group_ranks: dict[int, set[int]] = {}
    out: list[Admission] = []
    for g in snap.pending:
        if env_free <= 0:
            break
        if not g.started and not g.is_eval and quota_left <= 0:
            continue  # training groups wait for the quota; eval groups may still go
        each = snap.probe_default_tokens if g.probe_tokens is None else g.probe_tokens
        count = min(g.remaining, env_free)
        if g.probe_tokens is None and _room(snap, load, each) < count:
            # KV memory binds at the default footprint: only the probe goes, and its
            # siblings wait for the footprint it measures
            if g.started:
                continue
            count = 1
        if types is None:
            types = {r.rank: dict(r.type_counts) for r in snap.ranks}
            for r in snap.ranks:
                for gid in r.groups:
                    group_ranks.setdefault(gid, set()).add(r.rank)
        placed = 0
        while placed < count:
            target = _place(snap, ranks, load, types, group_ranks.get(g.group_id, set()), g, each)
            if target is None:
                break
            probe = not g.started and placed == 0  # the first task measures the footprint
            n = 1
            if not probe:  # fill the chosen rank with as many siblings as fit
                room = (ranks[target].budget_tokens - load[target]) // each
                n = max(1, min(count - placed, room))
            load[target] += n * each
            tcount = types[target]
            tcount[g.task_type] = tcount.get(g.task_type, 0) + n
            group_ranks.setdefault(g.group_id, set()).add(target)
            out.append(Admission(g.group_id, target, n, probe, each))
            placed += n
        if placed and not g.started and not g.is_eval:
            quota_left -= 1
        env_free -= placed
        if placed < count:
            break  # no rank has room for this group's footprint: keep dispatch order
    return tuple(out)


def _place(snap, ranks, load, types, near, group, each):
    cfg = snap.config
    best, best_score = None, None
    for r in snap.ranks:
        if not _fits(r, load, each):
            continue
        headroom = (r.budget_tokens - load[r.rank]) / max(1, r.budget_tokens)
        counts = types[r.rank]
        total = sum(counts.values())
        share = (counts.get(group.task_type, 0) + 1) / (total + 1)
        penalty = cfg.diversity_penalty if total and share > cfg.max_type_share else 0.0
        affinity = 1.0 if r.rank in near else 0.0  # siblings share the prompt's pages
        score = (affinity, headroom - penalty, -r.rank)
        if best_score is None or score > best_score:
            best, best_score = r.rank, score
    return best
