import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from holmes_jax.config import ConfigError, ModelConfig, ParallelConfig
from holmes_jax.mesh import devices as real
from holmes_jax.models import presets
from holmes_jax.planning import partition, placement, plan, search
from holmes_jax.planning.topology import NIC_CLASSES, Cluster, Topology, load

from helpers import REPO

TOPOLOGIES = Path(__file__).resolve().parent.parent / "configs" / "topologies"


def topo(name):
    return load(TOPOLOGIES / f"{name}.toml")


def _tensor_groups_inside_nodes(t, grid):
    nodes = t.device_node[grid]  # (pp, dp, tp)
    return bool((nodes == nodes[..., :1]).all())


def test_holmes_on_ib4_roce4_keeps_each_stage_in_one_cluster():
    t = topo("ib4_roce4")
    pl = placement.place(t, tp=8, pp=2)
    assert pl.grid.shape == (2, 4, 8)
    np.testing.assert_array_equal(np.sort(pl.grid[0].ravel()), np.arange(32))  # the IB nodes
    assert pl.stage_clusters == ("ib", "roce") and pl.stage_nic == ("infiniband", "roce")
    assert pl.data_groups_nic == (("infiniband",), ("roce",)) and pl.mixed_stages == ()
    assert [r.via for r in pl.data_routes] == ["infiniband", "roce"]
    assert pl.boundary_routes[0].via == "inter-cluster ethernet"
    assert _tensor_groups_inside_nodes(t, pl.grid)


def test_naive_on_ib4_roce4_mixes_nic_classes_in_data_groups():
    t = topo("ib4_roce4")
    naive, holmes = placement.place(t, 8, 2, method="naive"), placement.place(t, 8, 2, method="holmes")
    assert naive.data_groups_nic == (("infiniband", "roce"), ("infiniband", "roce"))
    assert all(len(g) == 1 for g in holmes.data_groups_nic)
    assert [r.via for r in naive.data_routes] == ["inter-cluster ethernet"] * 2
    # each data group alternates IB and RoCE hosts, as the scheduler listed them
    np.testing.assert_array_equal(t.device_cluster[naive.grid[0, :, 0]], [0, 1, 0, 1])
    assert _tensor_groups_inside_nodes(t, naive.grid)
    assert min(r.bytes_per_s for r in naive.data_routes) < min(r.bytes_per_s for r in holmes.data_routes)


def test_unequal_clusters_get_stages_in_proportion():
    t = topo("ib3_roce5")
    pl = placement.place(t, tp=8, pp=8)
    assert pl.stage_clusters == ("ib",) * 3 + ("roce",) * 5
    crossings = [s for s, r in enumerate(pl.boundary_routes) if r.via.startswith("inter-cluster")]
    assert crossings == [2]  # only the one boundary between the clusters
    assert _tensor_groups_inside_nodes(t, pl.grid)


def test_three_clusters_with_three_nic_classes():
    t = topo("three_clusters")
    pl = placement.place(t, tp=8, pp=4)
    assert pl.stage_clusters == ("ib", "roce", "eth", "eth")
    assert pl.data_groups_nic == (("infiniband",), ("roce",), ("ethernet",), ("ethernet",))
    assert [r.via for r in pl.boundary_routes] == ["inter-cluster ethernet", "inter-cluster ethernet", "ethernet"]


def test_stage_that_would_span_clusters_is_refused_or_reported():
    t = topo("ib3_roce5")
    with pytest.raises(ConfigError) as e:
        placement.place(t, tp=8, pp=2)
    assert "stage 0 would span clusters 'ib', 'roce'" in str(e.value)
    assert "allowed pp (every cluster holding whole stages): 8" in str(e.value)
    # pp derived from a dp given: the dp is what to change (it named pp 8, which no dp 2 goes with)
    with pytest.raises(ConfigError, match=r"^dp = 2 is not allowed with tp = 8: with pp = 4, stage 1 would span "
                                          r"clusters 'ib', 'roce', .*; allowed dp \(every cluster holding whole stages\): 1;"):
        placement.place(t, tp=8, pp=4, dp=2)
    pl = placement.place(t, tp=8, pp=2, allow_mixed=True)
    assert pl.mixed_stages == (0,) and pl.stage_clusters == ("ib+roce", "roce")
    assert pl.data_groups_nic == (("infiniband", "roce"), ("roce",))


