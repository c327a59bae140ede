"""Uneven stages shed their padding's work: a stage's gradient reduction over `data`, its ZeRO-1
all-gather and its optimizer update cover its real layers only (read from the compiled HLO), the
padding never moves, and the losses are those of one stage."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from holmes_jax import build, data
from helpers import small_configs

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
_COLLECTIVE = re.compile(r"= (.+?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\(")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            comps[current] = []
        elif current:
            comps[current].append(line)
    return comps


def _callees(line: str) -> list[str]:
    names = []
    for group in re.findall(r"\b(?:body|condition|to_apply|calls|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)", line):
        names += [n.strip(" {}%") for n in group.split(",")]
    return names


def _buffer_bytes(line: str, groups: str) -> int:
    """Bytes of the whole buffer a collective over `groups` reduces or gathers (0 for other groups)."""
    match = _COLLECTIVE.search(line)
    if not match or f"replica_groups={groups}" not in line.replace(" ", ""):
        return 0
    types, op = match.groups()
    size = sum(_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
               for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", types))
    ranks = len(groups.split("},{")[0].strip("{}").split(","))
    return size * ranks if op == "reduce-scatter" else size  # a reduce-scatter's result is 1/n of its input


def _data_bytes(hlo: str, groups: str) -> tuple[int, list[tuple[int, int]]]:
    """(bytes of collectives over `groups` the step always runs, [(false branch bytes, true branch
    bytes)] per conditional at the top level that holds some)."""
    comps = _computations(hlo)

    def reached(name, seen=None) -> int:
        seen = set() if seen is None else seen
        if name in seen:
            return 0
        seen.add(name)
        return sum(_buffer_bytes(l, groups) + sum(reached(c, seen) for c in _callees(l)) for l in comps[name])

    always, conds = 0, []
    for line in comps["ENTRY"]:
        if " conditional(" in line:
            branches = [reached(c) for c in _callees(line)]
            if any(branches):
                conds.append(tuple(branches))
        else:
            always += _buffer_bytes(line, groups) + sum(reached(c) for c in _callees(line))
    return always, conds


def _expected_bytes(setup, part: str) -> tuple[float, float]:
    """(bytes reduced, bytes gathered) over `data` per layer (part="blocks") or for the embedding
    and head (part="shared"): every gradient is reduced (reduce-scattered where ZeRO-1 splits it
    over `data`, else all-reduced); a split leaf's update is all-gathered."""
    reduced = gathered = 0.0
    shapes = jax.eval_shape(lambda: setup.pipeline.model.init(0))
    for name in ([part] if part == "blocks" else ["embed", "head"]):
        specs = jax.tree.leaves(setup.grad_specs[name], is_leaf=lambda x: isinstance(x, P))
        for leaf, spec in zip(jax.tree.leaves(shapes[name]), specs):
            nbytes = leaf.size * leaf.dtype.itemsize / (leaf.shape[0] if part == "blocks" else 1)
            reduced += nbytes
            gathered += nbytes if "data" in spec else 0.0
    return reduced, gathered


@pytest.mark.parametrize("pp, layers, zero1", [(2, (3, 1), True), (2, (3, 1), False),
                                               pytest.param(4, (1, 3, 2, 2), True, marks=pytest.mark.slow)])
