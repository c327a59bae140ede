import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from holmes_jax import build, data, optimizer, train
from holmes_jax.config import TrainConfig
from holmes_jax.models import gpt
from holmes_jax.pipeline import warmup
from helpers import REPO, launch_env, read_metrics, small_configs

SIX_LAYERS = ["--gin.ModelConfig.num_layers=6", "--gin.ParallelConfig.microbatches=4", "--gin.DataConfig.global_batch=32"]


def _loss_and_canonical_grads(tmp_path, *bindings, devices=None):
    cfgs = small_configs(tmp_path, *SIX_LAYERS, *bindings)
    setup = build.build(cfgs, devices)
    state = setup.init_state()
    batch = setup.batch("train", 0, data.load(cfgs.data))
    loss, grads = jax.jit(lambda p, b: setup.pipeline.loss_and_grads(p, b, setup.grad_specs))(state["params"], batch)
    return float(loss), jax.device_get(setup.pipeline.to_canonical(grads))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _loss_and_canonical_grads(tmp_path_factory.mktemp("ref"), "--gin.ParallelConfig.pp=1")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, layers", [(2, None), (2, "(5,1)"), (4, None), (4, "(1,2,2,1)"), (4, "(2,1,2,1)")])
def test_loss_and_every_gradient_match_one_stage(tmp_path, reference, schedule, pp, layers):
    bindings = [f"--gin.ParallelConfig.pp={pp}", f"--gin.ParallelConfig.schedule={schedule}"]
    if layers:
        bindings.append(f"--gin.ParallelConfig.stage_layers={layers}")
    _assert_matches(reference, *_loss_and_canonical_grads(tmp_path, *bindings))


def _assert_matches(reference, loss, grads):
    ref_loss, ref_grads = reference
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for (path, g), r in zip(flat, ref_flat):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
    assert max(float(np.abs(r).max()) for r in ref_flat) > 1e-3  # the comparison is not of zeros


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_stages_with_fewer_microbatches_than_stages_match_one_stage(tmp_path, reference, schedule):
    # pp 3 on 6 devices (dp 2, ZeRO-1 reduce-scatters), one-layer first and last stages, and 2
    # microbatches: fewer than the stages and not a multiple of them
    bindings = ["--gin.ParallelConfig.pp=3", "--gin.ParallelConfig.stage_layers=(1,4,1)",
                "--gin.ParallelConfig.microbatches=2", f"--gin.ParallelConfig.schedule={schedule}"]
    _assert_matches(reference, *_loss_and_canonical_grads(tmp_path, *bindings, devices=jax.devices()[:6]))


def test_tensor_parallel_stages_match_one_stage(tmp_path, reference):
    # mesh (stage, data, tensor) = (2, 2, 2): `tensor` stays automatic inside the manual region,
    # with uneven stages (padding skipped) and 1F1B's two-stage swap
    bindings = ["--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.tp=2", "--gin.ParallelConfig.stage_layers=(5,1)",
                "--gin.ParallelConfig.schedule=1f1b"]
    _assert_matches(reference, *_loss_and_canonical_grads(tmp_path, *bindings))


