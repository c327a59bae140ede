"""One process or many: `jax.distributed` start-up and the facts processes tell each other.

`initialize()` decides from the environment, in this order:

1. `HOLMES_NUM_PROCESSES`, `HOLMES_PROCESS_ID`, `HOLMES_COORDINATOR` (host:port), as
   `holmes_jax.launch` and `holmes_jax.emulate` set them;
2. Open MPI (`OMPI_COMM_WORLD_SIZE`, i.e. under `mpirun`; one rank is a single process), then
   SLURM (`SLURM_JOB_ID` with `SLURM_NTASKS` > 1, i.e. inside `srun`; the process count is the
   step's, `SLURM_STEP_NUM_TASKS`, where set: `srun --preserve-env` leaves the job's in
   `SLURM_NTASKS`): the coordinator and ranks as JAX's own cluster detection finds them, which
   makes each process see one GPU (its local rank, refused at once where this host's CUDA shows
   fewer GPUs; set `JAX_LOCAL_DEVICE_IDS` to change that); `HOLMES_COORDINATOR` may name the
   coordinator instead (needed for Open MPI 5, whose environment JAX does not parse). Open MPI
   comes first, as in JAX: an `mpirun` inside a SLURM allocation gives its ranks SLURM variables
   too, of the allocation or of the `srun` step that started its daemons, one task per node;
3. MPICH, Intel MPI, MVAPICH (`PMI_SIZE` > 1, Hydra's `mpiexec`): ranks from `PMI_RANK` and
   `MPI_LOCALRANKID`, the coordinator from `HOLMES_COORDINATOR` (JAX does not detect these).
   Inside SLURM they win over SLURM's variables when `PMI_SIZE` is not the step's task count
   (Hydra's proxies run as an `srun` step of one task per node; `srun --mpi=pmi2` sets the same
   count);
4. otherwise a single process, and `jax.distributed` is not started at all.

Processes that have not all met within `INIT_TIMEOUT_S` end with one error line and status 1.
`check_same_settings` ends processes that were given different settings (flags, gin files) with
one error line each, where they would otherwise wait for each other's collectives for ever;
`check_same_data` those that read different data (hosts with different copies of a corpus).
Each exchange between processes (`every_process`, `meet`) also stops all of them where one holds
a stop signal, so none is left waiting for another.

On CPU the backend's device count (`HOLMES_CPU_DEVICES`, else the argument) and gloo collectives
are configured first, so this must run before anything touches a JAX backend. So are the network
settings (docs/nccl.md): NCCL's variables from this host's NIC (`nic.nccl_env`), never overriding
what the environment already sets, and the XLA flags that let hops between clusters get
communicators of their own. They are set on every platform: without NCCL they do nothing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import errno
import importlib.metadata
import ipaddress
import json
import os
import pkgutil
import re
import socket
import sys
import threading
import time
from typing import Iterator

import jax

from holmes_jax import cli
from holmes_jax.cli import RunError
from holmes_jax.config import ConfigError, check_positive
from holmes_jax.mesh import nic

COORDINATOR, NUM_PROCESSES, PROCESS_ID, CPU_DEVICES = (
    "HOLMES_COORDINATOR", "HOLMES_NUM_PROCESSES", "HOLMES_PROCESS_ID", "HOLMES_CPU_DEVICES")
LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # the devices each process uses (JAX reads it), e.g. 0,1,2,3
INIT_TIMEOUT_S = 300  # how long processes wait for each other at start-up (JAX's own default)
LAST_TO_LEAVE_S = 2.0  # how long process 0 stays after its error line, where all leave at once (`Lockstep`)
SHOWN_SETTINGS = 4  # differing settings lines named when processes were given different settings
# A collective-permute's clique spans only the devices it connects (not every device), and no
# clique is split from another: a split communicator keeps its parent's network.
XLA_NETWORK_FLAGS = ("--xla_gpu_collective_permute_connected_components=true",
                     "--xla_gpu_enable_nccl_comm_splitting=false")

# XLA's error, where jaxlib raises it as a ValueError: a collective failing as it is dispatched
# (gloo's 'Connection reset by peer' in the stop vote, a peer killed) was a page of traceback
XLA_ERROR = re.compile(r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
                       r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
                       r"UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): ")


def xla_error(error: BaseException) -> bool:
    """Whether `error` is XLA's: jaxlib's own type, or a ValueError with XLA's status prefix."""
    return isinstance(error, jax.errors.JaxRuntimeError) or (isinstance(error, ValueError)
                                                             and XLA_ERROR.match(str(error)) is not None)


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_index: int
    process_count: int
    hostname: str
    nic: str  # NIC class: infiniband | roce | ethernet
    gbps: float | None  # the host's NIC speed; None: unknown (or set by HOLMES_NIC_CLASS)
    local_devices: int
    method: str  # how the processes were found: single | holmes | slurm | ompi | pmi

    def facts(self) -> dict:
        return {"process_index": self.process_index, "hostname": self.hostname, "nic": self.nic,
                "gbps": self.gbps, "local_devices": self.local_devices}


