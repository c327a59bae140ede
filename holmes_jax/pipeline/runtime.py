"""Runs a pipeline schedule over the mesh's `stage` axis.

Block parameters live in a staged layout: every block leaf is (stages, max_layers, ...) split over
`stage`, stage s holding its `stage_layers[s]` layers first and zero padding after. Padding is
skipped by the stage's layer scans (`_Layers`), so it gets zero gradient; its reduction over `data` and its optimizer
update are skipped too (`update_by_slot_group`, pipeline.update), so it never moves and a stage's
traffic over `data` is its real layers'. Checkpoints hold the canonical layout, (layers, ...) in model order,
so they move between partitions and pp values (`to_canonical` / `to_staged`).

The step is one `jax.shard_map` region manual over `stage` and `data` (`tensor` stays automatic,
so tensor-parallel shardings keep working inside). A scan walks the schedule's ticks; each tick a
stage stores what arrived, runs its forward (if the table says so), keeping each layer's vjp
residuals (what `ModelConfig.remat` saves: everything for 'none', the layer input for 'full'),
then its backward from the residuals it kept (`_Layers`): each layer's forward runs once per
microbatch, plus what the policy recomputes. Residuals of the microbatches in flight live in a
ring (GPipe: m of them, 1F1B: at most 2p - 1). The layer scans run in every tick outside any
`lax.cond`, each layer under a `cond` of its own that runs it only in a tick with work and on a
real slot: the ring and the gradient accumulators (sized by the longest stage) are carried
through them and written in place, where a `cond` around the whole scan made XLA copy them whole
every tick. Activations then move one stage down and gradients one stage up with
`lax.ppermute` (with two stages, a tick that moves both swaps them in one). They are replicated
over `tensor`, so each tensor rank sends only its 1/tp slice of the hidden axis and the receiving
stage gathers the slices over `tensor`, inside its node (as Megatron's scatter-gather does). Gradients accumulate locally and are reduced over `data` once, after the scan
(reduce-scattered where ZeRO-1 shards them): one reduction per step, not per microbatch, in
float32 or, where `ParallelConfig.grad_reduce_dtype` asks, bfloat16. Each stage reduces as soon
as it leaves the ticks: every reduction over `data` comes before the step's first collective
across stages, so the stages after the first (whose last ticks hold no work and no transfer)
reduce while stage 0 still runs its last backward.

The embedding runs on the first stage and the head and loss on the last, each under `lax.cond`:
other stages skip that work (and bubble ticks skip theirs), so they idle rather than compute
garbage. What it costs: embedding and head parameters are on every stage (memory; split over the
vocabulary on `tensor` where tp divides it), the
tied embedding's gradient is summed over `stage` once per step (after the reduction over
`data`: ZeRO-1's shards of it, 1/dp of its bytes across the boundary), and a tick in which some stage
sends moves a buffer across every boundary (idle ones send a stale stash entry or zeros, which no
stage stores: the arrival tables say when a transfer carries a microbatch). A tick in which none
does skips that transfer (GPipe's forward ticks move no gradients, its backward ticks no
activations): the skip is decided per tick, the same on every stage, so the collective stays
matched. The last stage runs each microbatch's forward, head and backward together in one tick,
its layers through the same `_Layers` as the other stages (so its padding is skipped the same
way), keeping the residuals for that tick only, in its ring (which it otherwise has no use for).

Each transfer is two `ppermute`s when some hops, not all, cross clusters (`boundary_hops`): one
holding only those hops, one the rest (an empty one is left out). Each becomes a collective of its
own, so XLA gives the crossing hops communicators of their own, which `boundary_warmup` creates
before the first step (docs/nccl.md).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from holmes_jax.models.gpt import GPT
from holmes_jax.planning import schedule as schedules
from holmes_jax.sharding import data_split_dims, keep_axes, on_tensor_ranks


def _is_block_leaf(path) -> bool:
    return any(getattr(k, "key", None) == "blocks" for k in path)


def map_blocks(fn, tree):
    """Applies `fn` to the leaves under a `blocks` key (parameters and their optimizer moments)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(x) if _is_block_leaf(path) else x, tree)


