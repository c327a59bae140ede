from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from holmes_jax.config import ConfigError
from holmes_jax.mesh import devices as real
from holmes_jax.planning import placement
from holmes_jax.planning.topology import NIC_CLASSES, Cluster, Topology, load

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
    with pytest.raises(ConfigError, match="process 1 has 3 devices but node"):
        real.device_array(np.arange(8), t, _fake_devices([2, 3, 2, 1]), nics)


def test_local_topology_one_node_per_process():
    t = real.local_topology(_fake_devices([4, 4]), nic_class="roce")
    (cluster,) = t.clusters
    assert (cluster.name, cluster.nic, cluster.nodes, cluster.devices_per_node) == ("local", "roce", 2, 4)
    with pytest.raises(ConfigError, match="the same count on every process"):
        real.local_topology(_fake_devices([4, 2]), nic_class="roce")
    here = real.local_topology()  # the 8 CPU devices of this process, NIC detected
    assert (here.num_devices, here.clusters[0].nodes, here.clusters[0].nic in NIC_CLASSES) == (8, 1, True)
