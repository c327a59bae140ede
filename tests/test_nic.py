import os
import pwd
import re
from types import SimpleNamespace

import pytest

from holmes_jax.config import ConfigError
from holmes_jax.mesh import nic


def _rdma_port(root, device, port, link_layer, rate, state="4: ACTIVE"):
    d = root / "class" / "infiniband" / device / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "link_layer").write_text(link_layer + "\n")
    (d / "rate").write_text(rate + "\n")
    (d / "state").write_text(state + "\n")


def _net(root, iface, speed=None, operstate=None):
    d = root / "class" / "net" / iface
    d.mkdir(parents=True)
    if speed is not None:
        (d / "speed").write_text(f"{speed}\n")
    if operstate is not None:
        (d / "operstate").write_text(operstate + "\n")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """The home directory NCCL reads .nccl.conf from ($HOME, or the password database's before
    NCCL 2.30): an empty one for both, and no site file, so that no test reads the user's or the
    machine's (a GPU node's /etc/nccl.conf setting NCCL_NET would change what the tests see)."""
    folder = tmp_path / "passwd-home"
    folder.mkdir()
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: SimpleNamespace(pw_dir=str(folder)))
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setattr(nic, "SITE_CONF", str(tmp_path / "no-site-nccl.conf"))
    return folder


IPV4_GID = "0000:0000:0000:0000:0000:ffff:0a00:00{:02x}"
LINK_LOCAL_GID = "fe80:0000:0000:0000:0ac0:ebff:fe12:3456"


def _gids(root, device, port, table):
    """GID table of a port: index -> (type, gid), as sysfs shows it under gid_attrs/types and gids."""
    d = root / "class" / "infiniband" / device / "ports" / str(port)
    (d / "gid_attrs" / "types").mkdir(parents=True)
    (d / "gids").mkdir()
    for index, (kind, gid) in table.items():
        (d / "gid_attrs" / "types" / str(index)).write_text(kind + "\n")
        (d / "gids" / str(index)).write_text(gid + "\n")


def _route(proc, *rows):
    """/proc/net/route with (iface, destination, mask) rows."""
    (proc / "net").mkdir(parents=True)
    header = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT"
    lines = [f"{i}\t{dst}\t0100000A\t0003\t0\t0\t0\t{mask}\t0\t0\t0" for i, dst, mask in rows]
    (proc / "net" / "route").write_text("\n".join([header, *lines]) + "\n")


