from pathlib import Path

import numpy as np
import pytest

from holmes_jax.config import ConfigError
from holmes_jax.planning import topology as T

TOPOLOGIES = Path(__file__).resolve().parent.parent / "configs" / "topologies"


@pytest.mark.parametrize("name, devices, clusters", [
    ("ib4_roce4", 64, ["ib", "roce"]), ("ib8", 64, ["ib"]), ("roce8", 64, ["roce"]), ("eth8", 64, ["eth"]),
    ("cpu_2x4", 8, ["ib", "roce"]), ("ib3_roce5", 64, ["ib", "roce"]), ("three_clusters", 64, ["ib", "roce", "eth"]),
])
def test_shipped_topologies_load(name, devices, clusters):
    topo = T.load(TOPOLOGIES / f"{name}.toml")
    assert topo.name == name
    assert topo.num_devices == devices
    assert [c.name for c in topo.clusters] == clusters


def test_ib4_roce4_is_the_papers_testbed():
    topo = T.load(TOPOLOGIES / "ib4_roce4.toml")
    ib, roce = topo.clusters
    assert (ib.nic, ib.nodes, ib.devices_per_node, ib.nic_link.gbps) == ("infiniband", 4, 8, 200)
    assert (roce.nic, roce.nodes, roce.devices_per_node, roce.nic_link.gbps) == ("roce", 4, 8, 100)
    assert (topo.inter_cluster.name, topo.inter_cluster.gbps) == ("ethernet", 25)


def test_link_between_devices_same_node_same_cluster_across():
    topo = T.load(TOPOLOGIES / "ib4_roce4.toml")

    def link(a, b):  # what joins devices a and b
        return topo.link_table[int(topo.link_kind(a, b))][topo.device_cluster[a]]

    assert link(0, 7).name == "intra-node" and link(0, 7).gbps == 2400
    assert link(0, 8) == topo.clusters[0].nic_link  # two IB nodes
    assert link(40, 63) == topo.clusters[1].nic_link  # two RoCE nodes
    assert link(31, 32) == topo.inter_cluster  # last IB device, first RoCE device
    ib = T.NIC_DEFAULTS["infiniband"]
    assert link(0, 8).bytes_per_s == pytest.approx(200e9 / 8 * ib.efficiency)
    assert link(3, 60).latency_s == pytest.approx(T.NIC_DEFAULTS["ethernet"].latency_us * 1e-6)


def test_class_defaults_fill_missing_fields_and_rdma_beats_tcp():
    topo = T.load(TOPOLOGIES / "three_clusters.toml")
    for cluster in topo.clusters:
        assert cluster.nic_link == T.NIC_DEFAULTS[cluster.nic]
        assert cluster.device_tflops == T.DEVICE_TFLOPS_DEFAULT
    rate = {c.nic: c.nic_link.bytes_per_s for c in topo.clusters}
    latency = {c.nic: c.nic_link.latency_us for c in topo.clusters}
    assert rate["infiniband"] > rate["roce"] > rate["ethernet"]
    assert latency["infiniband"] < latency["roce"] < latency["ethernet"]


def test_devices_numbered_cluster_by_cluster_node_by_node():
    topo = T.Topology((T.Cluster("a", "infiniband", nodes=2, devices_per_node=4),
                       T.Cluster("b", "roce", nodes=1, devices_per_node=8)))
    np.testing.assert_array_equal(topo.device_node, [0] * 4 + [1] * 4 + [2] * 8)
    np.testing.assert_array_equal(topo.device_cluster, [0] * 8 + [1] * 8)
    np.testing.assert_array_equal(topo.node_devices[1], [4, 5, 6, 7])
    np.testing.assert_array_equal(topo.link_kind([0, 0, 0], [3, 4, 8]), [T.INTRA_NODE, T.CLUSTER, T.INTER_CLUSTER])


def test_python_build_matches_toml_and_round_trips():
    topo = T.load(TOPOLOGIES / "ib4_roce4.toml")
    built = T.Topology(
        (T.Cluster("ib", "infiniband", 4, 8, nic_gbps=200), T.Cluster("roce", "roce", 4, 8, nic_gbps=100)),
        T.nic_link("ethernet", gbps=25), name="ib4_roce4")
    assert built == topo
    assert T.from_dict(topo.to_dict()) == topo


GOOD = {"cluster": [{"name": "ib", "nic": "infiniband", "nodes": 2, "devices_per_node": 8}]}


def _with(cluster=None, **top):
    data = {"cluster": [dict(GOOD["cluster"][0], **(cluster or {}))], **top}
    return {k: v for k, v in data.items() if v is not None}


