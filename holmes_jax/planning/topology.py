"""Clusters, nodes, NIC classes and links; TOML topology files (schema: README, "Topology files").

Devices are numbered cluster by cluster in file order, node by node, device by device. The
planner's device grid holds these numbers, and `Topology.link_kind(a, b)` says what joins two of
them (the node's NVLink-class link, the cluster's NIC, or the inter-cluster link); `link_table`
holds each kind's `Fabric` per sending cluster.

Default link figures (per node for NICs; override per cluster). `efficiency` is the fraction of
line rate that NCCL-style collectives reach on the link:

| class      | Gb/s | latency | efficiency | why                                                       |
|------------|------|---------|------------|-----------------------------------------------------------|
| infiniband | 200  | 3 us    | 0.90       | HDR 4x; RDMA with credit flow control runs near line rate |
| roce       | 100  | 8 us    | 0.60       | RDMA over Ethernet: PFC pauses, congestion control        |
| ethernet   | 25   | 50 us   | 0.80       | TCP sockets: kernel copies, the socket transport's latency |
| intra-node | 2400 | 2 us    | 0.80       | NVLink 3 on A100: 300 GB/s per device and direction       |

A device defaults to an A100 80GB (312 TFLOP/s dense bf16) reaching 75% of peak on transformer layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from pathlib import Path

import numpy as np

from holmes_jax.config import ConfigError, check_positive

NIC_CLASSES = ("infiniband", "roce", "ethernet")

# What joins two devices; indexes the rows of `Topology.link_table`.
INTRA_NODE, CLUSTER, INTER_CLUSTER = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Fabric:
    """A kind of link as a topology describes it: a NIC class, the inter-cluster link, or intra-node."""

    name: str  # a NIC class or "intra-node"
    gbps: float  # line rate
    latency_us: float  # per message, i.e. per step of a ring collective
    efficiency: float  # fraction of line rate collectives reach

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8 * self.efficiency

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclasses.dataclass(frozen=True)
class Link:
    """What a transfer gets: the one link the cost model, the placement's routes and a measured
    profile share. Figures may be arrays (the cost model prices all stages at once)."""

    bytes_per_s: float  # effective, after efficiency and NIC sharing
    latency_s: float  # per message
    via: str = "measured"  # "intra-node", a NIC class, "inter-cluster <class>", or "measured"
    shared_by: int = 1  # concurrent transfers sharing the NIC (already divided into bytes_per_s)

    @property
    def gbps(self) -> float:
        return self.bytes_per_s * 8 / 1e9

    def time(self, nbytes):
        return self.latency_s + nbytes / self.bytes_per_s


NIC_DEFAULTS = {
    "infiniband": Fabric("infiniband", 200.0, 3.0, 0.90),
    "roce": Fabric("roce", 100.0, 8.0, 0.60),
    "ethernet": Fabric("ethernet", 25.0, 50.0, 0.80),
}
INTRA_NODE_DEFAULT = Fabric("intra-node", 2400.0, 2.0, 0.80)
DEVICE_TFLOPS_DEFAULT = 312.0
DEVICE_EFFICIENCY_DEFAULT = 0.75
DEVICE_MEMORY_GB_DEFAULT = 80.0
# The planner holds arrays over the devices and tries every divisor of their count: past this it
# would take minutes or all memory. Far above the largest clusters built (about 100k GPUs).
MAX_DEVICES = 2**20


def _number(where: str, value, low: float, high: float | None = None, low_open: bool = True) -> None:
    # inf is refused too: TOML spells it `inf`, and an infinite rate or latency breaks the cost model
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        span = f"{'>' if low_open else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")
        raise ConfigError(f"{where} = {value!r} is not allowed; allowed: a finite number {span}")


_LINK_FIELDS = ("nic", "gbps", "latency_us", "efficiency")  # as [inter_cluster] spells them
_NIC_FIELDS = ("nic", "nic_gbps", "nic_latency_us", "nic_efficiency")  # as [[cluster]] spells them


def nic_link(nic: str, gbps: float | None = None, latency_us: float | None = None,
             efficiency: float | None = None, where: str = "", fields: tuple = _LINK_FIELDS) -> Fabric:
    """The link of NIC class `nic`, class defaults for the figures left out. Error messages name
    the field as `where` + its entry in `fields` (nic, gbps, latency_us, efficiency)."""
    if nic not in NIC_CLASSES:
        raise ConfigError(f"{where}{fields[0]} = {nic!r} is not allowed; "
                          f"choose one of {', '.join(map(repr, NIC_CLASSES))}")
    default = NIC_DEFAULTS[nic]
    link = Fabric(nic, default.gbps if gbps is None else gbps,
                default.latency_us if latency_us is None else latency_us,
                default.efficiency if efficiency is None else efficiency)
    _check_link(link, where, fields)
    return link


def _check_link(link: Fabric, where: str, fields: tuple = _LINK_FIELDS) -> None:
    _number(f"{where}{fields[1]}", link.gbps, 0)
    _number(f"{where}{fields[2]}", link.latency_us, 0, low_open=False)
    _number(f"{where}{fields[3]}", link.efficiency, 0, 1)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes that share one NIC class and fabric."""

    name: str
    nic: str
    nodes: int
    devices_per_node: int
    nic_gbps: float | None = None  # per node; None: the class default
    nic_latency_us: float | None = None
    nic_efficiency: float | None = None
    device_tflops: float = DEVICE_TFLOPS_DEFAULT  # dense peak of one device
    device_efficiency: float = DEVICE_EFFICIENCY_DEFAULT  # fraction of peak a transformer layer reaches
    intra_node_gbps: float = INTRA_NODE_DEFAULT.gbps  # per device
    device_memory_gb: float = DEVICE_MEMORY_GB_DEFAULT

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"cluster name = {self.name!r} is not allowed; allowed: a non-empty string")
        where = f"cluster {self.name!r}: "
        _ = self.nic_link  # builds the NIC's link, which checks its fields
        check_positive(f"{where}nodes", self.nodes)
        check_positive(f"{where}devices_per_node", self.devices_per_node)
        _number(f"{where}device_tflops", self.device_tflops, 0)
        _number(f"{where}device_efficiency", self.device_efficiency, 0, 1)
        _number(f"{where}intra_node_gbps", self.intra_node_gbps, 0)
        _number(f"{where}device_memory_gb", self.device_memory_gb, 0)

    @property
    def nic_link(self) -> Fabric:
        return nic_link(self.nic, self.nic_gbps, self.nic_latency_us, self.nic_efficiency,
                        where=f"cluster {self.name!r}: ", fields=_NIC_FIELDS)

    @property
    def intra_link(self) -> Fabric:
        return dataclasses.replace(INTRA_NODE_DEFAULT, gbps=self.intra_node_gbps)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_flops(self) -> float:
        """FLOP/s one device achieves on transformer layers."""
        return self.device_tflops * 1e12 * self.device_efficiency


