"""Step-time prediction from plain numbers: FLOPs, parameter counts, device speeds, link speeds.

One training step, as the model sees it (DESIGN.md section 6):

1. Every stage runs its microbatches' forwards and backwards in the schedule's order (GPipe or
   1F1B). A stage's forward of one microbatch takes its layers' FLOPs (the embedding on the first
   stage, head and loss on the last) divided by tensor parallelism, at the device's achievable
   FLOP/s, plus its tensor-parallel all-reduces over the node's link.
2. Activations cross each stage boundary after a forward and their gradients come back after a
   backward: micro_batch * seq * hidden * bytes each way, split over the tp ranks, over the link
   that boundary uses. A boundary carries one transfer per direction at a time, so a slow link
   paces the pipeline; the sender goes on computing meanwhile.
3. After its last backward a stage syncs its gradients over its data-parallel ring: a ring
   all-reduce, 2(n-1)/n * S/W + 2(n-1) latencies, or with ZeRO-1 a reduce-scatter of the gradients
   and an all-gather of the updated parameters (the same bytes when both are float32), on the
   ring's slowest link. Syncs do not overlap the backward pass; the optimizer update is not timed.
4. The step ends when the last stage finishes its sync.
5. Memory per device: weights, gradients and Adam state (ZeRO-1 shards the latter over data),
   plus each layer's stash for every microbatch in flight (GPipe: all m; 1F1B: p - s on stage s).
   A split over some device's memory is infinitely slow.

`simulate` replays each stage's op order against these durations and dependencies, vectorised
over a batch of candidate splits so the partitioner can compare many at once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Protocol, Sequence

import numpy as np

from holmes_jax.pipeline.schedule import op_order

SCHEDULES = ("gpipe", "1f1b")


class Part(NamedTuple):
    params: float
    fwd_flops: float  # one microbatch, the whole part (before tensor parallelism)
    bwd_flops: float


class PartLike(Protocol):  # Part, or anything with these numbers (e.g. models.presets.PartCost)
    params: float
    fwd_flops: float
    bwd_flops: float


@dataclasses.dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float

    def time(self, nbytes):
        return self.latency_s + nbytes / self.bytes_per_s


def reduce_scatter_s(nbytes, n, link: Link):
    """A ring reduce-scatter (or all-gather) of `nbytes` over `n` ranks: (n-1)/n * S/W + (n-1) latencies.
    Arguments may be arrays."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, (n - 1) / np.maximum(n, 1) * nbytes / link.bytes_per_s + (n - 1) * link.latency_s, 0.0)


all_gather_s = reduce_scatter_s


def allreduce_s(nbytes, n, link: Link):
    """A ring all-reduce: a reduce-scatter then an all-gather, 2(n-1)/n * S/W + 2(n-1) latencies."""
    return 2 * reduce_scatter_s(nbytes, n, link)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one microbatch costs on one whole model replica."""

    embed: PartLike
    layers: Sequence[PartLike]
    head: PartLike  # final norm, output projection and loss
    boundary_bytes: float  # activations of one microbatch at a stage boundary, each way
    tp_allreduces_fwd: int = 2  # per layer (Megatron: after attention and after the MLP)
    tp_allreduces_bwd: int = 2  # per layer; 4 with activation recompute (the repeated forward's two)
    layer_stash_bytes: float = 0.0  # what one layer keeps of one in-flight microbatch for its backward, per device
    grad_bytes_per_param: float = 4.0  # float32 gradients
    param_bytes_per_param: float = 4.0  # float32 master weights (what ZeRO-1 all-gathers)
    optimizer_bytes_per_param: float = 8.0  # Adam's two float32 moments (ZeRO-1 shards them over data)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Where one pipeline stage runs."""

    device_flops: float  # achievable FLOP/s of one device
    tp: int
    tp_link: Link  # its tensor groups' all-reduce ring
    dp: int
    dp_link: Link  # its data groups' gradient ring (the slowest hop, NIC sharing counted)
    memory_bytes: float = float("inf")  # of one device