@pytest.mark.parametrize("kwargs, words", [
    (dict(tp=16, pp=1), ["tp = 16", "tensor groups stay inside one node", "allowed: tp dividing 8"]),
    (dict(tp=3, pp=1), ["tp = 3", "allowed: tp dividing 8"]),
    (dict(tp=8, pp=3), ["pp = 3", "must divide the 64 devices", "allowed pp: 1, 2, 4, 8"]),
    (dict(tp=8, pp=16), ["pp = 16"]),
    (dict(tp=8, pp=2, dp=2), ["dp = 2", "allowed with pp = 2, tp = 8: dp = 4"]),
    (dict(tp=8, pp=2, method="random"), ["placement = 'random'", "'holmes', 'naive'"]),
])
def test_infeasible_sizes(kwargs, words):
    with pytest.raises(ConfigError) as e:
        placement.place(topo("ib4_roce4"), **kwargs)
    for word in words:
        assert word in str(e.value)


def test_rings_share_a_node_nic_between_concurrent_groups():
    t = topo("ib8")
    ib = t.clusters[0].nic_link.bytes_per_s
    wide = placement.place(t, tp=8, pp=1).data_routes[0]  # 8 data groups, each with one rank per node
    assert (wide.via, wide.shared_by) == ("infiniband", 8) and wide.bytes_per_s == pytest.approx(ib / 8)
    flat = placement.place(t, tp=1, pp=1).data_routes[0]  # one group: one hop leaves each node
    assert flat.shared_by == 1 and flat.bytes_per_s == pytest.approx(ib)
    inside = placement.place(t, tp=1, pp=8).data_routes[0]  # a stage is one node
    assert inside.via == "intra-node"


def test_a_node_holding_two_stages_carries_both_stages_data_rings():
    t = Topology((Cluster("ib", "infiniband", nodes=3, devices_per_node=8),), name="ib3")
    pl = placement.place(t, tp=4, pp=2)  # 12 devices a stage: node 1 holds half of each
    assert [sorted({int(n) for n in t.device_node[pl.grid[s]].ravel()}) for s in range(2)] == [[0, 1], [1, 2]]
    # All stages sync at once: 4 hops of each stage's ring leave node 1 and 4 enter it; each stage
    # was priced with its own 4 alone, at twice the rate its sync gets
    ib = t.clusters[0].nic_link.bytes_per_s
    assert [(r.via, r.shared_by) for r in pl.data_routes] == [("infiniband", 8)] * 2
    assert pl.data_routes[0].bytes_per_s == pytest.approx(ib / 8)