@dataclasses.dataclass(frozen=True)
class Topology:
    clusters: tuple[Cluster, ...]
    inter_cluster: Fabric = NIC_DEFAULTS["ethernet"]  # per node, between nodes of different clusters
    name: str = "topology"

    def __post_init__(self):
        if isinstance(self.clusters, Cluster):  # Topology(Cluster(...)): one cluster, not a tuple of them
            object.__setattr__(self, "clusters", (self.clusters,))
        if not isinstance(self.clusters, (tuple, list)) or not all(isinstance(c, Cluster) for c in self.clusters):
            raise ConfigError(f"topology clusters = {self.clusters!r} is not allowed; allowed: a tuple of Clusters")
        object.__setattr__(self, "clusters", tuple(self.clusters))
        if not self.clusters:
            raise ConfigError("topology cluster = [] is not allowed; allowed: one or more [[cluster]] tables")
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            raise ConfigError(f"topology cluster names {names} are not allowed; allowed: unique names")
        if not isinstance(self.name, str):
            raise ConfigError(f"topology name = {self.name!r} is not allowed; allowed: a string")
        if not isinstance(self.inter_cluster, Fabric):
            raise ConfigError(f"topology inter_cluster = {self.inter_cluster!r} is not allowed; allowed: a Fabric "
                              f"(topology.nic_link('ethernet', gbps=...))")
        _check_link(self.inter_cluster, "inter_cluster.")
        if self.num_devices > MAX_DEVICES:
            raise ConfigError(f"topology devices = {self.num_devices} (nodes * devices_per_node over its clusters) is "
                              f"not allowed; allowed: at most {MAX_DEVICES}")

    @property
    def num_devices(self) -> int:
        return sum(c.num_devices for c in self.clusters)

    @property
    def num_nodes(self) -> int:
        return sum(c.nodes for c in self.clusters)

    @functools.cached_property
    def node_cluster(self) -> np.ndarray:
        """Cluster index of each node (nodes numbered across clusters in file order)."""
        return np.repeat(np.arange(len(self.clusters)), [c.nodes for c in self.clusters])

    @functools.cached_property
    def device_node(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_nodes), [self.clusters[c].devices_per_node for c in self.node_cluster])

    @functools.cached_property
    def device_cluster(self) -> np.ndarray:
        return self.node_cluster[self.device_node]

    @functools.cached_property
    def node_devices(self) -> tuple[np.ndarray, ...]:
        """The device numbers of each node."""
        return tuple(np.split(np.arange(self.num_devices), np.cumsum(np.bincount(self.device_node))[:-1]))

    def link_kind(self, a, b) -> np.ndarray:
        """INTRA_NODE, CLUSTER or INTER_CLUSTER for each pair of device numbers (arrays broadcast)."""
        node, cluster = self.device_node, self.device_cluster
        a, b = np.asarray(a), np.asarray(b)
        return np.where(node[a] == node[b], INTRA_NODE, np.where(cluster[a] == cluster[b], CLUSTER, INTER_CLUSTER))

    @functools.cached_property
    def link_table(self) -> tuple[tuple[Fabric, ...], ...]:
        """[kind][cluster index of the sending device] -> Fabric."""
        inter = (self.inter_cluster,) * len(self.clusters)
        return tuple(c.intra_link for c in self.clusters), tuple(c.nic_link for c in self.clusters), inter

    def to_dict(self) -> dict:
        """The TOML schema's form; `from_dict(t.to_dict())` gives `t` back."""
        clusters = [{k: v for k, v in dataclasses.asdict(c).items() if v is not None} for c in self.clusters]
        inter = self.inter_cluster
        return {"name": self.name, "cluster": clusters, "inter_cluster": {
            "nic": inter.name, "gbps": inter.gbps, "latency_us": inter.latency_us, "efficiency": inter.efficiency}}


