"""Which fabric each communicator of a layout runs over.

One entry per stage for its data groups and one for its tensor groups (each only when its axis
has more than one device), and one per stage boundary (the pipeline hop s -> s + 1). `transport` is what NCCL
uses for it: `nvlink` when every group stays inside a node, `ib` (NCCL's IB transport, InfiniBand
and RoCE verbs alike) when the groups leave nodes but stay inside one RDMA cluster, `socket` (TCP)
when a group spans clusters, whose fabrics do not reach each other, or its cluster is Ethernet
(there NCCL takes a network plugin instead where one is installed: AWS EFA's, GCP's TCPX).
A boundary whose pairs span clusters is one the runtime gives communicators of their own, created
under NCCL_NET=Socket (docs/nccl.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from holmes_jax.planning.topology import Topology


@dataclasses.dataclass(frozen=True)
class Communicator:
    kind: str  # data | tensor | stage_boundary
    stages: tuple[int, ...]  # (s,) for a stage's groups; (s, s + 1) for a boundary
    clusters: tuple[str, ...]  # the clusters its groups touch, in topology order
    nic_classes: tuple[str, ...]  # sorted
    transport: str  # nvlink | ib | socket
    groups: int  # how many communicators of this kind the stage (or boundary) has
    size: int  # devices in each
    # some group joins devices of different clusters; `clusters` alone cannot say (naive placement:
    # a boundary's pairs may each stay inside one cluster while they touch two in all)
    spans_clusters: bool = False

    def to_dict(self) -> dict:
        where = {"stages": list(self.stages)} if self.kind == "stage_boundary" else {"stage": self.stages[0]}
        return {"kind": self.kind, **where, "clusters": list(self.clusters), "nic_classes": list(self.nic_classes),
                "transport": self.transport, "groups": self.groups, "size": self.size}


def _transport(topology: Topology, groups: list[np.ndarray]) -> tuple[str, tuple[int, ...], bool]:
    """(transport, cluster indices, whether some group spans clusters) of communicators over
    `groups` of device numbers."""
    clusters = sorted({int(c) for g in groups for c in topology.device_cluster[g]})
    if any(len(set(topology.device_cluster[g])) > 1 for g in groups):
        return "socket", tuple(clusters), True
    if all(len(set(topology.device_node[g])) == 1 for g in groups):
        return "nvlink", tuple(clusters), False
    rdma = all(topology.clusters[c].nic in ("infiniband", "roce") for c in clusters)
    return ("ib" if rdma else "socket"), tuple(clusters), False


def communicators(topology: Topology, grid: np.ndarray) -> tuple[Communicator, ...]:
    """Every stage's data and tensor communicators, then every stage boundary's, for a
    (pp, dp, tp) grid of topology device numbers."""
    grid = np.asarray(grid)
    pp, dp, tp = grid.shape
    found = []

    def add(kind, stages, groups):
        transport, clusters, spans = _transport(topology, groups)
        found.append(Communicator(kind, stages, tuple(topology.clusters[c].name for c in clusters),
                                  tuple(sorted({topology.clusters[c].nic for c in clusters})), transport,
                                  len(groups), len(groups[0]), spans))

    for s in range(pp):
        if dp > 1:
            add("data", (s,), [grid[s, :, t] for t in range(tp)])
        if tp > 1:
            add("tensor", (s,), [grid[s, d, :] for d in range(dp)])
    for s in range(pp - 1):
        add("stage_boundary", (s, s + 1), [np.array([a, b]) for a, b in zip(grid[s].ravel(), grid[s + 1].ravel())])
    return tuple(found)


def cross_cluster_hops(topology: Topology, grid: np.ndarray) -> tuple[int, ...]:
    """The stages s whose hop s -> s + 1 spans clusters."""
    return tuple(c.stages[0] for c in communicators(topology, grid) if c.kind == "stage_boundary" and c.spans_clusters)
