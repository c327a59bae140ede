"""The optimizer step on the pipeline's staged layout, covering each stage's real layers only.

Block leaves are (stages, max_layers, ...) with zero padding after a stage's real layers
(`Pipeline`). The step runs in one `jax.shard_map` manual over `stage` and `data` (`tensor`
automatic), one slot group at a time (`Pipeline.by_slot_group`): a group that is padding on a
stage runs under a `lax.cond` that stage skips, so the stage neither updates its padding nor
all-gathers it (ZeRO-1). What a stage computes and moves after the pipeline is proportional to
its real layers; padding stays exactly zero. The embedding and head take their own AdamW call.

With ZeRO-1 each replica computes the AdamW update of its shard; the updates are all-gathered
and every replica adds them to its float32 parameters. In float32 that is exactly gathering the
updated shards. With `update_gather_dtype = 'bfloat16'` the gather moves half the bytes: every
replica adds the same rounded update, so the replicas stay equal and the weights stay float32
(an update is off by at most 2^-9 of itself, where bfloat16 weights would lose small updates).

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

_SHARED = ("embed", "head")


def _manual(specs):
    """The part of each spec the shard_map handles by hand: `stage` and `data` (`tensor` stays automatic)."""
    return jax.tree.map(lambda spec: P(*(n if n in ("stage", "data") else None for n in spec)), specs,
                        is_leaf=lambda x: isinstance(x, P))


def make_update(pipeline: Pipeline, tx: optax.GradientTransformation, max_norm: float, state_specs: dict,
                grad_specs: dict, gather: bool = True, gather_dtype: str = "float32"):
    """`update(params, opt_state, grads) -> (params, opt_state, gradient norm before clipping)`,
    for use inside `jit`; the arguments laid out as `state_specs` ({"params", "opt_state"}) and
    `grad_specs` say (staged layout). Leaves that ZeRO-1 splits over `data` are updated on this
    replica's shard, the updates all-gathered in `gather_dtype`; with `gather=False` the
    parameters come back split like their gradients (what the profile times: the gather is the
    data link's part of the sync)."""
    wire = jnp.dtype(gather_dtype)
    param_specs, opt_specs, grad_specs = (_manual(s) for s in (state_specs["params"], state_specs["opt_state"],
                                                                 grad_specs))
    dims = jax.tree.map(lambda spec: list(spec).index("data") if "data" in spec else -1, grad_specs,
                        is_leaf=lambda x: isinstance(x, P))

    def body(params, opt_state, grads):
        n_layers = pipeline.stage_n_layers()
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

        def own(x, d):  # this replica's shard of a leaf ZeRO-1 splits along d
            if d < 0:
                return x
            size = x.shape[d] // replicas
            return lax.dynamic_slice_in_dim(x, rank * size, size, axis=d)

        def apply(p, mine, update, d):  # the new parameter from the update of this replica's shard
            if d < 0:
                return (p + update).astype(p.dtype)
            if not gather:
                return (mine + update).astype(p.dtype)
            return p + lax.all_gather(update.astype(wire), "data", axis=d, tiled=True).astype(p.dtype)

        def adamw(p, g, state, d):
            """One AdamW step of the parameter tree `p` (any part of the model), with `state` whose
            moments are shaped like `p`. Returns the new `p` and state."""
            mine = jax.tree.map(own, p, d)
            g = jax.tree.map(lambda x: (x * scale).astype(x.dtype), g)
            updates, state = tx.update(g, state, mine)
            return jax.tree.map(apply, p, mine, updates, d), state

        like = jax.tree.structure(params)
        # Embedding and head: every stage holds them whole; this call also advances the step count.
        new_shared, state = adamw(shared(params), shared(grads), _with_moments(opt_state, like, shared), shared(dims))

        def block_group(part):
            p, g, moments = part
            it = iter(moments)
            new_p, new_state = adamw({"blocks": p}, {"blocks": g},
                                     _with_moments(opt_state, like, lambda _: {"blocks": next(it)}),
                                     {"blocks": dims["blocks"]})
            return new_p["blocks"], [m["blocks"] for m in _moments(new_state, jax.tree.structure({"blocks": p}))]

        moments = [m["blocks"] for m in _moments(opt_state, like)]
        # Gathered, the new blocks are shaped like the old and overwrite them in place (padding
        # keeps its zeros); ungathered they are split like the gradients.
        new_blocks, new_moments = pipeline.by_slot_group(n_layers, (params["blocks"], grads["blocks"], moments),
                                                         block_group, axis=1,
                                                         into=(params["blocks"], moments) if gather else None)
        it = iter(new_moments)
        state = _with_moments(state, jax.tree.structure(shared(params)), lambda m: dict(m, blocks=next(it)))
        return dict(new_shared, blocks=new_blocks), state, norm

    out_params = param_specs if gather else grad_specs
    return jax.shard_map(body, mesh=pipeline.mesh, axis_names={"stage", "data"},
                         in_specs=(param_specs, opt_specs, grad_specs), out_specs=(out_params, opt_specs, P()),
                         check_vma=False)


def _is_like(like):
    return lambda node: isinstance(node, dict) and jax.tree.structure(node) == like


def _moments(state, like) -> list:
    """The subtrees of an optimizer state shaped like a parameter tree of structure `like` (Adam's moments)."""
    return [n for n in jax.tree.leaves(state, is_leaf=_is_like(like)) if _is_like(like)(n)]


def _with_moments(state, like, pick):
    """`state` with each moment shaped like `like` replaced by `pick(moment)`, in order."""
    return jax.tree.map(lambda n: pick(n) if _is_like(like)(n) else n, state, is_leaf=_is_like(like))