_info: ProcessInfo | None = None
_network: list[str] = []  # what `network_settings` set, one line per setting


def network_settings(local: nic.Nic, env=None, sysfs="/sys", proc="/proc") -> list[str]:
    """Sets NCCL's variables and the XLA flags in `env` (os.environ by default) where the user
    has not; returns one line per setting, "(from env)" or "(derived)"."""
    env = os.environ if env is None else env
    lines = nic.apply_nccl_env(nic.nccl_env(local, sysfs, proc), env)
    flags, source = _xla_flags(env)
    for flag in XLA_NETWORK_FLAGS:
        name = flag.partition("=")[0]
        given = [f for f in flags if f.partition("=")[0] == name]
        if given:
            lines.append(f"XLA_FLAGS {given[-1]} ({source})")
        else:
            flags.append(flag)
            lines.append(f"XLA_FLAGS {flag} (derived)")
    env["XLA_FLAGS"] = " ".join(flags)
    return lines


def _xla_flags(env) -> tuple[list[str], str]:
    """The flags XLA_FLAGS gives and where they come from. XLA reads a value whose first character
    after blanks is not '-' as the name of a file of flags: that file's flags are read here, to
    become XLA_FLAGS with ours (ours appended to the name, XLA died: "Could not open file")."""
    value = env.get("XLA_FLAGS", "")
    if not value.strip() or value.lstrip().startswith("-"):
        return value.split(), "from env"
    path = value.strip()
    try:
        with open(path) as f:
            return f.read().split(), f"from {path}, which XLA_FLAGS names"
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"XLA_FLAGS = {value!r} is not allowed: XLA reads it as the name of a file of flags (it does "
                          f"not start with '-'), and that file cannot be read ({getattr(e, 'strerror', None) or e}); "
                          "allowed: flags, e.g. --xla_dump_to=/tmp/dump, or a readable file of them") from None


def network_lines() -> list[str]:
    """The lines `initialize` got from `network_settings` (empty before it ran)."""
    return list(_network)


def _int(env, name: str, low: int) -> int:
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ConfigError(f"{name} = {text!r} is not allowed; allowed: an integer >= {low}")
    return value


def _index(env, name: str, count_name: str, count: int) -> int:
    """`env[name]`: this process's index among the `count` that `count_name` says there are."""
    index = _int(env, name, 0)
    if index >= count:
        raise ConfigError(f"{name} = {index} is not allowed; allowed: 0 .. {count_name} - 1 = {count - 1}")
    return index


def _jax_port(env) -> None:
    """JAX's detection (SLURM, Open MPI 4) takes its coordinator port from JAX_COORDINATOR_PORT
    (empty: unset, as JAX reads it)."""
    port = env.get("JAX_COORDINATOR_PORT")
    if port and not _port_number(port):
        raise ConfigError(f"JAX_COORDINATOR_PORT = {port!r} is not allowed; allowed: 1 .. 65535")


def _port_number(text: str) -> bool:
    # ASCII digits: str.isdigit() also takes '²' (int() then raised) and other scripts' digits
    return re.fullmatch(r"[0-9]+", text) is not None and 0 < int(text) < 65536


# A SLURM node list's first name, e.g. 'node[001-004],gpu7' or 'rack[1-2]-n[01-04]': text and
# bracket groups up to the first ',' outside brackets.
SLURM_FIRST_NAME = re.compile(r"([^\s,\[\]](?:[^\s,\[\]]|\[\d[\d,\-]*\])*)(?:,|$)")


