"""Step-time prediction from plain numbers: FLOPs, parameter counts, device speeds, link speeds.

One training step as the pipeline runtime runs it (holmes_jax.pipeline.runtime):

0. With ZeRO-1 a step starts by all-gathering the previous step's updates (each replica updated
   its own shard), each stage over its own data ring, in float32 or bfloat16
   (ParallelConfig.update_gather_dtype): an all-gather, (n-1)/n * S/W + (n-1) latencies. A stage
   starts its first tick once its gather is done, so a stage with no work in the first ticks (the
   last one: it waits for the first microbatch) gathers while the stages before it compute.
1. The schedule's tick table (GPipe or 1F1B) is walked in lockstep. In a tick each stage runs its
   forward of one microbatch (if the table says so), keeping what the backward needs, then its
   backward from that. The last stage runs its forward inside its backward's tick. A forward
   takes its layers' FLOPs divided by tensor parallelism, at the device's achievable FLOP/s,
   plus its tensor-parallel all-reduces over the node's link, and the head's and loss's (last
   stage) FLOPs divided by tp too where tp splits the vocabulary (the embedding's lookup has no
   matmul), else whole on each tp rank. A backward's FLOPs include what the remat policy
   recomputes (the layer costs carry them).
2. A tick ends with up to two ppermutes, activations one stage down and then gradients one stage
   up (micro_batch * seq * hidden * bytes, replicated over `tensor`: each tp rank sends its 1/tp
   slice, which the receiving stage all-gathers over `tensor` inside its node), over each
   boundary's link, each only in ticks where some stage sends one (GPipe: activations in its
   forward ticks, gradients in its backward ticks). With two stages a tick that moves both swaps
   them in one ppermute, both directions at once (links are full duplex): one transfer's time.
   They are collectives: a tick lasts as long as its slowest stage plus its transfers over the
   slowest boundary.
3. After its last tick each stage reduces its gradients over its data-parallel ring (the
   stages after the first leave the ticks once their last backward and the last transfer are
   done, which is one stage-0 backward before the end, and reduce while stage 0 computes): a ring
   all-reduce, 2(n-1)/n * S/W + 2(n-1) latencies, or with ZeRO-1 a reduce-scatter, (n-1)/n * S/W
   + (n-1) latencies, on the ring's slowest link, one per parameter leaf (so the latencies are
   paid once per leaf), of float32 or bfloat16 gradients (ParallelConfig.grad_reduce_dtype).
   Every stage holds the embedding and head and syncs them too. ZeRO-1 splits a leaf along an
   axis that dp divides; a leaf with none (e.g. power-of-two sizes, dp = 3) is all-reduced, and
   updated and held whole by every replica (workload.zero1_whole).
4. The embedding's and head's gradients (ZeRO-1: each device's shard of them, 1/dp) are summed
   over `stage` in float32, a ring all-reduce over the slowest boundary, and clipping takes the
   global gradient norm: both wait for the slowest stage's reduction. Then each stage runs its
   optimizer step, at the device's measured seconds per parameter (ZeRO-1: its 1/dp share, whose
   update waits for the next step's gather). Each stage then pays its fixed part: the work of a
   step that none of the above prices (on CPU: dispatch, buffer handling, the guard), fitted by a
   profile to real steps (planning.search; zero without one). The step ends when the last stage
   finishes.
5. Memory per device: weights, gradients and Adam state (ZeRO-1 shards the latter over data,
   and keeps the update of its shard until the next step's gather, in the gather's dtype),
   plus the ring of stashed residuals (what the remat policy keeps, per layer and microbatch):
   room for the schedule's microbatches in flight (GPipe: all m; 1F1B: min(2p - 1, m)) of the
   longest stage's layers, on every stage (the runtime's arrays have equal shards), and the
   scan's boundary-sized buffers (whole on every tp rank): a stashed input per ring slot, the one
   stashed output gradient, and the two a tick's transfers arrive in. With one stage, one
   microbatch's residuals. On top, a tick's working memory at its largest: one layer's backward
   (what its remat policy recomputes, or the activation gradients it makes, and its fresh
   parameter gradient; with one stage a microbatch's gradient of the whole model) or, on the last
   stage, the head's float32 logits and their gradient (workload.layer_work_bytes, head_work_bytes).
   A checkpoint's save (and a resume's restore, a fresh state's creation) runs apart from the
   step, with no gradients or activations, but holds at once the train state, the canonical state
   (every layer's weights and moments spread over all devices) and the all-to-all's buffer between
   them (every stage's layer slots, padding included, spread the same way: build.Setup.canonical).
   With little to stash (deep pipelines, short sequences, full remat) that is more than the step
   holds, so a device's memory is the larger of the two.
   A split over some device's memory is infinitely slow.
6. The runtime pads every stage to the longest stage's layer count, but the padding's
   reduction, update and gather are skipped (pipeline.update): sync and update cover a stage's
   real layers only. Memory is the padded stage's: weights, gradients and moments are arrays
   of equal shards.

`simulate` walks the ticks against these durations, vectorised over a batch of candidate splits
so the partitioner can compare many at once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from holmes_jax.planning import schedule as schedules
from holmes_jax.planning.topology import Link
from holmes_jax.planning.workload import Part

SCHEDULES = schedules.SCHEDULES


def reduce_scatter_s(nbytes, n, link: Link, collectives: int = 1):
    """Ring reduce-scatters (or all-gathers) of `nbytes` in all over `n` ranks, split into
    `collectives` separate ones: (n-1)/n * S/W + (n-1) latencies each. Arguments may be arrays."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, (n - 1) / np.maximum(n, 1) * nbytes / link.bytes_per_s
                    + collectives * (n - 1) * link.latency_s, 0.0)


