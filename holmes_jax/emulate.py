"""An emulated heterogeneous-NIC cluster on one Linux box (root only): hosts are network namespaces.

    with EmulatedCluster([("ib", "infiniband", 2), ("roce", "roce", 2)]) as ec:
        rc = ec.run(["python", "-m", "holmes_jax.train", ...], devices_per_process=1)

    python -m holmes_jax.emulate --clusters ib:infiniband:2,roce:roce:2 [--inter-mbit 100] -- CMD ...

Wiring, all inside namespaces named `hjx-<pid>-<n>-*` (nothing is added to the machine's own
network namespace, so deleting ours removes every link and bridge with them):

    host ns "ib-0" eth0 --veth--+                        +--veth-- eth0 host ns "roce-0"
    host ns "ib-1" eth0 --veth--+ br0 -up0==dn0- core -dn1==up1- br1 +--veth-- eth0 host ns "roce-1"
                                 \\_______________ switch ns ______________/

Cluster i is subnet 10.213.(i+1).0/24 (host j at .(j+1)), all in one /16 broadcast domain with
no route anywhere else. Shaping is `tc tbf` on egress: each host's eth0 at its NIC class's rate
(a flow is limited by its sender's NIC), and each cluster's uplink `up<i>` at `inter_mbit`
(all traffic leaving a cluster shares it). Latency needs `tc netem`, which some kernels lack,
so it is 0 (unshaped) by default.

Each process runs as `ip netns exec NS unshare --uts` with its own hostname; `ip netns exec`
bind-mounts /etc/netns/NS/hosts over /etc/hosts, and ours maps every emulated hostname to its
address, so gloo (which advertises the address its hostname resolves to) and JAX's coordinator
(on host 0's address) talk over the shaped links.

Default rates: the topology defaults / 100 (infiniband 200 Gb/s -> 2000 Mbit/s, roce 100 -> 1000,
ethernet 25 -> 250) and a 100 Mbit/s inter-cluster link, so that for the tiny preset
(4 layers, hidden 128, ~0.86 M parameters, ~3.4 MB of float32 gradients, ~1.7 MB per stage at
pp = 2) a data-parallel gradient all-reduce across clusters (ring over 2 ranks: 2·(n−1)/n·S/W =
1.7 MB / 12.5 MB/s ≈ 140 ms per step) dominates a CPU step, while one pipeline activation hop
(micro-batch 2 · seq 128 · hidden 128 · 4 B = 131 KB) takes ≈ 10 ms across clusters, and the same
gradient all-reduce inside an infiniband cluster ≈ 7 ms.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from holmes_jax import cli, launch
from holmes_jax.config import ConfigError
from holmes_jax.planning.topology import NIC_CLASSES

PREFIX = "hjx-"  # every namespace we make is hjx-<pid>-<n>-...; stale ones are found by the pid
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.213"
INTRA_MBIT = {"infiniband": 2000.0, "roce": 1000.0, "ethernet": 250.0}
INTER_MBIT = 100.0
# What tc shapes as asked: below 1 kbit/s tbf rounds the rate and bucket wrongly. Far above what a
# veth carries, tbf's queue (rate x 50 ms, 32-bit bytes) is cut short: 15.6 ms at 1 Tbit/s, 1.9 ms
# at 10 Tbit/s (`tc qdisc show`), harmless at the top of the range, not beyond it.
MIN_MBIT, MAX_MBIT = 0.001, 1_000_000.0
MIN_MEASURED_BYTES = 64 << 10  # what a bandwidth measurement sends at least
COORDINATOR_PORT = 29500  # inside host 0's fresh namespace, so always free
_counter = itertools.count()


class EmulationError(cli.RunError, RuntimeError):
    """The machine could not build or run the emulated cluster (a tool failed): on the command
    line one `error:` line and status 1, not a traceback."""


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridges and tc)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install iproute2 util-linux)"
    return None


def _sh(*args: str, timeout_s: float = 30.0) -> str:
    # A session of its own: a terminal's Ctrl-C (sent to our whole process group) reaches us alone,
    # so an `ip netns del` of the teardown that it would have cut short runs to its end.
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise EmulationError(f"{' '.join(args)}: still running after {timeout_s:g} s; stopped") from None
    if r.returncode:
        raise EmulationError(f"{' '.join(args)}: {r.stderr.strip() or f'exit status {r.returncode}'}")
    return r.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in _sh("ip", "netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(names: Sequence[str]) -> None:
    """Deletes the namespaces and /etc/netns entries `names`; tries them all before raising."""
    present, errors = set(namespaces()), []
    for name in names:
        if name in present:
            try:
                _sh("ip", "netns", "del", name)
            except EmulationError as e:
                errors.append(e)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    if errors:
        raise errors[0]


def cleanup_stale() -> list[str]:
    """Removes namespaces (and their /etc/netns entries) left by our emulators whose process is gone."""
    names = set(namespaces()) | ({p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set())
    stale = sorted(n for n in names if (m := re.match(re.escape(PREFIX) + r"(\d+)-", n)) and not _alive(int(m[1])))
    _remove(stale)
    return stale


def _tbf(ns: str, dev: str, mbit: float) -> None:
    # burst: 1 ms at the rate (tbf splits bigger GSO packets). A real link sends every message at
    # its rate; a bigger bucket let a pipeline hop (tens of KB) cross a 100 Mbit/s link at veth speed.
    burst = max(int(mbit * 1e6 / 8 / 1000), 3000)
    _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
        "latency", "50ms")


@dataclasses.dataclass(frozen=True)
class Host:
    netns: str
    hostname: str
    cluster: str
    nic_class: str
    address: str
    mbit: float  # its NIC's shaped rate


CGROUP = Path("/sys/fs/cgroup")


def _cpu_hierarchy() -> tuple[Path, str] | None:
    """(where to make CPU-limited groups, "v2" or "v1"): cgroup v2's cpu.max where the unified
    hierarchy has the cpu controller, else cgroup v1's cpu controller (cfs quota); None if neither."""
    for root, kind in ((CGROUP, "v2"), (CGROUP / "unified", "v2"), (CGROUP / "cpu", "v1")):
        controllers = root / "cgroup.controllers"
        if kind == "v2" and controllers.is_file() and "cpu" in controllers.read_text().split():
            return root, kind
        if kind == "v1" and (root / "cpu.cfs_quota_us").is_file():
            return root, kind
    return None