def test_tensor_parallelism_alone_matches_one_device(tmp_path, reference):
    # mesh (1, 1, 2): the sum over one stage of the tensor-split embedding and head gradients
    # failed in XLA's partitioner ("Cross-partition allreduce must be in (partial) manual
    # partitioning mode"), at every run's first step
    _assert_matches(reference, *_loss_and_canonical_grads(tmp_path, "--gin.ParallelConfig.pp=1",
                                                          "--gin.ParallelConfig.tp=2", devices=jax.devices()[:2]))


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots"])
@pytest.mark.parametrize("pp, layers, schedule", [(1, None, "gpipe"), (2, "(4,2)", "1f1b"), (4, "(2,1,2,1)", "gpipe")])
def test_every_remat_policy_gives_the_same_gradients(tmp_path, reference, remat, pp, layers, schedule):
    bindings = [f"--gin.ModelConfig.remat='{remat}'", f"--gin.ParallelConfig.pp={pp}",
                f"--gin.ParallelConfig.schedule={schedule}"]
    if layers:
        bindings.append(f"--gin.ParallelConfig.stage_layers={layers}")
    loss, grads = _loss_and_canonical_grads(tmp_path, *bindings)
    ref_loss, ref_grads = reference  # remat 'none', one stage
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("microbatches", [1, 4])
def test_a_batch_of_another_microbatch_count_than_the_schedules_is_refused(tmp_path, microbatches):
    # The ticks index the batch by the table's microbatches: one fewer read the last one again,
    # more were left out, and the mean was divided by the batch's count; the loss was wrong, silently.
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.microbatches=2")
    setup = build.build(cfgs, jax.devices()[:4])
    params = setup.abstract_state()["params"]
    loss = lambda m: jax.eval_shape(lambda p, b: setup.pipeline.loss_and_grads(p, b, setup.grad_specs)[0],  # noqa: E731
                                    params, jax.ShapeDtypeStruct((m, 8, cfgs.data.seq_len + 1), np.int32))
    assert loss(2).shape == ()
    with pytest.raises(ValueError, match=rf"batch of shape \({microbatches}, 8, 33\).* with 2 microbatches"):
        loss(microbatches)


ONE_STAGE = ["--gin.ParallelConfig.pp=1"]
EVEN = ["--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.stage_layers=(2,2)"]
UNEVEN = ["--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.stage_layers=(3,1)"]


MOVES = ["--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.microbatches=2", "--gin.CheckpointConfig.every=3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The metrics of a run of one stage from start to end, what every moved run must reproduce."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    train.run(small_configs(workdir, *MOVES), quiet=True)
    return read_metrics(workdir)


# Uneven to even is covered by going through the other two: each move is a save in the canonical
# layout and a restore into another one.
@pytest.mark.slow
@pytest.mark.parametrize("start, resume", [(UNEVEN, ONE_STAGE), (EVEN, UNEVEN), (ONE_STAGE, UNEVEN)])
def test_checkpoint_moves_between_uneven_even_and_one_stage(tmp_path, uninterrupted, start, resume):
    train.run(small_configs(tmp_path, *MOVES, *start, "--gin.TrainConfig.stop_after=3"), quiet=True)
    train.run(small_configs(tmp_path, *MOVES, *resume), quiet=True)
    want, got = uninterrupted, read_metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], atol=1e-4, rtol=0)


def _called_computations(hlo: str) -> dict[str, set[str]]:
    """Computation name -> the computations its instructions call (bodies, branches, ...)."""
    calls, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line.strip()) if not line.startswith(" ") else None
        if header:
            current = header.group(1)
            calls[current] = set()
        elif current:
            for group in re.findall(r"(?:body|condition|to_apply|calls|branch_computations|true_computation|"
                                    r"false_computation)=\{?(%?[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?", line):
                calls[current].update(name.strip().lstrip("%") for name in group.split(","))
    return calls


def test_gradients_are_reduced_over_data_once_per_step_not_per_microbatch(tmp_path):
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                         "--gin.ParallelConfig.microbatches=4")
    setup = build.build(cfgs)
    state = setup.init_state()
    batch = setup.batch("train", 0, data.load(cfgs.data))
    hlo = build.make_train_step(setup).lower(state, batch).compile().as_text()
    calls = _called_computations(hlo)
    loop_bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside, todo = set(), list(loop_bodies)
    while todo:  # everything a loop body reaches runs once per tick
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo.extend(calls.get(c, ()))
    where = {}
    current = None
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.strip().endswith("{"):
            current = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line.strip()).group(1)
        elif re.search(r"\b(all-reduce|reduce-scatter|collective-permute)(-start)?\(", line):
            where.setdefault(current, []).append(line)
    in_loop = [l for c, lines in where.items() if c in inside for l in lines]
    reductions = lambda lines: [l for l in lines if "all-reduce" in l or "reduce-scatter" in l]  # noqa: E731
    outside = reductions([l for c, lines in where.items() if c not in inside for l in lines])
    assert loop_bodies, "expected the schedule's scan to compile to a loop"
    assert any("collective-permute" in l for l in in_loop)  # the per-tick ppermutes: the loop is found
    assert not reductions(in_loop), reductions(in_loop)[:2]
    # Data groups of the mesh (stage, data, tensor) = (2, 4, 1): devices {0,1,2,3} and {4,5,6,7}.
    assert any("{0,1,2,3},{4,5,6,7}" in l.replace(" ", "") for l in outside), outside[:3]


