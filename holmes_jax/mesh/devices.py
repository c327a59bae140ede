"""The plan's device grid on real devices: which process's devices sit where, and the jax Mesh.

Device ids are not positions across processes (0, 1, ..., 2048, 2049, ...): devices are always
ordered by (process_index, id).
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import Mesh

from holmes_jax import distributed
from holmes_jax.config import ConfigError
from holmes_jax.mesh import nic
from holmes_jax.planning.placement import AXES
from holmes_jax.planning.topology import Cluster, Topology


def ordered_devices(devices=None) -> list:
    """Devices in (process_index, id) order: `devices` (a list, a 1-D array), else all of them."""
    return sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))


def _by_process(devices) -> dict[int, list]:
    groups = collections.defaultdict(list)
    for d in ordered_devices(devices):
        groups[d.process_index].append(d)
    return dict(sorted(groups.items()))


def device_array(grid, topology: Topology, devices=None, process_nics=None) -> np.ndarray:
    """The real devices at the grid's places.

    One process: its devices, in (process_index, id) order, are the topology's devices in order.
    Several: the processes reporting NIC class X, by index, run the nodes of class X in topology
    order, each node one process or several consecutive ones (one per GPU) that fill it exactly.
    `process_nics`: each process's NIC class (or `Nic`), in process order; None: exchanged between
    processes (only when the topology has several classes).
    """
    by_process = _by_process(devices)
    if len(by_process) == 1:
        placed = next(iter(by_process.values()))
        if len(placed) != topology.num_devices:
            raise ConfigError(f"topology {topology.name!r} has {topology.num_devices} devices but this process has "
                              f"{len(placed)}; allowed: a topology of exactly the devices present")
    else:
        placed = _match_processes(topology, by_process, process_nics)
    return np.array(placed, dtype=object)[np.asarray(grid)]


def _match_processes(topology: Topology, by_process: dict, process_nics) -> list:
    classes = sorted({c.nic for c in topology.clusters})
    if process_nics is None:  # with one class there is nothing to match on, so no collective
        if len(classes) == 1:
            process_nics = classes * len(by_process)
        else:
            process_nics = distributed.exchange_nics(nic.detect())
    process_nics = [getattr(x, "nic_class", x) for x in process_nics]
    if len(process_nics) != len(by_process):
        raise ConfigError(f"{len(process_nics)} NIC classes given for {len(by_process)} processes")
    placed = [None] * topology.num_devices
    for nic_class in sorted(set(process_nics) | set(classes)):
        nodes = [n for n in range(topology.num_nodes) if topology.clusters[topology.node_cluster[n]].nic == nic_class]
        procs = [p for p, c in zip(by_process, process_nics) if c == nic_class]
        have, need = sum(len(by_process[p]) for p in procs), sum(len(topology.node_devices[n]) for n in nodes)
        if have != need:
            raise ConfigError(
                f"NIC class {nic_class!r} is reported by {len(procs)} process(es) with {have} device(s) but topology "
                f"{topology.name!r} has {len(nodes)} {nic_class} node(s) with {need}; allowed: a node's devices in "
                "processes on a host of that node's NIC class")
        # A node runs one process or several (one per GPU, as srun and mpirun start them), taken in
        # process order: consecutive ranks share a host under srun's and mpirun's default layout.
        queue = iter(procs)
        for node in nodes:
            want, mine, taken = topology.node_devices[node], [], []
            while len(mine) < len(want):
                taken.append(next(queue))
                mine += by_process[taken[-1]]
            if len(mine) != len(want):
                *earlier, proc = taken  # processes before proc hold the node's first devices
                held = (f", {len(mine) - len(by_process[proc])} of them in process(es) {', '.join(map(str, earlier))}"
                        if earlier else "")
                raise ConfigError(f"process {proc} has {len(by_process[proc])} devices but node {node} of topology "
                                  f"{topology.name!r} has {len(want)}{held}; allowed: a node's devices in one process "
                                  "or several, none spread over two nodes")
            for index, device in zip(want, mine):
                placed[index] = device
    return placed


def build_mesh(plan_or_grid, topology: Topology | None = None, devices=None, process_nics=None):
    """A jax Mesh over axes (stage, data, tensor) from a Plan (or a grid and its topology)."""
    grid = getattr(plan_or_grid, "grid", plan_or_grid)
    topology = topology or plan_or_grid.topology
    return Mesh(device_array(grid, topology, devices, process_nics), AXES)


def local_topology(devices=None, nic_class: str | None = None, device_tflops: float | None = None) -> Topology:
    """An emulated topology of the devices present: one cluster "local", one node per process.

    NIC class: `nic_class`, else what process 0 detects (so every process builds the same
    topology), which is "ethernet" on hosts without RDMA ports.
    """
    by_process = _by_process(devices)
    sizes = {len(d) for d in by_process.values()}
    if len(sizes) != 1:
        raise ConfigError(f"processes have {sorted(sizes)} devices each; allowed: the same count on every process")
    found = nic.Nic(nic_class, None) if nic_class else distributed.exchange_nics(nic.detect())[0]
    extra = {} if device_tflops is None else {"device_tflops": device_tflops}
    cluster = Cluster("local", found.nic_class, nodes=len(by_process), devices_per_node=sizes.pop(),
                      nic_gbps=found.gbps, **extra)
    return Topology((cluster,), name="local")