def test_build_mesh_on_eight_cpu_devices_matches_the_grid():
    t = topo("cpu_2x4")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    for tp, pp in ((2, 2), (1, 2), (4, 2), (1, 8)):
        pl = placement.place(t, tp=tp, pp=pp)
        mesh = real.build_mesh(pl.grid, t)
        assert mesh.axis_names == placement.AXES
        assert dict(mesh.shape) == {"stage": pp, "data": 8 // (tp * pp), "tensor": tp}
        for index in np.ndindex(pl.grid.shape):
            assert mesh.devices[index] == devices[pl.grid[index]]
    with pytest.raises(ConfigError, match="has 64 devices but this process has 8"):
        real.build_mesh(placement.place(topo("ib8"), 8, 2).grid, topo("ib8"))


def _fake_devices(per_process, ids=None):
    """Devices of several processes whose ids, as in JAX, are not positions."""
    return [SimpleNamespace(process_index=p, id=2048 * p + k) for p in range(len(per_process))
            for k in range(per_process[p])]


def test_processes_matched_to_nodes_of_their_nic_class():
    t = Topology((Cluster("ib", "infiniband", nodes=2, devices_per_node=2),
                  Cluster("roce", "roce", nodes=2, devices_per_node=2)))
    nics = ["roce", "infiniband", "roce", "infiniband"]
    devices = _fake_devices([2, 2, 2, 2])[::-1]  # order given does not matter
    placed = real.device_array(np.arange(8).reshape(2, 2, 2), t, devices, nics)
    procs = np.vectorize(lambda d: d.process_index)(placed)
    # IB nodes 0, 1 run on processes 1 and 3; RoCE nodes on processes 0 and 2
    np.testing.assert_array_equal(procs, [[[1, 1], [3, 3]], [[0, 0], [2, 2]]])
    ids = np.vectorize(lambda d: d.id)(placed)
    assert ids[0, 0].tolist() == [2048, 2049]
    with pytest.raises(ConfigError, match="NIC class 'infiniband' is reported by 1 process"):
        real.device_array(np.arange(8).reshape(2, 2, 2), t, devices, ["roce", "infiniband", "roce", "roce"])
    with pytest.raises(ConfigError, match="has 2 devices but the infiniband processes that reach it in rank order "
                                          "hold 3: process 1 with 3;"):
        real.device_array(np.arange(8), t, _fake_devices([2, 3, 2, 1]), nics)


def test_a_node_whose_processes_are_on_different_hosts_is_warned_of(capsys):
    # srun --distribution=cyclic (mpirun --map-by node) puts consecutive ranks on different hosts:
    # node 0's processes 0-3 ran on two hosts and nothing said so
    t = Topology((Cluster("ib", "infiniband", nodes=2, devices_per_node=4),), name="ib2x4")
    devices, grid = _fake_devices([1] * 8), np.arange(8).reshape(2, 1, 4)
    cyclic = ["a", "b"] * 4
    placed = real.device_array(grid, t, devices, process_hosts=cyclic)
    # the placement is the same: a warning, not an error (one machine may give each process its own name)
    assert np.vectorize(lambda d: d.process_index)(placed).ravel().tolist() == list(range(8))
    assert capsys.readouterr().err.splitlines() == [
        "warning: the processes of node 0 of topology 'ib2x4' are on different hosts (0, 2 on a; 1, 3 on b) (and 1 "
        "other node(s) likewise), but the plan counts on intra-node links between them; start consecutive ranks on "
        "one host (srun's default --distribution=block, mpirun --map-by slot)"]
    # one node spread over hosts among nodes that are not: that node is named
    real.device_array(grid, t, devices, process_hosts=["a"] * 4 + ["b", "c", "b", "b"])
    assert "node 1 of topology 'ib2x4' are on different hosts (4, 6, 7 on b; 5 on c), but" in capsys.readouterr().err
    # block layout, one machine for every node (a single-machine launch), one process per node: fine
    real.device_array(grid, t, devices, process_hosts=["a"] * 4 + ["b"] * 4)
    real.device_array(grid, t, devices, process_hosts=["a"] * 8)
    real.device_array(grid, t, _fake_devices([4, 4]), process_hosts=["a", "a"])
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="2 host names given for 8 processes"):
        real.device_array(grid, t, devices, process_hosts=["a", "b"])


def test_host_names_are_exchanged_only_where_a_node_runs_several_processes(monkeypatch, capsys):
    t = Topology((Cluster("ib", "infiniband", nodes=2, devices_per_node=2),), name="ib2x2")
    exchanged = []

    def every_process(name, text):
        exchanged.append(name)
        return ["a", "b", "a", "b"]

    monkeypatch.setattr(real.distributed, "every_process", every_process)
    # processes made up in this one process (unit tests): nothing to exchange, nothing checked
    real.device_array(np.arange(4), t, _fake_devices([1] * 4))
    assert exchanged == [] and capsys.readouterr().err == ""
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    real.device_array(np.arange(4), t, _fake_devices([2, 2]), process_nics=["infiniband"] * 2)
    assert exchanged == []  # one process per node: nothing inside a node to check
    real.device_array(np.arange(4), t, _fake_devices([1] * 4))
    assert exchanged == ["hostname"]
    assert "node 0 of topology 'ib2x2' are on different hosts (0 on a; 1 on b)" in capsys.readouterr().err