def slurm_first_host(node_list: str) -> str | None:
    """The first host of a SLURM node list (each bracket group's first number), or None if the
    list does not start with a name. JAX's own reading stops at the first bracket group, so it
    gives 'rack1' for 'rack[1-2]-n[01-04]', whose first host is 'rack1-n01'."""
    name = SLURM_FIRST_NAME.match(node_list)
    if name is None:
        return None
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", name.group(1))


def slurm_tasks_name(env) -> str:
    """The variable that counts the processes of this SLURM job step: SLURM_STEP_NUM_TASKS where
    set. SLURM_NTASKS is the step's too, except under `srun --preserve-env` (-E), which keeps the
    job's: `srun -E -n 2` in an allocation of 4 tasks then left its 2 processes waiting for 2 more
    until the start-up timeout."""
    return "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"


def _coordinator(env) -> str | None:
    address = env.get(COORDINATOR)
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    if not host or not _port_number(port) or not _host_form(host):
        raise ConfigError(f"{COORDINATOR} = {address!r} is not allowed; allowed: HOST:PORT, e.g. 10.0.0.1:29500 "
                          "(an IPv6 address in brackets, e.g. [fd00::1]:29500)")
    return address


def _host_form(host: str) -> bool:
    """A host name or IPv4 address, or an IPv6 address in brackets: jaxlib cannot read a bare
    IPv6 address ('::1:29500'), and its processes then wait for each other until the timeout."""
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return not any(c in host for c in ":[]")


