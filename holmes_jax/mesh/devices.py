"""The plan's device grid on real devices: which process's devices sit where, and the jax Mesh.

Device ids are not positions across processes (0, 1, ..., 2048, 2049, ...): devices are always
ordered by (process_index, id).
"""

from __future__ import annotations

import collections
import itertools
import socket
import sys

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


def device_array(grid, topology: Topology, devices=None, process_nics=None, process_hosts=None) -> np.ndarray:
    """The real devices at the grid's places.

    One process: its devices, in (process_index, id) order, are the topology's devices in order.
    Several: the processes reporting NIC class X, by index, run the nodes of class X in topology
    order, each node one process or several consecutive ones (one per GPU) that fill it exactly.
    `process_nics`: each process's NIC class (or `Nic`), in process order; None: exchanged between
    processes (only when the topology has several classes).
    `process_hosts`: each process's host name, in process order, to warn where a node's processes
    are on different hosts; None: exchanged between processes (only when some node runs several
    processes, and only under jax.distributed).
    """
    by_process = _by_process(devices)
    if len(by_process) == 1:
        placed = next(iter(by_process.values()))
        if len(placed) != topology.num_devices:
            raise ConfigError(f"topology {topology.name!r} has {topology.num_devices} devices but this process has "
                              f"{len(placed)}; allowed: a topology of exactly the devices present")
    else:
        placed = _match_processes(topology, by_process, process_nics, process_hosts)
    return np.array(placed, dtype=object)[np.asarray(grid)]


def _match_processes(topology: Topology, by_process: dict, process_nics, process_hosts=None) -> list:
    classes = sorted({c.nic for c in topology.clusters})
    if process_nics is None:  # with one class there is nothing to match on, so no collective
        if len(classes) == 1:
            process_nics = classes * len(by_process)
        else:
            process_nics = distributed.exchange_nics(nic.detect())
    process_nics = [getattr(x, "nic_class", x) for x in process_nics]
    if len(process_nics) != len(by_process):
        raise ConfigError(f"{len(process_nics)} NIC classes given for {len(by_process)} processes")
    if process_hosts is not None and len(process_hosts) != len(by_process):
        raise ConfigError(f"{len(process_hosts)} host names given for {len(by_process)} processes")
    placed = [None] * topology.num_devices
    shared = {}  # node: its processes, for the nodes that several processes run
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
        # process order: consecutive ranks share a host under srun's and mpirun's default layout
        # (a warning below where they do not).
        queue = iter(procs)
        for node in nodes:
            want, mine, taken = topology.node_devices[node], [], []
            while len(mine) < len(want):
                taken.append(next(queue))
                mine += by_process[taken[-1]]
            if len(mine) != len(want):
                held = ", ".join(f"process {p} with {len(by_process[p])}" for p in taken)
                raise ConfigError(f"node {node} of topology {topology.name!r} has {len(want)} devices but the "
                                  f"{nic_class} processes that reach it in rank order hold {len(mine)}: {held}; "
                                  "allowed: a node's devices in one process or several consecutive ranks, none "
                                  "spread over two nodes (a NIC class's ranks in the topology's node order)")
            for index, device in zip(want, mine):
                placed[index] = device
            if len(taken) > 1:
                shared[node] = taken
    if shared:
        _warn_nodes_across_hosts(topology, shared, list(by_process), process_hosts)
    return placed


