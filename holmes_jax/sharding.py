"""Where a run's arrays live on the mesh (stage, data, tensor): parameters as the model's
tensor-parallel specs say (blocks split over `stage` in the staged layout), gradients, Adam
moments and the pending updates (pipeline.update) additionally over `data` with ZeRO-1, counters
replicated; a checkpoint's canonical state spread over every device."""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from holmes_jax.models import gpt


def _split_free_axis(spec: P, shape: tuple, axis, parts: int, skip: int = 0) -> P | None:
    """`spec` with mesh `axis` (a name or a tuple of names) added on the first unsplit axis of a
    leaf that `parts` divides, past the first `skip` axes; None where there is none."""
    dims = list(spec) + [None] * (len(shape) - len(spec))
    for i, (name, size) in enumerate(zip(dims, shape)):
        if i >= skip and name is None and size % parts == 0:
            dims[i] = axis
            return P(*dims)
    return None


def _zero1_spec(spec: P, shape: tuple, dp: int, skip: int = 0) -> P:
    """Adds `data` to the first unsplit axis of a leaf that `dp` divides (ZeRO stage 1), past the
    first `skip` axes."""
    return _split_free_axis(spec, shape, "data", dp, skip) or spec


def gradient_specs(params_shapes: dict, stage_axis: str | None, dp: int, zero1: bool, tp: int = 1) -> dict:
    """Where gradients and optimizer moments live: the parameter's spec, split over `data` too
    with ZeRO-1 (so the gradient is reduce-scattered and each replica updates its shard). Block
    leaves are split inside a layer, never along their layer axes, so each layer has its share
    on every replica (the pipeline reduces and updates a stage's real layers only)."""
    pspecs = gpt.param_specs(params_shapes, stage_axis, tp)
    if not zero1 or dp == 1:  # one replica: nothing to shard, and a split leaf would wait a step in `pending`
        return pspecs
    layer_axes = 1 if stage_axis is None else 2

    def spec(path, spec, leaf):
        blocks = getattr(path[0], "key", None) == "blocks"
        return _zero1_spec(spec, leaf.shape, dp, layer_axes if blocks else 0)

    return jax.tree_util.tree_map_with_path(spec, pspecs, params_shapes, is_leaf=lambda x: isinstance(x, P))


def canonical_shardings(mesh: Mesh, tx, params_shapes: dict) -> dict:
    """Where the canonical state (a checkpoint's layout: every layer in model order) lives while a
    save makes it or a restore reads it: split as tensor parallelism splits it, and each leaf
    also spread over the stage and data replicas together on an axis their count divides (else
    over `data`, else over `stage`), parameters and their moments alike. Kept whole on every
    stage and replica, it took each device several times its share of the train state at every
    save."""
    pp, dp = mesh.shape["stage"], mesh.shape["data"]
    ways = [(("stage", "data"), pp * dp)] if pp > 1 and dp > 1 else []
    ways += [(axis, parts) for axis, parts in (("data", dp), ("stage", pp)) if parts > 1]

    def spread(path, spec, leaf):
        # not along the layer axis: picking each stage's layers from it, XLA gathered every layer everywhere
        skip = 1 if getattr(path[0], "key", None) == "blocks" else 0
        return next((s for axis, parts in ways if (s := _split_free_axis(spec, leaf.shape, axis, parts, skip))), spec)

    pspecs = jax.tree_util.tree_map_with_path(spread, gpt.param_specs(params_shapes, None, mesh.shape["tensor"]),
                                              params_shapes, is_leaf=lambda x: isinstance(x, P))
    specs = {"params": pspecs, "opt_state": optimizer_specs(jax.eval_shape(tx.init, params_shapes), pspecs),
             "step": P()}
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def keep_axes(specs, axes: tuple[str, ...]):
    """Each PartitionSpec of the tree `specs` with only the mesh axes in `axes` kept (the rest None):
    the part a shard_map over those axes handles by hand."""
    return jax.tree.map(lambda spec: P(*(n if n in axes else None for n in spec)), specs,
                        is_leaf=lambda x: isinstance(x, P))


def on_tensor_ranks(fn, in_specs, out_specs):
    """`fn` inside a shard_map that is already manual over `stage` and `data`, run on each tensor
    rank's own shard (`tensor` manual too). Left automatic, XLA may gather a tensor-split operand
    of a collective or of an element read over `tensor` first."""
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs, out_specs=out_specs,
                         axis_names={"tensor"}, check_vma=False)


def data_split_dims(specs: dict) -> dict:
    """Per leaf, the axis its spec splits over `data` (ZeRO-1), -1 where it is not split."""
    return jax.tree.map(lambda spec: list(spec).index("data") if "data" in spec else -1, specs,
                        is_leaf=lambda x: isinstance(x, P))


def pending_shapes(params_shapes: dict, grad_specs: dict, dtype) -> dict:
    """The train state's `pending` (pipeline.update): for each leaf ZeRO-1 splits, the parameter's
    shape in `dtype`, split like its gradient (each replica holds the update of its shard);
    nothing, shape (0,), for the rest."""
    return jax.tree.map(lambda leaf, spec: jax.ShapeDtypeStruct(leaf.shape if "data" in spec else (0,), dtype),
                        params_shapes, grad_specs, is_leaf=lambda x: isinstance(x, P))


def pending_specs(grad_specs: dict) -> dict:
    return jax.tree.map(lambda spec: spec if "data" in spec else P(), grad_specs, is_leaf=lambda x: isinstance(x, P))


def optimizer_specs(opt_shapes, moment_specs: dict):
    """PartitionSpecs for optimizer state: a leaf under a parameter's path takes that parameter's
    moment spec; counters and scalars are replicated."""
    by_path = {tuple(path): spec for path, spec in
               jax.tree_util.tree_leaves_with_path(moment_specs, is_leaf=lambda x: isinstance(x, P))}

    def spec(path, leaf):
        for start in range(len(path)):
            match = by_path.get(tuple(path[start:]))
            if match is not None and len(leaf.shape) > 0:
                return match
        return P()

    return jax.tree_util.tree_map_with_path(spec, opt_shapes)


def state_shardings(mesh: Mesh, tx, params_shapes: dict, stage_axis: str | None, zero1: bool) -> dict:
    pspecs = gpt.param_specs(params_shapes, stage_axis, mesh.shape["tensor"])
    moments = gradient_specs(params_shapes, stage_axis, mesh.shape["data"], zero1, mesh.shape["tensor"])
    ospecs = optimizer_specs(jax.eval_shape(tx.init, params_shapes), moments)
    specs = {"params": pspecs, "opt_state": ospecs, "step": P()}
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
