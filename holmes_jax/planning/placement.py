"""The device grid of a mesh (stage, data, tensor) over a topology, as topology device numbers.

`place` returns a (pp, dp, tp) array of topology device numbers. Two placements:

- `holmes`: topology order (cluster by cluster, node by node) cut into pp consecutive stages, each
  cut into dp replicas of tp consecutive devices. So tensor groups sit inside one node; every
  stage sits inside one cluster when each cluster holds whole stages, which gives each data group
  (the replicas of one stage) one NIC class, Holmes' automatic NIC selection; clusters get stages
  in proportion to their devices (3 IB + 5 RoCE nodes, pp 8 -> 3 IB stages, 5 RoCE); and the
  stages of a cluster are consecutive, so only the clusters - 1 boundaries between clusters, the
  fewest possible, cross the inter-cluster link. A stage that would span clusters is refused
  unless `allow_mixed`, and then reported.
- `naive`: what a NIC-blind framework does. Megatron numbers ranks tensor fastest, then data, then
  stage, over hosts in the order the job scheduler lists them; here that order interleaves the
  clusters (node 0 of each cluster, then node 1, ...), as sorting host names does when IB and
  RoCE hosts are numbered alternately. Data groups then mix NIC classes and cross the slow link.

Routes (`Link`s with `via` and `shared_by`) say what the concurrent transfers of a collective go
over: a ring's hops leaving one node on one fabric share that node's NIC, with the other stages'
data rings where a node holds devices of several stages (they all sync at once).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from holmes_jax.config import ConfigError, check_positive
from holmes_jax.planning.topology import CLUSTER, INTRA_NODE, Link, Topology

AXES = ("stage", "data", "tensor")
PLACEMENTS = ("holmes", "naive")


@dataclasses.dataclass(frozen=True)
class Placement:
    method: str
    grid: np.ndarray  # (pp, dp, tp) topology device numbers
    stage_clusters: tuple[str, ...]  # "ib", or "ib+roce" for a stage spanning clusters
    stage_nic: tuple[str, ...]  # likewise
    data_groups_nic: tuple[tuple[str, ...], ...]  # per stage: NIC classes inside its data groups, sorted
    mixed_stages: tuple[int, ...]  # stages spanning more than one cluster
    device_flops: tuple[float, ...]  # per stage: achievable FLOP/s of its slowest device
    device_memory: tuple[float, ...]  # per stage: bytes of its smallest device
    tensor_routes: tuple[Link, ...]  # per stage: its tensor groups' all-reduce ring
    data_routes: tuple[Link, ...]  # per stage: its data groups' gradient ring
    boundary_routes: tuple[Link, ...]  # stage s -> s + 1: activations (gradients come back the same way)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dividing_pp(topology: Topology, tp: int, max_pp: int | None = None) -> list[int]:
    """pp values with pp * tp dividing the devices, up to `max_pp` (None: no limit)."""
    return [pp for pp in divisors(topology.num_devices // tp) if max_pp is None or pp <= max_pp]


def fitting_pp(topology: Topology, tp: int, max_pp: int | None = None) -> list[int]:
    """pp values for which every cluster holds whole stages of tp-wide tensor groups, up to `max_pp`."""
    n = topology.num_devices
    return [pp for pp in dividing_pp(topology, tp, max_pp)
            if all(c.num_devices % (n // pp) == 0 for c in topology.clusters)]


def scheduler_order(topology: Topology) -> np.ndarray:
    """Device numbers in the rank order of a NIC-blind launch (see the module doc)."""
    first = np.cumsum([0] + [c.nodes for c in topology.clusters])
    nodes = [first[c] + i for i in range(max(c.nodes for c in topology.clusters))
             for c in range(len(topology.clusters)) if i < topology.clusters[c].nodes]
    return np.concatenate([topology.node_devices[n] for n in nodes])


def route(topology: Topology, src, dst) -> Link:
    """The bottleneck of transfers src[i] -> dst[i] all running at once."""
    return _bottleneck(topology, _hops(topology, np.ravel(src), np.ravel(dst)))


def _hops(topology: Topology, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(kind, sender cluster, NICs' share) of each transfer src[i] -> dst[i], all running at once,
    as the rows of an array."""
    kind = topology.link_kind(src, dst)
    share = np.ones(len(src), dtype=int)
    net = kind != INTRA_NODE
    for end in (src[net], dst[net]):  # a node's NIC is shared by what leaves it and what enters it
        key = topology.device_node[end] * 3 + kind[net]  # (node, fabric)
        _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        share[net] = np.maximum(share[net], counts[inverse])
    return np.stack([kind, topology.device_cluster[src], share])