def _warn_nodes_across_hosts(topology: Topology, shared: dict, processes: list, process_hosts) -> None:
    """One warning line (from process 0) when the processes of one node are on different hosts:
    srun --distribution=cyclic or mpirun --map-by node put consecutive ranks on different hosts,
    and the plan's intra-node links (tensor and data groups inside a node) are then network hops.
    Not an error: some container setups give each GPU's process a host name of its own on one machine."""
    if process_hosts is None:
        # Every process gets here with the same topology and devices, so all of them exchange.
        process_hosts = host_names()
        if process_hosts is None:  # processes made up in one (tests): no hosts to compare
            return
    host_of = dict(zip(processes, process_hosts))
    spread = {node: procs for node, procs in shared.items() if len({host_of[p] for p in procs}) > 1}
    if not spread or jax.process_index() != 0:
        return
    node = min(spread)
    on_host = collections.defaultdict(list)
    for p in spread[node]:
        on_host[host_of[p]].append(str(p))
    where = "; ".join(f"{', '.join(ps)} on {host}" for host, ps in on_host.items())
    others = f" (and {len(spread) - 1} other node(s) likewise)" if len(spread) > 1 else ""
    print(f"warning: the processes of node {node} of topology {topology.name!r} are on different hosts ({where})"
          f"{others}, but the plan counts on intra-node links between them; start consecutive ranks on one host "
          "(srun's default --distribution=block, mpirun --map-by slot)", file=sys.stderr, flush=True)


def host_names() -> list[str] | None:
    """Each process's host name, in process order, exchanged between the processes (every process
    calls it); None with one process."""
    if jax.process_count() == 1:
        return None
    return distributed.every_process("hostname", socket.gethostname())


def build_mesh(plan_or_grid, topology: Topology | None = None, devices=None, process_nics=None, process_hosts=None):
    """A jax Mesh over axes (stage, data, tensor) from a Plan (or a grid and its topology)."""
    grid = getattr(plan_or_grid, "grid", plan_or_grid)
    topology = topology or plan_or_grid.topology
    return Mesh(device_array(grid, topology, devices, process_nics, process_hosts), AXES)


def local_topology(devices=None, nic_class: str | None = None, device_tflops: float | None = None,
                   process_hosts=None) -> Topology:
    """An emulated topology of the devices present: one cluster "local" whose nodes are the hosts.

    On GPUs a node is a host, whichever of its processes drives which GPU (srun --ntasks-per-node=8
    and mpirun -npernode 8 start one process per GPU), so tensor groups may span them and the links
    between them are the host's own. That needs the processes of a host to be consecutive ranks, as
    many on each host; where they are not (srun --distribution=cyclic), one node per process. On CPU
    a node is a process: each process of our launcher stands in for a host of the emulated cluster.
    `process_hosts`: each process's host name, in process order; None: exchanged between processes
    (on GPUs, with several processes).
    NIC class: `nic_class`, else what process 0 detects (so every process builds the same
    topology), which is "ethernet" on hosts without RDMA ports.
    """
    by_process = _by_process(devices)
    sizes = {len(d) for d in by_process.values()}
    if len(sizes) != 1:
        raise ConfigError(f"processes have {sorted(sizes)} devices each; allowed: the same count on every process")
    per_node = _processes_per_host(by_process, process_hosts)
    found = nic.Nic(nic_class, None) if nic_class else distributed.exchange_nics(nic.detect())[0]
    extra = {} if device_tflops is None else {"device_tflops": device_tflops}
    cluster = Cluster("local", found.nic_class, nodes=len(by_process) // per_node,
                      devices_per_node=sizes.pop() * per_node, nic_gbps=found.gbps, **extra)
    return Topology((cluster,), name="local")


def _processes_per_host(by_process: dict, process_hosts) -> int:
    """How many consecutive processes make one node of the local topology (see local_topology)."""
    first = next(iter(by_process.values()))[0]
    if len(by_process) == 1 or getattr(first, "platform", "cpu") == "cpu":
        return 1
    if process_hosts is None:
        process_hosts = host_names()
        if process_hosts is None:  # processes made up in one (tests): a node each
            return 1
    runs = [len(list(group)) for _, group in itertools.groupby(process_hosts)]
    if len(runs) != len(set(process_hosts)) or len(set(runs)) != 1:  # a host's ranks apart, or unequal counts
        return 1
    return runs[0]