# Primitives that run their inner jaxpr once, inputs to outputs: followed output by output. A
# loop's body (scan) is not: one pass through it misses what a carry brings in later iterations.
_CALLS = {"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "custom_jvp_call", "custom_vjp_call"}


def _depends_on_input(jaxpr, dynamic: list[bool]) -> list[bool]:
    """Which outputs of `jaxpr` may depend on the inputs flagged in `dynamic`. Conservative: an
    equation's outputs all depend on its inputs, except inside calls (jit, checkpoint), which are
    followed output by output."""
    marked = {v for v, d in zip(jaxpr.invars, dynamic) if d}
    is_marked = lambda v: not isinstance(v, Literal) and v in marked  # noqa: E731
    for eqn in jaxpr.eqns:
        inputs = [is_marked(v) for v in eqn.invars]
        if not any(inputs):
            continue
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
        if (eqn.primitive.name in _CALLS and isinstance(inner, Jaxpr)
                and (len(inner.invars), len(inner.outvars)) == (len(eqn.invars), len(eqn.outvars))):
            marked.update(v for v, d in zip(eqn.outvars, _depends_on_input(inner, inputs)) if d)
        else:
            marked.update(eqn.outvars)
    return [is_marked(v) for v in jaxpr.outvars]


class _Layers:
    """A stage's layers split into a forward that keeps what the backward needs and that backward.

    The forward takes each layer's `jax.vjp` and keeps the residuals that depend on the
    microbatch (what the remat policy saves: every activation the backward reads for 'none', the
    layer's input for 'full'), stacked over the stage's layers. Residuals that depend only on the
    parameters (their compute-dtype casts, constants) are not kept: the backward rebuilds them
    from a vjp of the layer at a zero input, whose other work XLA drops as dead code. So each
    layer's forward runs once per microbatch, plus what the policy recomputes.
    """

    def __init__(self, model: GPT, blocks: dict, act: jax.Array, n_layers):
        self.model, self.blocks, self.act, self.n_layers = model, blocks, act, n_layers
        self.depth = jax.tree.leaves(blocks)[0].shape[0]
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), blocks)
        residuals = jax.make_jaxpr(lambda lp, h: jax.tree.leaves(jax.vjp(model.layer, lp, h)[1]))(one, act)
        self.dynamic = _depends_on_input(residuals.jaxpr, [False] * len(jax.tree.leaves(one)) + [True])
        # (depth, ...) per kept residual: one microbatch's stash entry
        self.kept = [jax.ShapeDtypeStruct((self.depth,) + a.shape, a.dtype)
                     for a, d in zip(residuals.out_avals, self.dynamic) if d]

    def _each_layer(self, run, carry, active=True, reverse=False):
        """Scans the layers, `run(carry, layer_params, i)`; padding layers (at or past n_layers),
        and every layer where `active` is false, leave the carry as it is, so they move no memory
        (the ring and accumulators are carried, and written in place). A layer's parameters are
        sliced inside its `cond`, so padding does not even read them."""

        def layer(carry, i):
            return run(carry, jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), self.blocks), i)

        def step(carry, i):
            work = active if self.n_layers is None else active & (i < self.n_layers)
            if work is True:
                return layer(carry, i), None
            return lax.cond(work, layer, lambda c, _: c, carry, i), None

        return lax.scan(step, carry, jnp.arange(self.depth), reverse=reverse)[0]

    def forward(self, x, ring, slot, active=True):
        """The stage's output, and `ring` (one (slots, depth, ...) array per kept residual) with
        each real layer's residuals written at `slot`; where not `active`, `x` and `ring` as they came."""

        def run(carry, lp, i):
            h, ring = carry
            out, vjp = jax.vjp(self.model.layer, lp, h)
            kept = [r for r, d in zip(jax.tree.leaves(vjp), self.dynamic) if d]
            return out, [r.at[slot, i].set(k) for r, k in zip(ring, kept)]

        return self._each_layer(run, (x, ring), active)

    def backward(self, ring, slot, g, acc, active=True):
        """(`acc` plus the gradients of the stage's blocks, the gradient of its input) from the
        residuals at `ring[slot]` and the gradient `g` of the stage's output; where not
        `active`, `acc` and `g` as they came."""

        def run(carry, lp, i):
            g, acc = carry
            _, vjp = jax.vjp(self.model.layer, lp, jnp.zeros_like(self.act))  # the parameter-only residuals
            leaves, tree = jax.tree.flatten(vjp)
            stashed = iter([r[slot, i] for r in ring])
            g_lp, g_h = tree.unflatten([next(stashed) if d else r for r, d in zip(leaves, self.dynamic)])(g)
            return g_h, jax.tree.map(lambda a, x: a.at[i].add(x), acc, g_lp)

        g_x, acc = self._each_layer(run, (g, acc), active, reverse=True)
        return acc, g_x

    def ring(self, slots: int) -> list[jax.Array]:
        """Zeroed room for the kept residuals of `slots` microbatches."""
        return [jnp.zeros((slots,) + k.shape, k.dtype) for k in self.kept]


