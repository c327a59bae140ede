"""Pipeline schedules as tick tables.

A table says, for every tick and stage, which microbatch the stage runs forward and which
backward (-1: none). Within a tick a stage runs its forward first, then its backward; activations
move one stage down and gradients one stage up between ticks (`transfers`: in which ticks any
do). Tables come from a greedy
simulation of each stage's op order:

- `gpipe`: every forward, then every backward (in microbatch order);
- `1f1b`: stage s runs min(2(p - 1 - s), m) warm-up forwards, then one forward and one backward
  in each tick, then drains its backwards. Every stage is busy with both in every steady-state
  tick, so the table lasts m + 2(p - 1) ticks whose first and last p - 1 are the bubble: (p - 1)
  forward-and-backward ticks on each stage, the ideal for lockstep ticks. Stage s keeps at most
  2(p - 1 - s) + 1 microbatches in flight (`x_slots`: min(2p - 1, m)). Classic 1F1B's p - 1 - s
  warm-up forwards fit a runtime where a forward and a backward are separate time slots; in a
  tick, which runs a forward and then a backward, they leave a stage with only one of the two in
  every other steady-state tick (about 1.5x the work's time at p = 2).

Inputs a stage receives are kept in slot `microbatch % slots` until its backward has used them; the
table's `x_slots` / `g_slots` are the fewest slots for which that never overwrites a live input.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Table:
    schedule: str
    stages: int
    microbatches: int
    fwd: np.ndarray  # (ticks, stages) microbatch index or -1
    bwd: np.ndarray  # (ticks, stages)
    x_slots: int  # activations a stage holds at once (its stash)
    g_slots: int  # gradients received and not yet used

    @property
    def ticks(self) -> int:
        return self.fwd.shape[0]

    def x_arrivals(self) -> np.ndarray:
        """(ticks, stages): the microbatch whose activation reaches each stage at the tick's start."""
        arrive = np.full_like(self.fwd, -1)
        arrive[1:, 1:] = self.fwd[:-1, :-1]
        return arrive

    def g_arrivals(self) -> np.ndarray:
        """(ticks, stages): the microbatch whose output gradient reaches each stage at the tick's start."""
        arrive = np.full_like(self.bwd, -1)
        arrive[1:, :-1] = self.bwd[:-1, 1:]
        return arrive


def op_order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """A stage's forwards ("F", i) and backwards ("B", i) in the order it runs them."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(2 * (stages - 1 - stage), m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m):
        if i + warmup < m:
            ops.append(("F", i + warmup))
        ops.append(("B", i))
    return ops


def ring_slots(schedule: str, stages: int, microbatches: int) -> int:
    """`build(...).x_slots` without replaying the table: the most microbatches a stage holds at once."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}; choose one of {SCHEDULES}")
    return microbatches if schedule == "gpipe" else min(2 * stages - 1, microbatches)


def build(schedule: str, stages: int, microbatches: int) -> Table:
    fwd, bwd = ticks(schedule, stages, microbatches)
    x_slots, g_slots = _slots(fwd, bwd, stages, microbatches)
    return Table(schedule, stages, microbatches, fwd, bwd, x_slots, g_slots)


def ticks(schedule: str, stages: int, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """The table's (ticks, stages) forward and backward microbatch indices (-1: none), without
    the stash sizes (`build` adds those; the cost model needs only this)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}; choose one of {SCHEDULES}")
    p, m = stages, microbatches
    orders = [op_order(schedule, s, p, m) for s in range(p)]
    done = {"F": np.full((p, m), -1), "B": np.full((p, m), -1)}
    fwd_rows, bwd_rows, t = [], [], 0
    while any(orders):
        fwd_row, bwd_row = [-1] * p, [-1] * p
        for s in range(p):
            kinds_done = set()
            while orders[s] and len(kinds_done) < 2:
                kind, i = orders[s][0]
                # A tick runs its forward before its backward, so an F may not follow a B in it
                # (that F's input would be stashed while the B's is still held: p + 1 alive).
                if kind in kinds_done or "B" in kinds_done or not _ready(kind, i, s, p, t, done):
                    break
                orders[s].pop(0)
                kinds_done.add(kind)
                done[kind][s, i] = t
                (fwd_row if kind == "F" else bwd_row)[s] = i
        fwd_rows.append(fwd_row)
        bwd_rows.append(bwd_row)
        t += 1
        if t > 4 * (m + p) + 4:
            raise AssertionError(f"{schedule} schedule for p={p}, m={m} does not terminate")
    return np.asarray(fwd_rows), np.asarray(bwd_rows)


def transfers(fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ticks,) whether any activation moves down after each tick (a stage other than the last ran
    a forward), and whether any gradient moves up (a stage other than the first ran a backward).
    The same on every stage, so the runtime can skip a tick's idle transfer."""
    return (fwd[:, :-1] >= 0).any(axis=1), (bwd[:, 1:] >= 0).any(axis=1)


def hops_per_tick(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """(ticks,) the transfers that end each tick one after the other, as the runtime makes them:
    activations down, then gradients up; with two stages a tick that moves both swaps them in one
    ppermute, both directions at once."""
    x_moves, g_moves = transfers(fwd, bwd)
    both = x_moves.astype(int) + g_moves.astype(int)
    return np.minimum(both, 1) if fwd.shape[1] == 2 else both


def _ready(kind: str, i: int, s: int, p: int, t: int, done: dict) -> bool:
    if kind == "F":  # the previous stage's forward ended in an earlier tick
        return s == 0 or 0 <= done["F"][s - 1, i] < t
    own_forward = 0 <= done["F"][s, i] <= t  # earlier in this tick counts: forward runs first
    upstream = s == p - 1 or 0 <= done["B"][s + 1, i] < t
    return own_forward and upstream


def _slots(fwd: np.ndarray, bwd: np.ndarray, p: int, m: int) -> tuple[int, int]:
    """Fewest ring slots so that no live input is overwritten: an input is live from its arrival
    to its stage's backward, and k slots do for a stage when no two microbatches i < j live there
    at once have k dividing j - i. Found from those gaps, not by replaying every tick for every k:
    that took minutes for GPipe with a thousand microbatches (gradient accumulation at pp = 1)."""
    f_tick, b_tick = _when(fwd, m), _when(bwd, m)  # (p, m)
    x_from = f_tick.copy()  # arrival; stage 0 embeds in its forward's tick
    x_from[1:] = f_tick[:-1] + 1
    g_from = b_tick.copy()  # the last stage makes its own output gradient
    g_from[:-1] = b_tick[1:] + 1
    return _fewest(x_from, b_tick, m), _fewest(g_from, b_tick, m)


def _when(table: np.ndarray, m: int) -> np.ndarray:
    """(stages, m): the tick in which each stage runs each microbatch."""
    ticks, stages = np.nonzero(table >= 0)
    when = np.full((table.shape[1], m), -1)
    when[stages, table[ticks, stages]] = ticks
    return when


def _fewest(start: np.ndarray, end: np.ndarray, m: int) -> int:
    together = np.zeros(m, dtype=bool)  # [d]: some stage holds two microbatches d apart at once
    for a, b in zip(start, end):
        for i in range(m - 1):
            later = np.flatnonzero(np.maximum(a[i], a[i + 1:]) <= np.minimum(b[i], b[i + 1:]))
            together[later + 1] = True
    gaps = np.flatnonzero(together)
    return next(k for k in range(1, m + 1) if not (gaps % k == 0).any())
