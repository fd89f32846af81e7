"""BiDiRL-style intra-step bidirectional borrowing (reconstruction, calibration.md §6.4).

Inside a step, the bottleneck side may borrow idle ranks of the other side for a window:

* **to rollout**: the trainer idles waiting for data; lending ``k`` idle trainer ranks to
  rollout shortens the predicted wait ``T_win`` to ``T_win * n_r / (n_r + k)`` once they
  arrive - if rollout is throughput-bound; the gain is scaled by how saturated the rollout
  ranks are (a latency-bound rollout does not go faster with more ranks);
* **to train**: rollout ranks idle (throttled by the staleness bound) while the trainer
  works; lending them as extra data-parallel trainer ranks shortens the remaining training
  ``T_win`` to ``T_win * n_t / (n_t + k)``, at an extra gradient-sync cost ``c_grad``.

Borrow only if the predicted gain exceeds switch-in plus switch-out (plus ``c_grad``) and
the window is longer than the two switches (PEARL's Eq. 7 generalised to both directions).
The gain counts only the part of the window after the borrowed ranks have switched in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Direction(str, Enum):
    TO_ROLLOUT = "to_rollout"
    TO_TRAIN = "to_train"


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    c_in: float  # seconds for a rank to take up the other role
    c_out: float  # seconds to give it back
    c_grad: float = 0.0  # extra seconds per step when training spans both pools

    def __post_init__(self) -> None:
        if min(self.c_in, self.c_out, self.c_grad) < 0:
            raise ValueError("SwitchCosts must be >= 0")


@dataclass(frozen=True, slots=True)
class BorrowState:
    """What the runtime sees at a bubble. Counts are ranks, times are predictions in s."""

    n_rollout: int
    n_train: int
    idle_train: int  # trainer ranks idle now (waiting for data)
    idle_rollout: int  # rollout ranks idle now (throttled, no resident task)
    rollout_window_s: float  # predicted time until rollout delivers what the trainer waits for
    train_window_s: float  # predicted remaining trainer work in this step
    rollout_scalable: bool = True  # rollout has admissible work for more ranks
    # how close rollout runs to its throughput ceiling (0..1: running + queued sequences over
    # what the ranks can batch); extra ranks speed it up only in that proportion
    rollout_utilisation: float = 1.0

    def __post_init__(self) -> None:
        if min(self.n_rollout, self.n_train, self.idle_train, self.idle_rollout) < 0:
            raise ValueError("BorrowState counts must be >= 0")
        if self.idle_train > self.n_train or self.idle_rollout > self.n_rollout:
            raise ValueError("BorrowState: more idle ranks than ranks")
        if min(self.rollout_window_s, self.train_window_s) < 0:
            raise ValueError("BorrowState windows must be >= 0")
        if not 0 <= self.rollout_utilisation <= 1:
            raise ValueError("BorrowState.rollout_utilisation must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class Borrow:
    direction: Direction
    ranks: int
    window_s: float  # how long the ranks are lent (they switch back at its end)
    gain_s: float  # predicted time saved, net of switching


def _gain(window: float, n: int, k: int, c_in: float) -> float:
    """Time saved when ``k`` ranks join ``n`` after ``c_in`` seconds for the rest of a window."""
    if n <= 0 or k <= 0 or window <= c_in:
        return 0.0
    rest = window - c_in
    return rest - rest * n / (n + k)


def decide(state: BorrowState, costs: SwitchCosts) -> Borrow | None:
    """The better of the two borrowings if it pays for its switches; otherwise None."""
    switch = costs.c_in + costs.c_out
    options = []
    if state.idle_train and state.rollout_scalable and state.rollout_window_s > switch:
        k = state.idle_train
        gain = _gain(state.rollout_window_s, state.n_rollout, k, costs.c_in)
        gain *= state.rollout_utilisation
        if gain > switch:
            options.append(Borrow(Direction.TO_ROLLOUT, k, state.rollout_window_s, gain - switch))
    if state.idle_rollout and state.train_window_s > switch:
        k = state.idle_rollout
        gain = _gain(state.train_window_s, state.n_train, k, costs.c_in)
        if gain > switch + costs.c_grad:
            net = gain - switch - costs.c_grad
            options.append(Borrow(Direction.TO_TRAIN, k, state.train_window_s, net))
    if not options:
        return None
    return max(options, key=lambda b: (b.gain_s, b.direction.value))
