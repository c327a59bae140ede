"""The optimizer step on the pipeline's staged layout, covering each stage's real layers only.

Block leaves are (stages, max_layers, ...) with zero padding after a stage's real layers
(`Pipeline`). The step runs in one `jax.shard_map` manual over `stage` and `data` (`tensor`
automatic), one slot group at a time (`Pipeline.update_by_slot_group`): a group that is padding
on a stage runs under a `lax.cond` that stage skips, so the stage neither updates its padding nor
all-gathers it (ZeRO-1). What a stage computes and moves around the update is proportional to
its real layers; padding stays exactly zero. The embedding and head take their own AdamW call.

With ZeRO-1 each replica computes the AdamW update of its shard and keeps it, in the train
state's `pending`, until the next step opens with `settle`: the updates are all-gathered and every
replica adds them to its float32 parameters. In float32 that is exactly gathering the updated
shards. With `update_gather_dtype = 'bfloat16'` the update is kept and gathered in bfloat16, half
the bytes: every replica adds the same rounded update, so the replicas stay equal and the weights
stay float32 (an update is off by at most 2^-8 of itself, bfloat16's rounding, where bfloat16
weights would lose small updates). Gathering at the start of the next step rather than at the end
of this one lets a stage that waits for its first microbatch (the last) gather while the stages
before it compute.

Clipping needs the global gradient norm, one scalar summed over the whole mesh: every stage
waits for the slowest stage's gradient reduction before it updates (the cost model charges
that barrier).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from holmes_jax.pipeline.runtime import Pipeline
from holmes_jax.sharding import data_split_dims, keep_axes, on_tensor_ranks

_SHARED = ("embed", "head")


def _manual_specs(state_specs: dict, grad_specs: dict):
    """The part of each spec the shard_map handles by hand: `stage` and `data` (`tensor` stays automatic)."""
    return tuple(keep_axes(specs, ("stage", "data"))
                 for specs in (state_specs["params"], state_specs["pending"], state_specs["opt_state"], grad_specs))


def _leaves(tree, dims, split: bool) -> list:
    """The leaves ZeRO-1 splits (`split`) or does not split (all of them without ZeRO-1), in order."""
    return [x for x, d in zip(jax.tree.leaves(tree), jax.tree.leaves(dims)) if (d >= 0) == split]


def _joined(dims, split: list, whole: list):
    """The tree shaped like `dims` with its split leaves taken in order from `split`, the others from `whole`."""
    split, whole = iter(split), iter(whole)
    return jax.tree.map(lambda d: next(split) if d >= 0 else next(whole), dims)


def no_pending(dtype) -> jax.Array:
    """What `pending` holds for a leaf ZeRO-1 does not split (updated at once): nothing."""
    return jnp.zeros((0,), dtype)


def make_update(pipeline: Pipeline, tx: optax.GradientTransformation, max_norm: float, state_specs: dict,
                grad_specs: dict, gather_dtype: str = "float32"):
    """`update(params, opt_state, grads, loss) -> (params, pending, opt_state, gradient norm
    before clipping, applied)`, for use inside `jit`; the arguments laid out as `state_specs`
    ({"params", "pending", "opt_state"}) and `grad_specs` say (staged layout). Leaves that ZeRO-1
    splits over `data` are updated on this replica's shard: they come back unchanged in `params`,
    and the update of the shard, in `gather_dtype`, in `pending` (for `settle`). The others are
    updated in place and hold `no_pending` there. `applied` is False where `loss` or the norm is
    not finite: those parameters then come back as they were, and the caller keeps the old
    optimizer state and pends nothing. The parameters are chosen here, where each new value is
    computed: chosen after the update, the old ones stayed alive beside the new, so a later slot
    group's `cond` could not update them in place and XLA copied a stage's parameters whole
    (ZeRO-1 off, `[6, 2]`: 72 MiB a device). Choosing the moments and pending updates here too
    held more, not less (8.6 MiB, `[5, 1, 1, 1]` at seq 16)."""
    wire = jnp.dtype(gather_dtype)
    param_specs, pending_specs, opt_specs, grad_specs = _manual_specs(state_specs, grad_specs)
    dims = data_split_dims(grad_specs)

    def body(stage_ids, params, opt_state, grads, loss):
        n_layers = pipeline.stage_n_layers(stage_ids[0])
        stages, replicas, rank = lax.axis_size("stage"), lax.axis_size("data"), lax.axis_index("data")
        shared = lambda tree: {k: tree[k] for k in _SHARED}  # noqa: E731

        # The global norm: each device's sum of squares, counted once over the replicas that hold it.
        def sum_squares(tree, dim_tree, over_stages):
            total = jnp.zeros((), jnp.float32)
            for x, d in zip(jax.tree.leaves(tree), jax.tree.leaves(dim_tree)):
                copies = (1 if over_stages else stages) * (1 if d >= 0 else replicas)
                total += jnp.sum(jnp.square(x.astype(jnp.float32))) / copies
            return total

        blocks_sq = pipeline.sum_over_slot_groups(n_layers, grads["blocks"],
                                                  lambda g: sum_squares(g, dims["blocks"], True), axis=1)
        norm = jnp.sqrt(lax.psum(blocks_sq + sum_squares(shared(grads), shared(dims), False), ("stage", "data")))
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
        applied = jnp.isfinite(loss) & jnp.isfinite(norm)

        def own(x, d):  # this replica's shard of a leaf ZeRO-1 splits along d
            if d < 0:
                return x
            size = x.shape[d] // replicas
            return lax.dynamic_slice_in_dim(x, rank * size, size, axis=d)

        def adamw(p, g, state, d):
            """One AdamW step of the parameter tree `p` (any part of the model), with `state` whose
            moments are shaped like `p`. Returns the new `p`, its pending updates and the state."""
            mine = jax.tree.map(own, p, d)
            g = jax.tree.map(lambda x: (x * scale).astype(x.dtype), g)
            updates, new_state = tx.update(g, state, mine)
            new_p = jax.tree.map(lambda x, u, d: x if d >= 0 else jnp.where(applied, (x + u).astype(x.dtype), x),
                                 p, updates, d)
            pending = jax.tree.map(lambda u, d: u.astype(wire) if d >= 0 else no_pending(wire), updates, d)
            return new_p, pending, new_state

        like = jax.tree.structure(params)
        # Embedding and head: every stage holds them whole; this call also advances the step count.
        new_shared, shared_pending, state = adamw(shared(params), shared(grads),
                                                  _with_moments(opt_state, like, shared), shared(dims))

        blocks, block_dims = params["blocks"], dims["blocks"]

        def block_group(held, read):
            whole, _, moments = held
            g, split = read
            p = _joined(block_dims, split, whole)
            it = iter(moments)
            new_p, pending, new_state = adamw({"blocks": p}, {"blocks": g},
                                              _with_moments(opt_state, like, lambda _: {"blocks": next(it)}),
                                              {"blocks": block_dims})
            return (_leaves(new_p["blocks"], block_dims, split=False),
                    _leaves(pending["blocks"], block_dims, split=True),
                    [m["blocks"] for m in _moments(new_state, jax.tree.structure({"blocks": p}))])

        moments = [m["blocks"] for m in _moments(opt_state, like)]
        # Written in place into the old leaves that ZeRO-1 does not split, the old moments and
        # zeros (padding keeps its zeros and pends nothing). The split leaves do not change here
        # (`settle` adds their updates), so they are only read: written back too, their copy
        # would not depend on the gradients, and XLA copied them whole to keep the pipeline's
        # reads of them before the write (ZeRO-1, `[6, 2]` at seq 16: 72 MiB a device).
        split_blocks = _leaves(blocks, block_dims, split=True)
        nothing = [jnp.zeros(g.shape, wire) for g in _leaves(grads["blocks"], block_dims, split=True)]
        new_whole, split_pending, new_moments = pipeline.update_by_slot_group(
            n_layers, (_leaves(blocks, block_dims, split=False), nothing, moments),
            (grads["blocks"], split_blocks), block_group, axis=1)
        new_blocks = _joined(block_dims, split_blocks, new_whole)
        blocks_pending = _joined(block_dims, split_pending, [no_pending(wire) for _ in new_whole])
        it = iter(new_moments)
        state = _with_moments(state, jax.tree.structure(shared(params)), lambda m: dict(m, blocks=next(it)))
        return dict(new_shared, blocks=new_blocks), dict(shared_pending, blocks=blocks_pending), state, norm, applied

    update = jax.shard_map(body, mesh=pipeline.mesh, axis_names={"stage", "data"},
                           in_specs=(P("stage"), param_specs, opt_specs, grad_specs, P()),
                           out_specs=(param_specs, pending_specs, opt_specs, P(), P()), check_vma=False)
    return lambda *args: update(pipeline.stage_ids(), *args)


def make_settle(pipeline: Pipeline, state_specs: dict, grad_specs: dict):
    """`settle(params, pending) -> params` with the pending updates added: each leaf ZeRO-1 splits
    all-gathers its updates over `data` (in their dtype) and every replica adds them. For use
    inside `jit`; padding slots are skipped, so a stage gathers its real layers only."""
    param_specs, pending_specs, _, grad_specs = _manual_specs(state_specs, grad_specs)
    dims = data_split_dims(grad_specs)
    tensor_specs = keep_axes(state_specs["params"], ("tensor",))

    def add(p, u, d, t):
        # With `tensor` manual too: left automatic, XLA gathered a tensor-split leaf over `tensor`
        # first, so the gather over `data` (across nodes) moved tp times the bytes.
        def gather(p, u):
            return p + lax.all_gather(u, "data", axis=d, tiled=True).astype(p.dtype)

        if "tensor" not in t or pipeline.mesh.shape["tensor"] == 1:
            return gather(p, u)
        return on_tensor_ranks(gather, (t, t), t)(p, u)

    def body(stage_ids, params, pending):
        new = {k: jax.tree.map(lambda p, u, d, t: add(p, u, d, t) if d >= 0 else p, params[k], pending[k], dims[k],
                               tensor_specs[k], is_leaf=lambda x: isinstance(x, P))
               for k in _SHARED}
        block_dims = _leaves(dims["blocks"], dims["blocks"], split=True)
        block_tensor = _leaves(tensor_specs["blocks"], dims["blocks"], split=True)
        blocks = _leaves(params["blocks"], dims["blocks"], split=True)
        settled = pipeline.update_by_slot_group(
            pipeline.stage_n_layers(stage_ids[0]), blocks, _leaves(pending["blocks"], dims["blocks"], split=True),
            lambda held, updates: [add(p, u, d, t) for p, u, d, t in zip(held, updates, block_dims, block_tensor)],
            axis=1)
        whole = _leaves(params["blocks"], dims["blocks"], split=False)
        return dict(new, blocks=_joined(dims["blocks"], settled, whole))

    settle = jax.shard_map(body, mesh=pipeline.mesh, axis_names={"stage", "data"},
                           in_specs=(P("stage"), param_specs, pending_specs), out_specs=param_specs, check_vma=False)
    return lambda *args: settle(pipeline.stage_ids(), *args)


def _is_like(like):
    return lambda node: isinstance(node, dict) and jax.tree.structure(node) == like


def _moments(state, like) -> list:
    """The subtrees of an optimizer state shaped like a parameter tree of structure `like` (Adam's moments)."""
    return [n for n in jax.tree.leaves(state, is_leaf=_is_like(like)) if _is_like(like)(n)]


def _with_moments(state, like, pick):
    """`state` with each moment shaped like `like` replaced by `pick(moment)`, in order."""
    return jax.tree.map(lambda n: pick(n) if _is_like(like)(n) else n, state, is_leaf=_is_like(like))