all_gather_s = reduce_scatter_s


def allreduce_s(nbytes, n, link: Link, collectives: int = 1):
    """Ring all-reduces: a reduce-scatter then an all-gather, 2(n-1)/n * S/W + 2(n-1) latencies each."""
    return 2 * reduce_scatter_s(nbytes, n, link, collectives)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one microbatch costs on one whole model replica."""

    embed: Part
    layers: Sequence[Part]
    head: Part  # final norm, output projection and loss
    boundary_bytes: float  # activations of one microbatch at a stage boundary, each way
    tp_allreduces_fwd: int = 2  # per layer (Megatron: after attention and after the MLP)
    tp_allreduces_bwd: int = 2  # per layer; 4 with full recompute (the repeated forward's two)
    layer_stash_bytes: float = 0.0  # what one layer keeps of one in-flight microbatch for its backward, per device
    grad_bytes_per_param: float = 4.0  # float32 gradients (held)
    reduce_bytes_per_param: float = 4.0  # what crosses `data` per gradient: 2 with grad_reduce_dtype bfloat16
    param_bytes_per_param: float = 4.0  # float32 weights (held)
    gather_bytes_per_param: float = 4.0  # what ZeRO-1's gather of the updates moves: 2 with update_gather_dtype bfloat16
    optimizer_bytes_per_param: float = 8.0  # Adam's two float32 moments (ZeRO-1 shards them over data)
    sync_collectives: int = 1  # per sync: the runtime reduces (and ZeRO-1 gathers) each parameter leaf on its own
    # ZeRO-1: what dp splits along no axis stays whole on every replica (workload.zero1_whole)
    zero1_whole_layer_share: float = 0.0  # of each layer's parameters
    zero1_whole_shared_share: float = 0.0  # of the embedding's and head's
    zero1_whole_leaves: int = 0  # of the sync_collectives
    # the token embedding's and output projection's parameters tp splits over the vocabulary
    # (workload.vocab_split_params; 0: replicated over `tensor`, every rank runs the head whole)
    vocab_split_params: float = 0.0
    # working memory of a step beyond what it stashes, per device (workload.layer_work_bytes and
    # head_work_bytes): one layer's backward (what the remat policy recomputes and the gradients
    # on the way) and the last stage's head (float32 logits and their gradient)
    layer_work_bytes: float = 0.0
    head_work_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class Stage:
    """Where one pipeline stage runs."""

    device_flops: float  # achievable FLOP/s of one device
    tp: int
    tp_link: Link  # its tensor groups' all-reduce ring
    dp: int
    dp_link: Link  # its data groups' gradient ring (the slowest hop, NIC sharing counted)
    memory_bytes: float = float("inf")  # of one device
    update_s_per_param: float = 0.0  # the optimizer step on one device, per parameter it updates (measured)
    fixed_s: float = 0.0  # a step's work beyond what the model prices (fitted to measured steps)


@dataclasses.dataclass(frozen=True)
class Prediction:
    stage_layers: tuple[int, ...]
    stage_fwd_s: tuple[float, ...]  # one microbatch
    stage_bwd_s: tuple[float, ...]
    stage_compute_s: tuple[float, ...]  # all microbatches, forward and backward
    p2p_s: tuple[float, ...]  # per boundary: one microbatch's activations (its gradients take as long back)
    stage_gather_s: tuple[float, ...]  # ZeRO-1's gather of the last step's updates, before the stage's first tick
    stage_busy_s: tuple[float, ...]  # when the stage leaves the ticks: its last backward and the last transfer done
    pipeline_s: float  # when the schedule's last tick ends (stage 0's; the others leave it earlier)
    stage_sync_s: tuple[float, ...]  # the gradient reduction and (ZeRO-1) the gather of the updates
    stage_update_s: tuple[float, ...]  # the optimizer step
    stage_fixed_s: tuple[float, ...]  # the step's unpriced work, fitted to measured steps (0 without)
    shared_sum_s: float  # the embedding's and head's gradients summed over `stage`
    stage_finish_s: tuple[float, ...]  # the slowest (last tick + reduction), then the sum over stage and the update
    # per device: weights, gradients, optimizer state, stashed activations, or a checkpoint's save if more
    stage_memory_bytes: tuple[float, ...]
    fits: bool  # every stage within its devices' memory
    step_time_s: float
    samples_per_s: float
    tflops_per_device: float  # step_flops / step time / devices

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=256)
def _ticks(schedule: str, p: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The runtime's tick table as masks: (ticks, p) "runs a separate forward", (ticks, p) "runs a
    backward", each stage's last busy tick, and (ticks,) how many transfers end each tick one after
    the other (0-2: activations down, gradients up, each only where some stage sends; with two
    stages both in one swap, `schedule.hops_per_tick`). The last stage runs each
    forward in the tick of its backward (pipeline.runtime)."""
    fwd, bwd = schedules.ticks(schedule, p, m)
    forward, backward = fwd >= 0, bwd >= 0
    forward[:, -1] = backward[:, -1]
    busy = forward | backward
    last = np.array([np.flatnonzero(busy[:, s]).max() for s in range(p)])
    return forward, backward, last, schedules.hops_per_tick(fwd, bwd)