@dataclasses.dataclass(frozen=True)
class Prediction:
    stage_layers: tuple[int, ...]
    stage_fwd_s: tuple[float, ...]  # one microbatch
    stage_bwd_s: tuple[float, ...]
    stage_compute_s: tuple[float, ...]  # all microbatches, forward and backward
    p2p_s: tuple[float, ...]  # per boundary: one microbatch's activations (its gradients take as long back)
    stage_pipeline_s: tuple[float, ...]  # when the stage's last backward ends, waiting included
    stage_sync_s: tuple[float, ...]
    stage_finish_s: tuple[float, ...]  # pipeline end + sync
    stage_memory_bytes: tuple[float, ...]  # per device: weights, gradients, optimizer state, stashed activations
    fits: bool  # every stage within its devices' memory
    step_time_s: float
    samples_per_s: float
    tflops_per_device: float  # step_flops / step time / devices

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=256)
def _replay(schedule: str, p: int, m: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The schedule as waves of ops, each wave depending only on earlier ones.

    Ops run on resources: stage s runs F(s, i) and B(s, i) in its op order; boundary s carries
    activations A(s, i) to stage s + 1 and gradients G(s, i) back, each direction one transfer at
    a time in microbatch order. An op's row says what it is (F rows 0..p-1, B rows p..2p-1, A rows
    2p..3p-2, G rows 3p-1..4p-3) and its number is row * m + i; number (4p - 2) * m is "nothing"
    (ends at 0). Each wave holds arrays (op, previous op on its resource, op it waits for, row);
    waves come from Kahn's algorithm, a wave being every op whose two predecessors are done.
    Also returns each stage's last op.
    """
    a_row, g_row = 2 * p, 3 * p - 1
    none = (4 * p - 2) * m
    i = np.arange(m)
    # Resource queues in run order: stage s's ops, then each boundary's two directions.
    queues = [np.array([(s + (p if kind == "B" else 0)) * m + j for kind, j in op_order(schedule, s, p, m)])
              for s in range(p)]
    queues += [row * m + i for row in range(a_row, g_row + p - 1)]
    prev = np.full(none + 1, none)
    for q in queues:
        prev[q[1:]] = q[:-1]
    row = np.arange(none) // m
    s, j = row % p, np.arange(none) % m  # each op's stage (or boundary) and microbatch
    # F(s) waits for A(s - 1), B(s) for G(s) (the last stage's B follows its own F in its queue),
    # A(s) for F(s), G(s) for B(s + 1).
    dep = np.append(np.select(
        [(row < p) & (s > 0), (row >= p) & (row < a_row - 1), (row >= a_row) & (row < g_row), row >= g_row],
        [(a_row + s - 1) * m + j, (g_row + s) * m + j, (row - a_row) * m + j, (p + row - g_row + 1) * m + j],
        default=none), none)

    # Kahn's algorithm, one wave at a time.
    follower = np.full(none + 1, none)  # the next op on the same resource
    follower[prev[:none]] = np.arange(none)
    waiter = np.full(none + 1, none)  # the op that waits for this one
    waiter[dep[:none]] = np.arange(none)
    follower[none] = waiter[none] = none
    pending = (prev[:none] != none).astype(int) + (dep[:none] != none)  # predecessors not done yet
    wave, waves = np.flatnonzero(pending == 0), []
    while len(wave):
        waves.append((wave, prev[wave], dep[wave], row[wave]))
        freed = np.concatenate([follower[wave], waiter[wave]])
        freed = freed[freed != none]
        np.subtract.at(pending, freed, 1)
        wave = np.unique(freed[pending[freed] == 0])
    if sum(len(w[0]) for w in waves) != none:
        raise AssertionError(f"{schedule} op order deadlocks for p={p}, m={m}")
    return tuple(waves), np.array([q[-1] for q in queues[:p]])


def simulate(fwd_s, bwd_s, p2p_s, microbatches: int, schedule: str = "gpipe") -> np.ndarray:
    """When each stage ends its last backward, starting at 0.

    fwd_s, bwd_s: (p, *batch) seconds per microbatch; p2p_s: (p - 1, *batch) seconds of one
    microbatch's transfer across each boundary, either way (a 1-D vector broadcasts over the
    batch). A boundary carries one transfer per direction at a time. Returns (p, *batch).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}; choose one of {SCHEDULES}")
    fwd_s, bwd_s = np.asarray(fwd_s, dtype=float), np.asarray(bwd_s, dtype=float)
    p, batch = fwd_s.shape[0], fwd_s.shape[1:]
    waves, last = _replay(schedule, p, microbatches)
    p2p = np.asarray(p2p_s, dtype=float)
    p2p = np.broadcast_to(p2p.reshape(p2p.shape + (1,) * (len(batch) + 1 - p2p.ndim)), (p - 1,) + batch)
    duration = np.concatenate([fwd_s, bwd_s, p2p, p2p])
    end = np.zeros(((4 * p - 2) * microbatches + 1,) + batch)  # the last entry: "nothing", ends at 0
    for op, prev, dep, row in waves:
        end[op] = np.maximum(end[prev], end[dep]) + duration[row]
    return end[last]