def test_tensor_parallel_steps_keep_split_what_tensor_splits(tmp_path):
    # mesh (stage, data, tensor) = (2, 2, 2), untied head: the activations are replicated over
    # `tensor`, so each rank sends 1/tp of them and the receiving stage gathers them over its
    # tensor groups (whole, every boundary carried tp copies)
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                         "--gin.ParallelConfig.tp=2", "--gin.ParallelConfig.schedule=1f1b",
                         "--gin.ParallelConfig.microbatches=2", "--gin.ModelConfig.tie_embeddings=False")
    setup = build.build(cfgs)
    batch = setup.batch("train", 0, data.load(cfgs.data))
    hlo = build.make_train_step(setup).lower(setup.init_state(), batch).compile().as_text()
    whole = [setup.plan.micro_batch, cfgs.data.seq_len, cfgs.model.hidden]
    sent = [list(map(int, m.group(1).split(","))) for m in re.finditer(r"= f32\[([\d,]+)\]\S* collective-permute\(", hlo)]
    assert sent and all(shape == whole[:2] + [whole[2] // 2] for shape in sent), (sent, whole)
    # Over `tensor` (pairs inside a node) only the activations are gathered. Weights and
    # gradients split over `tensor` stay split: the ZeRO-1 gather over `data` moved tp copies of
    # each when XLA gathered it over `tensor` first, and the reduction's ordering read whole ones.
    tensor_groups = ((0, 1), (2, 3), (4, 5), (6, 7))
    over_tensor = [re.search(r"= \w+\[([\d,]*)\]", line).group(1) for line in hlo.splitlines()
                   if " all-gather(" in line and warmup.collectives(line)[0][1] == tensor_groups]
    assert over_tensor and set(over_tensor) == {",".join(map(str, whole))}, over_tensor
    # the vocabulary is split over `tensor` too: each rank holds half the table and the head
    params = setup.init_state()["params"]
    table, head = params["embed"]["tokens"]["embedding"], params["head"]["out"]["kernel"]
    assert table.sharding.shard_shape(table.shape)[0] == head.sharding.shard_shape(head.shape)[1] == cfgs.model.vocab_size // 2


def test_two_stages_swap_activations_and_gradients_in_one_ppermute(tmp_path):
    # 1F1B, pp 2 x data 4: ticks that move both (the steady ones) swap them in one collective-
    # permute; the first tick moves activations alone, the last transfer gradients alone
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                         "--gin.ParallelConfig.schedule=1f1b", "--gin.ParallelConfig.microbatches=4")
    setup = build.build(cfgs)
    batch = setup.batch("train", 0, data.load(cfgs.data))
    hlo = build.make_train_step(setup).lower(setup.init_state(), batch).compile().as_text()
    permutes = {frozenset(pairs) for op, pairs in warmup.collectives(hlo) if op == "collective-permute"}
    down, up = ({(i, i + 4) for i in range(4)}, {(i + 4, i) for i in range(4)})
    assert permutes == {frozenset(down), frozenset(up), frozenset(down | up)}


def _score_products(hlo: str, heads: int, seq: int) -> dict[str, int]:
    """Computation name -> its dot instructions shaped like attention scores (heads x seq x seq per
    sequence, micro batch 1): the forward's q.k product and the backward's gradient of the softmax
    weights; none of the model's other products has that shape."""
    found, current = {}, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.strip().endswith("{"):
            current = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line.strip()).group(1)
        shape = re.search(r"= f32\[([\d,]+)\]\{[^}]*\} dot\(", line)
        if shape and [int(d) for d in shape.group(1).split(",") if d != "1"] == [heads, seq, seq]:
            found[current] = found.get(current, 0) + 1
    return found


