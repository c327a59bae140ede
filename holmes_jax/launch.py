"""`python -m holmes_jax.launch -n N [options] -- CMD ...`: N local processes of one JAX job.

Each process gets `HOLMES_COORDINATOR` (127.0.0.1 and a free port), `HOLMES_NUM_PROCESSES`,
`HOLMES_PROCESS_ID` (what `holmes_jax.distributed.initialize` reads), optionally its CPU device
count and NIC class, and `HOLMES_LAUNCH_ID`, which marks this launch's processes: a stop reaches
what they started in sessions of their own (`setsid`, a daemon) too, as long as it kept the mark.
Output is streamed line by line as "[rank i] ...". When one process fails the others are stopped
(SIGTERM, then SIGKILL after a grace period) and its status is returned. SIGINT (Ctrl-C), SIGTERM
or SIGHUP to the launcher is passed on to all (a training process saves a checkpoint and exits),
then SIGKILL after the grace period; the status is 128 + the signal. If the launcher itself is
killed (even SIGKILL), its processes get SIGTERM from the kernel (Linux parent-death signal), so
none runs on orphaned: the processes it starts, and a holmes_jax process (train, profile) that a
wrapper script of theirs started, once the script's shell has gone. Status 0 only when all succeed.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable, Sequence

from holmes_jax import cli
from holmes_jax.config import ConfigError, check_positive
from holmes_jax.planning.topology import NIC_CLASSES

TIMED_OUT = 124  # the status `timeout(1)` uses
GRACE_S = 30.0  # after a stop signal, before SIGKILL: time for a checkpoint to be written
LAUNCH_ID = "HOLMES_LAUNCH_ID"  # marks one launch's processes, to find those that left their group


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# XLA:CPU allocates a step's buffers afresh every step. With glibc's defaults, big buffers and all
# those allocated on XLA's worker threads (which get arenas of their own) are mapped with mmap and
# unmapped on free, so every step page-faults its whole working set back in; in a VM that was up to
# half of a CPU step, growing with a stage's padded depth (docs/uneven.md). One arena that never
# maps, trims or shrinks keeps the pages from step to step. The user's own GLIBC_TUNABLES wins.
CPU_MALLOC_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4000000000:"
                       "glibc.malloc.top_pad=1073741824")


def process_env(rank: int, n: int, coordinator: str, devices_per_process: int | None = None,
                nic_class: str | None = None, extra: dict | None = None, launch_id: str | None = None) -> dict:
    """The environment of process `rank`: ours on top of this process's, then `extra`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HOLMES_COORDINATOR=coordinator,
               HOLMES_NUM_PROCESSES=str(n), HOLMES_PROCESS_ID=str(rank))
    if launch_id is not None:
        env[LAUNCH_ID] = launch_id
    if devices_per_process is not None:
        # JAX_NUM_CPU_DEVICES for any JAX program; HOLMES_CPU_DEVICES wins over train's config.
        env.update(JAX_NUM_CPU_DEVICES=str(devices_per_process), HOLMES_CPU_DEVICES=str(devices_per_process))
        env.setdefault("GLIBC_TUNABLES", CPU_MALLOC_TUNABLES)
    if nic_class is not None:
        env["HOLMES_NIC_CLASS"] = nic_class
    env.update(extra or {})
    return env