def _port_in_use(port: int) -> bool:
    """Whether a process on this host listens on `port` on any address, IPv4 or IPv6 (the
    coordinator's server binds it on all of them)."""
    for family, anywhere in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family)
        except OSError:  # a host without IPv6
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as that server does: TIME_WAIT is no conflict
            try:
                s.bind((anywhere, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def _mpi_ranks(env, prefix: str, local: str) -> dict:
    """`jax.distributed.initialize`'s process count, index and local device from an MPI launcher's
    `{prefix}_SIZE`, `{prefix}_RANK` and `local` rank, checked: JAX would read them with int()."""
    size, rank = f"{prefix}_SIZE", f"{prefix}_RANK"
    count = _int(env, size, 2)
    if rank not in env:  # JAX would raise a KeyError
        raise ConfigError(f"{size} = {count} but {rank} unset: start one process per rank with mpirun")
    kwargs = {"num_processes": count, "process_id": _index(env, rank, size, count)}
    # One device per process, as JAX's own detection does, unless JAX_LOCAL_DEVICE_IDS names them:
    # JAX reads that only where no local_device_ids are given.
    if local in env and not env.get(LOCAL_DEVICE_IDS):
        kwargs["local_device_ids"] = [_int(env, local, 0)]
    return kwargs


def _local_device_ids(env) -> None:
    """JAX reads JAX_LOCAL_DEVICE_IDS with int() inside `jax.distributed.initialize`: a traceback."""
    ids = env.get(LOCAL_DEVICE_IDS)
    if ids and not re.fullmatch(r"[0-9]+(,[0-9]+)*", ids):
        raise ConfigError(f"{LOCAL_DEVICE_IDS} = {ids!r} is not allowed; allowed: device numbers separated by commas, "
                          "e.g. 0,1,2,3")


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU of the NVIDIA driver, read without CUDA
LOCAL_RANKS = {"slurm": "SLURM_LOCALID", "ompi": "OMPI_COMM_WORLD_LOCAL_RANK", "pmi": "MPI_LOCALRANKID"}


def _cuda_plugin_installed() -> bool:
    """Whether JAX has a CUDA plugin to start, looked for where JAX finds its plugins (the
    jax_plugins package and entry points), without importing one."""
    names = [entry.value for entry in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins
    except ImportError:
        pass
    else:
        names += [name for _, name, _ in pkgutil.iter_modules(jax_plugins.__path__)]
    return any("cuda" in name for name in names)


def visible_gpus(env, platforms: str | None = None) -> int | None:
    """How many GPUs CUDA will show this process, read without starting it (that would fix the
    devices before jax.distributed chooses them); None where JAX will not run on CUDA (JAX_PLATFORMS
    without it, no CUDA plugin, no NVIDIA driver). `platforms`: JAX's, by default its config's."""
    platforms = jax.config.jax_platforms if platforms is None else platforms
    wanted = {name.strip() for name in (platforms or "").lower().split(",") if name.strip()}
    if wanted and not wanted & {"cuda", "gpu"}:
        return None
    if not _cuda_plugin_installed():
        return None
    try:
        driver = len(os.listdir(NVIDIA_GPUS))
    except OSError:
        return None
    shown = env.get("CUDA_VISIBLE_DEVICES")
    if shown is None:
        return driver
    # CUDA takes the entries up to the first it cannot use (-1, SLURM's NoDevFiles, a GPU the
    # driver does not have); a UUID (GPU-..., MIG-...) is one GPU
    count = 0
    for entry in shown.split(","):
        entry = entry.strip()
        if not (entry.isdecimal() and int(entry) < driver or entry.startswith(("GPU-", "MIG-"))):  # isdigit took '²'
            break
        count += 1
    return count


def check_local_gpus(method: str, env=None, platforms: str | None = None) -> None:
    """Raises `ConfigError` where jax.distributed would give this process a GPU that CUDA does not
    show it: more ranks on a host than it has GPUs (mpirun -npernode 8 on a host of 4), or SLURM
    giving each task a GPU of its own (--gpus-per-task=1: every task is shown one, GPU 0) while
    the process takes the GPU of its local rank. jaxlib would fail only when its backend starts,
    with CUDA's 'invalid device ordinal', after the others waited for it."""
    env = os.environ if env is None else env
    name = LOCAL_DEVICE_IDS if env.get(LOCAL_DEVICE_IDS) else LOCAL_RANKS.get(method)
    if name is None or name not in env:  # no devices chosen: the process takes every GPU it is shown
        return
    shown = visible_gpus(env, platforms)
    if not shown:  # not a CUDA run, or no GPU shown at all (JAX then runs on the CPU)
        return
    beyond = [int(i) for i in env[name].split(",") if int(i) >= shown]
    if beyond:
        whence = (f"CUDA_VISIBLE_DEVICES = {env['CUDA_VISIBLE_DEVICES']!r}" if "CUDA_VISIBLE_DEVICES" in env
                  else "every GPU of the NVIDIA driver")
        raise ConfigError(
            f"{name} = {env[name]!r}: this process would use GPU {beyond[0]}, but CUDA shows it {shown} "
            f"(0 .. {shown - 1}; {whence}); allowed: one process a GPU shown (at most {shown} on this host), "
            f"or {LOCAL_DEVICE_IDS} naming GPUs it shows (e.g. 0 where each process is shown its own)")


def _mpi_coordinator(coordinator: str | None, example: str) -> str:
    if coordinator is None:
        raise ConfigError(f"this MPI does not tell JAX the coordinator; pass {COORDINATOR}=HOST:PORT "
                          f"(e.g. {example} ...)")
    return coordinator


# Where the keyword arguments name everything themselves: JAX's detection would fill a local device
# left unset from another launcher's variables (a by-hand start inside an srun step took its
# SLURM_LOCALID: GPU 0 alone of the node's 8). JAX_LOCAL_DEVICE_IDS is still read.
NO_DETECTION = {"cluster_detection_method": "deactivate"}


def launch_method(env=None) -> tuple[str, dict]:
    """(method, keyword arguments for `jax.distributed.initialize`) from `env`; method 'single'
    means one process and no `jax.distributed` at all."""
    env = os.environ if env is None else env
    method, kwargs = _launch_method(env)
    if method != "single":
        _local_device_ids(env)
    return method, kwargs


def _launch_method(env) -> tuple[str, dict]:
    coordinator = _coordinator(env)
    given = [name for name in (NUM_PROCESSES, PROCESS_ID) if name in env]
    if given:
        if len(given) == 1:
            missing = PROCESS_ID if given[0] == NUM_PROCESSES else NUM_PROCESSES
            raise ConfigError(f"{given[0]} is set but {missing} is not; set both (and {COORDINATOR})")
        count, index = _int(env, NUM_PROCESSES, 1), _int(env, PROCESS_ID, 0)
        if index >= count:
            raise ConfigError(f"{PROCESS_ID} = {index} is not allowed; allowed: 0 .. {NUM_PROCESSES} - 1 = {count - 1}")
        if count == 1:
            return "single", {}
        if coordinator is None:
            raise ConfigError(f"{NUM_PROCESSES} = {count} needs {COORDINATOR}=HOST:PORT (process 0's host)")
        return "holmes", {"coordinator_address": coordinator, "num_processes": count, "process_id": index,
                          **NO_DETECTION}
    # Open MPI before SLURM, as in JAX: mpirun's ranks inside an allocation carry SLURM's variables
    # too, of the allocation or of the step that started Open MPI's daemons (one task per node).
    if "OMPI_COMM_WORLD_SIZE" in env:
        if _int(env, "OMPI_COMM_WORLD_SIZE", 1) == 1:  # mpirun -np 1, whatever tasks the allocation has
            return "single", {}
        kwargs = _mpi_ranks(env, "OMPI_COMM_WORLD", "OMPI_COMM_WORLD_LOCAL_RANK")
        if "OMPI_MCA_orte_hnp_uri" in env and coordinator is None:  # Open MPI 4: JAX finds it all
            _jax_port(env)
            return "ompi", {"cluster_detection_method": "ompi"}
        address = _mpi_coordinator(coordinator, "mpirun -x HOLMES_COORDINATOR=$(hostname):29500")
        return "ompi", {"coordinator_address": address, **kwargs, **NO_DETECTION}
    pmi_size = _int(env, "PMI_SIZE", 1) if "PMI_SIZE" in env else 1
    tasks_name = slurm_tasks_name(env)  # SLURM_NTASKS itself is needed still: JAX's detection reads it
    slurm_tasks = _int(env, tasks_name, 1) if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env else 1
    # srun's own PMI (--mpi=pmi2) counts the step's tasks; Hydra's mpiexec inside an allocation runs
    # its proxies as a step of one task per node, whose SLURM variables its ranks inherit.
    if slurm_tasks > 1 and pmi_size in (1, slurm_tasks):
        needed = ("SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
        if any(name not in env for name in needed):
            raise ConfigError(f"{tasks_name} = {env[tasks_name]} but {', '.join(n for n in needed if n not in env)} "
                              "unset: start one process per task with srun")
        # JAX reads these with int() (a traceback) and checks none of them: a rank out of range or
        # an empty coordinator host ends only in its connection timeout, minutes later.
        index = _index(env, "SLURM_PROCID", tasks_name, slurm_tasks)
        _int(env, "SLURM_LOCALID", 0)
        if coordinator is None:
            host = slurm_first_host(env["SLURM_STEP_NODELIST"])
            if host is None:
                raise ConfigError(f"SLURM_STEP_NODELIST = {env['SLURM_STEP_NODELIST']!r} is not allowed; allowed: "
                                  "a SLURM node list starting with a host name, e.g. node[001-004]")
            _jax_port(env)
            # JAX's port rule for SLURM jobs, unless JAX_COORDINATOR_PORT names one
            port = env.get("JAX_COORDINATOR_PORT") or str(_int(env, "SLURM_JOB_ID", 0) % 4096 + 61440)
            coordinator = f"{host}:{port}"
        # The step's count (JAX would read the job's) and the index, given here so that process 0
        # checks its port first and a timeout names the process
        return "slurm", {"coordinator_address": coordinator, "num_processes": slurm_tasks, "process_id": index,
                         "cluster_detection_method": "slurm"}
    # MPICH's, Intel MPI's and MVAPICH's mpiexec (Hydra's PMI), which JAX does not detect: left
    # alone, every rank would train the whole job on its own, all in one workdir.
    if pmi_size > 1:
        kwargs = _mpi_ranks(env, "PMI", "MPI_LOCALRANKID")
        address = _mpi_coordinator(coordinator, "mpiexec -genv HOLMES_COORDINATOR $(hostname):29500")
        return "pmi", {"coordinator_address": address, **kwargs, **NO_DETECTION}
    if coordinator is not None:
        raise ConfigError(f"{COORDINATOR} = {env[COORDINATOR]!r} is set but {NUM_PROCESSES} and {PROCESS_ID} are not; "
                          f"set all three (or unset {COORDINATOR} for one process)")
    return "single", {}


def _answers(address: str) -> bool:
    """Whether anything accepts a connection at HOST:PORT."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except (OSError, ValueError):
        return False
    return True


def _is_this_host(addresses: list) -> bool:
    """Whether one of `addresses` (getaddrinfo's) is this host's: only a local address can be bound."""
    for family, _, _, _, sockaddr in addresses:
        with socket.socket(family) as s:
            try:
                s.bind((sockaddr[0], 0))
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:  # not a verdict (e.g. a link-local address without scope)
                    return True
            else:
                return True
    return False


def _why_not_met(address: str | None, index: int | None) -> str:
    """The likely reason why processes that met nobody within the timeout did not."""
    joined = "not every process joined: are they all running, with the same coordinator?"
    if address is None:
        return joined
    host = address.rpartition(":")[0].strip("[]")
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return f"the coordinator's host {host} does not resolve: is {address} right?"
    if index == 0 and not _is_this_host(addresses):
        return f"process 0 starts the coordinator on its own host, but {host} is another host: is {address} right?"
    if index and not _answers(address):
        return f"nothing answers at {address}: is process 0 running, on that host and port?"
    return joined


def _start(method: str, kwargs: dict) -> None:
    """`jax.distributed.initialize`, or one error line and status 1 after `INIT_TIMEOUT_S`: when its
    own timeout runs out, jaxlib aborts the process with a C++ check failure and a stack dump."""
    started, failed = threading.Event(), []

    def start():
        try:
            jax.distributed.initialize(**kwargs, initialization_timeout=int(INIT_TIMEOUT_S) + 60)
        except BaseException as e:  # raised again in the main thread
            failed.append(e)
        finally:
            started.set()

    # Started in a thread of its own: the main thread waits here, where a stop signal's handler runs
    # (inside jaxlib it ran only once the processes met, up to INIT_TIMEOUT_S later).
    threading.Thread(target=start, daemon=True).start()
    try:
        met = started.wait(INIT_TIMEOUT_S)
    except (cli.Signalled, KeyboardInterrupt) as e:  # said as cli.run says it, then out at once:
        # jaxlib's thread cannot be stopped, and would hold the exit
        line, status = cli.stop_message(e)
        print(line, file=sys.stderr, flush=True)
        os._exit(status)
    if failed:
        raise failed[0]
    if not met:
        address, index = kwargs.get("coordinator_address"), kwargs.get("process_id")
        where = f"{method}, coordinator {address or 'found by JAX'}"
        if index is not None:
            where += f", process {index} of {kwargs['num_processes']}"
        why = _why_not_met(address, index)
        print(f"error: jax.distributed did not start within {INIT_TIMEOUT_S:g} s ({where}); {why}",
              file=sys.stderr, flush=True)
        os._exit(1)  # jaxlib's thread waits on, and aborts the process if it gives up first


def initialize(cpu_devices_per_process: int | None = None) -> ProcessInfo:
    """Starts `jax.distributed` when the environment describes several processes; returns this
    process's facts. Idempotent: later calls return the first call's answer."""
    global _info
    if _info is not None:
        return _info
    if "HOLMES_LAUNCH_ID" in os.environ:
        # holmes_jax.launch's ranks get SIGTERM when it dies; a rank that a wrapper script started is
        # the shell's child, so it asks the same of the shell, which dies with the launcher.
        cli.term_when_parent_dies(os.getppid())
    method, kwargs = launch_method()
    if method != "single":
        check_local_gpus(method)  # one line before start-up, not jaxlib's failure when its backend starts
    local = nic.detect()
    _network[:] = network_settings(local)
    if CPU_DEVICES in os.environ:  # the launcher's --devices-per-process wins over the config
        cpu_devices_per_process = _int(os.environ, CPU_DEVICES, 1)
    if cpu_devices_per_process is not None:
        check_positive("cpu_devices_per_process", cpu_devices_per_process)
        try:
            jax.config.update("jax_num_cpu_devices", cpu_devices_per_process)
        except RuntimeError:
            if method != "single":
                raise
            # A backend already started in this single process (e.g. a test runner's): keep it.
    if method != "single":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption service takes SIGTERM over in C++ for its own sync point, which we do not
        # use (guard.StopVote stops all processes alike): a SIGTERM before the training loop (a
        # scheduler's, while a resumed run compiled) was noted there and the run trained on.
        jax.config.update("jax_enable_preemption_service", False)
        if not jax.distributed.is_initialized():
            # Process 0 starts the coordinator; jaxlib answers a port in use with a traceback, or
            # at times a segmentation fault, so look first.
            address = kwargs.get("coordinator_address")
            if kwargs.get("process_id") == 0 and _port_in_use(port := int(address.rpartition(":")[2])):
                raise ConfigError(f"{COORDINATOR} = {address!r}: port {port} is in use on this host, process 0's, where "
                                  "the coordinator starts; allowed: a free port (holmes_jax.launch: leave --port out)")
            try:
                _start(method, kwargs)
            except RuntimeError as e:  # the port taken after all (a race, or one JAX derives), an Open MPI URI
                raise RunError(f"jax.distributed did not start ({method}, coordinator {address or 'found by JAX'}): "
                               f"{str(e).strip().splitlines()[0]}") from None
    _info = ProcessInfo(jax.process_index(), jax.process_count(), socket.gethostname(), local.nic_class,
                        local.gbps, jax.local_device_count(), method)
    return _info


def exchange_process_facts(info: ProcessInfo) -> list[dict]:
    """Every process's `info.facts()`, ordered by process index, the same list on every process.
    All processes must call it."""
    return [json.loads(text) for text in every_process("facts", json.dumps(info.facts()))]


def exchange_nics(local: nic.Nic) -> list[nic.Nic]:
    """Every process's Nic, in process order. All processes must call it."""
    return [nic.Nic(**json.loads(text)) for text in every_process("nic", json.dumps(dataclasses.asdict(local)))]


_exchanges: collections.Counter = collections.Counter()  # calls of every_process per name, in this process


FAILED = "holmes_jax/failed"  # under it, each process that stopped on an error says why (`errors_told`)


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


@contextlib.contextmanager
def errors_told() -> Iterator[None]:
    """Runs the block; an error that ends it on this process is told to the others, whose waits in
    `every_process` then end with an error of the same kind (`ConfigError` or `RunError`: the same
    exit status) that names it. They waited for this process until INIT_TIMEOUT_S (five minutes)
    at the next exchange, or for ever in a device collective."""
    try:
        yield
    except Exception as e:
        if jax.process_count() > 1:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            kind = "ConfigError" if isinstance(e, ConfigError) else "RunError"
            with contextlib.suppress(Exception):  # the coordination service is gone (process 0 died)
                _client().key_value_set(f"{FAILED}/{jax.process_index()}", f"{kind} {why}")
        raise


def every_process(name: str, text: str, timeout_s: float = INIT_TIMEOUT_S, signals: bool = True) -> list[str]:
    """Every process's `text`, in process order (all processes call it, in the same order),
    through jax.distributed's key-value store, as JAX's own multihost_utils and orbax use it: no
    device collective, so no NCCL communicator, which across NIC classes could not connect.
    `timeout_s`: how long a process waits for the slowest one to get there.

    It is also a vote on stopping: where a process holds a stop signal (`cli.SignalHold`, as a run
    does before its loop), every process raises it here (the largest number), so all stop at
    the same point. One that stopped alone would leave the others waiting for it in a device
    collective (orbax's, a restore's), which no signal interrupts. Not with `signals=False`: in
    the loop, the stop vote after each step decides."""
    if jax.process_count() == 1:  # no jax.distributed, nothing to exchange
        return [text]
    client = _client()
    _exchanges[name] += 1
    prefix = f"holmes_jax/{name}/{_exchanges[name]}"  # a key is set once: each call has its own
    client.key_value_set(f"{prefix}/{jax.process_index()}", f"{signals and cli.held_signal() or 0} {text}")
    deadline = time.monotonic() + timeout_s
    votes, texts = zip(*(_wait_for(client, f"{prefix}/{i}", deadline, signals).split(" ", 1)
                         for i in range(jax.process_count())))
    if signals and (signum := max(map(int, votes))):
        raise cli.stop(signum)
    return list(texts)


def meet(name: str) -> None:
    """Returns once every process has called it; a stop signal any of them holds stops all of them
    here (`every_process`)."""
    every_process(name, "")


class Lockstep:
    """A stretch of a multi-process run in which every process takes part in each device
    collective: the training loop. An error that ends it on this process alone (a bug, a read that
    failed, a device fault) leaves the others waiting for this one in a collective (gloo's, NCCL's)
    that no signal interrupts, and JAX's shutdown barrier at this process's exit would wait for
    them in turn, for minutes. Such an error ends the process at once after its line
    (`cli.leave_at_once`): its connections close, the others' collective fails, and they end too.
    The errors every process raises alike, at the same point, are raised inside `agreed()`: those
    processes all leave through the barrier, the normal way."""

    def __init__(self):
        self.left = False  # this process left it alone, on an error
        self._agreed: BaseException | None = None

    def __enter__(self) -> "Lockstep":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None and error is not self._agreed and jax.process_count() > 1:
            self.left = True
            # Process 0's end takes the coordination service with it, and jaxlib then ends every
            # other process with a fatal log: those that leave too (a write failed) print first.
            cli.leave_at_once(LAST_TO_LEAVE_S if jax.process_index() == 0 else 0.0)

    @contextlib.contextmanager
    def agreed(self) -> Iterator[None]:
        try:
            yield
        except BaseException as e:
            self._agreed = e
            raise


def _wait_for(client, key: str, deadline: float, signals: bool = True) -> str:
    """`key`'s value once set, waited for a second at a time until `deadline`. A stop signal ends
    the wait between two of them, held or not (inside one, only at its end: a process whose peer
    had stopped waited out the whole timeout before it stopped too). The process that sets `key`
    has not come yet, so it cannot pass this point and wait for this one in a device collective:
    a held signal it got too stops it here when it comes (where `signals`). So does an error that
    another process told (`errors_told`)."""
    while True:
        wait_ms = max(1, int(min(deadline - time.monotonic(), 1.0) * 1000))
        try:
            return client.blocking_key_value_get(key, wait_ms)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e) or time.monotonic() >= deadline:
                raise
        if signals and (signum := cli.held_signal()):
            raise cli.stop(signum)
        if told := client.key_value_dir_get(FAILED):
            process, text = min((int(key.rpartition("/")[2]), text) for key, text in told)
            kind, why = text.split(" ", 1)
            raise (ConfigError if kind == "ConfigError" else RunError)(
                f"process {process} stopped on an error (see its output): {why}")


def check_same_settings(settings: str) -> None:
    """Raises `ConfigError` on every process when any process's `settings` (its operative
    config.gin text) differ from process 0's. All processes must call it, once the configs are
    read. Processes given other flags or gin files (a wrapper that adds flags per rank, a gin file
    that differs between hosts) build other steps, or evaluate and save at other steps, and then
    wait for each other's collectives for ever."""
    texts = every_process("settings", settings)
    differ = [i for i, text in enumerate(texts) if text != texts[0]]
    if not differ:
        return
    first = differ[0]
    diff = list(difflib.unified_diff(texts[0].splitlines(), texts[first].splitlines(), lineterm="", n=0))[2:]

    def lines(sign: str) -> str:
        return "; ".join([line[1:] for line in diff if line.startswith(sign)][:SHOWN_SETTINGS]) or "nothing"

    raise ConfigError(f"the processes were given different settings: process {first} has {lines('+')} where "
                      f"process 0 has {lines('-')} (processes that differ from process 0: {', '.join(map(str, differ))}); "
                      "allowed: the same command, flags and gin files (with the same contents) for every process")


def check_same_data(identity: str) -> None:
    """Raises `ConfigError` on every process when any process's data `identity` (the data's
    `describe_identity`: token count, vocabulary, a hash of sampled ids) differs from process 0's.
    All processes must call it, once the data is loaded. Hosts with different copies of a corpus
    would otherwise build each global batch of rows from different data, without a word (or, with
    other vocabularies, build other models and wait for each other for ever)."""
    identities = every_process("data", identity)
    differ = [i for i, text in enumerate(identities) if text != identities[0]]
    if not differ:
        return
    raise ConfigError(f"the processes read different data: process {differ[0]} has {identities[differ[0]]} where "
                      f"process 0 has {identities[0]} (processes that differ from process 0: "
                      f"{', '.join(map(str, differ))}); allowed: the same data for every process (DataConfig.source "
                      "with the same contents on every host)")