def _reached(calls: dict[str, set[str]], counts: dict[str, int], root: str) -> int:
    seen, todo = set(), [root]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(calls.get(c, ()))
    return sum(counts.get(c, 0) for c in seen)


@pytest.mark.slow
def test_without_remat_each_layer_runs_its_forward_once_per_microbatch(tmp_path):
    """Counts the attention-score products in the compiled pp = 2 step. A layer's forward and
    backward hold one each (jax.value_and_grad of the model shows the same); a recomputed forward
    adds one. Each tick runs two scans over the stage's layers: the forward (every stage but the
    last in its forward ticks, the last in its backward ticks) and the backward, each layer
    under a cond of its own. So per layer and microbatch a stage runs one iteration of each; with
    remat 'none' that must be what value_and_grad runs, with 'full' more."""
    heads, seq = 4, 32
    per_microbatch = {}
    for remat in ("none", "full"):
        cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                             "--gin.ParallelConfig.microbatches=4", f"--gin.ModelConfig.remat='{remat}'",
                             f"--gin.ModelConfig.num_heads={heads}", f"--gin.DataConfig.seq_len={seq}")
        assert cfgs.data.global_batch == 4 * 4  # micro batch 1 on each of the 4 data shards
        setup = build.build(cfgs)
        state = setup.init_state()
        batch = setup.batch("train", 0, data.load(cfgs.data))
        hlo = build.make_train_step(setup).lower(state, batch).compile().as_text()
        counts, calls = _score_products(hlo, heads, seq), _called_computations(hlo)
        plain = sum(_score_products(jax.jit(jax.value_and_grad(setup.model.loss)).lower(
            setup.model.init(0), batch[0, :1]).compile().as_text(), heads, seq).values())
        # The layer scans: loops whose body reaches score products and no other loop that does.
        bodies = {m.group(1) for m in re.finditer(r"body=%?([\w.\-]+)", hlo)}
        with_products = {b for b in bodies if _reached(calls, counts, b)}
        inner = [b for b in with_products
                 if not any(o != b and _reaches(calls, b, o) for o in with_products)]
        assert len(inner) == 2, (inner, with_products)
        forward, backward = sorted(_reached(calls, counts, b) for b in inner)  # a layer's, per microbatch
        assert sum(counts.values()) == forward + backward  # nothing else in the step computes scores
        per_microbatch[remat] = (forward, forward + backward, plain)
    none, full = per_microbatch["none"], per_microbatch["full"]
    assert none[2] == 2 and full[2] == 3  # value_and_grad: forward + backward, and a recompute with 'full'
    assert none[0] == 1 and none[1] == none[2], per_microbatch  # forward once, nothing recomputed
    assert full[1] == full[2] > none[1], per_microbatch


def _reaches(calls: dict[str, set[str]], root: str, target: str) -> bool:
    seen, todo = set(), [root]
    while todo:
        c = todo.pop()
        if c == target:
            return True
        if c not in seen:
            seen.add(c)
            todo.extend(calls.get(c, ()))
    return False