def check_arguments(cmd, n, devices_per_process, port, nic_classes, grace_s, timeout_s, env) -> None:
    """ConfigError for launcher arguments that cannot run (also the emulated cluster's, before it builds)."""
    if not cmd:
        raise ConfigError("no command to run; give it after --, e.g. -- python -m holmes_jax.train")
    for name, value in (("-n", n), ("--devices-per-process", devices_per_process)):
        check_positive(name, value, allow_none=True)
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"--port = {port} is not allowed; allowed: 1 .. 65535")
    # A negative or NaN grace would SIGKILL at once (no checkpoint); a NaN timeout never fires.
    if not grace_s >= 0:
        raise ConfigError(f"--grace = {grace_s:g} is not allowed; allowed: seconds >= 0")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"--timeout = {timeout_s:g} is not allowed; allowed: seconds > 0")
    for key in env or {}:  # they would override the job's own: a count not -n, one rank twice
        if key in ("HOLMES_COORDINATOR", "HOLMES_NUM_PROCESSES", "HOLMES_PROCESS_ID", LAUNCH_ID):
            raise ConfigError(f"--env {key}=... is not allowed: the launcher sets it for each process (-n, --port); "
                              "allowed: any other variable")
    if nic_classes is not None:
        if len(nic_classes) != n:
            raise ConfigError(f"--nic-classes lists {len(nic_classes)} classes for -n {n} processes; give one per process")
        for c in nic_classes:
            if c not in NIC_CLASSES:
                raise ConfigError(f"--nic-classes: {c!r} is not allowed; choose from {', '.join(NIC_CLASSES)}")


def _say(text: str, stream, lock: threading.Lock) -> None:
    # Whatever becomes of our output (`| head` exited, a full disk, a terminal gone: an OSError or,
    # under cli.run, OutputFailed) the job runs on: a pump that raised would stop reading its pipe,
    # and the rank writing to it would block for ever.
    with lock:
        try:
            try:
                print(text, file=stream, flush=True)
            except UnicodeEncodeError:  # an output encoding without some character (latin-1)
                print(text.encode("ascii", "backslashreplace").decode("ascii"), file=stream, flush=True)
        except Exception:
            pass


# What gloo prints on stdout for every context it connects, in every process (dozens a run): left
# out where all the peers it expected connected; a shortfall is shown. Its threads write their
# messages in pieces, which can land in each other's lines ('[Gloo] Rank [Gloo] Rank 0 is ...'):
# a line of such pieces alone is one of them too.
_GLOO_PIECES = re.compile(r"(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. "
                          r"|Expected number of connected peer ranks is : )+")
_GLOO_COUNTS = re.compile(r"connected to (\d+) peer ranks\. Expected number of connected peer ranks is : (\d+)")


def gloo_connected(line: str) -> bool:
    """Whether `line` holds only gloo's 'connected' messages (or pieces of them), none short of a peer."""
    return (bool(_GLOO_PIECES.fullmatch(line)) and not line.isdigit()
            and all(have == expected for have, expected in _GLOO_COUNTS.findall(line)))


def _pump(pipe, prefix: str, stream, lock: threading.Lock) -> None:
    # Reads to the end even when `stream` is gone: a process blocked on a full pipe would hang the job.
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if not gloo_connected(line):
            _say(prefix + line, stream, lock)
    pipe.close()


def _exit_code(p: subprocess.Popen) -> int | None:
    """`p`'s return code (Popen's: -s when signal s killed it) once it has exited, else None.
    Left unreaped until the job is over: while it is a zombie its pid, which names its process
    group, cannot be given to another process, which a stop signal to the group would reach."""
    if p.returncode is not None or not hasattr(os, "waitid"):  # (macOS before Python 3.13)
        return p.poll()
    try:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return p.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _processes() -> list[tuple[int, int, bool]] | None:
    """(pid, process group, alive: not a zombie) of every process /proc shows; None without /proc."""
    try:
        pids = [pid for pid in os.listdir("/proc") if pid.isdigit()]
    except OSError:
        return None
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state, _parent, group = f.read().rpartition(b")")[2].split()[:3]  # after the name, which may hold ')'
        except (OSError, ValueError):  # gone
            continue
        found.append((int(pid), int(group), state != b"Z"))
    return found


