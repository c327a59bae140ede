"""Layers per pipeline stage.

- `uniform`: Megatron's equal split, the remainder going one layer each to the first stages.
- `params`: DeepSpeed's parameter balancing: the contiguous split with the smallest largest
  stage, counting the embedding on the first stage and the head on the last.
- `holmes-ratio`: the Holmes paper's rule, layers in proportion to per-stage ratios (their
  scripts: 26 vs 22 of 48 layers for IB vs RoCE); by default each stage's cluster NIC bandwidth.
- `auto`: the split with the least step time the cost model predicts: every contiguous split when
  there are few (EXHAUSTIVE_LIMIT), else hill-climbing from the best of the others and a
  time-balanced split, moving one layer between two stages at a time (two at a time where one
  gains nothing); so it is never predicted slower than the splits it starts from.

An explicit `stage_layers` always wins.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

from holmes_jax.config import ConfigError
from holmes_jax.planning.cost import CostModel

METHODS = ("auto", "uniform", "params", "holmes-ratio")
EXHAUSTIVE_LIMIT = 3000  # contiguous splits auto tries one by one
ALL_PAIRS_LIMIT = 12  # up to this many stages, hill-climbing tries moving a layer between any two
DOUBLE_MOVES_LIMIT = 4096  # hill-climbing tries pairs of moves when single ones are stuck, if this few


def check_stages(num_layers: int, stages: int, allowed: Sequence[int] | None = None) -> None:
    """`allowed`: the pp values the devices take, up to the layers (the error lists them); None: any."""
    if stages > num_layers:
        offered = (f"pp <= {num_layers}" if allowed is None else
                   f"pp {', '.join(map(str, allowed))}" if allowed else "none with these devices")
        raise ConfigError(f"pp = {stages} is not allowed: every pipeline stage needs a layer and the model has "
                          f"{num_layers}; allowed: {offered}")


def ratio_split(num_layers: int, ratios: Sequence[float]) -> tuple[int, ...]:
    """Layers in proportion to `ratios`, largest remainders rounding up (earlier stages win ties),
    at least one layer per stage."""
    check_stages(num_layers, len(ratios))
    r = np.asarray(ratios, dtype=float)
    if not np.all((r > 0) & np.isfinite(r)):  # an infinite ratio makes every quota nan
        raise ConfigError(f"partition ratios {list(ratios)} are not allowed; allowed: finite positive numbers")
    r = r / r.max()  # ratios near the float maximum would sum to inf and every quota to 0
    quota = num_layers * r / r.sum()
    n = np.floor(quota).astype(int)
    n[np.argsort(n - quota, kind="stable")[: num_layers - n.sum()]] += 1
    while n.min() == 0:  # a tiny ratio: take a layer from the largest stage
        n[np.argmax(n)] -= 1
        n[np.argmin(n)] += 1
    return tuple(int(x) for x in n)


def uniform(num_layers: int, stages: int) -> tuple[int, ...]:
    return ratio_split(num_layers, [1.0] * stages)


def balanced(costs, extra=None) -> tuple[int, ...]:
    """A contiguous split minimising the largest stage cost, where stage s holding layers [a, b)
    costs extra[s] + sum(costs[s, a:b]), evened out towards equal layer counts where that keeps
    the largest cost. costs: (stages, layers), non-negative.

    A greedy feasibility test and bisection on the limit: exact when every stage prices a layer
    the same and only the first and last stages carry extra (params), or when every layer costs a
    stage the same (identical layers, any stage speeds); otherwise a good split, never worse than
    uniform."""
    costs = np.asarray(costs, dtype=float)
    p, layers = costs.shape
    check_stages(layers, p)
    extra = np.zeros(p) if extra is None else np.asarray(extra, dtype=float)
    prefix = np.concatenate([np.zeros((p, 1)), np.cumsum(costs, axis=1)], axis=1)

    def greedy(limits):
        """Each stage takes the most layers within the limit, leaving one for each later stage
        (optimal for monotone costs); vectorised over limits. -> (feasible, stops)."""
        start, ok, stops = np.zeros(len(limits), dtype=int), np.ones(len(limits), dtype=bool), []
        for s in range(p - 1):
            stop = np.searchsorted(prefix[s], limits - extra[s] + prefix[s, start], side="right") - 1
            stop = np.minimum(stop, layers - (p - 1 - s))
            ok &= stop > start
            start = np.maximum(stop, start + 1)  # infeasible rows go on; their answer is dropped
            stops.append(start)
        return ok & (extra[-1] + prefix[-1, -1] - prefix[-1, start] <= limits), stops

    def cost(s, a, b):
        return extra[s] + prefix[s, b] - prefix[s, a]

    even = np.cumsum(uniform(layers, p))
    hi = max(cost(s, a, b) for s, (a, b) in enumerate(zip(np.r_[0, even[:-1]], even))) * (1 + 1e-9) + 1e-300
    if not greedy(np.array([hi]))[0][0]:  # greedy is not exact for these costs
        return uniform(layers, p)
    lo = 0.0
    for _ in range(5):  # each round narrows [lo, hi] 128-fold; hi stays feasible
        limits = np.linspace(lo, hi, 129)
        first = int(np.argmax(greedy(limits)[0]))
        lo, hi = limits[max(first - 1, 0)], limits[first]
    bounds = [0] + [int(stop[0]) for stop in greedy(np.array([hi]))[1]] + [layers]
    moved = True
    while moved:  # shift a boundary towards the smaller neighbour while both stay within hi
        moved = False
        for s in range(p - 1):
            a, b, c = bounds[s], bounds[s + 1], bounds[s + 2]
            if b - a > c - b + 1 and cost(s + 1, b - 1, c) <= hi:
                bounds[s + 1], moved = b - 1, True
            elif c - b > b - a + 1 and cost(s, a, b + 1) <= hi:
                bounds[s + 1], moved = b + 1, True
    return tuple(int(x) for x in np.diff(bounds))


def params(model: CostModel) -> tuple[int, ...]:
    return balanced(np.tile(model.layer_params(), (model.num_stages, 1)), model.end_params())


def time_balanced(model: CostModel) -> tuple[int, ...]:
    """The split whose slowest stage's forward + backward of one microbatch is fastest."""
    return balanced(model.layer_seconds(), model.end_seconds())