def test_weight_decay_covers_kernels_and_both_embeddings_not_norms_or_biases(tmp_path):
    # Zero gradients make Adam's step zero, so the update is the decay alone: -0.5 * the
    # parameter where the mask decays it (learning rate 1 at step 0, no warm-up), else zero.
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.bias=True", "--gin.ModelConfig.tie_embeddings=False",
                         "--gin.ModelConfig.positions='learned'")
    params = gpt.GPT(cfgs.model).init(0)
    tx, _ = optimizer.make_optimizer(TrainConfig(learning_rate=1.0, warmup_steps=0, weight_decay=0.5))
    updates, _ = tx.update(jax.tree.map(np.zeros_like, params), tx.init(params), params)
    decayed = set()
    for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params)):
        if np.any(u):
            decayed.add(jax.tree_util.keystr(path))
            np.testing.assert_allclose(u, -0.5 * np.asarray(p), rtol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert decayed == {"['embed']['positions']", "['embed']['tokens']['embedding']", "['head']['out']['kernel']",
                       *(f"['blocks']['{name}']['kernel']" for name in ("q", "k", "v", "o", "up", "down"))}


def test_settling_for_an_eval_adds_the_pending_updates_and_copies_no_optimizer_state(tmp_path):
    # Every eval settles the state; a program that passed the optimizer state through made a copy
    # of both Adam moments on every device each time (memory the train step does not need).
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.stage_layers=(1,1)"))
    state = setup.init_state()
    state["pending"] = jax.tree.map(lambda u: u + 0.5, state["pending"])
    settled = setup.settled(state)
    assert "pending" not in settled and settled["step"] is state["step"]
    assert all(a is b for a, b in zip(jax.tree.leaves(settled["opt_state"]), jax.tree.leaves(state["opt_state"])))
    split = 0
    for p, u, s in zip(*(jax.tree.leaves(x) for x in (state["params"], state["pending"], settled["params"]))):
        if u.size:  # a leaf ZeRO-1 splits: each replica's half-step gathered and added
            split += 1
            np.testing.assert_allclose(np.asarray(s), np.asarray(p) + 0.5, rtol=0, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(s), np.asarray(p))
    assert split


def test_zero1_with_one_data_replica_holds_no_pending_copy_and_the_plan_counts_none(tmp_path):
    # With dp = 1 ZeRO-1 split every leaf over a data axis of size 1: `pending` held a whole copy of
    # the parameters (4 bytes a parameter, no use) and every update waited a step for it.
    setups = {zero1: build.build(small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.dp=1",
                                               f"--gin.ParallelConfig.zero1={zero1}"), jax.devices()[:2])
              for zero1 in (True, False)}
    on, off = setups[True], setups[False]
    assert sum(leaf.size for leaf in jax.tree.leaves(on.pending_shapes)) == 0
    assert not on.plan.zero1
    assert on.plan.prediction.stage_memory_bytes == off.plan.prediction.stage_memory_bytes


def test_the_measured_peak_is_measured_once_whatever_the_device_order(monkeypatch):
    # The plan asks in the order it places devices, train.run in the mesh's: a second order was a
    # second measurement (and an MFU baseline other than the plan's figure).
    calls = []
    monkeypatch.setattr(build.metrics, "measure_matmul_peak_tflops", lambda devices: calls.append(1) or 0.5)
    build._measured_peak.cache_clear()  # before and after: no other test sees the fake figure
    try:
        devices = jax.devices()
        assert build.peak_tflops(devices)[0] == build.peak_tflops(devices[::-1])[0] == 0.5
    finally:
        build._measured_peak.cache_clear()
    assert len(calls) == 1


PLAN_DEVICE_SPEED = """
import sys
from holmes_jax import build, configure, distributed
cfgs = configure.load_configs(sys.argv[1:])
info = distributed.initialize(cfgs.parallel.cpu_devices)
speed = build.build(cfgs).plan.topology.clusters[0].device_tflops
print(f"device_tflops {info.process_index} {speed!r}", flush=True)
"""


@pytest.mark.slow
def test_processes_plan_from_one_measured_device_speed(tmp_path):
    # Without a topology file a CPU's speed is timed (no listed peak). That figure is the emulated
    # topology's device speed, which prices every candidate plan, so all processes must hold the
    # same one: each timing its own matmuls, they held different ones.
    args = ["--gin.ModelConfig.num_layers=4", "--gin.ModelConfig.hidden=64", "--gin.ModelConfig.num_heads=4",
            "--gin.ModelConfig.ffn_hidden=128", "--gin.DataConfig.seq_len=32", "--gin.DataConfig.global_batch=16",
            "--gin.ParallelConfig.pp=2", f"--gin.TrainConfig.workdir={tmp_path}"]
    env = launch_env()
    r = subprocess.run([sys.executable, "-m", "holmes_jax.launch", "-n", "2", "--devices-per-process", "4",
                        "--timeout", "100", "--", sys.executable, "-c", PLAN_DEVICE_SPEED, *args],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    speeds = dict(re.findall(r"device_tflops (\d) (\S+)", r.stdout))
    assert sorted(speeds) == ["0", "1"] and float(speeds["0"]) > 0, r.stdout[-2000:]
    assert speeds["0"] == speeds["1"]