def _bottleneck(topology: Topology, hops: np.ndarray) -> Link:
    """The slowest of `hops` (see `_hops`), with the longest latency among them."""
    kind, sender, share = hops
    table = topology.link_table
    rate = np.array([[link.bytes_per_s for link in row] for row in table])[kind, sender]
    latency = np.array([[link.latency_s for link in row] for row in table])[kind, sender]
    worst = int(np.argmin(rate / share))
    k, link = int(kind[worst]), table[kind[worst]][sender[worst]]
    via = "intra-node" if k == INTRA_NODE else link.name if k == CLUSTER else f"inter-cluster {link.name}"
    return Link(float(rate[worst] / share[worst]), float(latency.max()), via, int(share[worst]))


def _layers_limit(topology: Topology, tp: int, max_pp: int | None, joiner: str = " ") -> str:
    """Words saying that the pp offered stop at the model's layers, where that leaves some out."""
    cut = max_pp is not None and max_pp < topology.num_devices // tp
    return f"{joiner}up to the model's {max_pp} layers" if cut else ""


def _names(clusters: list, shown: int = 4) -> str:
    """The clusters' names for an error line: the first few of many, and how many in all."""
    names = ", ".join(repr(c.name) for c in clusters[:shown])
    return names if len(clusters) <= shown else f"{names}, ... ({len(clusters)} in all)"


def check_dp(devices: int, tp: int, dp: int) -> None:
    """A ConfigError naming dp where dp * tp does not divide the devices (no pp then fills them)."""
    if devices % (dp * tp):
        allowed = [d for d in divisors(devices) if devices % (d * tp) == 0]  # none where tp does not divide them
        raise ConfigError(f"dp = {dp} is not allowed with tp = {tp}: dp * tp must divide the {devices} devices; "
                          f"allowed dp: {', '.join(map(str, allowed)) or f'none (tp = {tp} does not divide them)'}")