def test_devices_given_as_an_array_or_an_empty_list_are_taken_as_given():
    # `devices or jax.devices()`: an array of devices was asked for its truth ("ambiguous"
    # ValueError), and an empty list meant every device
    devices = _fake_devices([2, 2])
    assert real.ordered_devices(np.array(devices[::-1], dtype=object)) == devices
    t = real.local_topology(np.array(devices, dtype=object), nic_class="roce")
    assert (t.clusters[0].nodes, t.clusters[0].devices_per_node) == (2, 2)
    assert real.ordered_devices([]) == []


def test_local_topology_one_node_per_process():
    t = real.local_topology(_fake_devices([4, 4]), nic_class="roce")
    (cluster,) = t.clusters
    assert (cluster.name, cluster.nic, cluster.nodes, cluster.devices_per_node) == ("local", "roce", 2, 4)
    with pytest.raises(ConfigError, match="the same count on every process"):
        real.local_topology(_fake_devices([4, 2]), nic_class="roce")
    here = real.local_topology()  # the 8 CPU devices of this process, NIC detected
    assert (here.num_devices, here.clusters[0].nodes, here.clusters[0].nic in NIC_CLASSES) == (8, 1, True)


def test_local_topology_on_gpus_makes_a_node_of_each_host():
    """One process per GPU (srun --ntasks-per-node=8): the host is the node, so tensor groups may
    span its processes; the launcher's CPU processes each stand in for a host."""
    gpus = [SimpleNamespace(process_index=d.process_index, id=d.id, platform="gpu") for d in _fake_devices([1] * 8)]
    def shape(hosts, devices=gpus):
        (cluster,) = real.local_topology(devices, nic_class="infiniband", process_hosts=hosts).clusters
        return cluster.nodes, cluster.devices_per_node
    assert shape(["a"] * 8) == (1, 8)
    assert shape(["a"] * 4 + ["b"] * 4) == (2, 4)
    assert shape(["a", "b"] * 4) == (8, 1)  # cyclic ranks: a node of consecutive ranks would span hosts
    assert shape(["a"] * 6 + ["b"] * 2) == (8, 1)  # hosts of unequal counts
    assert shape(["a"] * 8, _fake_devices([1] * 8)) == (8, 1)  # CPU
    topo = real.local_topology(gpus, nic_class="infiniband", process_hosts=["a"] * 4 + ["b"] * 4)
    made = plan(topo, ModelConfig(preset="tiny"), ParallelConfig(tp=4, pp=1), global_batch=8, seq_len=64)
    placed = real.device_array(made.grid, topo, gpus, process_hosts=["a"] * 4 + ["b"] * 4)
    assert sorted(d.process_index for d in placed[0, 0]) == [0, 1, 2, 3]  # a tensor group is one host's GPUs


def test_search_goes_past_the_microbatch_cap_where_only_small_micro_batches_fit():
    """7.5B in float32 without remat on one node of 40 GB devices fits only with micro batches of 1 or
    2, more microbatches than the search's cap (32 a stage): a plan, not 'no layout fits'."""
    t = Topology((Cluster("a", "infiniband", nodes=1, devices_per_node=8, device_memory_gb=40),))
    p = plan(t, "7.5b")
    assert p.prediction.fits
    assert p.microbatches > search.MAX_MICROBATCHES_PER_STAGE * p.mesh["stage"]
    with pytest.raises(ConfigError, match="do not fit in device memory"):  # under the cap nothing fits
        plan(t, "7.5b", ParallelConfig(tp=8, pp=1, microbatches=search.MAX_MICROBATCHES_PER_STAGE))


