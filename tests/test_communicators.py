"""The Plan's communicators: which fabric each data group, tensor group and stage boundary uses."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from holmes_jax import cli
from holmes_jax.config import ParallelConfig
from holmes_jax.planning import placement, plan
from holmes_jax.planning.cli import main
from holmes_jax.planning.communicators import communicators, cross_cluster_hops
from holmes_jax.planning.topology import load

TOPOLOGIES = Path(__file__).resolve().parent.parent / "configs" / "topologies"


def _rows(comms):
    return [(c["kind"], c.get("stage", c.get("stages")), c["nic_classes"], c["transport"]) for c in comms]


def test_ib4_roce4_json_lists_each_stage_group_and_the_boundary_with_its_transport():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        cli.run(main, ["--topology", str(TOPOLOGIES / "ib4_roce4.toml"), "--model", "7.5b", "--tp", "8", "--pp", "2",
                       "--json"])
    assert e.value.code == 0
    comms = json.loads(out.getvalue())["communicators"]
    assert _rows(comms) == [
        ("data", 0, ["infiniband"], "ib"), ("tensor", 0, ["infiniband"], "nvlink"),
        ("data", 1, ["roce"], "ib"), ("tensor", 1, ["roce"], "nvlink"),
        ("stage_boundary", [0, 1], ["infiniband", "roce"], "socket"),
    ]
    data0, boundary = comms[0], comms[-1]
    assert (data0["groups"], data0["size"], data0["clusters"]) == (8, 4, ["ib"])  # 8 tensor ranks, 4 replicas each
    assert (boundary["groups"], boundary["size"], boundary["clusters"]) == (32, 2, ["ib", "roce"])


def test_three_clusters_boundaries_inside_a_class_keep_its_transport():
    p = plan(TOPOLOGIES / "three_clusters.toml", "1.3b", ParallelConfig(tp=2, pp=8), global_batch=64, seq_len=512)
    comms = p.to_dict()["communicators"]
    boundaries = [c for c in comms if c["kind"] == "stage_boundary"]
    assert [(c["stages"], c["nic_classes"], c["transport"]) for c in boundaries] == [
        ([0, 1], ["infiniband"], "ib"),  # two IB nodes: one stage each
        ([1, 2], ["infiniband", "roce"], "socket"),
        ([2, 3], ["roce"], "ib"),  # RoCE verbs: NCCL's IB transport too
        ([3, 4], ["ethernet", "roce"], "socket"),
        ([4, 5], ["ethernet"], "socket"), ([5, 6], ["ethernet"], "socket"), ([6, 7], ["ethernet"], "socket"),
    ]
    data = [c for c in comms if c["kind"] == "data"]
    assert [c["nic_classes"] for c in data] == [["infiniband"]] * 2 + [["roce"]] * 2 + [["ethernet"]] * 4
    assert {c["transport"] for c in data} == {"nvlink"}  # pp 8 on 8 nodes: each stage's replicas in one node
    assert {c["transport"] for c in comms if c["kind"] == "tensor"} == {"nvlink"}
    assert cross_cluster_hops(p.topology, p.grid) == (1, 3)  # only the hops between clusters, not eth -> eth
    explained = p.explain()
    assert "stage_boundary  1->2" in explained and "socket (own cliques, across clusters)" in explained


def test_naive_ranks_put_data_groups_on_sockets_across_clusters():
    t = load(TOPOLOGIES / "ib4_roce4.toml")
    naive = communicators(t, placement.place(t, 8, 2, method="naive").grid)
    assert [(c.kind, c.stages, c.nic_classes, c.transport) for c in naive if c.kind == "data"] == [
        ("data", (0,), ("infiniband", "roce"), "socket"), ("data", (1,), ("infiniband", "roce"), "socket")]


def test_one_device_per_axis_has_no_communicator():
    t = load(TOPOLOGIES / "cpu_2x4.toml")
    comms = communicators(t, placement.place(t, tp=1, pp=8).grid)  # one device per stage
    assert {c.kind for c in comms} == {"stage_boundary"}
    assert [c.transport for c in comms] == ["nvlink"] * 3 + ["socket"] + ["nvlink"] * 3


def test_naive_boundary_whose_pairs_each_stay_in_one_cluster_is_not_a_cross_cluster_hop():
    # naive on ib4_roce4, pp 2: replica d of both stages sits in the same cluster (IB, RoCE, IB, RoCE),
    # so every boundary pair stays inside one cluster, though the boundary touches both
    t = load(TOPOLOGIES / "ib4_roce4.toml")
    grid = placement.place(t, 8, 2, method="naive").grid
    boundary = [c for c in communicators(t, grid) if c.kind == "stage_boundary"]
    assert [(c.clusters, c.transport, c.spans_clusters) for c in boundary] == [(("ib", "roce"), "ib", False)]
    assert cross_cluster_hops(t, grid) == ()
    holmes = placement.place(t, 8, 2).grid
    assert cross_cluster_hops(t, holmes) == (0,)