@pytest.mark.parametrize("data, words", [
    (_with({"nic": "ib"}), ["nic = 'ib'", "'infiniband', 'roce', 'ethernet'"]),
    (_with({"gpus": 8}), ["cluster[0]", "unknown key 'gpus'", "allowed:"]),
    (_with(hosts=3), ["unknown key 'hosts'", "allowed: name, cluster, inter_cluster"]),
    (_with({"nodes": 0}), ["nodes = 0", "allowed: a positive integer"]),
    (_with({"devices_per_node": "8"}), ["devices_per_node = '8'", "allowed: a positive integer"]),
    (_with({"nic_gbps": -1}), ["nic_gbps = -1", "allowed: a finite number > 0"]),
    (_with({"nic_efficiency": 1.5}), ["nic_efficiency = 1.5", "<= 1"]),
    (_with({"device_tflops": True}), ["device_tflops = True", "allowed"]),
    (_with({"nic_gbps": float("inf")}), ["nic_gbps = inf", "allowed: a finite number > 0"]),
    (_with({"device_memory_gb": float("inf")}), ["device_memory_gb = inf", "finite"]),
    (_with(inter_cluster={"latency_us": float("inf")}), ["inter_cluster.latency_us = inf", "finite"]),
    (_with(inter_cluster={"nic": "ethernet", "speed": 10}), ["inter_cluster", "unknown key 'speed'"]),
    (_with(inter_cluster={"gbps": 0}), ["inter_cluster.gbps = 0", "allowed"]),
    ({"cluster": [{"name": "ib", "nic": "roce", "nodes": 1}]}, ["missing key 'devices_per_node'"]),
    ({"cluster": []}, ["cluster", "allowed: one or more [[cluster]] tables"]),
    ({"cluster": GOOD["cluster"] * 2}, ["unique names"]),
    ({}, ["missing key 'cluster'"]),
])
def test_invalid_fields_name_the_field_and_what_is_allowed(data, words):
    with pytest.raises(ConfigError) as e:
        T.from_dict(data)
    for word in words:
        assert word in str(e.value)


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        T.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[cluster]\nname = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        T.load(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[[cluster]]\nname = "x"\nnic = "infiniband"\nnodes = -2\ndevices_per_node = 8\n')
    with pytest.raises(ConfigError, match=r"wrong\.toml.*nodes = -2"):
        T.load(wrong)


def test_python_api_misuse_is_a_config_error():
    one = T.Cluster("ib", "infiniband", nodes=2, devices_per_node=8)
    assert T.Topology(one) == T.Topology((one,))  # one cluster without a tuple around it
    with pytest.raises(ConfigError, match="topology clusters = 'ib' is not allowed; allowed: a tuple of Clusters"):
        T.Topology("ib")
    # a NIC class's name where a link goes was an AttributeError
    with pytest.raises(ConfigError, match="inter_cluster = 'ethernet' is not allowed; allowed: a Fabric"):
        T.Topology((one,), "ethernet")


def test_a_utf8_file_loads_under_a_non_utf8_locale(tmp_path):
    """TOML is UTF-8: read with the locale's encoding, a name like 'münchen' was 'not valid TOML' (or mojibake)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "utf8.toml"
    path.write_text('# Ströme\n[[cluster]]\nname = "münchen"\nnic = "roce"\nnodes = 1\ndevices_per_node = 2\n',
                    encoding="utf-8")
    code = f"from holmes_jax.planning import topology as T; print(ascii(T.load({str(path)!r}).clusters[0].name))"
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0")  # an ASCII locale, no UTF-8 mode
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ascii("münchen")


def test_plan_takes_a_topology_as_a_dict_of_the_toml_tables():
    # it was refused ("allowed: a TOML file path or a Topology") though the tables are the file's
    import tomllib

    import holmes_jax

    path = TOPOLOGIES / "ib4_roce4.toml"
    tables = tomllib.loads(path.read_text())
    from_dict, from_file = holmes_jax.plan(tables, "tiny").to_dict(), holmes_jax.plan(str(path), "tiny").to_dict()
    assert (from_dict["topology"].pop("name"), from_file["topology"].pop("name")) == ("topology", "ib4_roce4")
    assert from_dict == from_file
    del tables["cluster"][0]["nic"]
    with pytest.raises(ConfigError, match="nic"):  # checked as a file's fields are
        holmes_jax.plan(tables, "tiny")
    with pytest.raises(ConfigError, match="a dict shaped like one"):
        holmes_jax.plan(42, "tiny")