def test_search_goes_past_the_microbatch_cap_where_only_small_micro_batches_fit_the_faster_split():
    """350m with 12 layers on 3 devices: at 80 GB the balanced split 5,5,2 fits only past the cap (128
    microbatches), the even split under it. The search stopped at 64 with 4,4,4: 1.84 s, slower than
    the 1.37 s it found on 60 GB devices, where nothing fitted under the cap."""
    model = ModelConfig(preset="350m", num_layers=12)

    def on(memory_gb, parallel=None):
        t = Topology((Cluster("a", "infiniband", nodes=3, devices_per_node=1, device_memory_gb=memory_gb),))
        return plan(t, model, parallel, global_batch=256)

    past_the_cap = on(80, ParallelConfig(tp=1, pp=3, dp=1, microbatches=128, schedule="1f1b"))
    assert past_the_cap.stage_layers == (5, 5, 2) and past_the_cap.prediction.fits
    best = on(80)
    assert best.prediction.step_time_s <= past_the_cap.prediction.step_time_s
    assert best.prediction.step_time_s <= on(60).prediction.step_time_s  # more memory is never slower


def _need_over_have(text):
    need, have = re.search(r"needs ([0-9.e+]+) GB, its devices have ([0-9.e+]+) GB", text).groups()
    return float(need) / float(have)


def test_when_nothing_fits_memory_the_error_names_the_layout_nearest_to_fitting():
    t = Topology((Cluster("a", "infiniband", nodes=2, devices_per_node=8, device_memory_gb=24),))
    with pytest.raises(ConfigError, match="no layout fits") as e:
        plan(t, "7.5b")
    cfg = presets.resolve(ModelConfig(preset="7.5b"))
    _, errors, _ = search._candidates(t, cfg, ParallelConfig(), set(search.SEARCHABLE), 512, cfg.max_seq_len, False, None)
    nearest = min(_need_over_have(m) for m in errors if "device memory" in m)
    assert _need_over_have(str(e.value)) == pytest.approx(nearest)  # it named the 4.5 TB pp = 1 layout before
    assert "ModelConfig.remat = 'full', the plan CLI's --remat" in str(e.value)


def test_tp_over_the_devices_with_pp_left_to_the_search_is_a_config_error():
    # no pp was left to try, so no reason either: an IndexError from the plan command
    with pytest.raises(ConfigError, match="tp = 16 is not allowed"):
        plan(TOPOLOGIES / "cpu_2x4.toml", "llama-tiny", ParallelConfig(tp=16), auto=("pp",))


def test_auto_may_name_one_size_as_a_string():
    one = plan(TOPOLOGIES / "cpu_2x4.toml", "tiny", ParallelConfig(tp=1, dp=4), global_batch=8, auto="pp")
    assert one.to_dict() == plan(TOPOLOGIES / "cpu_2x4.toml", "tiny", ParallelConfig(tp=1, dp=4), global_batch=8,
                                 auto=("pp",)).to_dict()


def test_planner_scale_bench_answers_help_without_running():
    # it took no flags and ran its whole 33-plan sweep (tens of seconds) for --help or a typo
    run = lambda *args: subprocess.run([sys.executable, "bench/planner_scale.py", *args], capture_output=True,
                                       text=True, cwd=REPO, timeout=60)
    r = run("--help")
    assert r.returncode == 0 and "Planning time from 8 to 8192 nodes" in r.stdout and "nodes layers" not in r.stdout
    r = run("--nodes", "8")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1