class CpuLimits:
    """A hard cap on the CPU time of each emulated host's process, as a context manager: one
    cgroup per rank (cgroup v2 `cpu.max`, or cgroup v1's cfs quota), `cores[rank]` CPUs of time
    per 10 ms period, removed on exit. Capped processes cannot use what idle ones leave, so
    hosts that share the machine's cores behave like devices of fixed speed.

        with CpuLimits([0.5, 0.5, 0.25, 0.25]) as cpu:
            ec.run(["python", ...], cpu=cpu)
    """

    PERIOD_US = 10_000  # short: a capped process that used its share waits at most this long (mid-collective too)
    MIN_QUOTA_US = 1_000  # the kernel's least quota: 0.1 CPUs at our period

    def __init__(self, cores: Sequence[float]):
        least = self.MIN_QUOTA_US / self.PERIOD_US
        if not cores or any(not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c)
                            or c * self.PERIOD_US < self.MIN_QUOTA_US for c in cores):
            raise ConfigError(f"cores = {list(cores)!r} is not allowed; allowed: a number of CPUs per host, "
                              f"at least {least:g}")
        self.cores = list(cores)
        found = _cpu_hierarchy()
        if os.geteuid() != 0 or found is None:
            raise EmulationError("CPU limits need root and a cgroup cpu controller (v2 cpu.max or v1 cfs quota)")
        root, self.kind = found
        self.root = root / f"{PREFIX}{os.getpid()}-{next(_counter)}-cpu"

    def __enter__(self) -> CpuLimits:
        self._cleanup_stale()
        try:
            self.root.mkdir()
            if self.kind == "v2":  # the children's cpu.max needs the controller enabled below the group
                (self.root / "cgroup.subtree_control").write_text("+cpu")
            for rank, cores in enumerate(self.cores):
                group = self.root / str(rank)
                group.mkdir()
                quota = int(cores * self.PERIOD_US)
                if self.kind == "v2":
                    (group / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
                else:
                    (group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                    (group / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as e:
            self.close()
            raise EmulationError(f"cannot set CPU limits under {self.root}: {e}") from None
        except BaseException:  # a Ctrl-C half-way: no group is left behind
            self.close()
            raise
        return self

    def _cleanup_stale(self) -> None:
        """Removes the groups of our emulators whose process is gone (a killed run's), and one of
        ours by this very name (a crashed run's that had our pid); one a process still runs in stays."""
        for group in self.root.parent.glob(f"{PREFIX}*-cpu"):
            m = re.match(re.escape(PREFIX) + r"(\d+)-", group.name)
            if group == self.root or (m and not _alive(int(m[1]))):
                for path in [*sorted(group.glob("*"), reverse=True), group]:
                    if path.is_dir():
                        try:
                            path.rmdir()
                        except OSError:
                            pass

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except EmulationError as e:
            if exc is None:
                raise
            exc.add_note(str(e))  # the block's own error stays the one reported

    def close(self, wait_s: float = 2.0) -> None:
        """Removes the groups. A process still in one (one we started, or what it started) keeps
        it: after `wait_s` for it to end, the others go and the error names the pids."""
        deadline, busy = time.monotonic() + wait_s, []
        for group in sorted(self.root.glob("*"), reverse=True) + [self.root]:
            while group.is_dir() and not (busy and group == self.root):  # the root goes only once empty
                try:
                    group.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        busy.append(group)
                        break
                    time.sleep(0.05)  # a process just stopped may still be exiting
        if busy:
            pids = [pid for g in busy if (g / "cgroup.procs").is_file()
                    for pid in (g / "cgroup.procs").read_text().split()]
            raise EmulationError(f"CPU groups {', '.join(map(str, busy))} are still in use (processes "
                                 f"{', '.join(pids) or '?'}); stop those processes, then remove the groups with rmdir")

    def prefix(self) -> list[str]:
        """A command prefix that moves the process into its rank's group (launch's HOLMES_PROCESS_ID)."""
        return ["sh", "-c", 'echo $$ > "$0/$HOLMES_PROCESS_ID/cgroup.procs" && exec "$@"', str(self.root)]


class EmulatedCluster:
    """Namespaces as hosts in clusters `[(name, nic_class, hosts), ...]`; a context manager that
    tears everything down on exit, also after an error inside the block."""

    def __init__(self, clusters: Sequence[tuple[str, str, int]], intra_mbit: dict | None = None,
                 inter_mbit: float = INTER_MBIT, latency_ms: float = 0.0):
        self.intra_mbit = {**INTRA_MBIT, **(intra_mbit or {})}
        self.inter_mbit, self.latency_ms = inter_mbit, latency_ms
        self._check(clusters)
        self.clusters = [tuple(c) for c in clusters]
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}-"
        self.switch = self.prefix + "sw"
        self._made_netns_etc = False  # whether /etc/netns is ours to remove once empty
        self.hosts = [Host(f"{self.prefix}{name}-{j}", f"{name}-{j}", name, nic, f"{SUBNET}.{i + 1}.{j + 1}",
                           self.intra_mbit[nic])
                      for i, (name, nic, count) in enumerate(self.clusters) for j in range(count)]

    def _check(self, clusters) -> None:
        if not clusters:
            raise ConfigError("clusters: give at least one (name, nic_class, hosts)")
        for c in clusters:
            if len(c) != 3:
                raise ConfigError(f"cluster {c!r} is not allowed; allowed: (name, nic_class, hosts)")
            name, nic, count = c
            if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9]{0,11}", name):
                raise ConfigError(f"cluster name {name!r} is not allowed; allowed: a lower-case letter, then up to 11 letters or digits")
            if nic not in NIC_CLASSES:
                raise ConfigError(f"cluster {name!r}: NIC class {nic!r} is not allowed; choose one of {', '.join(NIC_CLASSES)}")
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 250:
                raise ConfigError(f"cluster {name!r}: hosts = {count!r} is not allowed; allowed: 1 .. 250")
        names = [c[0] for c in clusters]
        if len(set(names)) != len(names) or len(names) > 250:
            raise ConfigError(f"cluster names {names} must be unique, at most 250 clusters")
        rates = [(f"intra_mbit[{k!r}]", v) for k, v in self.intra_mbit.items()] + [("inter_mbit", self.inter_mbit)]
        for what, mbit in rates:  # `not <=` catches NaN too
            if not isinstance(mbit, (int, float)) or isinstance(mbit, bool) or not MIN_MBIT <= mbit <= MAX_MBIT:
                raise ConfigError(f"{what} = {mbit!r} is not allowed; allowed: {MIN_MBIT:g} .. {MAX_MBIT:.0f} Mbit/s")
        unknown = set(self.intra_mbit) - set(NIC_CLASSES)
        if unknown:
            raise ConfigError(f"intra_mbit: unknown NIC class {sorted(unknown)}; choose from {', '.join(NIC_CLASSES)}")
        if (not isinstance(self.latency_ms, (int, float)) or isinstance(self.latency_ms, bool)
                or not 0 <= self.latency_ms < math.inf):
            raise ConfigError(f"latency_ms = {self.latency_ms!r} is not allowed; allowed: a finite number >= 0")

    # ------------------------------------------------------------------------- life cycle

    def __enter__(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise EmulationError(f"emulated cluster {reason}")
        cleanup_stale()
        try:
            _remove(self.leftovers())  # a crashed run's that had our pid: its names are ours now
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        # A Ctrl-C or SIGTERM during the teardown (a second one, often) acts once it is done: cut
        # short, it left namespaces. Held by handler, not by signal mask: other threads (BLAS's) take it.
        caught, previous, failed = [], {}, None
        try:
            if threading.current_thread() is threading.main_thread():
                for sig in cli.STOP_SIGNALS:
                    if signal.getsignal(sig) is not None:  # None: a handler not set from Python
                        previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
            try:
                _remove(self.leftovers())
            except EmulationError as e:
                failed = e
                raise
            if self._made_netns_etc:
                try:
                    NETNS_ETC.rmdir()  # only when empty: others' entries stay
                except OSError:
                    pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if caught:
                if failed:  # the signal raised next replaces the error: say it first
                    print(f"error: the teardown left some of {self.prefix}*: {failed}", file=sys.stderr, flush=True)
                signal.raise_signal(caught[0])  # now it stops us as it would have

    def leftovers(self) -> list[str]:
        """Our namespaces and /etc/netns entries that still exist (none after the block)."""
        names = set(namespaces()) | ({p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set())
        return sorted(n for n in names if n.startswith(self.prefix))

    def _build(self) -> None:
        sw = self.switch
        _sh("ip", "netns", "add", sw)
        _sh("ip", "-n", sw, "link", "add", "core", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "core", "up")
        for i, _ in enumerate(self.clusters):
            _sh("ip", "-n", sw, "link", "add", f"br{i}", "type", "bridge")
            _sh("ip", "-n", sw, "link", "add", f"up{i}", "type", "veth", "peer", "name", f"dn{i}")
            _sh("ip", "-n", sw, "link", "set", f"up{i}", "master", f"br{i}", "up")
            _sh("ip", "-n", sw, "link", "set", f"dn{i}", "master", "core", "up")
            _sh("ip", "-n", sw, "link", "set", f"br{i}", "up")
            if len(self.clusters) > 1:  # one cluster's traffic never leaves its bridge
                self._shape_uplink(f"up{i}")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.hostname}\n" for h in self.hosts)
        self._made_netns_etc = not NETNS_ETC.exists()
        for k, h in enumerate(self.hosts):
            cluster = next(i for i, c in enumerate(self.clusters) if c[0] == h.cluster)
            _sh("ip", "netns", "add", h.netns)
            try:
                (NETNS_ETC / h.netns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / h.netns / "hosts").write_text(hosts_file)
            except OSError as e:
                raise EmulationError(f"cannot write {NETNS_ETC / h.netns / 'hosts'}: {e.strerror or e}") from None
            _sh("ip", "-n", sw, "link", "add", f"h{k}", "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _sh("ip", "-n", sw, "link", "set", f"h{k}", "master", f"br{cluster}", "up")
            _sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/16", "dev", "eth0")
            _sh("ip", "-n", h.netns, "link", "set", "lo", "up")
            _sh("ip", "-n", h.netns, "link", "set", "eth0", "up")
            _tbf(h.netns, "eth0", h.mbit)

    def _shape_uplink(self, dev: str) -> None:
        if not self.latency_ms:
            _tbf(self.switch, dev, self.inter_mbit)
            return
        try:
            _sh("tc", "-n", self.switch, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{self.latency_ms}ms",
                "rate", f"{self.inter_mbit}mbit", "limit", "100000")
        except EmulationError as e:
            raise EmulationError(f"latency_ms = {self.latency_ms} needs tc netem (kernel module sch_netem), which "
                                 f"this machine lacks; use latency_ms = 0 ({e})") from None

    # ------------------------------------------------------------------------- using it

    def exec_prefix(self, host: Host) -> list[str]:
        """Runs what follows inside `host`: its namespace, its /etc/hosts, its own hostname."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                host.hostname]

    def run(self, cmd: Sequence[str], devices_per_process: int | None = None, env: dict | None = None,
            timeout_s: float | None = None, grace_s: float = 5.0, cpu: CpuLimits | None = None) -> int:
        """`cmd` as one process per host (`holmes_jax.launch`), the coordinator on host 0; with
        `cpu`, each process under its rank's CPU cap (entered before the namespace, whose own
        /sys hides the cgroup tree)."""
        if cpu is not None and len(cpu.cores) != len(self.hosts):  # a rank without its group fails in its shell
            raise ConfigError(f"cpu has limits for {len(cpu.cores)} hosts, the cluster has {len(self.hosts)}; "
                              "allowed: CpuLimits with one number of CPUs per host")
        if cpu is not None and not cpu.root.is_dir():
            raise ConfigError("cpu is not set up; allowed: CpuLimits entered with `with CpuLimits(...) as cpu`")

        def wrap(rank):
            return [*(cpu.prefix() if cpu else []), *self.exec_prefix(self.hosts[rank])]

        return launch.launch(cmd, len(self.hosts), devices_per_process, COORDINATOR_PORT, env,
                             [h.nic_class for h in self.hosts], coordinator_host=self.hosts[0].address,
                             wrap=wrap, grace_s=grace_s, timeout_s=timeout_s)

    def expected_mbit(self, src: Host, dst: Host) -> float:
        return src.mbit if src.cluster == dst.cluster else min(src.mbit, self.inter_mbit)

    def bandwidth_mbit(self, src: Host, dst: Host, seconds: float = 0.5, timeout_s: float = 30.0) -> float:
        """Measured TCP throughput src -> dst: about `seconds` of traffic at the expected rate
        (1 .. 256 MB, but what takes at most half of `timeout_s`), from a receiver in `dst` and a
        sender in `src`."""
        expected = self.expected_mbit(src, dst)
        bytes_per_s = expected * 1e6 / 8
        # A slow link sends less than 1 MiB, or it ran out of time (1 MiB takes 30 s at 0.28 Mbit/s).
        nbytes = int(min(max(bytes_per_s * seconds, 1 << 20), 256 << 20, bytes_per_s * timeout_s / 2))
        if nbytes < MIN_MEASURED_BYTES:  # tc's 3000-byte bucket and TCP's start would be much of it
            raise EmulationError(f"bandwidth {src.hostname} -> {dst.hostname}: a {expected:g} Mbit/s link is too "
                                 f"slow to measure in {timeout_s:g} s (a measurement sends at least "
                                 f"{MIN_MEASURED_BYTES >> 10} KiB)")
        port = 5201
        py = [sys.executable, "-c"]
        recv = subprocess.Popen(["ip", "netns", "exec", dst.netns, *py,
                                 f"from holmes_jax.emulate import receive; receive({dst.address!r}, {port}, {nbytes}, {timeout_s})"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = recv.stdout.readline()  # the receiver says so once it listens (or exits on error)
            if ready.strip() != "listening":
                raise EmulationError(f"bandwidth receiver in {dst.hostname}: {recv.stderr.read().strip()}")
            _sh("ip", "netns", "exec", src.netns, *py,  # its own limit is timeout_s; python's start on top
                f"from holmes_jax.emulate import send; send({dst.address!r}, {port}, {nbytes}, {timeout_s})",
                timeout_s=timeout_s + 30)
            try:
                out, errs = recv.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise EmulationError(f"bandwidth receiver in {dst.hostname}: no result after {timeout_s:g} s") from None
            if recv.returncode:
                raise EmulationError(f"bandwidth receiver in {dst.hostname}: {errs.strip()}")
            return json.loads(out)["mbit"]
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()


def receive(address: str, port: int, nbytes: int, timeout_s: float) -> None:
    """Accepts one connection, reads `nbytes`, prints the rate from first to last byte."""
    import socket

    got, start, reason = 0, None, ""
    with socket.create_server((address, port)) as server:
        server.settimeout(timeout_s)
        print("listening", flush=True)
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout_s)
                deadline = time.monotonic() + timeout_s
                while got < nbytes and time.monotonic() < deadline:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    start = start or time.perf_counter()
                    got += len(chunk)
        except OSError as e:  # one line for the error message, not a traceback
            reason = f": {e}"
        if got < nbytes:  # before the rate: with nothing received there is no start
            raise SystemExit(f"received {got} of {nbytes} bytes{reason}")
        elapsed = time.perf_counter() - start
    print(json.dumps({"bytes": got, "seconds": elapsed, "mbit": got * 8 / elapsed / 1e6}))


def send(address: str, port: int, nbytes: int, timeout_s: float) -> None:
    import socket

    block, offset = b"\0" * (1 << 16), 0
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            for offset in range(0, nbytes, len(block)):
                conn.sendall(block[:nbytes - offset])
    except OSError as e:  # one line for the error message, not a traceback
        raise SystemExit(f"sent {offset} of {nbytes} bytes to {address}:{port}: {e}") from None


# ----------------------------------------------------------------------------- command line


def parse_clusters(text: str) -> list[tuple[str, str, int]]:
    clusters = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not (parts[2].isascii() and parts[2].isdigit()):
            raise ConfigError(f"--clusters item {item!r} is not allowed; allowed: NAME:NIC_CLASS:HOSTS, e.g. ib:infiniband:2")
        clusters.append((parts[0], parts[1], int(parts[2])))
    return clusters


def parse_rates(text: str) -> dict[str, float]:
    rates = {}
    for item in text.split(","):
        nic, _, mbit = item.partition("=")
        try:
            rates[nic] = float(mbit)
        except ValueError:
            raise ConfigError(f"--intra-mbit item {item!r} is not allowed; allowed: NIC_CLASS=MBIT, e.g. roce=1000") from None
    return rates


def _stop(signum, frame) -> None:
    for sig in cli.STOP_SIGNALS:  # the first stops us; a second (Ctrl-C twice) must not cut the teardown short
        signal.signal(sig, cli.ignore_signal)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise cli.Signalled(signum)  # cli.run says 'stopped by SIGTERM' once the teardown is done


def main(argv: list[str]) -> int:
    opts, cmd = launch.split_command(argv) if "--" in argv else (argv, [])  # --bandwidth alone runs nothing
    p = cli.Parser(prog="python -m holmes_jax.emulate", usage="python -m holmes_jax.emulate --clusters "
                       "NAME:NIC:HOSTS,... [options] -- CMD ...", description="Runs CMD on an emulated cluster (root).")
    p.add_argument("--clusters", required=True, help="e.g. ib:infiniband:2,roce:roce:2")
    p.add_argument("--intra-mbit", help=f"NIC rates, e.g. roce=1000 (default {INTRA_MBIT})")
    p.add_argument("--inter-mbit", type=float, default=INTER_MBIT, help="each cluster's uplink")
    p.add_argument("--latency-ms", type=float, default=0.0, help="uplink delay (needs tc netem)")
    p.add_argument("--devices-per-process", type=int)
    launch.add_stop_flags(p)
    p.add_argument("--bandwidth", action="store_true", help="measure an intra and an inter-cluster link first")
    args = p.parse_args(opts)
    # Ctrl-C, a SIGTERM (a scheduler's, `timeout`) or a SIGHUP (a closed terminal) unwinds through
    # the with-block below, so nothing is left; nohup's ignored SIGHUP stays ignored.
    for sig in cli.stop_signals_to_catch():
        signal.signal(sig, _stop)
    if not cmd and not args.bandwidth:
        raise ConfigError("no command to run; give it after --, or pass --bandwidth")
    ec = EmulatedCluster(parse_clusters(args.clusters), parse_rates(args.intra_mbit) if args.intra_mbit else None,
                         args.inter_mbit, args.latency_ms)
    if cmd:  # the launcher's checks of --devices-per-process and --timeout now, not after the build and --bandwidth
        launch.check_arguments(cmd, len(ec.hosts), args.devices_per_process, COORDINATOR_PORT, None, args.grace,
                               args.timeout, None)
    reason = unavailable_reason()
    if reason:
        raise ConfigError(f"the emulated cluster {reason}")
    with ec:
        for h in ec.hosts:
            print(f"emulate: {h.hostname:>10} {h.address:<13} {h.nic_class:<10} {h.mbit:g} Mbit/s  (netns {h.netns})")
        print(f"emulate: inter-cluster uplinks {ec.inter_mbit:g} Mbit/s, latency {ec.latency_ms:g} ms"
              if len(ec.clusters) > 1 else "emulate: one cluster, no uplink between clusters "
              "(--inter-mbit and --latency-ms shape nothing)", flush=True)
        if args.bandwidth:
            pairs = [(a, b) for a in ec.hosts for b in ec.hosts if a is not b]
            for kind, same in (("intra", True), ("inter", False)):
                pair = next(((a, b) for a, b in pairs if (a.cluster == b.cluster) == same), None)
                if pair is None:
                    print(f"emulate: {kind}-cluster: no two hosts to measure between", flush=True)
                    continue
                mbit = ec.bandwidth_mbit(*pair)
                figure = f"{mbit:.0f}" if mbit >= 10 else f"{mbit:.3g}"  # a slow link's is not "0"
                print(f"emulate: {kind}-cluster {pair[0].hostname} -> {pair[1].hostname}: {figure} Mbit/s measured",
                      flush=True)
        return ec.run(cmd, args.devices_per_process, timeout_s=args.timeout, grace_s=args.grace) if cmd else 0


if __name__ == "__main__":
    cli.run(main)