def place(topology: Topology, tp: int, pp: int, dp: int | None = None, method: str = "holmes",
          allow_mixed: bool = False, max_pp: int | None = None, pp_given: bool = False) -> Placement:
    """The (pp, dp, tp) device grid; ConfigError when the sizes do not fit the topology.
    `max_pp` (the model's layers): the largest pp an error may offer (None: no limit). `pp_given`:
    pp was the user's, not derived from dp; an error then names pp, not dp."""
    if method not in PLACEMENTS:
        raise ConfigError(f"placement = {method!r} is not allowed; choose one of {', '.join(map(repr, PLACEMENTS))}")
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        check_positive(name, value, allow_none=True)
    for c in topology.clusters:
        if c.devices_per_node % tp:
            # every cluster's node size, not just this one's: a tp that fits here may not fit another
            node = math.gcd(*(d.devices_per_node for d in topology.clusters))
            raise ConfigError(
                f"tp = {tp} is not allowed: tensor groups stay inside one node and cluster {c.name!r} has "
                f"{c.devices_per_node} devices per node; allowed: tp dividing {node}")
    n = topology.num_devices
    if n % (pp * tp):
        if dp is not None:  # the search derives pp from a given dp: name the dp
            check_dp(n, tp, dp)
        allowed = dividing_pp(topology, tp, max_pp)
        # say which of them fit the clusters: the others are refused next as mixed stages
        fitting = fitting_pp(topology, tp, max_pp) if method == "holmes" and not allow_mixed else allowed
        raise ConfigError(f"pp = {pp} is not allowed with tp = {tp}: pp * tp must divide the {n} devices; "
                          f"allowed pp{_layers_limit(topology, tp, max_pp)}: {', '.join(map(str, allowed)) or 'none'}"
                          + ("" if fitting == allowed else
                             f"; every cluster holds whole stages only with pp {', '.join(map(str, fitting))} "
                             f"(the others need the planner's allow_mixed=True, --allow-mixed)" if fitting else
                             "; with none of them does every cluster hold whole stages (they need the planner's "
                             "allow_mixed=True, --allow-mixed)"))
    if dp is not None and pp * dp * tp != n:
        raise ConfigError(f"dp = {dp} is not allowed: pp * dp * tp = {pp} * {dp} * {tp} must equal the {n} devices; "
                          f"allowed with pp = {pp}, tp = {tp}: dp = {n // (pp * tp)}")
    order = np.arange(n) if method == "holmes" else scheduler_order(topology)
    grid = order.reshape(pp, n // (pp * tp), tp)

    clusters = [[topology.clusters[c] for c in np.unique(topology.device_cluster[grid[s]])] for s in range(pp)]
    mixed = tuple(s for s in range(pp) if len(clusters[s]) > 1)
    if method == "holmes" and mixed and not allow_mixed:
        s, fitting = mixed[0], fitting_pp(topology, tp, max_pp)
        spans = f"stage {s} would span clusters {_names(clusters[s])}, so its data groups would sync across clusters"
        if dp is None or pp_given:
            allowed = (f"pp = {pp} is not allowed with tp = {tp}: {spans}; allowed pp (every cluster holding whole "
                       f"stages{_layers_limit(topology, tp, max_pp, ', ')}): {', '.join(map(str, fitting)) or 'none'}")
        else:  # a dp given: the search derived the pp from it, so the dp is what to change
            dps = ", ".join(str(n // (p * tp)) for p in fitting[::-1]) or "none"
            allowed = (f"dp = {dp} is not allowed with tp = {tp}: with pp = {pp}, {spans}; allowed dp (every "
                       f"cluster holding whole stages): {dps}")
        raise ConfigError(f"{allowed}; or allow mixed stages (the planner's allow_mixed=True, --allow-mixed)")

    # Every stage syncs at once (after its last tick), so a node holding two stages' devices (a
    # stage not a whole number of nodes) carries both stages' data rings: their NIC shares are
    # counted together. (pp, 3, dp * tp): each stage's hops to the next device of its data group.
    data_hops = _hops(topology, grid.ravel(), np.roll(grid, -1, axis=1).ravel()).reshape(3, pp, -1).swapaxes(0, 1)

    def joined(values) -> str:
        return "+".join(dict.fromkeys(values))  # file order, no repeats

    return Placement(
        method=method, grid=grid,
        stage_clusters=tuple(joined(c.name for c in cs) for cs in clusters),
        stage_nic=tuple(joined(c.nic for c in cs) for cs in clusters),
        data_groups_nic=tuple(tuple(sorted({c.nic for c in cs})) for cs in clusters),
        mixed_stages=mixed,
        device_flops=tuple(min(c.device_flops for c in cs) for cs in clusters),
        device_memory=tuple(min(c.device_memory_gb for c in cs) * 1e9 for cs in clusters),
        tensor_routes=tuple(route(topology, grid[s], np.roll(grid[s], -1, axis=1)) for s in range(pp)),
        data_routes=tuple(_bottleneck(topology, h) for h in data_hops),
        boundary_routes=tuple(route(topology, grid[s], grid[s + 1]) for s in range(pp - 1)),
    )