def test_a_pp_error_offers_only_pp_the_model_has_layers_for():
    """tiny (4 layers) on ib3_roce5 offered pp 8, 16, 32, 64 as 'allowed', each then refused for
    having more stages than layers; 7.5b (36 layers) with pp 3 offered pp 64."""
    with pytest.raises(ConfigError) as e:
        plan(TOPOLOGIES / "ib3_roce5.toml", "tiny")
    assert "allowed pp (every cluster holding whole stages, up to the model's 4 layers): none; or allow mixed " \
           "stages" in str(e.value)
    with pytest.raises(ConfigError) as e:
        plan(TOPOLOGIES / "ib4_roce4.toml", "7.5b", ParallelConfig(pp=3))
    assert "allowed pp up to the model's 36 layers: 1, 2, 4, 8, 16, 32;" in str(e.value)
    assert "with pp 2, 4, 8, 16, 32 (the others" in str(e.value)
    # the largest it offers passes the model's check (it is over memory here, a later check)
    with pytest.raises(ConfigError, match="do not fit in device memory"):
        plan(TOPOLOGIES / "ib4_roce4.toml", "7.5b", ParallelConfig(pp=32))


def test_a_layout_that_fits_only_past_the_microbatch_cap_is_named():
    """A global batch of 65536 fits 80 GB devices only with micro batches smaller than the search's
    512 microbatches allow: 'no layout fits' named no way out, though a given count plans."""
    model = ModelConfig(preset="39.1b", remat="full")
    with pytest.raises(ConfigError) as e:
        plan(TOPOLOGIES / "ib4_roce4.toml", model, global_batch=65536)
    found = re.search(r"tp = (\d+), pp = (\d+) fits device memory only with more microbatches than the search "
                      r"tries \(up to 512\): with microbatches = (\d+), schedule (\w+);", str(e.value))
    assert found and "the plan CLI's --microbatches" in str(e.value)
    tp, pp, m, schedule = found.groups()
    given = ParallelConfig(tp=int(tp), pp=int(pp), microbatches=int(m), schedule=schedule)
    p = plan(TOPOLOGIES / "ib4_roce4.toml", model, given, global_batch=65536)
    assert p.prediction.fits and p.microbatches == int(m) > search.MAX_MICROBATCHES


def test_a_given_split_over_memory_is_named_with_the_way_out():
    """Memory is the longest stage's: 20,10 is over 24 GB where 15,15 is not. The error named the
    layout but not the split that put it over."""
    t = Topology((Cluster("big", "infiniband", 2, 8), Cluster("small", "roce", 2, 8, device_memory_gb=24)))
    fixed = dict(tp=8, pp=2, microbatches=256, schedule="1f1b")
    for given in (dict(stage_layers=(20, 10)), dict(partition="holmes-ratio")):
        with pytest.raises(ConfigError) as e:
            plan(t, "3.6b", ParallelConfig(**fixed, **given))
        assert "schedule 1f1b, stage layers 20,10 do not fit in device memory" in str(e.value)
        assert "or a more even split: partition auto picks one that fits)" in str(e.value)
    assert plan(t, "3.6b", ParallelConfig(**fixed)).prediction.fits
    with pytest.raises(ConfigError) as e:  # the even split itself over memory: no such advice
        plan(t, "3.6b", ParallelConfig(**fixed, stage_layers=(15, 15)), global_batch=8192)
    assert "stage layers 15,15 do not fit" in str(e.value) and "more even split" not in str(e.value)


def test_the_screen_walks_no_tick_table_and_balances_no_split_where_nothing_fits_memory(monkeypatch):
    # the planner screened thousands of layouts over memory by replaying each one's schedule and
    # time-balancing its layers: most of a 10 s search with a batch of many divisors
    from holmes_jax.planning import cost, partition
    t = Topology((Cluster("a", "infiniband", nodes=1, devices_per_node=8, device_memory_gb=24),
                  Cluster("b", "roce", nodes=1, devices_per_node=8, device_memory_gb=24)))
    balanced, real = [], partition.time_balanced
    monkeypatch.setattr(partition, "time_balanced", lambda model: balanced.append(model) or real(model))
    cost._ticks.cache_clear()
    with pytest.raises(ConfigError, match="do not fit in device memory"):
        plan(t, "7.5b", global_batch=720)
    assert cost._ticks.cache_info().misses == 0 and balanced == []