def simulate(fwd_s, bwd_s, p2p_s, microbatches: int, schedule: str = "gpipe",
             start_s=None) -> tuple[np.ndarray, np.ndarray]:
    """The runtime's lockstep ticks: (when each stage leaves them, when the scan ends). A stage
    leaves after its last backward and the last transfer, which every stage takes part in: from
    then on it only runs ticks with no work and no collective, so it can go on (the reduction).
    A stage enters the ticks at `start_s` (p, *batch) (ZeRO-1's gather; default 0): no tick
    ends before every stage has entered, and a stage's work in it starts no earlier.

    fwd_s, bwd_s: (p, *batch) seconds of one microbatch's forward and backward on each stage;
    p2p_s: (p - 1, *batch) seconds of one transfer across each boundary (a 1-D vector broadcasts
    over the batch). Each tick a stage runs its forward (if any), then its backward (the last
    stage runs both in its backward's ticks); then the activations move down if any stage sent
    one, and the gradients up if any stage sent one, one ppermute after the other (with two
    stages, one swap). A ppermute is a collective, so every tick lasts as long as its slowest
    stage plus its transfers over the slowest boundary.
    Returns ((p, *batch), (*batch)).
    """
    fwd_s, bwd_s = np.asarray(fwd_s, dtype=float), np.asarray(bwd_s, dtype=float)
    p, batch = fwd_s.shape[0], fwd_s.shape[1:]
    forward, backward, last, transfers = _ticks(schedule, p, microbatches)
    shape = (p,) + (1,) * len(batch)
    hop = np.zeros(batch)
    if p > 1:
        p2p = np.asarray(p2p_s, dtype=float)
        p2p = np.broadcast_to(p2p.reshape(p2p.shape + (1,) * (len(batch) + 1 - p2p.ndim)), (p - 1,) + batch)
        hop = p2p.max(axis=0)
    start = np.zeros((p,) + batch) if start_s is None else np.asarray(start_s, dtype=float)
    end, stage_end, moved = np.zeros(batch), np.zeros((p,) + batch), np.zeros(batch)
    for t in range(forward.shape[0]):
        work = forward[t].reshape(shape) * fwd_s + backward[t].reshape(shape) * bwd_s
        end = (np.maximum(end, start) + work).max(axis=0) + transfers[t] * hop
        stage_end[last == t] = end
        if transfers[t]:
            moved = end
    return np.maximum(stage_end, moved), end