def _running_groups(groups: set[int]) -> set[int]:
    """Those of `groups` (the ranks' process groups) in which something still runs: the rank, or
    what it started (a wrapper script's python outlives the shell that a SIGTERM ends at once, and
    must get its grace period and its SIGKILL too). Zombies do not count: the ranks are reaped only
    at the end, and where we are a container's PID 1 or a subreaper, a wrapper's exited python is
    ours to reap."""
    found = _processes()
    if found is None:  # a group whose members are all zombies counts here
        return {group for group in groups if _group_exists(group)}
    return {group for _pid, group, alive in found if alive and group in groups}


def _group_exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _marked(pid: int | str, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:  # empty once it has exited (a zombie)
            return mark in f.read().split(b"\0")
    except OSError:  # gone, another user's, or no /proc
        return False


def _stop(procs: list[subprocess.Popen], first: int, grace_s: float, mark: bytes = b"") -> None:
    """Signals each rank's process group still running, and each other process marked with `mark`
    (what the ranks started that left their group: `setsid`, a daemon), with `first`, then SIGKILL
    after `grace_s`. Each process gets each signal once. Then reaps the ranks."""
    groups = {p.pid for p in procs}
    for sig in (first, signal.SIGKILL):
        for group in _running_groups(groups):
            try:
                os.killpg(group, sig)  # its own session: reaches whatever it started too
            except ProcessLookupError:
                pass
        strays = [pid for pid, group, alive in _processes() or [] if alive and group not in groups
                  and _marked(pid, mark)] if mark else []
        for pid in strays:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while ((_running_groups(groups) or any(_marked(pid, mark) for pid in strays))
               and time.monotonic() < deadline):
            time.sleep(0.05)
    for p in procs:
        p.poll()


def first_failure(codes: Sequence[int | None]) -> tuple[int, int] | None:
    """(rank, return code) of the rank to blame among those found failed (a Popen return code, or
    None: running). Of several found at once, the first killed by a signal (the OOM killer?): the
    others' errors are often what its end caused (a connection reset); else the lowest rank."""
    failed = sorted((code >= 0, rank, code) for rank, code in enumerate(codes) if code not in (None, 0))
    return failed[0][1:] if failed else None


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as shells report it


def _how(code: int) -> str:
    """How a process ended, from its Popen return code: a signal is named (SIGKILL: the OOM killer?)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (status {_status(code)})"
        except ValueError:  # a real-time signal has no name
            pass
    return f"exited with status {_status(code)}"


def launch(cmd: Sequence[str], n: int, devices_per_process: int | None = None, port: int | None = None,
           env: dict | None = None, nic_classes: Sequence[str] | None = None, coordinator_host: str = "127.0.0.1",
           wrap: Callable[[int], list[str]] | None = None, grace_s: float = GRACE_S,
           timeout_s: float | None = None) -> int:
    """Runs `cmd` as processes 0 .. n-1 of one job and returns the job's exit status.
    `wrap(rank)` is a command prefix per process (the emulator's `ip netns exec HOST ...`);
    `timeout_s` stops everything after that long, returning 124."""
    check_arguments(cmd, n, devices_per_process, port, nic_classes, grace_s, timeout_s, env)
    coordinator = f"{coordinator_host}:{port or free_port()}"
    launch_id = uuid.uuid4().hex
    out, err, lock = sys.stdout, sys.stderr, threading.Lock()
    procs, pumps = [], []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first_signal, code = signal.SIGTERM, None
    # Ctrl-C, a SIGTERM or a SIGHUP to us (a job scheduler's, a closed terminal's) must reach the
    # children, which live in their own sessions; set explicitly, since a background shell may have
    # ignored SIGINT. A SIGHUP ignored from the start is `nohup`'s: the children inherit that and
    # train on when the terminal closes, so it is left alone.
    handled = cli.stop_signals_to_catch() if threading.current_thread() is threading.main_thread() else ()
    # A stop is recorded, not raised, and acted on by the loops below (the first one wins): raised from
    # the handler, it could land in Popen's fork hooks (logging's lock release), where Python prints
    # an exception as ignored, and the job ran on to the end with status 0.
    stops: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum)) for sig in handled}
    try:
        # All started before any output thread: a preexec_fn must not run while other threads do.
        for rank in range(n):
            if stops:
                break
            penv = process_env(rank, n, coordinator, devices_per_process, nic_classes and nic_classes[rank], env,
                               launch_id)
            argv = [*(wrap(rank) if wrap else []), *cmd]
            try:
                procs.append(subprocess.Popen(argv, env=penv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, start_new_session=True,
                                              preexec_fn=functools.partial(cli.term_when_parent_dies,
                                                                           os.getpid())))
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM):  # our limits, not the command
                    raise ConfigError(f"-n {n}: cannot start process {rank}: {e.strerror}; allowed: as many "
                                      "processes as this host's limits take (ulimit -n, ulimit -u)") from None
                raise ConfigError(f"cannot run {argv[0]!r}: {e.strerror}") from None
        for rank, p in enumerate(procs):
            for pipe, stream in ((p.stdout, out), (p.stderr, err)):
                t = threading.Thread(target=_pump, args=(pipe, f"[rank {rank}] ", stream, lock), daemon=True)
                t.start()
                pumps.append(t)
        while code is None:
            codes = [_exit_code(p) for p in procs]
            failed = first_failure(codes)
            if stops:
                first_signal, code = stops[0], 128 + stops[0]
                _say(f"launch: {signal.Signals(first_signal).name} passed on to all; SIGKILL after {grace_s:g} s",
                     err, lock)
            elif failed:
                code = _status(failed[1])
                # which rank failed first, also when the others ended too before we looked; a lone
                # process's own error line says why it failed, but a killed one (the OOM killer) says nothing
                if n > 1 or failed[1] < 0:
                    rest = "; stopping the others" if None in codes else ""
                    _say(f"launch: rank {failed[0]} {_how(failed[1])}{rest}", err, lock)
            elif all(c == 0 for c in codes):
                code = 0
            elif deadline is not None and time.monotonic() > deadline:
                code = TIMED_OUT
                _say(f"launch: still running after {timeout_s:g} s; stopping all", err, lock)
            else:
                time.sleep(0.05)
    finally:
        _stop(procs, first_signal, grace_s, f"{LAUNCH_ID}={launch_id}".encode())  # a second Ctrl-C is only recorded
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for t in pumps:
            t.join(timeout=5)
    return code


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise ConfigError(f"--env {text!r} is not allowed; allowed: KEY=VALUE")
    return key, value


def parser(prog: str = "python -m holmes_jax.launch") -> argparse.ArgumentParser:
    p = cli.Parser(prog=prog, description="Runs CMD as N local processes of one JAX job.",
                usage=f"{prog} -n N [options] -- CMD ...")
    p.add_argument("-n", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, help="CPU devices each process exposes")
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment, repeatable")
    p.add_argument("--nic-classes", help="one NIC class per process, comma-separated, e.g. infiniband,roce")
    add_stop_flags(p)
    return p


def add_stop_flags(p: argparse.ArgumentParser) -> None:
    """--grace and --timeout, which the emulated cluster's command line passes on to `launch`."""
    p.add_argument("--grace", type=float, default=GRACE_S,
                   help=f"seconds the processes get to save and exit after a stop signal, before SIGKILL "
                        f"(default {GRACE_S:g})")
    p.add_argument("--timeout", type=float, help="stop everything after this many seconds (status 124)")


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(options, command) around the first `--`."""
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            return argv, []
        raise ConfigError("no command to run; give it after --, e.g. -- python -m holmes_jax.train")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str]) -> int:
    opts, cmd = split_command(argv)
    args = parser().parse_args(opts)
    return launch(cmd, args.n, args.devices_per_process, args.port, dict(map(_key_value, args.env)),
                  args.nic_classes.split(",") if args.nic_classes is not None else None,  # '' is no class
                  grace_s=args.grace, timeout_s=args.timeout)


if __name__ == "__main__":
    cli.run(main)