_TOP_KEYS = ("name", "cluster", "inter_cluster")
_CLUSTER_KEYS = tuple(f.name for f in dataclasses.fields(Cluster))


def _known_keys(where: str, table, allowed: tuple, required: tuple = ()) -> None:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} = {table!r} is not allowed; allowed: a table")
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(allowed)}")
    for key in required:
        if key not in table:
            raise ConfigError(f"{where}: missing key {key!r}; required: {', '.join(required)}")


def from_dict(data: dict, name: str = "topology") -> Topology:
    """A Topology from the TOML schema (README, "Topology files"), every field checked."""
    _known_keys("topology", data, _TOP_KEYS, required=("cluster",))
    if not isinstance(data["cluster"], list):
        raise ConfigError("topology cluster is not allowed as a single table; allowed: [[cluster]] tables")
    for i, table in enumerate(data["cluster"]):
        _known_keys(f"cluster[{i}]", table, _CLUSTER_KEYS, required=("name", "nic", "nodes", "devices_per_node"))
    clusters = tuple(Cluster(**table) for table in data["cluster"])
    inter = data.get("inter_cluster", {})
    _known_keys("inter_cluster", inter, _LINK_FIELDS)
    link = nic_link(inter.get("nic", "ethernet"), inter.get("gbps"), inter.get("latency_us"), inter.get("efficiency"),
                    where="inter_cluster.")
    return Topology(clusters, link, data.get("name", name))


def load(path) -> Topology:
    """Reads a topology TOML file; any problem is a ConfigError naming the file and the field."""
    path = Path(path).expanduser()  # from a gin file, which no shell expands
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8 whatever the locale says
    except OSError as e:
        raise ConfigError(f"topology {str(path)!r}: cannot read ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"topology {str(path)!r}: not valid TOML ({e})") from None
    try:
        return from_dict(data, name=path.stem)
    except ConfigError as e:
        raise ConfigError(f"topology {str(path)!r}: {e}") from None
