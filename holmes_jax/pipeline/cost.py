"""Step-time prediction from plain numbers: FLOPs, parameter counts, device speeds, link speeds.

One training step, as the model sees it (DESIGN.md section 6):

1. Every stage runs its microbatches' forwards and backwards in the schedule's order (GPipe or
   1F1B). A stage's forward of one microbatch takes its layers' FLOPs (the embedding on the first
   stage, head and loss on the last) divided by tensor parallelism, at the device's achievable
   FLOP/s, plus its tensor-parallel all-reduces over the node's link.
2. Activations cross each stage boundary after a forward and their gradients come back after a
   backward: micro_batch * seq * hidden * bytes each way, split over the tp ranks, over the link
   that boundary uses. Transfers delay the receiver only; the sender goes on computing.
3. After its last backward a stage syncs its gradients over its data-parallel ring: a ring
   all-reduce, 2(n-1)/n * S/W + 2(n-1) latencies, or with ZeRO-1 a reduce-scatter of the gradients
   and an all-gather of the updated parameters (the same bytes when both are float32), on the
   ring's slowest link. Syncs do not overlap the backward pass; the optimizer update is not timed.
4. The step ends when the last stage finishes its sync.

`simulate` replays each stage's op order against these durations and dependencies, vectorised
over a batch of candidate splits so the partitioner can compare many at once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Protocol, Sequence

import numpy as np

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
    grad_bytes_per_param: float = 4.0  # float32 gradients
    param_bytes_per_param: float = 4.0  # float32 master weights (what ZeRO-1 all-gathers)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Where one pipeline stage runs."""

    device_flops: float  # achievable FLOP/s of one device
    tp: int
    tp_link: Link  # its tensor groups' all-reduce ring
    dp: int
    dp_link: Link  # its data groups' gradient ring (the slowest hop, NIC sharing counted)


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
    step_time_s: float
    samples_per_s: float
    tflops_per_device: float  # step_flops / step time / devices

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def op_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """A stage's forwards ("F", i) and backwards ("B", i) in the order it runs them, as in
    holmes_jax.pipeline.schedule: GPipe all forwards then all backwards; 1F1B min(p-1-s, m)
    warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - 1 - stage, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m):
        if i + warmup < m:
            ops.append(("F", i + warmup))
        ops.append(("B", i))
    return ops


@functools.lru_cache(maxsize=256)
def _replay(schedule: str, p: int, m: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The schedule's ops grouped into waves that depend only on earlier waves.

    An op is F(s, i) or B(s, i), numbered (s + p * is_backward) * m + i; number 2pm is "nothing"
    (ends at 0). Each wave holds arrays (op, previous op on its stage, op it waits for, duration
    index, transfer index); durations are [fwd per stage, bwd per stage], transfers [p2p per
    boundary, 0]. Also returns each stage's last op.
    """
    orders = [op_order(schedule, s, p, m) for s in range(p)]
    none = 2 * p * m
    level = {none: -1}
    rows, prev, pos = [], [none] * p, [0] * p
    while len(rows) < 2 * p * m:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep, link = ((s - 1) * m + i, s - 1) if s > 0 else (none, p - 1)
                else:  # the last stage's backward follows its own forward, already earlier in its order
                    dep, link = ((p + s + 1) * m + i, s) if s < p - 1 else (none, p - 1)
                if dep not in level:
                    break
                row = s + (p if kind == "B" else 0)
                op = row * m + i
                level[op] = 1 + max(level[prev[s]], level[dep])
                rows.append((level[op], op, prev[s], dep, row, link))
                prev[s], pos[s], progressed = op, pos[s] + 1, True
        if not progressed:
            raise AssertionError(f"{schedule} op order deadlocks for p={p}, m={m}")
    table = np.array(sorted(rows))
    cuts = np.flatnonzero(np.diff(table[:, 0])) + 1
    waves = tuple(tuple(w[:, j] for j in range(1, 6)) for w in np.split(table, cuts))
    return waves, np.array(prev)


def simulate(fwd_s, bwd_s, p2p_s, microbatches: int, schedule: str = "gpipe") -> np.ndarray:
    """When each stage ends its last backward, starting at 0.

    fwd_s, bwd_s: (p, *batch) seconds per microbatch; p2p_s: (p - 1, *batch) seconds one way per
    boundary (a 1-D vector broadcasts over the batch). Returns (p, *batch).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}; choose one of {SCHEDULES}")
    fwd_s, bwd_s = np.asarray(fwd_s, dtype=float), np.asarray(bwd_s, dtype=float)
    p, batch = fwd_s.shape[0], fwd_s.shape[1:]
    waves, last = _replay(schedule, p, microbatches)
    p2p = np.asarray(p2p_s, dtype=float)
    transfer = np.zeros((p,) + batch)
    transfer[: p - 1] = p2p.reshape(p2p.shape + (1,) * (len(batch) + 1 - p2p.ndim))
    duration = np.concatenate([fwd_s, bwd_s])
    end = np.zeros((2 * p * microbatches + 1,) + batch)
    for op, prev, dep, row, link in waves:
        end[op] = np.maximum(end[prev], end[dep] + transfer[link]) + duration[row]
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
        self._flops = np.array([s.device_flops for s in stages]) * np.array([s.tp for s in stages])
        self._tp = np.array([s.tp for s in stages], dtype=float)
        self._dp = np.array([s.dp for s in stages])
        self._dp_link = Link(np.array([s.dp_link.bytes_per_s for s in stages]),
                             np.array([s.dp_link.latency_s for s in stages]))
        tp_allreduce = np.array([float(allreduce_s(work.boundary_bytes, s.tp, s.tp_link)) for s in stages])
        self._tp_fwd, self._tp_bwd = work.tp_allreduces_fwd * tp_allreduce, work.tp_allreduces_bwd * tp_allreduce
        self._p2p = np.array([link.time(work.boundary_bytes / stages[0].tp) for link in boundaries])

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

    def _evaluate(self, splits) -> dict[str, np.ndarray]:
        n = np.asarray(splits, dtype=int)  # (batch, stages)
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
        pipeline = simulate(fwd.T, bwd.T, self._p2p, self.microbatches, self.schedule).T
        return {"fwd": fwd, "bwd": bwd, "sync": sync, "pipeline": pipeline, "finish": pipeline + sync}

    def step_times(self, splits) -> np.ndarray:
        """(batch,) predicted step seconds of each split in `splits` (batch, stages)."""
        return self._evaluate(splits)["finish"].max(axis=1)

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
            step_time_s=step, samples_per_s=self.samples / step,
            tflops_per_device=self.step_flops / step / devices / 1e12,
        )