def test_lower_bounds_over_memory_are_infinite_without_the_tick_table():
    from holmes_jax.planning import cost
    cfg = presets.resolve(ModelConfig(preset="7.5b"))
    t = Topology((Cluster("a", "infiniband", nodes=2, devices_per_node=8, device_memory_gb=1),))
    pl = placement.place(t, tp=8, pp=2)
    model, _ = search._cost_model(cfg, pl, 64, cfg.max_seq_len, 8, "1f1b", ParallelConfig())
    cost._ticks.cache_clear()
    assert np.all(model.lower_bounds([(18, 18), (10, 26)]) == np.inf)
    assert cost._ticks.cache_info().misses == 0
    roomy = model.with_stages([dataclasses.replace(s, memory_bytes=np.inf) for s in model.stages])
    bound = roomy.lower_bounds([(18, 18)])[0]
    assert np.isfinite(bound) and bound <= roomy.step_times([(18, 18)])[0]


def _two_clusters(memory_gb=80.0):
    """1 + 2 nodes of 8: every cluster holds whole stages only with pp 3, 6, 12 or 24."""
    return Topology((Cluster("ib", "infiniband", nodes=1, devices_per_node=8, device_memory_gb=memory_gb),
                     Cluster("roce", "roce", nodes=2, devices_per_node=8, device_memory_gb=memory_gb)))


def test_errors_on_given_sizes_offer_only_sizes_that_are_allowed():
    """dp was refused and offered in one line where tp does not divide the devices; with pp and dp
    both given, the dp offered (2) was another pp's, and dp = 2 sent the user back to dp = 3."""
    three = {"cluster": [{"name": "a", "nic": "roce", "nodes": 3, "devices_per_node": 1}]}
    with pytest.raises(ConfigError, match=r"^dp = 1 is not allowed with tp = 2: dp \* tp must divide the 3 devices; "
                                          r"allowed dp: none \(tp = 2 does not divide them\)$"):
        plan(three, "tiny", ParallelConfig(tp=2, dp=1), auto=["pp"])
    two = {"cluster": [{"name": "a", "nic": "infiniband", "nodes": 1, "devices_per_node": 4},
                       {"name": "b", "nic": "roce", "nodes": 2, "devices_per_node": 1}]}
    with pytest.raises(ConfigError, match=r"^pp = 2 is not allowed with tp = 1: stage 1 would span clusters 'a', 'b'.*"
                                          r"allowed pp \(every cluster holding whole stages.*\): 3;"):
        plan(two, "tiny", ParallelConfig(tp=1, pp=2, dp=3))
    with pytest.raises(ConfigError, match=r"allowed with pp = 3, tp = 1: dp = 2$"):
        plan(two, "tiny", ParallelConfig(tp=1, pp=3, dp=3))
    assert plan(two, "tiny", ParallelConfig(tp=1, pp=3, dp=2)).mesh == {"stage": 3, "data": 2, "tensor": 1}
    # pp past the layers: only the pp that keep every cluster's stages whole (1 and 2 span 'a' and 'b')
    with pytest.raises(ConfigError, match=r"the model has 4; allowed: pp 3$"):
        plan(two, "tiny", ParallelConfig(tp=1, pp=5))
    with pytest.raises(ConfigError, match=r"the model has 4; allowed: pp 1, 2, 3$"):
        plan(two, "tiny", ParallelConfig(tp=1, pp=5), allow_mixed=True)