def test_infiniband_host(tmp_path):
    _rdma_port(tmp_path, "mlx5_0", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    _rdma_port(tmp_path, "mlx5_1", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    _rdma_port(tmp_path, "mlx5_2", 1, "InfiniBand", "200 Gb/sec (4X HDR)", state="1: DOWN")  # not counted
    _net(tmp_path, "eth0", 25000)
    assert nic.detect(tmp_path, env={}) == nic.Nic("infiniband", 400.0)


def test_roce_host(tmp_path):
    _rdma_port(tmp_path, "mlx5_0", 1, "Ethernet", "100 Gb/sec (4X EDR)")
    _net(tmp_path, "eth0", 100000)
    assert nic.detect(tmp_path, env={}) == nic.Nic("roce", 100.0)


def test_host_with_both_trains_over_the_faster_fabric(tmp_path):
    _rdma_port(tmp_path, "mlx5_0", 1, "Ethernet", "100 Gb/sec (4X EDR)")
    _rdma_port(tmp_path, "mlx5_1", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    assert nic.detect(tmp_path, env={}).nic_class == "infiniband"


def test_ethernet_host_skips_loopback_unknown_and_unreadable_speeds(tmp_path):
    _net(tmp_path, "lo", 100000)  # loopback never counts
    _net(tmp_path, "eth0", 25000)
    _net(tmp_path, "eth1", -1)  # link down
    _net(tmp_path, "docker0")  # no speed file
    (tmp_path / "class" / "net" / "eth2").mkdir()
    (tmp_path / "class" / "net" / "eth2" / "speed").mkdir()  # unreadable as a file
    assert nic.detect(tmp_path, env={}) == nic.Nic("ethernet", 25.0)


def test_bare_host_is_ethernet_of_unknown_speed(tmp_path):
    assert nic.detect(tmp_path, env={}) == nic.Nic("ethernet", None)


def test_environment_overrides_sysfs(tmp_path):
    _rdma_port(tmp_path, "mlx5_0", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    assert nic.detect(tmp_path, env={nic.ENV: "roce"}) == nic.Nic("roce", None)
    with pytest.raises(ConfigError, match="HOLMES_NIC_CLASS = 'ib' is not allowed; choose one of"):
        nic.detect(tmp_path, env={nic.ENV: "ib"})


def test_nccl_env_of_an_infiniband_host_names_its_active_ib_ports_and_the_default_route(tmp_path):
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    _rdma_port(sysfs, "mlx5_0", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    _rdma_port(sysfs, "mlx5_1", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    _rdma_port(sysfs, "mlx5_2", 1, "InfiniBand", "200 Gb/sec (4X HDR)", state="1: DOWN")
    _rdma_port(sysfs, "mlx5_3", 1, "Ethernet", "100 Gb/sec (4X EDR)")  # a RoCE port: not this class
    _net(sysfs, "ib0", 200000, "up")  # IPoIB: faster, but not where the default route goes
    _net(sysfs, "eth0", 25000, "up")
    _route(proc, ("ib0", "0000A8C0", "00FFFFFF"), ("eth0", "00000000", "00000000"))
    found = nic.detect(sysfs, env={})
    assert nic.nccl_env(found, sysfs, proc) == {
        "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_SOCKET_IFNAME": "=eth0"}


def test_nccl_env_of_a_roce_host_adds_the_roce_v2_gid_of_an_ipv4_address(tmp_path):
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    for device in ("mlx5_0", "mlx5_1"):
        _rdma_port(sysfs, device, 1, "Ethernet", "100 Gb/sec (4X EDR)")
        _gids(sysfs, device, 1, {0: ("IB/RoCE v1", LINK_LOCAL_GID), 1: ("RoCE v2", LINK_LOCAL_GID),
                                 2: ("IB/RoCE v1", IPV4_GID.format(1)), 3: ("RoCE v2", IPV4_GID.format(1)),
                                 4: ("RoCE v2", "0000:0000:0000:0000:0000:0000:0000:0000")})
    _net(sysfs, "ens1f0", 100000, "up")
    _route(proc, ("ens1f0", "00000000", "00000000"))
    assert nic.nccl_env(nic.detect(sysfs, env={}), sysfs, proc) == {
        "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_GID_INDEX": "3",
        "NCCL_SOCKET_IFNAME": "=ens1f0"}


def test_nccl_env_leaves_the_gid_index_to_nccl_when_ports_disagree_or_sysfs_is_silent(tmp_path):
    sysfs = tmp_path / "sys"
    _rdma_port(sysfs, "mlx5_0", 1, "Ethernet", "100 Gb/sec (4X EDR)")
    _rdma_port(sysfs, "mlx5_1", 1, "Ethernet", "100 Gb/sec (4X EDR)")
    _gids(sysfs, "mlx5_0", 1, {3: ("RoCE v2", IPV4_GID.format(1))})
    _gids(sysfs, "mlx5_1", 1, {5: ("RoCE v2", IPV4_GID.format(2))})
    env = nic.nccl_env(nic.Nic("roce", 200.0), sysfs, tmp_path / "proc")
    assert "NCCL_IB_GID_INDEX" not in env and env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    bare = tmp_path / "bare"
    _rdma_port(bare, "mlx5_0", 1, "Ethernet", "100 Gb/sec (4X EDR)")  # no gid_attrs in this container
    assert nic.nccl_env(nic.Nic("roce", 100.0), bare, tmp_path / "proc") == {
        "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1"}


def test_nccl_env_of_an_ethernet_host_uses_the_fastest_up_interface_without_a_route(tmp_path):
    sysfs = tmp_path / "sys"
    _net(sysfs, "lo", 100000, "unknown")
    _net(sysfs, "eth0", 10000, "up")
    _net(sysfs, "eth1", 25000, "up")
    _net(sysfs, "eth2", 100000, "down")  # fastest, but down
    assert nic.nccl_env(nic.detect(sysfs, env={}), sysfs, tmp_path / "no-proc") == {"NCCL_SOCKET_IFNAME": "=eth1"}
    assert nic.nccl_env(nic.Nic("ethernet", None), tmp_path / "empty", tmp_path / "no-proc") == {}


def test_an_ethernet_host_leaves_the_network_to_nccl_unless_it_has_ib_or_roce_ports(tmp_path):
    # NCCL_NET=Socket bypassed a network plugin: AWS EFA, whose RDMA ports sysfs shows with link
    # layer "Unknown" (an Ethernet host to the planner), or GCP's TCPX on plain Ethernet
    efa = tmp_path / "efa"
    _rdma_port(efa, "efa_0", 1, "Unknown", "100 Gb/sec")
    _net(efa, "ens32", 100000, "up")
    assert nic.detect(efa, env={}) == nic.Nic("ethernet", 100.0)
    assert "NCCL_NET" not in nic.nccl_env(nic.detect(efa, env={}), efa, tmp_path / "no-proc")
    # an InfiniBand host told it is Ethernet (HOLMES_NIC_CLASS): NCCL would take its IB ports
    ib = tmp_path / "ib"
    _rdma_port(ib, "mlx5_0", 1, "InfiniBand", "200 Gb/sec (4X HDR)")
    given = nic.detect(ib, env={nic.ENV: "ethernet"})
    assert nic.nccl_env(given, ib, tmp_path / "no-proc")["NCCL_NET"] == "Socket"


def test_apply_nccl_env_never_overrides_the_user_and_says_where_each_value_came_from():
    env = {"NCCL_SOCKET_IFNAME": "bond0", "PATH": "/bin"}
    lines = nic.apply_nccl_env({"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_SOCKET_IFNAME": "=eth0"}, env)
    assert env == {"NCCL_SOCKET_IFNAME": "bond0", "PATH": "/bin", "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1"}
    assert lines == ['NCCL_NET="IB" (derived)', 'NCCL_IB_HCA="=mlx5_0:1" (derived)',
                     'NCCL_SOCKET_IFNAME="bond0" (from env)']


def test_network_settings_add_the_xla_flags_unless_the_user_chose_them(tmp_path):
    from holmes_jax import distributed

    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_gpu_enable_nccl_comm_splitting=true", "NCCL_NET": "Socket"}
    lines = distributed.network_settings(nic.Nic("infiniband", 200.0), env, tmp_path / "sys", tmp_path / "proc")
    assert env["NCCL_NET"] == "Socket"  # the user's choice stands
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", "--xla_gpu_enable_nccl_comm_splitting=true",
                                        "--xla_gpu_collective_permute_connected_components=true"]
    assert lines == ['NCCL_NET="Socket" (from env)',
                     "XLA_FLAGS --xla_gpu_collective_permute_connected_components=true (derived)",
                     "XLA_FLAGS --xla_gpu_enable_nccl_comm_splitting=true (from env)"]


def test_network_settings_read_the_file_of_flags_xla_flags_names(tmp_path):
    from holmes_jax import distributed

    # XLA reads a value not starting with '-' as a file of flags: the derived flags were appended
    # to the file's name, and XLA died at start-up ("Could not open file")
    (tmp_path / "flags").write_text("--xla_dump_to=/tmp/d\n--xla_gpu_enable_nccl_comm_splitting=true\n")
    env = {"XLA_FLAGS": f" {tmp_path / 'flags'}"}
    lines = distributed.network_settings(nic.Nic("ethernet", 25.0), env, tmp_path / "sys", tmp_path / "proc")
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", "--xla_gpu_enable_nccl_comm_splitting=true",
                                        "--xla_gpu_collective_permute_connected_components=true"]
    given = f"XLA_FLAGS --xla_gpu_enable_nccl_comm_splitting=true (from {tmp_path / 'flags'}, which XLA_FLAGS names)"
    assert given in lines
    with pytest.raises(ConfigError, match=r"XLA_FLAGS = '.*missing' is not allowed: XLA reads it as the name of a "
                                          r"file of flags .* cannot be read \(No such file or directory\)"):
        distributed.network_settings(nic.Nic("ethernet", 25.0), {"XLA_FLAGS": str(tmp_path / "missing")},
                                     tmp_path / "sys", tmp_path / "proc")


def test_nccl_env_skips_a_default_route_without_an_interface(tmp_path):
    # an unreachable or blackhole default route has no device: /proc/net/route names it "*"
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    _net(sysfs, "eth0", 25000, "up")
    _route(proc, ("*", "00000000", "00000000"), ("eth0", "0000A8C0", "00FFFFFF"))
    assert nic.nccl_env(nic.Nic("ethernet", 25.0), sysfs, proc) == {"NCCL_SOCKET_IFNAME": "=eth0"}


ROCE_DERIVED = {"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_IB_GID_INDEX": "3", "NCCL_SOCKET_IFNAME": "=eth0"}


@pytest.mark.parametrize("name, value", [("NCCL_IB_ROCE_VERSION_NUM", "1"), ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
                                         ("NCCL_IB_ADDR_RANGE", "10.0.0.0/8")])
def test_apply_nccl_env_leaves_the_gid_index_to_nccl_when_the_user_steers_its_search(name, value):
    # NCCL reads these only in its own GID search, which an explicit NCCL_IB_GID_INDEX skips
    env = {name: value}
    lines = nic.apply_nccl_env(ROCE_DERIVED, env)
    assert env == {name: value, "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_SOCKET_IFNAME": "=eth0"}
    assert not any("NCCL_IB_GID_INDEX" in line for line in lines)


def test_apply_nccl_env_uses_sockets_when_the_user_disabled_ib():
    env = {"NCCL_IB_DISABLE": "1"}  # NCCL_NET=IB would leave NCCL no network at all
    lines = nic.apply_nccl_env(ROCE_DERIVED, env)
    assert env == {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "=eth0"}
    assert lines[0] == 'NCCL_NET="Socket" (derived, as NCCL_IB_DISABLE="1" from env)'
    env = {"NCCL_IB_DISABLE": "0"}
    nic.apply_nccl_env(ROCE_DERIVED, env)
    assert env["NCCL_NET"] == "IB" and env["NCCL_IB_GID_INDEX"] == "3"
    with pytest.raises(ConfigError, match="NCCL_NET = 'ib' is not allowed with NCCL_IB_DISABLE = '1'"):
        nic.apply_nccl_env(ROCE_DERIVED, {"NCCL_IB_DISABLE": "1", "NCCL_NET": "ib"})


@pytest.mark.parametrize("name, value", [
    ("NCCL_NET", ""), ("NCCL_NET", "IB "),  # no network has these names
    ("NCCL_SOCKET_IFNAME", ""), ("NCCL_SOCKET_IFNAME", "e"),  # NCCL ignores values this short
    ("NCCL_SOCKET_IFNAME", "eth0, eth1"), ("NCCL_SOCKET_IFNAME", "=^eth0"), ("NCCL_SOCKET_IFNAME", "^="),
    ("NCCL_IB_HCA", ""), ("NCCL_IB_HCA", "=mlx5_0:1,=mlx5_1:1"),  # "": every HCA; "=mlx5_1" matches none
    ("NCCL_IB_GID_INDEX", ""), ("NCCL_IB_GID_INDEX", "three"),  # NCCL reads "three" as 0
    ("NCCL_IB_GID_INDEX", "08"), ("NCCL_IB_GID_INDEX", "010"),  # strtoll's octal: 0 and 8
])
def test_apply_nccl_env_refuses_user_values_nccl_would_misread(name, value):
    with pytest.raises(ConfigError, match="^" + re.escape(f"{name} = {value!r} is not allowed: NCCL would misread it")):
        nic.apply_nccl_env(ROCE_DERIVED, {name: value})


def test_apply_nccl_env_takes_the_user_values_nccl_reads():
    env = {"NCCL_NET": "AWS Libfabric", "NCCL_IB_HCA": "^=mlx5_2:1,mlx5_3", "NCCL_IB_GID_INDEX": "-1",
           "NCCL_SOCKET_IFNAME": "^docker,lo"}
    assert nic.apply_nccl_env(ROCE_DERIVED, dict(env)) == [f'{k}="{v}" (from env)' for k, v in env.items()]


def test_nccl_env_leaves_the_network_to_nccl_without_a_port_of_the_class(tmp_path):
    # HOLMES_NIC_CLASS=infiniband on a host without IB ports (an emulated cluster): NCCL_NET=IB
    # would fail every communicator ("Failed to initialize any NET plugin")
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    _rdma_port(sysfs, "mlx5_0", 1, "Ethernet", "100 Gb/sec (4X EDR)")  # RoCE only
    _net(sysfs, "eth0", 25000, "up")
    _route(proc, ("eth0", "00000000", "00000000"))
    found = nic.detect(sysfs, env={nic.ENV: "infiniband"})
    assert nic.nccl_env(found, sysfs, proc) == {"NCCL_SOCKET_IFNAME": "=eth0"}
    assert nic.nccl_env(nic.Nic("roce", None), tmp_path / "bare", proc) == {"NCCL_SOCKET_IFNAME": "=eth0"}


def test_nccl_env_without_a_default_route_skips_ipoib_and_interfaces_without_an_address(tmp_path):
    # a cluster without a default route: IPoIB is the fastest interface up, but does not reach
    # other clusters; eth1 is up but holds no IPv4 route, so NCCL would find no address on it
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    _net(sysfs, "ib0", 200000, "up")
    (sysfs / "class" / "net" / "ib0" / "type").write_text("32\n")
    _net(sysfs, "eth0", 10000, "up")
    _net(sysfs, "eth1", 25000, "up")
    for iface in ("eth0", "eth1"):
        (sysfs / "class" / "net" / iface / "type").write_text("1\n")
    _route(proc, ("ib0", "0000A8C0", "00FFFFFF"), ("eth0", "0000000A", "000000FF"))
    assert nic.nccl_env(nic.Nic("ethernet", 25.0), sysfs, proc)["NCCL_SOCKET_IFNAME"] == "=eth0"


def test_apply_nccl_env_never_overrides_nccl_config_files(tmp_path, home):
    # NCCL reads NCCL_CONF_FILE (else ~/.nccl.conf), then /etc/nccl.conf, for what the environment
    # leaves unset: a site's HCA and interface choices there must not be replaced
    conf = tmp_path / "nccl.conf"
    conf.write_text("# site settings\nNCCL_IB_HCA=^mlx5_4\n#NCCL_NET=Socket\nNCCL_SOCKET_IFNAME=bond0\r\n")
    env = {"NCCL_CONF_FILE": str(conf), "NCCL_SOCKET_IFNAME": "eth9"}  # the environment wins over the file
    lines = nic.apply_nccl_env(ROCE_DERIVED, env)
    assert env == {"NCCL_CONF_FILE": str(conf), "NCCL_SOCKET_IFNAME": "eth9", "NCCL_NET": "IB",
                   "NCCL_IB_GID_INDEX": "3"}
    assert lines == ['NCCL_NET="IB" (derived)', f'NCCL_IB_HCA="^mlx5_4" (from {conf})',
                     'NCCL_IB_GID_INDEX="3" (derived)', 'NCCL_SOCKET_IFNAME="eth9" (from env)']
    (home / ".nccl.conf").write_text("NCCL_IB_DISABLE=1\n")
    env = {}
    assert nic.apply_nccl_env(ROCE_DERIVED, env)[0] == (
        f'NCCL_NET="Socket" (derived, as NCCL_IB_DISABLE="1" from {home / ".nccl.conf"})')
    (home / ".nccl.conf").write_text("NCCL_IB_GID_INDEX=three\n")
    with pytest.raises(ConfigError, match=re.escape(f"NCCL_IB_GID_INDEX = 'three' (from {home / '.nccl.conf'}) is "
                                                    "not allowed: NCCL would misread it")):
        nic.apply_nccl_env(ROCE_DERIVED, {})


def test_nccl_conf_keeps_the_spaces_nccl_keeps(tmp_path):
    # NCCL cuts a config line at its end only: a space that opens the file is part of the first
    # name (so no NCCL variable), one that ends the file part of the last value (no such interface)
    conf = tmp_path / "nccl.conf"
    conf.write_text(" NCCL_IB_HCA=mlx5_4\nNCCL_SOCKET_IFNAME=bond0 \n")
    env = {"NCCL_CONF_FILE": str(conf)}
    assert nic.nccl_conf(env)[" NCCL_IB_HCA"] == ("mlx5_4", str(conf))
    with pytest.raises(ConfigError, match=re.escape(f"NCCL_SOCKET_IFNAME = 'bond0 ' (from {conf}) is not allowed")):
        nic.apply_nccl_env(ROCE_DERIVED, env)
    conf.write_text(" NCCL_IB_HCA=mlx5_4\r\n")
    assert nic.apply_nccl_env(ROCE_DERIVED, env)[1] == 'NCCL_IB_HCA="=mlx5_0:1" (derived)'


def test_processes_exchange_their_nic_classes_without_a_device_collective(monkeypatch):
    # It was an all-gather over every device: on GPUs a communicator of them all, which over IB
    # joins an InfiniBand HCA to a RoCE one and cannot connect. Now it goes through
    # jax.distributed's key-value store.
    from types import SimpleNamespace

    import jax
    import numpy as np
    from jax._src import distributed as jax_distributed
    from jax.experimental import multihost_utils

    from holmes_jax.mesh import devices as real
    from holmes_jax.planning.topology import Cluster, Topology

    class Store:  # this is process 0; process 1's answer is set beside its own
        values = {}

        def key_value_set(self, key, value):
            assert key not in self.values  # a key is set once
            self.values[key] = value
            self.values[key[:-1] + "1"] = '0 {"nic_class": "infiniband", "gbps": null}'  # no stop signal held

        def blocking_key_value_get(self, key, timeout_ms):
            return self.values[key]

    monkeypatch.setattr(jax_distributed.global_state, "client", Store())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda *a: pytest.fail("a device collective"))
    monkeypatch.setattr(nic, "detect", lambda: nic.Nic("roce", None))
    t = Topology((Cluster("ib", "infiniband", nodes=1, devices_per_node=2),
                  Cluster("roce", "roce", nodes=1, devices_per_node=2)))
    devices = [SimpleNamespace(process_index=p, id=2048 * p + k) for p in range(2) for k in range(2)]
    for _ in range(2):  # twice: each exchange has keys of its own
        placed = real.device_array(np.arange(4), t, devices)
        assert [d.process_index for d in placed] == [1, 1, 0, 0]


def test_nccl_conf_keeps_a_carriage_return_in_the_value_as_nccl_before_2_30_does(tmp_path):
    # NCCL cuts only the newline (setEnvFile): a file saved with CRLF line ends gives the
    # interface "bond0\r", which does not exist; it was read as "bond0" and taken as the user's
    conf = tmp_path / "nccl.conf"
    conf.write_bytes(b"NCCL_IB_GID_INDEX=3\r\nNCCL_SOCKET_IFNAME=bond0\r\n")
    env = {"NCCL_CONF_FILE": str(conf)}
    assert nic.nccl_conf(env)["NCCL_SOCKET_IFNAME"] == ("bond0\r", str(conf))
    # NCCL 2.30 and later cut it too: the error says which NCCLs misread it, and how to get past a site file
    with pytest.raises(ConfigError, match=re.escape(
            f"NCCL_SOCKET_IFNAME = 'bond0\\r' (from {conf}) is not allowed: NCCL before 2.30 keeps the carriage "
            "return of a CRLF line end in the value; allowed: the file with LF line ends, or NCCL_SOCKET_IFNAME set "
            "in the environment")):
        nic.apply_nccl_env(ROCE_DERIVED, env)
    # strtoll stops at the carriage return: "3\r" is 3 to NCCL, and stands
    conf.write_bytes(b"NCCL_IB_GID_INDEX=3\r\n")
    assert f'NCCL_IB_GID_INDEX="3\r" (from {conf})' in nic.apply_nccl_env(ROCE_DERIVED, env)


def test_nccl_conf_reads_a_file_with_bytes_that_are_not_utf8(tmp_path):
    # NCCL reads bytes: a Latin-1 comment hid the whole file, so the derived HCA list replaced the site's
    conf = tmp_path / "nccl.conf"
    conf.write_bytes("# r\u00e9seau du site\nNCCL_IB_HCA=^mlx5_4\n".encode("latin-1"))
    env = {"NCCL_CONF_FILE": str(conf)}
    assert nic.apply_nccl_env(ROCE_DERIVED, env)[1] == f'NCCL_IB_HCA="^mlx5_4" (from {conf})'
    assert "NCCL_IB_HCA" not in env


def test_nccl_conf_reads_the_home_directory_of_every_nccl_version(tmp_path, home, monkeypatch):
    # NCCL's userHomeDir() is getpwuid(getuid())->pw_dir before 2.30, $HOME from 2.30 on (what
    # the pinned jax installs today): a setting in either file is the user's, never replaced
    (home / ".nccl.conf").write_text("NCCL_IB_HCA=^mlx5_4\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".nccl.conf").write_text("NCCL_SOCKET_IFNAME=bond0\n")
    found = nic.nccl_conf({"HOME": str(elsewhere)})
    assert found["NCCL_IB_HCA"] == ("^mlx5_4", f"{home}/.nccl.conf")
    assert found["NCCL_SOCKET_IFNAME"] == ("bond0", f"{elsewhere}/.nccl.conf")

    def no_entry(uid):
        raise KeyError(uid)

    # a user id the database lacks (a container started with --user): $HOME's file still counts
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    env = {"HOME": str(elsewhere)}
    assert nic.apply_nccl_env(ROCE_DERIVED, env)[-1] == f'NCCL_SOCKET_IFNAME="bond0" (from {elsewhere}/.nccl.conf)'
    assert "NCCL_SOCKET_IFNAME" not in env and "NCCL_IB_HCA" not in nic.nccl_conf(env)


def test_over_sockets_gives_back_a_config_files_nccl_net(tmp_path, monkeypatch):
    # NCCL copies its config files into the environment once, where unset: unsetting NCCL_NET
    # after the warm-up dropped the file's choice for every later communicator
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_NET=IB\n")
    monkeypatch.setenv("NCCL_CONF_FILE", str(conf))
    monkeypatch.delenv("NCCL_NET", raising=False)
    with nic.over_sockets():
        assert os.environ["NCCL_NET"] == "Socket"
    assert os.environ.get("NCCL_NET") == "IB"
    monkeypatch.delenv("NCCL_NET")
    conf.write_text("# nothing\n")  # set nowhere: unset again
    with nic.over_sockets():
        assert os.environ["NCCL_NET"] == "Socket"
    assert "NCCL_NET" not in os.environ


def test_apply_nccl_env_leaves_the_network_to_the_users_net_plugin():
    # NCCL_NET=IB would bypass the plugin the user named (the SHARP plugin's network is IBext)
    env = {"NCCL_NET_PLUGIN": "libnccl-net-sharp.so"}
    lines = nic.apply_nccl_env(ROCE_DERIVED, env)
    assert "NCCL_NET" not in env and not any(line.startswith("NCCL_NET=") for line in lines)
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1"
    env = {"NCCL_NET_PLUGIN": "none"}  # no plugin: NCCL's own IB, as derived
    nic.apply_nccl_env(ROCE_DERIVED, env)
    assert env["NCCL_NET"] == "IB"
    # IB disabled too: NCCL takes the plugin, else sockets (NCCL_NET=Socket bypassed the plugin)
    env = {"NCCL_NET_PLUGIN": "libnccl-net-sharp.so", "NCCL_IB_DISABLE": "1"}
    nic.apply_nccl_env(ROCE_DERIVED, env)
    assert env == {"NCCL_NET_PLUGIN": "libnccl-net-sharp.so", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "=eth0"}


@pytest.mark.parametrize("disable, net", [("08", "IB"), ("0x0", "IB"), ("010", "Socket"), (" 1", "Socket")])
def test_nccl_ib_disable_is_read_as_strtoll_reads_it(disable, net):
    # strtoll(text, NULL, 0): "08" is octal 0 followed by "8", so IB stays on; "010" is 8
    env = {"NCCL_IB_DISABLE": disable}
    nic.apply_nccl_env(ROCE_DERIVED, env)
    assert env["NCCL_NET"] == net
