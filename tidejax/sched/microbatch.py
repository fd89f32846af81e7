"""RA2P micro-batch formation and dispatch: pure functions over sequence lengths.

Formation (both modes, as in TideRL): sequences are packed first-fit-decreasing into
micro-batches of at most `token_budget` tokens (the compute budget of one micro-batch over
all data-parallel ranks). Early micro-batches come out full; the last is kept as small as
possible: micro-batches are ordered by load, heaviest first, and no sequence of the last
one fits into the free space of an earlier one.

Dispatch differs by mode:
- colocated: execution is sequential, so balance the load of each micro-batch across the
  data-parallel ranks with a zig-zag longest-first assignment (sorted by length, dealt
  0, 1, ..., R-1, R-1, ..., 0, ...). Bound: within a micro-batch, the heaviest rank carries
  at most one longest sequence more than the lightest.
- decoupled: the step ends when the last micro-batch's backward ends, so additionally the
  shortest sequence overall is moved into the last micro-batch (swapped with that
  micro-batch's shortest, when the receiving micro-batch stays within budget) and each
  rank is fed its sequences longest first, so the last sequence fed is the smallest.

Only the standard library is used; the runtime and the simulator call the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

MODES = ("colocated", "decoupled")


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """`micro_batches[k][r]`: indices of the sequences rank r processes in micro-batch k,
    in feed order. Micro-batches are listed in dispatch order."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    mode: str

    def sequences(self, k: int) -> list[int]:
        return [i for rank in self.micro_batches[k] for i in rank]

    def loads(self, lengths: Sequence[int]) -> list[int]:
        """Tokens per micro-batch."""
        return [sum(lengths[i] for i in self.sequences(k)) for k in range(len(self.micro_batches))]

    def rank_loads(self, lengths: Sequence[int], k: int) -> list[int]:
        return [sum(lengths[i] for i in rank) for rank in self.micro_batches[k]]


def _check_lengths(lengths: Sequence[int], capacity: int, what: str) -> None:
    if capacity <= 0:
        raise ValueError(f"{what} must be > 0, got {capacity}")
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"lengths[{i}] must be > 0, got {n}")
        if n > capacity:
            raise ValueError(f"lengths[{i}] = {n} exceeds {what} = {capacity}")


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of sequence indices, each summing to at most `capacity`.

    Any two bins together exceed `capacity` (a later bin's items did not fit an earlier
    one), so at most one bin is half empty: #bins <= 2 * total / capacity + 1.
    """
    _check_lengths(lengths, capacity, "capacity")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def form_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Micro-batches (lists of sequence indices), heaviest first, the last as light as can be.

    Guarantees: every index exactly once; each micro-batch <= token_budget; any two
    micro-batches together exceed the budget; loads are non-increasing; no sequence of the
    last micro-batch fits into the free space of an earlier one.
    """
    bins = first_fit_decreasing(lengths, token_budget)
    bins.sort(key=lambda b: -sum(lengths[i] for i in b))  # stable: ties keep FFD order
    if len(bins) > 1:
        last = bins[-1]
        # First-fit order and load order can differ, so drain the last bin into any earlier
        # free space (largest sequences first); its load only drops, so it stays lightest.
        for i in sorted(last, key=lambda i: (-lengths[i], i)):
            for b in bins[:-1]:
                if sum(lengths[j] for j in b) + lengths[i] <= token_budget:
                    b.append(i)
                    last.remove(i)
                    break
        if not last:
            bins.pop()
        bins.sort(key=lambda b: -sum(lengths[i] for i in b))
    return bins


def zigzag_assign(
    lengths: Sequence[int], indices: Sequence[int], num_ranks: int
) -> list[list[int]]:
    """Deal `indices` to ranks longest first in zig-zag order: 0..R-1, R-1..0, ...

    Each round of R deals gives every rank one sequence, and rounds hold successively
    shorter sequences, so the rank loads differ by at most the longest sequence.
    """
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be > 0, got {num_ranks}")
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    for n, i in enumerate(order):
        round_, pos = divmod(n, num_ranks)
        ranks[pos if round_ % 2 == 0 else num_ranks - 1 - pos].append(i)
    return ranks


def _smallest_into_last(lengths: Sequence[int], bins: list[list[int]], budget: int) -> None:
    """Swap the globally shortest sequence into the last micro-batch when the budget allows."""
    if len(bins) < 2:
        return
    shortest = min((i for b in bins for i in b), key=lambda i: (lengths[i], i))
    last = bins[-1]
    if shortest in last:
        return
    home = next(b for b in bins if shortest in b)
    swap = min(last, key=lambda i: (lengths[i], i))
    if sum(lengths[i] for i in home) - lengths[shortest] + lengths[swap] <= budget:
        home[home.index(shortest)] = swap
        last[last.index(swap)] = shortest
        # The last one got lighter, the other heavier: restore heaviest-first, last lightest.
        bins[:-1] = sorted(bins[:-1], key=lambda b: -sum(lengths[i] for i in b))


def plan_micro_batches(
    lengths: Sequence[int], token_budget: int, num_ranks: int = 1, mode: str = "colocated"
) -> MicroBatchPlan:
    """Form micro-batches and dispatch them over `num_ranks` data-parallel ranks."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    bins = form_micro_batches(lengths, token_budget)
    if mode == "decoupled":
        _smallest_into_last(lengths, bins, token_budget)
    planned = []
    for b in bins:
        ranks = zigzag_assign(lengths, b, num_ranks)
        if mode == "decoupled":
            ranks = [sorted(r, key=lambda i: (-lengths[i], i)) for r in ranks]
        planned.append(tuple(tuple(r) for r in ranks))
    return MicroBatchPlan(micro_batches=tuple(planned), mode=mode)


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Pack sequences into rows of `row_len` tokens (segment ids 1, 2, ... in list order).

    This realises one rank's share of a micro-batch as a fixed-shape `[rows, row_len]`
    array; same guarantees as `first_fit_decreasing`.
    """
    return first_fit_decreasing(lengths, row_len)


def load_imbalance(lengths: Sequence[int], ranks: Sequence[Sequence[int]]) -> int:
    """Heaviest minus lightest rank load, in tokens."""
    loads = [sum(lengths[i] for i in r) for r in ranks]
    return max(loads) - min(loads) if loads else 0