def test_a_batch_error_with_given_microbatches_offers_batches_they_split():
    # it offered 3 for global_batch 2 and 2 for 3, each refused in turn: 4 microbatches split neither
    six = {"cluster": [{"name": "a", "nic": "infiniband", "nodes": 3, "devices_per_node": 2}]}
    given = ParallelConfig(tp=1, microbatches=4)
    with pytest.raises(ConfigError, match=r"global_batch = 3 is not allowed: every data replica needs the same samples, "
                                          r"split into 4 microbatches, and dp = 2, 6 do not divide it; allowed: a "
                                          r"multiple of 8, 24 \(the smallest: 8\)$"):
        plan(six, "tiny", given, auto=["pp", "dp", "schedule"], global_batch=3)
    assert plan(six, "tiny", given, auto=["pp", "dp", "schedule"], global_batch=8).mesh["data"] == 2


def test_where_only_stages_spanning_clusters_fit_the_error_says_allow_mixed_would_find_one():
    two_layers = ModelConfig(preset="tiny", num_layers=2)  # too few layers for pp 3
    with pytest.raises(ConfigError) as e:
        plan(_two_clusters(), two_layers, global_batch=48)
    mixed = plan(_two_clusters(), two_layers, global_batch=48, allow_mixed=True)
    hint = re.search(r"with stages spanning clusters tp = (\d+), pp = (\d+), dp = (\d+), microbatches = (\d+), "
                     r"(\w+) fits \(([0-9.e+-]+) s a step; the planner's allow_mixed=True, --allow-mixed\)$",
                     str(e.value))
    assert hint, str(e.value)
    tp, pp, dp, m = map(int, hint.groups()[:4])
    assert (mixed.tp, mixed.pp, mixed.dp, mixed.microbatches, mixed.schedule) == (tp, pp, dp, m, hint.group(5))
    assert mixed.prediction.step_time_s <= float(hint.group(6)) * 1.001


def test_where_stages_spanning_clusters_would_not_fit_either_the_error_does_not_offer_them():
    with pytest.raises(ConfigError, match="^no layout fits") as e:
        plan(_two_clusters(memory_gb=24), "7.5b", global_batch=48)
    with pytest.raises(ConfigError, match="^no layout fits"):  # allow_mixed finds nothing either
        plan(_two_clusters(memory_gb=24), "7.5b", global_batch=48, allow_mixed=True)
    assert "spanning clusters" not in str(e.value) and "allow_mixed" not in str(e.value)


@pytest.mark.parametrize("topology, model, batch, allow_mixed", [
    ("ib3_roce5", "350m", 64, True),  # a stage spanning clusters syncs slowly: its best split is 3,21
    ("three_clusters", "350m", 64, False),
])
def test_plan_is_the_fastest_layout_and_split_the_cost_model_predicts(topology, model, batch, allow_mixed):
    # every layout the search considers, each at every split: the time-balanced split ignores the
    # gradient sync, and a layout screened at it alone never got the partition search
    t, cfg = topo(topology), presets.resolve(ModelConfig(preset=model))
    found = plan(t, cfg, global_batch=batch, allow_mixed=allow_mixed).prediction.step_time_s
    candidates, _, _ = search._candidates(t, cfg, ParallelConfig(), set(search.SEARCHABLE), batch, cfg.max_seq_len,
                                          allow_mixed, None)
    fastest = min(float(c.model.step_times(partition.compositions(cfg.num_layers, c.model.num_stages)).min())
                  for c in candidates if c.model.num_stages <= 4)
    assert found <= fastest * (1 + 1e-9)


def test_a_stage_spanning_many_clusters_names_a_few_of_them():
    # the error line listed all 300 names ('c0', 'c1', ... 'c299'): thousands of characters
    many = Topology(tuple(Cluster(f"c{i}", "infiniband", 1, 2) for i in range(300)))
    with pytest.raises(ConfigError) as e:
        placement.place(many, 1, 1)
    assert "stage 0 would span clusters 'c0', 'c1', 'c2', 'c3', ... (300 in all), so" in str(e.value)
    with pytest.raises(ConfigError, match="stage 0 would span clusters 'ib', 'roce', so"):  # a few: every name
        placement.place(topo("ib4_roce4"), 1, 1)