class Pipeline:
    def __init__(self, model: GPT, mesh: Mesh, stage_layers: tuple[int, ...], microbatches: int, schedule: str,
                 boundary_hops: tuple[int, ...] = (), grad_reduce_dtype: str = "float32"):
        self.model, self.mesh = model, mesh
        self.grad_reduce_dtype = jnp.dtype(grad_reduce_dtype)  # what gradients cross `data` in
        self.boundary_hops = tuple(sorted(set(boundary_hops)))  # stages s whose hop s -> s + 1 crosses clusters
        self.stage_layers = tuple(int(n) for n in stage_layers)
        self.stages = len(self.stage_layers)
        if mesh.shape["stage"] != self.stages or sum(self.stage_layers) != model.cfg.num_layers:
            raise ValueError(f"stage_layers {self.stage_layers} do not fit mesh {dict(mesh.shape)} and "
                             f"{model.cfg.num_layers} layers")
        if not set(self.boundary_hops) <= set(range(self.stages - 1)):
            raise ValueError(f"boundary_hops {self.boundary_hops} are not hops of {self.stages} stages")
        self.max_layers = max(self.stage_layers)
        self.table = schedules.build(schedule, self.stages, microbatches)
        index = np.full((self.stages, self.max_layers), -1)
        offsets = np.cumsum((0,) + self.stage_layers)
        for s, n in enumerate(self.stage_layers):
            index[s, :n] = np.arange(offsets[s], offsets[s] + n)
        self.layer_index = index  # model layer at (stage, slot), -1 for padding

    @property
    def real_layers(self) -> np.ndarray:
        return self.layer_index >= 0

    @property
    def slot_groups(self) -> tuple[tuple[int, int], ...]:
        """Slot ranges [start, stop) that are real on the same stages: those with more than `start`
        layers. The first, [0, fewest layers), is real everywhere; even stages have only that one."""
        cuts = sorted({0, *self.stage_layers})
        return tuple(itertools.pairwise(cuts))

    def stage_ids(self):
        """Each stage's index, a shard_map input split over `stage` (P("stage")) that a stage reads
        as `ids[0]`. Not `lax.axis_index`: where `tensor` is left automatic, XLA's SPMD partitioner
        refused the PartitionId that lowers to in some layouts (tp 2, dp 1, three stage sizes)."""
        return jnp.arange(self.stages, dtype=jnp.int32)

    def stage_n_layers(self, stage):
        """Stage `stage`'s real layer count inside the shard_map (None when every stage has as many)."""
        return None if len(self.slot_groups) == 1 else jnp.asarray(self.stage_layers)[stage]

    # ------------------------------------------------------------------ layouts

    def to_staged(self, tree):
        """(layers, ...) block leaves -> (stages, max_layers, ...), zero padded."""
        take, real = np.maximum(self.layer_index, 0), self.real_layers

        def stage(x):
            mask = jnp.asarray(real).reshape(real.shape + (1,) * (x.ndim - 1))
            return jnp.where(mask, x[take], 0).astype(x.dtype)

        return map_blocks(stage, tree)

    def to_canonical(self, tree):
        """(stages, max_layers, ...) block leaves -> (layers, ...) in model order."""
        order = np.argsort(self.layer_index.ravel())[-self.model.cfg.num_layers:]  # real slots, by layer
        return map_blocks(lambda x: x.reshape((-1,) + x.shape[2:])[order], tree)

    def _over_slot_groups(self, n_layers, blocks, run, carry, axis: int):
        """`carry = run(carry, group_slice, start, stop)` for each slot group's slice of `blocks`
        (slot axis at `axis`). A group beyond the first runs under `lax.cond` on this stage's
        `n_layers`, so the stages it is padding on skip its work and its collectives (a data
        group is one stage: its members agree) and keep the carry. The slice sits in the branch
        with the work, so XLA need not copy the trees whole."""
        for start, stop in self.slot_groups:
            def group(carry, blocks, start=start, stop=stop):
                part = jax.tree.map(lambda x: lax.slice_in_dim(x, start, stop, axis=axis), blocks)
                return run(carry, part, start, stop)
            carry = group(carry, blocks) if start == 0 else lax.cond(n_layers > start, group, lambda c, b: c,
                                                                       carry, blocks)
        return carry

    def by_slot_group(self, n_layers, blocks, fn, axis: int = 0):
        """`fn` over each slot group's slice of `blocks`, the results written in place into zeros
        shaped like `fn(blocks)` (`update_by_slot_group`); padding groups stay zero."""
        zeros = jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), jax.eval_shape(fn, blocks))
        return self.update_by_slot_group(n_layers, zeros, blocks, lambda _, part: fn(part), axis)

    def update_by_slot_group(self, n_layers, state, blocks, fn, axis: int = 0):
        """`state` (a tree) with each slot group's slice replaced by `fn(state's slice, blocks'
        slice)`, written in place; the stages a group is padding on keep theirs
        (`_over_slot_groups`). Writing in place, rather than slicing each group out and joining
        the results, spares XLA a copy of every tree each step. What `fn` updates it must read
        from its first argument, not from `blocks`: a `cond` that reads an array as one operand
        and writes it in place as another makes XLA copy the array whole."""
        def run(state, part, start, stop):
            new = fn(jax.tree.map(lambda x: lax.slice_in_dim(x, start, stop, axis=axis), state), part)
            return jax.tree.map(lambda x, r: lax.dynamic_update_slice_in_dim(x, r, start, axis=axis), state, new)

        return self._over_slot_groups(n_layers, blocks, run, state, axis)

    def sum_over_slot_groups(self, n_layers, blocks, fn, axis: int = 0):
        """The sum of the float32 scalar `fn` over each slot group's slice of `blocks`, skipping
        the groups that are padding on this stage."""
        return self._over_slot_groups(n_layers, blocks, lambda total, part, *_: total + fn(part),
                                      jnp.zeros((), jnp.float32), axis)

    # ------------------------------------------------------------------ transfers

    def hop_pairs(self, down: bool) -> tuple[list, list]:
        """The `stage` permutation of one transfer (activations down, or gradients up), split into
        the pairs of hops that cross clusters and the rest; either may be empty."""
        pairs = [((s, s + 1) if down else (s + 1, s), s in self.boundary_hops) for s in range(self.stages - 1)]
        return [p for p, crossing in pairs if crossing], [p for p, crossing in pairs if not crossing]

    def _split_over_tensor(self, send, x):
        """`send(x)` with each tensor rank sending only its 1/tp slice of the hidden axis, the slices
        gathered back over `tensor` (inside a node) on arrival: the activations are replicated over
        `tensor`, so whole they would cross the boundary tp times."""
        if self.mesh.shape["tensor"] == 1:
            return send(x)
        # `tensor` manual around the send and the gather (sharding constraints alone left XLA
        # sending whole buffers, or gathering again at every consumer)
        def split_send_gather(part):
            return lax.all_gather(send(part), "tensor", axis=part.ndim - 1, tiled=True)

        # the split must not reach back into x's maker
        x = lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), P()))
        return on_tensor_ranks(split_send_gather, P(*[None] * (x.ndim - 1), "tensor"), P())(x)

    def _transfer(self, x, down: bool):
        def send(x):
            moved = [lax.ppermute(x, "stage", pairs) for pairs in self.hop_pairs(down) if pairs]
            return moved[0] if len(moved) == 1 else moved[0] + moved[1]  # each stage receives from one of them
        return self._split_over_tensor(send, x)

    def _transfers(self, x_out, g_out, x_moves, g_moves, idle, is_first):
        """(what arrives from the stage above, from the stage below) at the end of a tick:
        activations down where `x_moves`, gradients up where `g_moves`, `idle` for neither.
        With two stages a tick that moves both swaps them in one ppermute (stage 0, `is_first`,
        sends activations, stage 1 gradients), so the two directions share the link's time
        instead of taking turns; each stage reads the one it is sent."""
        down = lambda: self._transfer(x_out, down=True)  # noqa: E731
        up = lambda: self._transfer(g_out, down=False)  # noqa: E731
        if self.stages != 2:
            return lax.cond(x_moves, down, lambda: idle), lax.cond(g_moves, up, lambda: idle)

        def swap():
            sent = self._split_over_tensor(lambda x: lax.ppermute(x, "stage", [(0, 1), (1, 0)]),
                                           jnp.where(is_first, x_out, g_out))
            return sent, sent

        return lax.switch(x_moves.astype(jnp.int32) + 2 * g_moves.astype(jnp.int32),
                          [lambda: (idle, idle), lambda: (down(), idle), lambda: (idle, up()), swap])

    def boundary_warmup(self, micro_batch: int, seq: int):
        """(jitted program, its input) moving an activation-shaped buffer across the boundary hops
        only, down and up, as the step's boundary ppermutes do (same mesh, device pairs, shape,
        dtype: each tensor rank its slice of the hidden axis); None without boundary hops.
        `micro_batch` is per data replica. Nothing else: the step's gather of the slices over
        `tensor` stays inside a node, so its communicators are not made here, over sockets."""
        if not self.boundary_hops:
            return None
        dtype = jnp.dtype(self.model.cfg.compute_dtype)
        spec = P("stage", "data", None, "tensor")

        def program(x):
            down, up = (lax.ppermute(x[0], "stage", self.hop_pairs(d)[0]) for d in (True, False))
            return (down + up)[None]

        fn = jax.shard_map(program, mesh=self.mesh, axis_names={"stage", "data", "tensor"}, in_specs=spec,
                           out_specs=spec, check_vma=False)
        shape = (self.stages, micro_batch * self.mesh.shape["data"], seq, self.model.cfg.hidden)
        x = jax.device_put(jnp.zeros(shape, dtype), NamedSharding(self.mesh, spec))
        return jax.jit(fn), x

    # ------------------------------------------------------------------ the step

    def loss_and_grads(self, params: dict, batch: jax.Array, grad_specs: dict):
        """Mean loss over `batch` (microbatches, micro_batch, seq + 1) and the gradients of `params`
        (staged layout), laid out as `grad_specs` says. Call inside `jit`. A leaf whose spec names
        `data` (ZeRO-1) is reduce-scattered over `data` along that axis; the rest are all-reduced."""
        # The ticks index the batch by the table's microbatches: another count read the wrong rows
        # (past the end, the last one again) and scaled the mean by the wrong count, silently.
        if batch.ndim != 3 or batch.shape[0] != self.table.microbatches:
            raise ValueError(f"batch of shape {tuple(batch.shape)}: the pipeline takes (microbatches, micro_batch, "
                             f"seq + 1) with {self.table.microbatches} microbatches, its schedule's")
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        manual = keep_axes(grad_specs, ("stage", "data"))
        scatter_dims = data_split_dims(manual)
        shared = {"embed": params["embed"], "head": params["head"]}
        shared_out = {"embed": manual["embed"], "head": manual["head"]}
        shared_dims = {"embed": scatter_dims["embed"], "head": scatter_dims["head"]}
        tensor = keep_axes(grad_specs, ("tensor",))
        tensor_specs = {"embed": tensor["embed"], "head": tensor["head"],
                        "blocks": jax.tree.map(lambda spec: P(*spec[1:]), tensor["blocks"], is_leaf=is_spec)}
        block_specs = jax.tree.map(lambda _: P("stage"), params["blocks"])
        fn = jax.shard_map(
            functools.partial(self._stage_program, block_dims=scatter_dims["blocks"], shared_dims=shared_dims,
                              tensor_specs=tensor_specs),
            mesh=self.mesh, axis_names={"stage", "data"},
            in_specs=(P("stage"), block_specs, P(), P(None, "data")),
            out_specs=(P(), manual["blocks"], shared_out), check_vma=False,
        )
        loss, block_grads, shared_grads = fn(self.stage_ids(), params["blocks"], shared, batch)
        return loss, {"embed": shared_grads["embed"], "blocks": block_grads, "head": shared_grads["head"]}

    def _stage_program(self, stage_ids, blocks, shared, batch, block_dims, shared_dims, tensor_specs):
        model, table, p = self.model, self.table, self.stages
        s = stage_ids[0]
        blocks = jax.tree.map(lambda x: x[0], blocks)
        # Static where the layout allows, so XLA sees straight-line code: no padding to skip when
        # stages are even (one stage takes the plain vjp of the whole model instead, in `tick`).
        n_layers = self.stage_n_layers(s)
        is_first, is_last = s == 0, s == p - 1
        m, micro_batch, seq = batch.shape[0], batch.shape[1], batch.shape[2] - 1
        scale = 1.0 / (m * lax.axis_size("data"))  # each microbatch's share of the global mean
        act = jnp.zeros((micro_batch, seq, model.cfg.hidden), jnp.dtype(model.cfg.compute_dtype))
        layers = _Layers(model, blocks, act, n_layers) if p > 1 else None

        def tick(carry, xs):
            stash, res, gstash, x_in, g_in, grads, loss_sum = carry
            row, (x_moves, g_moves) = xs
            fwd, bwd, x_arrival, g_arrival = (r[s] for r in row)
            stash = lax.cond(x_arrival >= 0, lambda: stash.at[x_arrival % table.x_slots].set(x_in), lambda: stash)
            gstash = lax.cond(g_arrival >= 0, lambda: gstash.at[g_arrival % table.g_slots].set(g_in), lambda: gstash)

            if p == 1:  # one stage: the plain vjp of the whole model
                def backward_whole(grads, loss_sum):
                    loss, vjp = jax.vjp(lambda b, sh: model.loss(dict(sh, blocks=b), batch[bwd]), blocks, shared)
                    return jax.tree.map(jnp.add, grads, vjp(jnp.asarray(scale, jnp.float32))), loss_sum + loss * scale

                grads, loss_sum = lax.cond(bwd >= 0, backward_whole, lambda g, l: (g, l), grads, loss_sum)
                return (stash, res, gstash, x_in, g_in, grads, loss_sum), None

            # The layer scans run in every tick, outside any cond (see the module doc); the last
            # stage runs each microbatch's forward in the tick of its backward.
            tokens_f, tokens_b = batch[fwd], batch[bwd]
            slot = jnp.where(is_last, bwd, fwd) % table.x_slots  # where this tick's forward keeps its residuals
            x = lax.cond(is_first & (fwd >= 0), lambda: model.embed(shared, tokens_f[:, :-1]).astype(act.dtype),
                         lambda: stash[slot])
            x_out, res = layers.forward(x, res, slot, active=jnp.where(is_last, bwd, fwd) >= 0)

            def head(g_shared, loss_sum):
                loss, head_vjp = jax.vjp(lambda sh, h: model.head_loss(sh, h, tokens_b[:, 1:]), shared, x_out)
                g_sh, g_h = head_vjp(jnp.asarray(scale, jnp.float32))
                return jax.tree.map(jnp.add, g_shared, g_sh), loss_sum + loss * scale, g_h

            g_blocks, g_shared = grads
            g_shared, loss_sum, g_h = lax.cond(is_last & (bwd >= 0), head, lambda g, l: (g, l, act), g_shared, loss_sum)
            g = jnp.where(is_last, g_h, gstash[bwd % table.g_slots])
            g_blocks, g_out = layers.backward(res, bwd % table.x_slots, g, g_blocks, active=bwd >= 0)

            def embed_backward(g_shared):
                g_embed = jax.vjp(lambda sh: model.embed(sh, tokens_b[:, :-1]).astype(act.dtype), shared)[1](g_out)[0]
                return jax.tree.map(jnp.add, g_shared, g_embed)

            g_shared = lax.cond(is_first & (bwd >= 0), embed_backward, lambda g: g, g_shared)
            grads = (g_blocks, g_shared)
            # Where a stage had no forward or backward, x_out and g_out hold a stale stash entry
            # (slot -1) or zeros; no stage stores them (the arrival tables say when a transfer
            # carries a microbatch).
            x_in, g_in = self._transfers(x_out, g_out, x_moves, g_moves, act, is_first)
            return (stash, res, gstash, x_in, g_in, grads, loss_sum), None

        zeros = jax.tree.map(jnp.zeros_like, (blocks, shared))
        res = [] if layers is None else layers.ring(table.x_slots)
        carry = (jnp.zeros((table.x_slots,) + act.shape, act.dtype), res,
                 jnp.zeros((table.g_slots,) + act.shape, act.dtype), act, act, zeros, jnp.zeros((), jnp.float32))
        rows = tuple(jnp.asarray(r) for r in (table.fwd, table.bwd, table.x_arrivals(), table.g_arrivals()))
        moves = tuple(jnp.asarray(m) for m in schedules.transfers(table.fwd, table.bwd))
        (_, _, _, _, _, (g_blocks, g_shared), loss_sum), _ = lax.scan(tick, carry, (rows, moves))
        # The one gradient reduction of the step, over `data` (reduce-scatter for ZeRO-1 leaves,
        # all-reduce otherwise), then the shared embedding and head, used on the first and last
        # stage, summed over `stage`: ZeRO-1's shards of them, 1/dp of the bytes across the
        # boundary. Block leaves here lack the leading stage axis: dim - 1.
        # It runs in `grad_reduce_dtype` (bfloat16: half the bytes; the sums come back in float32
        # for clipping and the update), with `tensor` manual too: XLA:CPU widens a bfloat16
        # reduction to float32 and fails on the reducer a partly automatic shard_map gives it.
        def over_data(x, dim, tensor_spec, offset=0):
            def reduce(y):
                wire = y.astype(self.grad_reduce_dtype)
                if dim < 0:
                    return lax.psum(wire, "data").astype(y.dtype)
                return lax.psum_scatter(wire, "data", scatter_dimension=dim - offset, tiled=True).astype(y.dtype)

            return on_tensor_ranks(reduce, tensor_spec, tensor_spec)(x)

        g_blocks = self.by_slot_group(n_layers, g_blocks, lambda g: jax.tree.map(
            lambda x, d, t: over_data(x, d, t, offset=1), g, block_dims, tensor_specs["blocks"]))
        shared_specs = {k: tensor_specs[k] for k in ("embed", "head")}
        g_shared = jax.tree.map(over_data, g_shared, shared_dims, shared_specs)
        # Every reduction over `data` before any collective across stages: the stages after the
        # first, done once the last transfer is (one stage-0 backward before the end), reduce
        # while stage 0 still computes, rather than waiting for them at the sum over `stage`. XLA drops optimization
        # barriers before it schedules, so the order is a data dependency: a zero it cannot see
        # through, taken from every reduced gradient (from its first element on each tensor rank:
        # read from a tensor-split leaf as a whole, XLA gathered the leaf over `tensor` first).
        def zero_from(x, tensor_spec):
            def zero(y):
                return jnp.minimum(jnp.abs(y.ravel()[0]), 0.0)

            if "tensor" not in tensor_spec or self.mesh.shape["tensor"] == 1:
                return zero(x)
            return on_tensor_ranks(zero, tensor_spec, P())(x)

        after = sum(jax.tree.leaves(jax.tree.map(zero_from, (g_blocks, g_shared),
                                                 (tensor_specs["blocks"], shared_specs))))
        g_shared = jax.tree.map(lambda x: x + after.astype(x.dtype), g_shared)
        if self.stages > 1:  # one stage: the sum is the identity, and with one replica too (tp alone)
            g_shared = lax.psum(g_shared, "stage")  # XLA's partitioner failed on it (a RET_CHECK, every step)
        loss = lax.psum(loss_sum, ("stage", "data"))
        return loss, jax.tree.map(lambda x: x[None], g_blocks), g_shared
