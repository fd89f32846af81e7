"""RA2P micro-batch formation and dispatch: hand examples and hypothesis properties."""

import ast
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidejax.sched import microbatch as mb

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def workloads(draw):
    budget = draw(st.integers(8, 200))
    lengths = draw(st.lists(st.integers(1, budget), min_size=0, max_size=40))
    ranks = draw(st.integers(1, 6))
    return lengths, budget, ranks


def _flat(plan):
    return sorted(i for k in range(len(plan.micro_batches)) for i in plan.sequences(k))


def test_hand_example_colocated():
    # Budget 10. FFD: 7 -> A; 6 -> B; 4 -> B (10); 3 -> A (10); 2 -> C; 1 -> C.
    # Loads [10, 10, 3]: the last micro-batch is the light one.
    lengths = [3, 7, 1, 6, 2, 4]
    plan = mb.plan_micro_batches(lengths, 10, num_ranks=2, mode="colocated")
    assert plan.loads(lengths) == [10, 10, 3]
    # Zig-zag inside the first micro-batch [7, 3]: rank 0 gets 7, rank 1 gets 3.
    assert plan.micro_batches[0] == ((1,), (0,))
    assert plan.micro_batches[2] == ((4,), (2,))


def test_hand_example_zigzag():
    # Sorted 9 8 7 6 5 4 3 over 3 ranks: round 0 -> r0 9, r1 8, r2 7; round 1 (reversed)
    # -> r2 6, r1 5, r0 4; round 2 -> r0 3. Loads 16, 13, 13: imbalance 3 <= longest 9.
    lengths = [9, 8, 7, 6, 5, 4, 3]
    ranks = mb.zigzag_assign(lengths, range(7), 3)
    assert ranks == [[0, 5, 6], [1, 4], [2, 3]]
    assert mb.load_imbalance(lengths, ranks) == 3


def test_hand_example_decoupled_smallest_last():
    # Budget 9. FFD: 7 -> A; 4 -> B; 4 -> B (8); 2 -> A (9); 1 -> B (9). Loads tie at 9;
    # the stable sort keeps A first, so B, which holds the shortest (1), is last. Each rank
    # is fed longest first: 4, 4, 1.
    lengths = [7, 4, 4, 2, 1]
    plan = mb.plan_micro_batches(lengths, 9, num_ranks=1, mode="decoupled")
    assert plan.loads(lengths) == [9, 9]
    assert plan.micro_batches[-1] == ((1, 2, 4),)


def test_decoupled_swap_by_hand():
    # Lengths [5, 3, 3, 1]; bins A = [0, 3] (5 + 1 = 6), B = [1, 2] (3 + 3 = 6), B last.
    # The shortest (index 3) is in A; B's shortest is index 1 (3, lower index wins the tie).
    # Swapping gives A = 6 - 1 + 3 = 8: allowed with budget 8, refused with budget 7.
    bins = [[0, 3], [1, 2]]
    mb._smallest_into_last([5, 3, 3, 1], bins, 7)
    assert bins == [[0, 3], [1, 2]]
    mb._smallest_into_last([5, 3, 3, 1], bins, 8)
    assert bins == [[0, 1], [3, 2]]


@SETTINGS
@given(workloads(), st.sampled_from(mb.MODES))
def test_every_sequence_placed_once_within_budget(work, mode):
    lengths, budget, ranks = work
    plan = mb.plan_micro_batches(lengths, budget, ranks, mode)
    assert _flat(plan) == list(range(len(lengths)))
    loads = plan.loads(lengths)
    assert all(0 < load <= budget for load in loads)
    assert loads == sorted(loads, reverse=True)  # heaviest first, the last is the lightest
    assert all(len(m) == ranks for m in plan.micro_batches)


@SETTINGS
@given(workloads())
def test_colocated_formation_bounds(work):
    lengths, budget, ranks = work
    plan = mb.plan_micro_batches(lengths, budget, ranks, "colocated")
    loads = plan.loads(lengths)
    # No two micro-batches could be merged, hence count <= 2 * total / budget + 1.
    for i in range(len(loads)):
        for j in range(i + 1, len(loads)):
            assert loads[i] + loads[j] > budget
    assert len(loads) <= 2 * sum(lengths) / budget + 1
    # Nothing in the last micro-batch fits into an earlier one's free space.
    if len(loads) > 1:
        for i in plan.sequences(len(loads) - 1):
            assert all(load + lengths[i] > budget for load in loads[:-1])
    # Load imbalance across ranks within a micro-batch <= its longest sequence.
    for k in range(len(loads)):
        rank_loads = plan.rank_loads(lengths, k)
        longest = max(lengths[i] for i in plan.sequences(k))
        assert max(rank_loads) - min(rank_loads) <= longest


@SETTINGS
@given(workloads())
def test_decoupled_smallest_last(work):
    lengths, budget, ranks = work
    plan = mb.plan_micro_batches(lengths, budget, ranks, "decoupled")
    if not lengths:
        assert plan.micro_batches == ()
        return
    for m in plan.micro_batches:  # each rank is fed longest first, so its last is smallest
        for rank in m:
            assert [lengths[i] for i in rank] == sorted((lengths[i] for i in rank),
                                                        reverse=True)
    loads = plan.loads(lengths)
    for i in range(len(loads) - 1):  # all pairs but those with the last cannot be merged
        for j in range(i + 1, len(loads) - 1):
            assert loads[i] + loads[j] > budget
    shortest = min(lengths)
    last = plan.sequences(len(loads) - 1)
    if min(lengths[i] for i in last) != shortest:
        # Swapping the shortest in would overflow the micro-batch that holds it.
        home = next(k for k in range(len(loads)) if any(lengths[i] == shortest
                                                         for i in plan.sequences(k)))
        assert loads[home] - shortest + min(lengths[i] for i in last) > budget
    for k in range(len(loads)):
        rank_loads = plan.rank_loads(lengths, k)
        assert max(rank_loads) - min(rank_loads) <= max(lengths[i] for i in plan.sequences(k))


@SETTINGS
@given(st.lists(st.integers(1, 64), max_size=50), st.integers(64, 256))
def test_pack_rows(lengths, row_len):
    rows = mb.pack_rows(lengths, row_len)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in r) for r in rows]
    assert all(load <= row_len for load in loads)
    for i in range(len(loads)):
        for j in range(i + 1, len(loads)):
            assert loads[i] + loads[j] > row_len


def test_invalid_inputs():
    with pytest.raises(ValueError, match="exceeds"):
        mb.plan_micro_batches([5, 11], 10)
    with pytest.raises(ValueError, match="lengths\\[0\\]"):
        mb.plan_micro_batches([0], 10)
    with pytest.raises(ValueError, match="mode"):
        mb.plan_micro_batches([1], 10, mode="fast")
    with pytest.raises(ValueError, match="num_ranks"):
        mb.zigzag_assign([1], [0], 0)


def test_module_is_pure_python():
    """sched/ must not import jax, numpy, time, threading or random."""
    tree = ast.parse(pathlib.Path(mb.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"__future__", "dataclasses", "collections"}, names
