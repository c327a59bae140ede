"""Which NIC class a host has, and every process's answer.

`detect()` looks, in order, at: the HOLMES_NIC_CLASS environment variable (an override for hosts
whose sysfs misleads, and for emulated clusters); RDMA ports under
`/sys/class/infiniband/*/ports/*/` (link_layer InfiniBand -> infiniband, Ethernet -> roce; speed
from `rate`, e.g. "200 Gb/sec (4X HDR)"); else plain Ethernet, its speed from
`/sys/class/net/*/speed` (Mb/s). The sysfs root is a parameter so tests can pass a fake tree.

`nccl_env()` turns the answer into NCCL settings for this host (docs/nccl.md says why each):
InfiniBand and RoCE -> NCCL_NET=IB and NCCL_IB_HCA naming the active HCA ports of that class,
where sysfs shows some (RoCE also NCCL_IB_GID_INDEX, the port's RoCE v2 GID of an IPv4 address);
Ethernet -> NCCL's own choice (a network plugin if one is installed, else its socket transport),
NCCL_NET=Socket only where InfiniBand or RoCE ports would otherwise be taken. `apply_nccl_env`
sets them where neither the environment nor NCCL's config files do. Every class gets
NCCL_SOCKET_IFNAME, the interface of the default route: NCCL's own choice would start with IPoIB
(`ib*`) interfaces, which do not reach other clusters, and the socket transport carries the hops
between clusters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import re
from pathlib import Path

from holmes_jax.config import ConfigError
from holmes_jax.planning.topology import NIC_CLASSES

ENV = "HOLMES_NIC_CLASS"
NCCL_VARIABLES = ("NCCL_NET", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_SOCKET_IFNAME")
# NCCL reads these only in its own RoCE GID search, which an explicit NCCL_IB_GID_INDEX skips
GID_SEARCH = ("NCCL_IB_ADDR_FAMILY", "NCCL_IB_ADDR_RANGE", "NCCL_IB_ROCE_VERSION_NUM")
# NCCL reads its integer variables with strtoll(text, NULL, 0): spaces and a sign, then hex after
# 0x, octal after 0 ("08" is 0, "010" is 8), else decimal, up to the first other character
_INTEGER = re.compile(r"\s*[+-]?(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
# an integer NCCL reads as a person does: no leading 0, which strtoll takes for octal
_PLAIN_INTEGER = re.compile(r"\s*[+-]?(0[xX][0-9a-fA-F]+|0|[1-9][0-9]*)\s*")


@dataclasses.dataclass(frozen=True)
class Nic:
    nic_class: str  # infiniband | roce | ethernet
    gbps: float | None  # the host's total over its active ports of that class; None: unknown


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _rdma_ports(sysfs: Path) -> list[tuple[str, float, Path]]:
    """(class, Gb/s, sysfs directory) of each active RDMA port."""
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
        ports.append((nic_class, gbps, port))
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
        for nic_class, gbps, _ in ports:
            totals[nic_class] = totals.get(nic_class, 0.0) + gbps
        best = max(totals, key=lambda c: (totals[c], c == "infiniband"))
        return Nic(best, totals[best] or None)
    return Nic("ethernet", _ethernet_gbps(sysfs))


@contextlib.contextmanager
def over_sockets():
    """NCCL_NET=Socket for the communicators created inside, then NCCL_NET as it was: NCCL picks
    a communicator's network when it creates it, and an IB one across NIC classes (an
    InfiniBand HCA to a RoCE one) cannot connect. Unset before, NCCL_NET gets back a config file's
    value: NCCL copies that into the environment (only where unset) once, so unsetting the
    variable here would drop it for every later communicator."""
    saved = os.environ.get("NCCL_NET")
    if saved is None:
        saved = nccl_conf().get("NCCL_NET", (None,))[0]
    os.environ["NCCL_NET"] = "Socket"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("NCCL_NET", None)
        else:
            os.environ["NCCL_NET"] = saved


def _roce_v2_gid(port: Path) -> int | None:
    """The lowest GID index of `port` that is RoCE v2 and holds an IPv4 address (NCCL's default
    address family), else the lowest RoCE v2 one that is set; None when sysfs does not say."""
    found = []
    for path in (port / "gid_attrs" / "types").glob("*"):
        gid = _read(port / "gids" / path.name)
        if not path.name.isdigit() or _read(path) != "RoCE v2" or not gid or not gid.strip("0:"):
            continue
        if gid.lower().startswith("fe80"):  # link-local: not routable between hosts
            continue
        found.append((not gid.lower().startswith("0000:0000:0000:0000:0000:ffff"), int(path.name)))
    return min(found)[1] if found else None


def _default_route_interface(sysfs: Path, proc: Path) -> str | None:
    """The interface of the IPv4 default route (/proc/net/route), else the fastest interface that
    is up, not IPoIB, and preferably one with an IPv4 route (an address NCCL can use); loopback
    never, nor "*", how the file names the missing device of an unreachable or blackhole route."""
    rows = [line.split() for line in (_read(proc / "net" / "route") or "").splitlines()[1:]]
    for fields in rows:
        default = len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000"
        if default and fields[0] not in ("lo", "*"):
            return fields[0]
    routed = {fields[0] for fields in rows if fields}
    best = None
    for iface in sorted((sysfs / "class" / "net").glob("*")):
        # type 32 (ARPHRD_INFINIBAND) is IPoIB: often the fastest, but it does not reach other clusters
        if iface.name == "lo" or _read(iface / "operstate") != "up" or _read(iface / "type") == "32":
            continue
        speed = _read(iface / "speed") or ""
        key = (iface.name in routed, int(speed) if speed.lstrip("-").isdigit() else 0)
        if best is None or key > best[0]:
            best = (key, iface.name)
    return best and best[1]


def nccl_env(nic: Nic, sysfs: str | os.PathLike = "/sys", proc: str | os.PathLike = "/proc") -> dict[str, str]:
    """NCCL settings for a host of NIC class `nic.nic_class`, from what sysfs and procfs show.
    A setting sysfs cannot support (no HCA, no RoCE v2 GID, no interface) is left out, so NCCL
    picks it itself. HCAs and interfaces are named with `=` (exact match): NCCL otherwise
    matches prefixes, and mlx5_1 would also select mlx5_10."""
    sysfs, proc = Path(sysfs), Path(proc)
    env = {}
    if nic.nic_class == "ethernet":
        # Left to NCCL unless the host has InfiniBand or RoCE ports that NCCL would take against
        # the class it was given (HOLMES_NIC_CLASS): NCCL_NET=Socket would also bypass a network
        # plugin (AWS EFA's, whose ports sysfs shows with link layer "Unknown"; GCP's TCPX).
        if _rdma_ports(sysfs):
            env["NCCL_NET"] = "Socket"
    else:
        ports = [path for nic_class, _, path in _rdma_ports(sysfs) if nic_class == nic.nic_class]
        # NCCL_NET=IB without an IB device fails every communicator ("Failed to initialize any NET
        # plugin"), e.g. HOLMES_NIC_CLASS=infiniband on an Ethernet host: then NCCL picks itself.
        if ports:
            env["NCCL_NET"] = "IB"
            env["NCCL_IB_HCA"] = "=" + ",".join(f"{p.parent.parent.name}:{p.name}" for p in ports)
        if nic.nic_class == "roce":
            gids = {_roce_v2_gid(p) for p in ports}
            if len(gids) == 1 and None not in gids:  # one index for all ports, as NCCL takes one
                env["NCCL_IB_GID_INDEX"] = str(gids.pop())
    iface = _default_route_interface(sysfs, proc)
    if iface:
        env["NCCL_SOCKET_IFNAME"] = "=" + iface
    return env


def _nccl_list(value: str) -> bool:
    """Whether NCCL reads `value` as the list of names it looks like: `[^][=]name[:port],...`.
    NCCL strips one leading ^ (exclude), then one = (exact match), and no spaces at all."""
    body = value[1:] if value.startswith("^") else value
    body = body[1:] if body.startswith("=") else body
    return any(body.split(",")) and not any(c.isspace() or c in "^=" for c in body)


_LIST = "names, comma-separated without spaces, optionally led by ^ (exclude) and then = (exact match)"
_USER_VALUES = {  # name: (whether NCCL reads the value as meant, what is allowed)
    "NCCL_NET": (lambda v: v != "" and v == v.strip(), "a network name without surrounding spaces, e.g. IB or Socket"),
    "NCCL_IB_HCA": (_nccl_list, "HCA[:port] " + _LIST),
    "NCCL_IB_GID_INDEX": (lambda v: bool(_PLAIN_INTEGER.fullmatch(v)), "an integer without leading zeros"),
    "NCCL_SOCKET_IFNAME": (lambda v: len(v) > 1 and _nccl_list(v),
                           "interface " + _LIST + ", 2 characters at least (NCCL ignores shorter values)"),
}


def _nonzero(text: str) -> bool:
    """Whether NCCL reads the integer variable `text` as nonzero."""
    match = _INTEGER.match(text)
    return bool(match) and match.group(1).strip("0xX") != ""


def _homes(env) -> list[str]:
    """The home directories NCCL may read .nccl.conf from: $HOME (NCCL 2.30 and later) and the
    password database's (earlier NCCLs). Which NCCL loads is not known here, so a variable set in
    either file counts as the user's: at worst NCCL then picks it itself."""
    homes = [env.get("HOME")]
    try:
        homes.append(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:  # a user id without an entry (a container started with --user)
        pass
    return list(dict.fromkeys(filter(None, homes)))


SITE_CONF = "/etc/nccl.conf"  # the config file NCCL reads after the user's


def nccl_conf(env=None) -> dict[str, tuple[str, str]]:
    """NCCL's variables from its config files, which NCCL reads for what the environment does not
    set (`initEnv` in NCCL's src/misc/param.cc): NCCL_CONF_FILE, else ~/.nccl.conf (see `_homes`),
    then /etc/nccl.conf, the first to set a variable winning; name -> (value, file). Lines as NCCL
    reads them: `NAME=value`, nothing stripped but the newline (a carriage return before it stays
    in the value, as in NCCL before 2.30), `#` lines skipped."""
    env = os.environ if env is None else env
    user = [env["NCCL_CONF_FILE"]] if env.get("NCCL_CONF_FILE") else [f"{home}/.nccl.conf" for home in _homes(env)]
    found = {}
    for path in (*user, SITE_CONF):
        try:
            # as is: no newline translation, no spaces stripped; NCCL reads bytes, so a byte that
            # is not UTF-8 (a Latin-1 comment) must not hide the file's other lines
            text = Path(path).read_bytes().decode(errors="backslashreplace")
        except OSError:
            continue
        for line in text.split("\n"):
            name, eq, value = line.partition("=")
            if eq and name and not name.startswith("#"):
                found.setdefault(name, (value, path))
    return found


def apply_nccl_env(derived: dict[str, str], env=None, conf=None) -> list[str]:
    """Sets each derived variable the user has not set, in `env` (os.environ by default) or in
    NCCL's config files (`conf`, by default `nccl_conf(env)`); returns one line per NCCL variable in
    force, saying whether it came from the environment, a config file, or was derived. A value the
    user set that NCCL would misread is a ConfigError. With NCCL_IB_DISABLE set the network is
    NCCL's sockets, and with NCCL's GID search steered no GID index is derived."""
    env = os.environ if env is None else env
    conf = nccl_conf(env) if conf is None else conf
    # what NCCL reads without us; the environment wins over the files, as in NCCL
    given = {name: (value, "from " + path) for name, (value, path) in conf.items()}
    given |= {name: (value, "from env") for name, value in env.items() if name.startswith("NCCL_")}
    for name, (ok, allowed) in _USER_VALUES.items():
        if name in given and not ok(given[name][0]):
            value, source = given[name]
            if source != "from env" and value.endswith("\r") and ok(value[:-1]):
                # NCCL 2.30 and later cut it too, earlier ones keep it; a site file may not be the user's to edit
                raise ConfigError(f"{name} = {value!r} ({source}) is not allowed: NCCL before 2.30 keeps the carriage "
                                  f"return of a CRLF line end in the value; allowed: the file with LF line ends, or "
                                  f"{name} set in the environment, which NCCL takes over the file")
            where = "" if source == "from env" else f" ({source})"
            raise ConfigError(f"{name} = {value!r}{where} is not allowed: NCCL would misread it; allowed: "
                              f"unset (holmes_jax derives it) or {allowed}")
    derived, why = dict(derived), {}
    plugin = given.get("NCCL_NET_PLUGIN", ("", ""))[0].lower() not in ("", "none")
    disable, disable_from = given.get("NCCL_IB_DISABLE", ("", ""))
    if _nonzero(disable):
        net = given.get("NCCL_NET", ("", ""))[0]
        if net.lower() == "ib":
            raise ConfigError(f"NCCL_NET = {net!r} is not allowed with NCCL_IB_DISABLE = {disable!r}: NCCL would "
                              "find no network; allowed: unset one of them")
        if derived.get("NCCL_NET") == "IB":  # NCCL would find no network; sockets, as NCCL picks itself then
            derived = {k: v for k, v in derived.items() if k == "NCCL_SOCKET_IFNAME"}
            if not plugin:  # with one, NCCL tries the user's plugin first, then sockets
                derived["NCCL_NET"] = "Socket"
                why["NCCL_NET"] = f'derived, as NCCL_IB_DISABLE="{disable}" {disable_from}'
    if any(name in given for name in GID_SEARCH):
        derived.pop("NCCL_IB_GID_INDEX", None)
    if plugin and derived.get("NCCL_NET") == "IB":
        # NCCL_NET=IB would bypass the network plugin the user chose (e.g. the SHARP plugin's IBext)
        del derived["NCCL_NET"]
    lines = []
    for name in NCCL_VARIABLES:
        if name in given:
            lines.append(f'{name}="{given[name][0]}" ({given[name][1]})')
        elif name in derived:
            env[name] = derived[name]
            lines.append(f'{name}="{derived[name]}" ({why.get(name, "derived")})')
    return lines
