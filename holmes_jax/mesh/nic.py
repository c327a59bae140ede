"""Which NIC class a host has, and every process's answer.

`detect()` looks, in order, at: the HOLMES_NIC_CLASS environment variable (an override for hosts
whose sysfs misleads, and for emulated clusters); RDMA ports under
`/sys/class/infiniband/*/ports/*/` (link_layer InfiniBand -> infiniband, Ethernet -> roce; speed
from `rate`, e.g. "200 Gb/sec (4X HDR)"); else plain Ethernet, its speed from
`/sys/class/net/*/speed` (Mb/s). The sysfs root is a parameter so tests can pass a fake tree.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from holmes_jax.config import ConfigError
from holmes_jax.planning.topology import NIC_CLASSES

ENV = "HOLMES_NIC_CLASS"


@dataclasses.dataclass(frozen=True)
class Nic:
    nic_class: str  # infiniband | roce | ethernet
    gbps: float | None  # the host's total over its active ports of that class; None: unknown


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _rdma_ports(sysfs: Path) -> list[tuple[str, float]]:
    """(class, Gb/s) of each active RDMA port."""
    ports = []
    for port in sorted((sysfs / "class" / "infiniband").glob("*/ports/*")):
        layer, rate, state = (_read(port / name) for name in ("link_layer", "rate", "state"))
        if state is not None and "ACTIVE" not in state:  # e.g. "1: DOWN": a cable not plugged in
            continue
        nic_class = {"infiniband": "infiniband", "ethernet": "roce"}.get((layer or "").lower())
        if nic_class is None:
            continue
        try:
            gbps = float(rate.split()[0]) if rate else 0.0
        except ValueError:
            gbps = 0.0
        ports.append((nic_class, gbps))
    return ports


def _ethernet_gbps(sysfs: Path) -> float | None:
    """The fastest interface's speed; loopback, unreadable and unknown (-1) speeds skipped."""
    speeds = []
    for iface in sorted((sysfs / "class" / "net").glob("*")):
        text = _read(iface / "speed") if iface.name != "lo" else None
        if text is not None and text.lstrip("-").isdigit() and int(text) > 0:
            speeds.append(int(text) / 1000)
    return max(speeds, default=None)


def detect(sysfs: str | os.PathLike = "/sys", env: dict | None = None) -> Nic:
    env = os.environ if env is None else env
    override = env.get(ENV)
    if override:
        if override not in NIC_CLASSES:
            raise ConfigError(f"{ENV} = {override!r} is not allowed; choose one of {', '.join(map(repr, NIC_CLASSES))}")
        return Nic(override, None)
    sysfs = Path(sysfs)
    ports = _rdma_ports(sysfs)
    if ports:
        # A host with both kinds trains over the faster fabric; InfiniBand wins a tie.
        totals: dict[str, float] = {}
        for nic_class, gbps in ports:
            totals[nic_class] = totals.get(nic_class, 0.0) + gbps
        best = max(totals, key=lambda c: (totals[c], c == "infiniband"))
        return Nic(best, totals[best] or None)
    return Nic("ethernet", _ethernet_gbps(sysfs))


def exchange(local: Nic) -> list[Nic]:
    """Every process's Nic, in process order (a collective: all processes must call it)."""
    import jax

    if jax.process_count() == 1:
        return [local]
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.array([NIC_CLASSES.index(local.nic_class), -1.0 if local.gbps is None else local.gbps], np.float32)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    return [Nic(NIC_CLASSES[int(code)], None if gbps < 0 else float(gbps)) for code, gbps in rows]