class CostModel:
    """Predicted step time of any layers-per-stage split on one layout."""

    def __init__(self, work: Work, stages: Sequence[Stage], boundaries: Sequence[Link], microbatches: int,
                 schedule: str = "gpipe", zero1: bool = False, step_flops: float = 0.0, samples: int = 0):
        if len(boundaries) != len(stages) - 1:
            raise ValueError(f"{len(stages)} stages need {len(stages) - 1} boundary links, got {len(boundaries)}")
        self.work, self.stages, self.microbatches, self.schedule = work, tuple(stages), microbatches, schedule
        self.zero1, self.step_flops, self.samples = zero1, step_flops, samples
        p = len(stages)

        def prefix(attr):
            return np.concatenate([[0.0], np.cumsum([getattr(layer, attr) for layer in work.layers])])

        def ends(attr):  # the embedding's share on the first stage plus the head's on the last
            extra = np.zeros(p)
            extra[0] += getattr(work.embed, attr)
            extra[-1] += getattr(work.head, attr)
            return extra

        self._prefix = {a: prefix(a) for a in ("fwd_flops", "bwd_flops", "params")}
        self._ends = {a: ends(a) for a in ("fwd_flops", "bwd_flops", "params")}
        self._tp = np.array([s.tp for s in stages], dtype=float)
        self._flops = np.array([s.device_flops for s in stages]) * self._tp  # a stage's tp devices together
        self._dp = np.array([s.dp for s in stages])
        self._dp_link = Link(np.array([s.dp_link.bytes_per_s for s in stages]),
                             np.array([s.dp_link.latency_s for s in stages]))
        tp_allreduce = np.array([float(allreduce_s(work.boundary_bytes, s.tp, s.tp_link)) for s in stages])
        self._tp_fwd, self._tp_bwd = work.tp_allreduces_fwd * tp_allreduce, work.tp_allreduces_bwd * tp_allreduce
        # each of a stage's tp ranks sends its share of the activations (every stage has the same tp)
        self._p2p = np.array([link.time(work.boundary_bytes / stages[0].tp) for link in boundaries])
        # 1F1B keeps at most p - s microbatches in flight on stage s, GPipe all of them
        depth = np.arange(p, 0, -1) if schedule == "1f1b" else np.full(p, microbatches)
        self._in_flight = np.minimum(depth, microbatches)
        self._memory = np.array([s.memory_bytes for s in stages])

    @property
    def num_layers(self) -> int:
        return len(self.work.layers)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def layer_params(self) -> np.ndarray:
        return np.diff(self._prefix["params"])

    def end_params(self) -> np.ndarray:
        """(stages,): the embedding's parameters on the first stage, the head's on the last."""
        return self._ends["params"]

    def layer_seconds(self) -> np.ndarray:
        """(stages, layers): one microbatch's forward + backward of each layer on each stage."""
        flops = self._prefix["fwd_flops"] + self._prefix["bwd_flops"]
        return np.diff(flops)[None, :] / self._flops[:, None] + (self._tp_fwd + self._tp_bwd)[:, None]

    def end_seconds(self) -> np.ndarray:
        """(stages,): one microbatch's embedding (first stage) and head (last stage), forward + backward."""
        return (self._ends["fwd_flops"] + self._ends["bwd_flops"]) / self._flops

    def stage_terms(self, splits) -> dict[str, np.ndarray]:
        """What each stage of each split (batch, stages) costs, before the schedule: one
        microbatch's forward and backward, the gradient sync, and memory per device."""
        n = np.asarray(splits, dtype=int)
        stop = np.cumsum(n, axis=1)
        start = stop - n

        def total(attr):
            return self._prefix[attr][stop] - self._prefix[attr][start] + self._ends[attr]

        fwd = total("fwd_flops") / self._flops + n * self._tp_fwd
        bwd = total("bwd_flops") / self._flops + n * self._tp_bwd
        params = total("params") / self._tp
        w = self.work
        if self.zero1:
            sync = (reduce_scatter_s(params * w.grad_bytes_per_param, self._dp, self._dp_link)
                    + all_gather_s(params * w.param_bytes_per_param, self._dp, self._dp_link))
        else:
            sync = allreduce_s(params * w.grad_bytes_per_param, self._dp, self._dp_link)
        optimizer = w.optimizer_bytes_per_param / (self._dp if self.zero1 else 1)
        memory = (params * (w.param_bytes_per_param + w.grad_bytes_per_param + optimizer)
                  + self._in_flight * n * w.layer_stash_bytes)
        return {"fwd": fwd, "bwd": bwd, "sync": sync, "memory": memory,
                "fits": (memory <= self._memory).all(axis=1)}

    def _evaluate(self, splits) -> dict[str, np.ndarray]:
        t = self.stage_terms(splits)
        t["pipeline"] = simulate(t["fwd"].T, t["bwd"].T, self._p2p, self.microbatches, self.schedule).T
        t["finish"] = t["pipeline"] + t["sync"]
        return t

    def step_times(self, splits) -> np.ndarray:
        """(batch,) predicted step seconds of each split in `splits` (batch, stages); infinite
        where a stage does not fit in its devices' memory."""
        t = self._evaluate(splits)
        return np.where(t["fits"], t["finish"].max(axis=1), np.inf)

    def lower_bounds(self, splits) -> np.ndarray:
        """(batch,) what no schedule beats, without simulating: stage 0 ends no sooner than the
        first microbatch reaches some stage k, k works through all m microbatches, and the last
        gradient comes back (then stage 0 syncs); and no stage ends before its own m microbatches
        and sync. Infinite where a stage does not fit in memory."""
        t = self.stage_terms(splits)
        work = t["fwd"] + t["bwd"]
        before = np.cumsum(work, axis=1) - work
        m = self.microbatches
        bound = np.maximum((before + m * work).max(axis=1) + t["sync"][:, 0], (m * work + t["sync"]).max(axis=1))
        return np.where(t["fits"], bound, np.inf)

    def predict(self, stage_layers: Sequence[int]) -> Prediction:
        t = {k: v[0] for k, v in self._evaluate([list(stage_layers)]).items()}
        step = float(t["finish"].max())
        devices = int(sum(s.tp * s.dp for s in self.stages))

        def floats(a):
            return tuple(float(x) for x in a)

        return Prediction(
            stage_layers=tuple(int(x) for x in stage_layers),
            stage_fwd_s=floats(t["fwd"]), stage_bwd_s=floats(t["bwd"]),
            stage_compute_s=floats(self.microbatches * (t["fwd"] + t["bwd"])),
            p2p_s=floats(self._p2p), stage_pipeline_s=floats(t["pipeline"]),
            stage_sync_s=floats(t["sync"]), stage_finish_s=floats(t["finish"]),
            stage_memory_bytes=floats(t["memory"]), fits=bool(t["fits"]),
            step_time_s=step, samples_per_s=self.samples / step,
            tflops_per_device=self.step_flops / step / devices / 1e12,
        )