def compositions(num_layers: int, stages: int) -> np.ndarray:
    """Every contiguous split of `num_layers` into `stages` non-empty stages: (count, stages)."""
    cuts = list(itertools.combinations(range(1, num_layers), stages - 1))
    cuts = np.array(cuts, dtype=int).reshape(len(cuts), stages - 1)
    bounds = np.concatenate([np.zeros((len(cuts), 1), int), cuts, np.full((len(cuts), 1), num_layers)], axis=1)
    return np.diff(bounds, axis=1)


def _moves(stages: int) -> np.ndarray:
    """Rows adding a layer to one stage and taking it from another: any two stages when there are
    few, else neighbours."""
    if stages <= ALL_PAIRS_LIMIT:
        pairs = [(a, b) for a in range(stages) for b in range(stages) if a != b]
    else:
        pairs = [(a, a + d) for a in range(stages) for d in (-1, 1) if 0 <= a + d < stages]
    moves = np.zeros((len(pairs), stages), dtype=int)
    for row, (a, b) in enumerate(pairs):
        moves[row, a], moves[row, b] = 1, -1
    return moves


def auto(step_time: Callable[[np.ndarray], np.ndarray], num_layers: int, stages: int,
         starts: Sequence[Sequence[int]] = (), exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> tuple[int, ...]:
    """The split with the least `step_time` (which maps splits (count, stages) to seconds (count,))."""
    check_stages(num_layers, stages)
    if math.comb(num_layers - 1, stages - 1) <= exhaustive_limit:
        splits = compositions(num_layers, stages)
        return tuple(int(x) for x in splits[int(np.argmin(step_time(splits)))])
    candidates = np.array(list(starts) or [uniform(num_layers, stages)], dtype=int)
    times = step_time(candidates)
    best, best_time = candidates[int(np.argmin(times))], float(np.min(times))
    single = _moves(stages)
    # Two moves at once where one is not enough: the step waits for the slowest of several stages
    # (their gradient reductions), so taking a layer off only one of two slow stages gains nothing.
    double = (single[:, None] + single[None, :]).reshape(-1, stages) if len(single) ** 2 <= DOUBLE_MOVES_LIMIT else None
    moves = single
    while True:
        near = best + moves
        near = near[near.min(axis=1) >= 1]
        times = step_time(near) if len(near) else np.array([np.inf])
        i = int(np.argmin(times))
        if times[i] >= best_time * (1 - 1e-12):  # only a real gain moves: no cycling on float noise
            if moves is single and double is not None:
                moves = double
                continue
            break
        best, best_time, moves = near[i], float(times[i]), single
    return tuple(int(x) for x in best)


def split(method: str, model: CostModel, ratios: Sequence[float] | None = None,
          stage_layers: Sequence[int] | None = None, exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> tuple[int, ...]:
    """Layers per stage by `method` on `model`'s layout; `stage_layers`, when given, wins.
    `ratios`: holmes-ratio's weight per stage (default equal)."""
    layers, p = model.num_layers, model.num_stages
    check_stages(layers, p)
    if stage_layers is not None:
        given = tuple(stage_layers)
        if len(given) != p or sum(given) != layers or min(given) < 1:
            raise ConfigError(f"stage_layers = {list(given)} is not allowed; allowed: {p} positive layer counts "
                              f"(one per stage) summing to the model's {layers} layers")
        return given
    ratio = tuple(ratios) if ratios is not None else (1.0,) * p
    if len(ratio) != p:
        raise ConfigError(f"partition ratios {list(ratio)} are not allowed; allowed: one per stage ({p})")
    if method == "uniform":
        return uniform(layers, p)
    if method == "params":
        return params(model)
    if method == "holmes-ratio":
        return ratio_split(layers, ratio)
    if method == "auto":
        starts = [uniform(layers, p), params(model), ratio_split(layers, ratio), time_balanced(model)]
        return auto(model.step_times, layers, p, starts, exhaustive_limit)
    raise ConfigError(f"partition = {method!r} is not allowed; choose one of {', '.join(map(repr, METHODS))}")