class CostModel:
    """Predicted step time of any layers-per-stage split on one layout."""

    def __init__(self, work: Work, stages: Sequence[Stage], boundaries: Sequence[Link], microbatches: int,
                 schedule: str = "gpipe", zero1: bool = False, step_flops: float = 0.0, samples: int = 0):
        if len(boundaries) != len(stages) - 1:
            raise ValueError(f"{len(stages)} stages need {len(stages) - 1} boundary links, got {len(boundaries)}")
        self.work, self.stages, self.microbatches, self.schedule = work, tuple(stages), microbatches, schedule
        self.boundaries = tuple(boundaries)
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
        self._mean_layer_params = self._prefix["params"][-1] / max(len(work.layers), 1)
        self._all_params = self._prefix["params"][-1] + work.embed.params + work.head.params
        self._devices = sum(s.tp * s.dp for s in stages)
        tp = stages[0].tp  # every stage has the same tp
        # on every stage, per device: whole, but for the vocabulary's share where tp splits it
        self._shared_params = work.embed.params + work.head.params - work.vocab_split_params * (1 - 1 / tp)
        self._ends = {a: ends(a) for a in ("fwd_flops", "bwd_flops", "params")}
        self._tp = np.array([s.tp for s in stages], dtype=float)
        self._flops = np.array([s.device_flops for s in stages], dtype=float) * self._tp  # a stage's tp devices
        # the head's logits: split over the vocabulary on the tp devices, or whole on each
        self._end_flops = self._flops / (1 if work.vocab_split_params else self._tp)
        self._dp = np.array([s.dp for s in stages])
        self._dp_link = Link(np.array([s.dp_link.bytes_per_s for s in stages]),
                             np.array([s.dp_link.latency_s for s in stages]))
        # per stage, as arrays: the planner builds thousands of these
        tp_links = Link(np.array([s.tp_link.bytes_per_s for s in stages], dtype=float),
                        np.array([s.tp_link.latency_s for s in stages], dtype=float))
        tp_allreduce = allreduce_s(work.boundary_bytes, self._tp, tp_links)
        self._tp_fwd, self._tp_bwd = work.tp_allreduces_fwd * tp_allreduce, work.tp_allreduces_bwd * tp_allreduce
        # each tp rank sends its 1/tp slice of the activations (the route's rate is already its
        # share of the NIC), and the receiving stage all-gathers the slices over `tensor` inside
        # its node (a ring all-gather takes a reduce-scatter's time)
        stage_gather = reduce_scatter_s(work.boundary_bytes, tp, tp_links)
        gather = np.maximum(stage_gather[:-1], stage_gather[1:])
        self._p2p = np.array([link.time(work.boundary_bytes / tp) + g for link, g in zip(boundaries, gather)])
        # the embedding's and head's float32 gradients (ZeRO-1: each device's shard, after the
        # reduction over `data`) summed over `stage`: a ring through every boundary, the slowest
        self._shared_sum = 0.0
        if boundaries:
            kept = work.zero1_whole_shared_share
            shared_bytes = self._shared_params * work.grad_bytes_per_param * (
                kept + (1 - kept) / self._dp.max() if zero1 else 1)
            slowest = min(boundaries, key=lambda link: link.bytes_per_s)
            self._shared_sum = float(allreduce_s(shared_bytes, p, slowest))
        # the runtime's residual ring: x_slots microbatches of the longest stage's layers, on every
        # stage; one stage runs a plain vjp, a microbatch at a time
        self._ring_slots = schedules.ring_slots(schedule, p, microbatches) if p > 1 else 1
        # plus the scan's boundary-sized carries: an input stash of as many slots, one output
        # gradient slot (schedule.Table.g_slots) and the activation and gradient that arrive
        self._inputs_bytes = (self._ring_slots + 3) * work.boundary_bytes if p > 1 else 0.0
        self._memory = np.array([s.memory_bytes for s in stages])
        self._update_rate = np.array([s.update_s_per_param for s in stages])
        self._fixed = np.array([s.fixed_s for s in stages])

    def with_stages(self, stages: Sequence[Stage]) -> "CostModel":
        """The same work, links and schedule on other stages."""
        return CostModel(self.work, stages, self.boundaries, self.microbatches, self.schedule, self.zero1,
                         self.step_flops, self.samples)

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
        """(stages,): one microbatch's embedding (first stage) and head (last stage), forward + backward:
        over the tp devices where tp splits the vocabulary, else whole on each."""
        return (self._ends["fwd_flops"] + self._ends["bwd_flops"]) / self._end_flops

    def stage_terms(self, splits) -> dict[str, np.ndarray]:
        """What each stage of each split (batch, stages) costs, before the schedule: one
        microbatch's forward and backward, the gradient reduction, the optimizer step, the
        parameter gather (ZeRO-1) and memory per device: the step's, a checkpoint save's and the
        larger of the two. Reduction, update and gather cover the stage's real layers; memory is
        of the padded stage (every stage holds the longest stage's layer count)."""
        n = np.asarray(splits, dtype=int)
        stop = np.cumsum(n, axis=1)
        start = stop - n

        def seconds(attr):  # layers split over tp; embedding and head as `end_seconds` says
            layers = self._prefix[attr][stop] - self._prefix[attr][start]
            return layers / self._flops + self._ends[attr] / self._end_flops

        fwd = seconds("fwd_flops") + n * self._tp_fwd
        bwd = seconds("bwd_flops") + n * self._tp_bwd
        layers = self._prefix["params"][stop] - self._prefix["params"][start]
        params = layers / self._tp + self._shared_params  # per device
        padding = n.max(axis=1, keepdims=True) - n
        held = params + padding * self._mean_layer_params / self._tp
        w = self.work
        k = w.sync_collectives
        if self.zero1:  # each replica reduces, updates and keeps its 1/dp share of what dp splits
            whole = layers / self._tp * w.zero1_whole_layer_share + self._shared_params * w.zero1_whole_shared_share
            held_whole = whole + padding * self._mean_layer_params / self._tp * w.zero1_whole_layer_share
            split, held_split, k_whole = params - whole, held - held_whole, w.zero1_whole_leaves
            reduce = (reduce_scatter_s(split * w.reduce_bytes_per_param, self._dp, self._dp_link, k - k_whole)
                      + allreduce_s(whole * w.reduce_bytes_per_param, self._dp, self._dp_link, k_whole))
            gather = all_gather_s(split * w.gather_bytes_per_param, self._dp, self._dp_link, k - k_whole)
            # Adam's moments, and the update until the next gather in the gather's dtype
            state = (held_split * (w.optimizer_bytes_per_param + w.gather_bytes_per_param) / self._dp
                     + held_whole * w.optimizer_bytes_per_param)
            update = self._update_rate * (split / self._dp + whole)
        else:
            reduce, gather = allreduce_s(params * w.reduce_bytes_per_param, self._dp, self._dp_link, k), 0.0 * params
            state, update = held * w.optimizer_bytes_per_param, self._update_rate * params
        longest = n.max(axis=1, keepdims=True)
        # A tick's working memory on top of the ring, at its largest: a layer's backward (with its
        # fresh parameter gradient, added to the accumulator only after; one stage takes the vjp
        # of the whole model, a microbatch's gradient of every parameter at once), or on the last
        # stage the head's logits, which run before the layers' backward, not with it.
        fresh = held if n.shape[1] == 1 else self._mean_layer_params / self._tp
        work = np.broadcast_to(w.layer_work_bytes + fresh * w.grad_bytes_per_param, n.shape).copy()
        work[:, -1] = np.maximum(work[:, -1], w.head_work_bytes)
        step_memory = (held * (w.param_bytes_per_param + w.grad_bytes_per_param) + state
                       + self._ring_slots * longest * w.layer_stash_bytes + self._inputs_bytes + work)
        # a save: the train state, the canonical state and the all-to-all's buffer of the padded
        # one (every stage's layer slots), both spread over every device (module docstring, 5.)
        spread = (w.param_bytes_per_param + w.optimizer_bytes_per_param) / self._devices
        padding_slots = n.shape[1] * longest - self.num_layers
        checkpoint_memory = (held * w.param_bytes_per_param + state + 2 * self._all_params * spread
                             + padding_slots * self._mean_layer_params * spread)
        memory = np.maximum(step_memory, checkpoint_memory)
        shared_sum = np.full((n.shape[0], 1), self._shared_sum)
        fixed = np.broadcast_to(self._fixed, n.shape)
        return {"fwd": fwd, "bwd": bwd, "reduce": reduce, "gather": gather, "sync": reduce + gather,
                "update": update, "fixed": fixed, "shared_sum": shared_sum, "step_memory": step_memory,
                "checkpoint_memory": checkpoint_memory, "memory": memory,
                "fits": (memory <= self._memory).all(axis=1)}

    @staticmethod
    def _finish(busy, t: dict) -> np.ndarray:
        """(batch, stages) when each stage finishes, its last tick ending at `busy`: every stage
        reduces over `data` from its last tick on; the sum over `stage` (and the global norm)
        waits for the slowest, then each stage updates (its gather opens the next step) and pays
        its fixed part."""
        return (busy + t["reduce"]).max(axis=1, keepdims=True) + t["shared_sum"] + t["update"] + t["fixed"]

    def _all_microbatches(self, t: dict) -> np.ndarray:
        """(batch, stages) one stage's compute over the step: a forward and a backward per microbatch."""
        return self.microbatches * (t["fwd"] + t["bwd"])

    def _evaluate(self, splits) -> dict[str, np.ndarray]:
        t = self.stage_terms(splits)
        busy, end = simulate(t["fwd"].T, t["bwd"].T, self._p2p, self.microbatches, self.schedule, t["gather"].T)
        t["busy"], t["pipeline"] = busy.T, end
        t["finish"] = self._finish(t["busy"], t)
        return t

    def step_times(self, splits) -> np.ndarray:
        """(batch,) predicted step seconds of each split in `splits` (batch, stages); infinite
        where a stage does not fit in its devices' memory."""
        t = self._evaluate(splits)
        return np.where(t["fits"], t["finish"].max(axis=1), np.inf)

    def lower_bounds(self, splits) -> np.ndarray:
        """(batch,) what the ticks cannot beat, without walking them: a stage's last tick ends
        no earlier than its gather plus its own m forwards and backwards, and stage 0's (it runs
        the last backward) no earlier than the busiest stage's plus every transfer the ticks make,
        since no tick is shorter than any one stage's work in it. Infinite where a stage does not
        fit in memory."""
        t = self.stage_terms(splits)
        if not t["fits"].any():  # no tick table to replay (the planner screens thousands of layouts)
            return np.full(len(t["fits"]), np.inf)
        hops = 0.0
        if self.num_stages > 1:
            hops = _ticks(self.schedule, self.num_stages, self.microbatches)[3].sum() * self._p2p.max()
        busy = t["gather"] + self._all_microbatches(t)
        busy[:, 0] = np.maximum(busy[:, 0], busy.max(axis=1) + hops)
        bound = self._finish(busy, t).max(axis=1)
        return np.where(t["fits"], bound, np.inf)

    def predict(self, stage_layers: Sequence[int]) -> Prediction:
        t = self._evaluate([list(stage_layers)])
        t = {k: v[0] for k, v in dict(t, compute=self._all_microbatches(t)).items()}
        step = float(t["finish"].max())
        devices = int(sum(s.tp * s.dp for s in self.stages))

        def floats(a):
            return tuple(float(x) for x in a)

        return Prediction(
            stage_layers=tuple(int(x) for x in stage_layers),
            stage_fwd_s=floats(t["fwd"]), stage_bwd_s=floats(t["bwd"]),
            stage_compute_s=floats(t["compute"]),
            p2p_s=floats(self._p2p), stage_gather_s=floats(t["gather"]), stage_busy_s=floats(t["busy"]),
            pipeline_s=float(t["pipeline"]),
            stage_sync_s=floats(t["sync"]), stage_update_s=floats(t["update"]), stage_fixed_s=floats(t["fixed"]),
            shared_sum_s=float(t["shared_sum"][0]), stage_finish_s=floats(t["finish"]),
            stage_memory_bytes=floats(t["memory"]), fits=bool(t["fits"]),
            step_time_s=step, samples_per_s=self.samples / step,
            tflops_per_device=self.step_flops / step / devices / 1e12,
        )
