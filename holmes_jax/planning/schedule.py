"""Pipeline schedules as tick tables.

A table says, for every tick and stage, which microbatch the stage runs forward and which
backward (-1: none). Within a tick a stage runs its forward first, then its backward; activations
move one stage down and gradients one stage up between ticks (`transfers`: in which ticks any
do). Tables come from a greedy simulation of each stage's op order:

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
    x_slots, g_slots = _slots(fwd, bwd, microbatches)
    return Table(schedule, stages, microbatches, fwd, bwd, x_slots, g_slots)


def ticks(schedule: str, stages: int, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """The table's (ticks, stages) forward and backward microbatch indices (-1: none), without
    the stash sizes (`build` adds those; the cost model needs only this)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}; choose one of {SCHEDULES}")
    p, m = stages, microbatches
    orders = [op_order(schedule, s, p, m) for s in range(p)]
    nxt = [0] * p  # each stage's next op in its order
    # The tick each stage ran each microbatch's forward / backward in (-1: not yet). Plain lists and
    # the readiness checks inline: the planner replays thousands of tables, and numpy's
    # per-element indexing and a call per check were most of its time.
    f_done, b_done = [[-1] * m for _ in range(p)], [[-1] * m for _ in range(p)]
    fwd_rows, bwd_rows, t = [], [], 0
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        fwd_row, bwd_row = [-1] * p, [-1] * p
        for s in range(p):
            order, k, ran_f, ran_b = orders[s], nxt[s], False, False
            while k < len(order):
                kind, i = order[k]
                if kind == "F":
                    # A tick runs its forward before its backward, so an F may not follow a B in it
                    # (that F's input would be stashed while the B's is still held: p + 1 alive);
                    # its input is the previous stage's forward of an earlier tick.
                    if ran_f or ran_b or (s > 0 and not 0 <= f_done[s - 1][i] < t):
                        break
                    f_done[s][i], fwd_row[s], ran_f = t, i, True
                else:
                    # its own forward ran (earlier in this tick counts) and the next stage's
                    # backward of this microbatch in an earlier tick
                    if ran_b or not 0 <= f_done[s][i] <= t or (s < p - 1 and not 0 <= b_done[s + 1][i] < t):
                        break
                    b_done[s][i], bwd_row[s], ran_b = t, i, True
                k += 1
            nxt[s] = k
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


def _slots(fwd: np.ndarray, bwd: np.ndarray, m: int) -> tuple[int, int]:
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