def test_collectives_over_data_carry_bytes_in_proportion_to_real_layers(tmp_path, pp, layers, zero1):
    cfgs = small_configs(tmp_path, f"--gin.ModelConfig.num_layers={sum(layers)}", f"--gin.ParallelConfig.pp={pp}",
                         f"--gin.ParallelConfig.stage_layers={layers}", f"--gin.ParallelConfig.zero1={zero1}",
                         "--gin.ParallelConfig.microbatches=2")
    setup = build.build(cfgs)
    state = setup.init_state()
    batch = setup.batch("train", 0, data.load(cfgs.data))
    hlo = build.make_train_step(setup).lower(state, batch).compile().as_text()
    devices = np.arange(8).reshape(pp, -1)  # mesh (stage, data): each row one data group
    groups = "{" + ",".join("{" + ",".join(map(str, row)) + "}" for row in devices) + "}"
    always, conds = _data_bytes(hlo, groups)

    reduced, gathered = _expected_bytes(setup, "blocks")
    per_layer = reduced + gathered
    shared = sum(_expected_bytes(setup, "shared"))
    assert gathered == (reduced if zero1 else 0.0) and shared > 0
    # Always: the embedding and head, and the slots every stage holds for real.
    assert always == pytest.approx(shared + min(layers) * per_layer)
    # Each later slot group: its reduction and its update's gather, each in the branch the stages
    # holding those slots take; the other branch moves nothing.
    starts = sorted({0, *layers})[1:-1]
    widths = np.diff(sorted({0, *layers}))[1:]
    assert all(min(c) == 0 for c in conds), conds
    expected = [w * reduced for w in widths] + [w * gathered for w in widths if gathered]
    assert sorted(max(c) for c in conds) == pytest.approx(sorted(expected))
    # So what a stage moves over `data` is its real layers' bytes (plus the embedding and head).
    for n in layers:
        moved = always + sum(w * per_layer for w, start in zip(widths, starts) if n > start)
        assert moved == pytest.approx(shared + n * per_layer)
    # The slot groups' results are written in place, never joined: no concatenate builds a
    # stage's (1, max_layers, ...) block array (joining them copied every tree each step).
    assert not re.findall(rf"= \w+\[1,{max(layers)}(?:,\d+)*\]\S* concatenate\(", hlo)


def test_stages_gather_before_the_ticks_reduce_before_they_meet_and_sum_only_shards_across_stages(tmp_path):
    # pp 2 x data 4, ZeRO-1. The step opens with the gather of the last step's updates, before
    # the tick scan, so the last stage (no work in the first tick) gathers while stage 0 computes.
    # The last stage finishes its ticks one tick early; its reductions over `data` must not wait
    # behind a collective across stages, so every reduction over `data` comes before the sum over
    # `stage`, which moves only ZeRO-1's shards of the embedding and head: 1/4 of their bytes.
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                         "--gin.ParallelConfig.stage_layers=(3, 1)", "--gin.ParallelConfig.microbatches=2")
    setup = build.build(cfgs)
    hlo = build.make_train_step(setup).lower(setup.init_state(), setup.batch("train", 0, data.load(cfgs.data)))
    hlo = hlo.compile().as_text()
    comps = _computations(hlo)
    data_groups, stage_groups = "{{0,1,2,3},{4,5,6,7}}", "{{0,4},{1,5},{2,6},{3,7}}"

    def moves(line, groups, seen=()):
        return _buffer_bytes(line, groups) + sum(moves(l, groups, seen + (c,)) for c in _callees(line)
                                                  if c not in seen for l in comps[c])

    def holds(line, op, seen=()):
        return op in line or any(holds(l, op, seen + (c,)) for c in _callees(line) if c not in seen for l in comps[c])

    entry = comps["ENTRY"]
    ticks = [i for i, line in enumerate(entry) if " while(" in line and holds(line, "collective-permute")]
    over_data = [i for i, line in enumerate(entry) if moves(line, data_groups)]
    across = [i for i, line in enumerate(entry) if moves(line, stage_groups)]
    assert len(ticks) == 1 and over_data and len(across) == 1, (ticks, over_data, across)
    before, after = [i for i in over_data if i < ticks[0]], [i for i in over_data if i > ticks[0]]
    # before the ticks: the gathers (the later slot group's in its conditional), no reduction
    assert before and all(holds(entry[i], "all-gather") and not holds(entry[i], "reduce-scatter") for i in before)
    # after them: the reductions, all before the sum across stages, and nothing over `data` after it
    assert after and all(not holds(entry[i], "all-gather") for i in after)
    assert max(after) < across[0]
    shared = _expected_bytes(setup, "shared")[0]  # float32 gradients of the embedding and head
    assert moves(entry[across[0]], stage_groups) == pytest.approx(shared / 4)


@pytest.mark.slow
# (tp 2, dp 1, three stage sizes: the step did not compile, XLA's SPMD partitioner refusing the
# PartitionId that lax.axis_index("stage") lowered to)
@pytest.mark.parametrize("pp, layers, schedule, tp", [(2, (3, 1), "1f1b", 1), (4, (1, 2, 1, 2), "gpipe", 1),
                                                      (4, (3, 2, 1, 1), "gpipe", 2)])
