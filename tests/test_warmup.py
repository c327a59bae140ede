"""Cross-cluster hops as collectives of their own, and the warm-up that creates their
communicators over sockets before the first step (docs/nccl.md)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from holmes_jax import build, data, distributed, train
from holmes_jax.pipeline import warmup
from holmes_jax.pipeline.runtime import Pipeline
from helpers import REPO, small_configs

CPU_2X4 = str(Path(__file__).resolve().parent.parent / "configs" / "topologies" / "cpu_2x4.toml")


def _setup(tmp_path, pp, *bindings):
    """Devices 0-3 an "ib" node, 4-7 a "roce" node; `pp` stages over them."""
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", f"--gin.ParallelConfig.pp={pp}",
                         "--gin.ParallelConfig.microbatches=4", f"--gin.ParallelConfig.topology='{CPU_2X4}'", *bindings)
    setup = build.build(cfgs)
    state = setup.init_state()
    batch = setup.batch("train", 0, data.load(cfgs.data))
    return setup, state, batch


def _step_hlo(setup, state, batch) -> str:
    return build.make_train_step(setup).lower(state, batch).compile().as_text()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """pp -> (setup, state, batch, compiled step HLO), each built once for the module."""
    cache = {}

    def get(pp):
        if pp not in cache:
            setup, state, batch = _setup(tmp_path_factory.mktemp(f"pp{pp}"), pp)
            cache[pp] = setup, state, batch, _step_hlo(setup, state, batch)
        return cache[pp]

    return get


def _clusters(setup):
    return setup.plan.topology.device_cluster[setup.plan.grid.ravel()]


def _boundary_pairs(setup) -> set:
    """Device-position pairs of the hops that cross clusters, both directions."""
    grid = np.arange(setup.mesh.devices.size).reshape(setup.mesh.devices.shape)
    return {pair for s in setup.pipeline.boundary_hops for a, b in zip(grid[s].ravel(), grid[s + 1].ravel())
            for pair in ((int(a), int(b)), (int(b), int(a)))}


@pytest.mark.parametrize("pp, hops", [(2, (0,)), (4, (1,))])
def test_the_step_moves_boundary_hops_in_collective_permutes_of_their_own(built, pp, hops):
    setup, _, _, hlo = built(pp)
    assert setup.pipeline.boundary_hops == hops  # stage hops from the ib node to the roce node
    boundary = _boundary_pairs(setup)
    permutes = [set(g) for op, g in warmup.collectives(hlo) if op == "collective-permute"]
    own = [p for p in permutes if p <= boundary]
    assert own and {pair for p in own for pair in p} == boundary  # every boundary pair, down and up
    assert all(p <= boundary or not p & boundary for p in permutes)  # none mixes boundary and other pairs
    if pp == 4:  # the hops inside a cluster still move, in permutes of their own
        assert {pair for p in permutes if not p & boundary for pair in p} == {
            (0, 2), (1, 3), (4, 6), (5, 7), (2, 0), (3, 1), (6, 4), (7, 5)}


def test_with_tensor_ranks_the_warm_up_sends_each_ranks_slice_and_gathers_nothing(tmp_path):
    # tp 2: the step sends each tensor rank's half of the activations across the boundary and
    # gathers the halves over `tensor` inside the node. The warm-up ran that gather too, so the
    # tensor groups' communicators (inside a node, used by every layer) were made over sockets.
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                         "--gin.ParallelConfig.tp=2", "--gin.ParallelConfig.microbatches=2",
                         f"--gin.ParallelConfig.topology='{CPU_2X4}'")
    setup = build.build(cfgs)
    fn, args = warmup.program(setup, "")  # the hops alone: no step HLO, no sums
    hlo = fn.lower(*args).compile().as_text()
    assert {pair for _, pairs in warmup.collectives(hlo) for pair in pairs} == _boundary_pairs(setup)
    assert {op for op, _ in warmup.collectives(hlo)} == {"collective-permute"}
    sent = {m.group(1) for m in re.finditer(r"= f32\[([\d,]+)\]\S* collective-permute\(", hlo)}
    assert sent == {f"{setup.plan.micro_batch},{cfgs.data.seq_len},{cfgs.model.hidden // 2}"}  # as the step sends


def test_splitting_the_hops_leaves_loss_and_gradients_unchanged(built):
    setup, state, batch, _ = built(4)
    split = setup.pipeline
    joined = Pipeline(split.model, setup.mesh, split.stage_layers, setup.plan.microbatches, setup.plan.schedule)
    def run(pipe):
        return jax.jit(lambda p, b: pipe.loss_and_grads(p, b, setup.grad_specs))(state["params"], batch)

    (loss, grads), (ref_loss, ref_grads) = run(split), run(joined)
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-6, rtol=0)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_warm_up_holds_exactly_the_steps_collectives_across_clusters(built, pp):
    setup, _, _, hlo = built(pp)
    step, clusters = warmup.collectives(hlo), _clusters(setup)
    fn, args = warmup.program(setup, hlo)
    warm = warmup.collectives(fn.lower(*args).compile().as_text())
    spans = lambda g: len({int(clusters[i]) for i in g}) > 1  # noqa: E731
    boundary = _boundary_pairs(setup)
    assert {op for op, _ in warm} == {"collective-permute", "all-reduce"}
    for op, groups in warm:
        if op == "collective-permute":
            assert set(groups) <= boundary  # the boundary hops and nothing else
        else:
            assert all(spans(g) for g in groups)  # only groups spanning clusters
    # Every group of the step that spans clusters has its communicator made by the warm-up.
    needed = {(op == "collective-permute", frozenset(g)) for op, groups in step for g in groups if spans(g)}
    made = {(op == "collective-permute", frozenset(g)) for op, groups in warm for g in groups}
    assert needed and needed <= made


@pytest.mark.slow
def test_no_warm_up_without_hops_across_clusters(tmp_path):
    cfgs = small_configs(tmp_path, "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.microbatches=2")
    setup = build.build(cfgs)  # an emulated one-cluster topology
    state, batch = setup.init_state(), setup.batch("train", 0, data.load(cfgs.data))
    assert setup.pipeline.boundary_hops == ()
    assert warmup.program(setup, _step_hlo(setup, state, batch)) is None


@pytest.mark.slow
def test_warm_up_runs_under_socket_before_the_first_step_and_restores_nccl_net(tmp_path, monkeypatch):
    events = []
    monkeypatch.setenv("NCCL_NET", "IB")
    run_warmup, train_steps = warmup._run, train.train_steps

    def recording_run(compiled, args):
        ops = {op for op, _ in warmup.collectives(compiled.as_text())}
        events.append(("warm-up", os.environ.get("NCCL_NET"), ops))
        return run_warmup(compiled, args)

    def recording_steps(*a, **k):
        for item in train_steps(*a, **k):
            events.append(("step", os.environ.get("NCCL_NET"), None))
            yield item

    monkeypatch.setattr(warmup, "_run", recording_run)
    monkeypatch.setattr(train, "train_steps", recording_steps)
    cfgs = small_configs(tmp_path, "--gin.ModelConfig.num_layers=4", "--gin.ParallelConfig.pp=2",
                         "--gin.ParallelConfig.microbatches=4", f"--gin.ParallelConfig.topology='{CPU_2X4}'",
                         "--gin.TrainConfig.steps=2", "--gin.CheckpointConfig.enabled=False")
    train.run(cfgs, quiet=True)
    assert events[0] == ("warm-up", "Socket", {"collective-permute", "all-reduce"})
    assert [e[:2] for e in events[1:]] == [("step", "IB"), ("step", "IB")]  # restored before step one
    assert os.environ["NCCL_NET"] == "IB"


def test_warm_up_leaves_nccl_net_unset_when_it_was(built, monkeypatch):
    monkeypatch.delenv("NCCL_NET", raising=False)
    setup, _, _, hlo = built(2)
    during, run_warmup = [], warmup._run
    monkeypatch.setattr(warmup, "_run", lambda *args: during.append(os.environ.get("NCCL_NET")) or run_warmup(*args))
    lines = []
    assert warmup.warm_up(setup, hlo, lines.append)
    assert during == ["Socket"]  # unset is no reason to leave the communicators to NCCL's own pick
    assert "NCCL_NET" not in os.environ and "stage hops 0->1" in lines[-1]


def test_collective_groups_are_read_in_every_hlo_format():
    hlo = "\n".join([
        "  %a = f32[] all-reduce(%x), channel_id=1, replica_groups={{0,4},{1,5}}, use_global_device_ids=true",
        "  %b = f32[] all-gather-start(%x), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}",
        "  %c = f32[] reduce-scatter(%x), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2], "
        "device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
        "  %d = f32[] all-reduce(%x), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}",
        "  %e = f32[2] collective-permute(%x), channel_id=5, source_target_pairs={{0,4},{1,5}}",
        "  %f = f32[2] add(%x, %y)",
    ])
    assert warmup.collectives(hlo) == [
        ("all-reduce", ((0, 4), (1, 5))),
        ("all-gather", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("reduce-scatter", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("all-reduce", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("collective-permute", ((0, 4), (1, 5))),
    ]
    with pytest.raises(ValueError, match="cannot read the groups"):
        warmup.collectives("  %g = f32[] all-reduce(%x), replica_groups=something_new")


def test_this_jaxlib_accepts_the_xla_network_flags():
    """XLA aborts on a flag it does not know, so a renamed flag fails here, not on a cluster."""
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=" ".join(distributed.XLA_NETWORK_FLAGS))
    r = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "3.0", r.stderr[-500:]


UNREADABLE = "  %g = f32[] all-reduce(%x), channel_id=9, replica_groups=something_new, to_apply=%add"


def test_a_group_format_it_cannot_read_warms_the_hops_and_warns_rather_than_stopping_the_run(built, monkeypatch):
    monkeypatch.delenv("NCCL_NET", raising=False)
    setup, _, _, hlo = built(2)
    lines = []
    fn, args = warmup.program(setup, hlo + "\n" + UNREADABLE, lines.append)
    assert args[1] is None  # no sums: their groups could not be read
    assert {op for op, _ in warmup.collectives(fn.lower(*args).compile().as_text())} == {"collective-permute"}
    assert any(line.startswith("warning: cannot read the groups of: %g = f32[] all-reduce") for line in lines)
    lines.clear()
    assert warmup.warm_up(setup, hlo + "\n" + UNREADABLE, lines.append)
    assert "stage hops 0->1" in lines[-1] and "sums" not in lines[-1]


def test_one_cluster_has_nothing_to_warm_up_whatever_its_hlo_holds(tmp_path):
    setup = build.build(small_configs(tmp_path, "--gin.ParallelConfig.dp=8"))  # an emulated one-cluster topology
    assert warmup.program(setup, UNREADABLE) is None
    assert not warmup.warm_up(setup, UNREADABLE, lambda *a: None)


@pytest.mark.parametrize("groups", ["replica_groups={}", "replica_groups=[2,4]<=[6]",
                                    "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_9'}"])
def test_groups_that_do_not_add_up_are_named_as_unreadable(groups):
    with pytest.raises(ValueError, match=r"cannot read the groups of: %g = f32\[\] all-reduce"):
        warmup.collectives(f"  %g = f32[] all-reduce(%x), {groups}")


def test_the_naive_placements_data_groups_across_clusters_get_their_communicators_too(tmp_path):
    # Two nodes a cluster: the naive rank order interleaves the clusters, so each stage's data
    # group spans both. The warm-up left those groups (the gradients' reduce-scatter and the
    # updates' all-gather) to the host's IB network, which does not reach the other cluster.
    topology = tmp_path / "two_by_two.toml"
    topology.write_text(Path(CPU_2X4).read_text().replace("nodes = 1", "nodes = 2")
                        .replace("devices_per_node = 4", "devices_per_node = 2"))
    setup, state, batch = _setup(tmp_path, 2, f"--gin.ParallelConfig.topology='{topology}'",
                                 "--gin.ParallelConfig.placement='naive'")
    hlo, clusters = _step_hlo(setup, state, batch), _clusters(setup)
    spans = lambda g: len({int(clusters[i]) for i in g}) > 1  # noqa: E731
    needed = {frozenset(g) for op, groups in warmup.collectives(hlo) if op != "collective-permute"
              for g in groups if spans(g)}
    assert needed >= {frozenset(g) for g in ((0, 1, 2, 3), (4, 5, 6, 7))}  # both stages' data groups
    lines = []
    fn, args = warmup.program(setup, hlo, lines.append)
    made = {frozenset(g) for op, groups in warmup.collectives(fn.lower(*args).compile().as_text())
            if op == "all-reduce" for g in groups}
    assert needed <= made and not lines
    assert all(spans(g) for g in made)  # no group inside one cluster is put on sockets
