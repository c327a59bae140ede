import pytest

from holmes_jax.config import ConfigError
from holmes_jax.mesh import nic


def _rdma_port(root, device, port, link_layer, rate, state="4: ACTIVE"):
    d = root / "class" / "infiniband" / device / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "link_layer").write_text(link_layer + "\n")
    (d / "rate").write_text(rate + "\n")
    (d / "state").write_text(state + "\n")


def _net(root, iface, speed=None):
    d = root / "class" / "net" / iface
    d.mkdir(parents=True)
    if speed is not None:
        (d / "speed").write_text(f"{speed}\n")


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


def test_exchange_in_one_process_is_the_local_answer():
    local = nic.Nic("roce", 100.0)
    assert nic.exchange(local) == [local]