def test_losses_match_one_stage_and_padding_never_moves(tmp_path, pp, layers, schedule, tp):
    common = [f"--gin.ModelConfig.num_layers={sum(layers)}", "--gin.ParallelConfig.microbatches=2",
              f"--gin.ParallelConfig.schedule={schedule}"]

    def run(*bindings):
        cfgs = small_configs(tmp_path, *common, *bindings)
        setup = build.build(cfgs)
        state, step, tokens = setup.init_state(), build.make_train_step(setup), data.load(cfgs.data)
        first = jax.device_get(state)
        losses = []
        for k in range(4):
            state, m = step(state, setup.batch("train", k, tokens))
            losses.append((float(m["loss"]), float(m["grad_norm"])))
        return losses, first, jax.device_get(state), setup

    ref, _, _, _ = run()
    got, first, last, setup = run(f"--gin.ParallelConfig.pp={pp}", f"--gin.ParallelConfig.stage_layers={layers}",
                                  f"--gin.ParallelConfig.tp={tp}")
    # tp splits the matmuls' sums, which XLA then adds in another order: relative float32 noise
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0 if tp == 1 else 2e-5)
    padding = ~setup.pipeline.real_layers
    assert padding.any()
    for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(first), jax.tree.leaves(last)):
        # parameters and both Adam moments (with dp 1 nothing is pending: placeholders, not staged)
        if "blocks" in jax.tree_util.keystr(path) and after.shape[:2] == padding.shape:
            assert not after[padding].any(), jax.tree_util.keystr(path)
            assert not np.array_equal(after[~padding], before[~padding]), jax.tree_util.keystr(path)


@pytest.mark.parametrize("layers", ["(2,1,1,0)", "(4,0,0,0)", "(0,4,0,0)"])
def test_a_stage_without_layers_is_refused_in_one_line(tmp_path, layers):
    from holmes_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"stage_layers = .* must list 4 positive layer counts"):
        small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=4",
                      f"--gin.ParallelConfig.stage_layers={layers}")


@pytest.mark.parametrize("zero1, bound", [(True, 1), (False, 2)])
def test_an_uneven_step_does_not_copy_the_parameters(tmp_path, zero1, bound):
    # Without ZeRO-1 the step chose the old parameters for a non-finite step after the update, so
    # they stayed alive beside the new ones and the later slot group's cond could not update them
    # in place: XLA copied them whole (temporaries 2.8 times a stage's block parameters above
    # [3, 3]'s; 1.8 now, the rest copies of the Adam moments, README "Checkpoint memory"). With
    # ZeRO-1 the update wrote the leaves it splits back unchanged, a write that did not wait for
    # the gradients, so XLA copied them to keep the pipeline's reads first (1.66 times; 0.66 now).
    def temporaries(layers):
        cfgs = small_configs(tmp_path, f"--gin.ModelConfig.num_layers={sum(layers)}", "--gin.ParallelConfig.pp=2",
                             "--gin.ParallelConfig.dp=2", f"--gin.ParallelConfig.stage_layers={layers}",
                             "--gin.ParallelConfig.microbatches=2", f"--gin.ParallelConfig.zero1={zero1}")
        setup = build.build(cfgs, jax.devices()[:4])
        state = setup.abstract_state()
        batch = jax.ShapeDtypeStruct((2, 8, 33), np.int32, sharding=setup.batch_sharding)
        step = build.make_train_step(setup).lower(state, batch).compile()
        blocks = sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                     for x in jax.tree.leaves(state["params"]["blocks"]))
        return step.memory_analysis().temp_size_in_bytes, blocks

    (uneven, blocks), (even, same) = temporaries([3, 1]), temporaries([3, 3])
    assert blocks == same  # as many slots
    assert uneven - even < bound * blocks


def test_settling_uneven_stages_updates_the_parameters_in_place(tmp_path):
    # The later slot group's cond read the parameters as one operand and wrote them in place as
    # another: XLA copied them whole, each step (temporaries 1.7 times a stage's block parameters).
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                         "--gin.ParallelConfig.stage_layers=(3, 1)", "--gin.ParallelConfig.microbatches=2")
    setup = build.build(cfgs)
    state = setup.abstract_state()
    settle = jax.jit(setup.settle, donate_argnums=0, out_shardings=setup.state_shardings["params"])
    temp = settle.lower(state["params"], state["pending"]).compile().memory_analysis().temp_size_in_bytes
    blocks = sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                 for x in jax.tree.leaves(state["params"]["blocks"]))
    assert temp < blocks  # the later group's gathered updates (2 of 3 slots) and small ones
