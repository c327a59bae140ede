"""What every command-line entry point shares: one stderr line and an exit status that says why.

  0    done
  1    a failure during the run (`RunError`): the loss stayed non-finite, a disk is full
  2    bad input (`ConfigError`): a config field, a flag, a topology file, a workdir, a checkpoint
       that does not fit the configured model
  128 + N  stopped by signal N after saving (`Stopped`): 130 SIGINT (Ctrl-C), 143 SIGTERM,
       129 SIGHUP, 141 the reader of the output left (`| head`; SIGPIPE); rerun the same command to
       resume
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, NoReturn

from holmes_jax.config import ConfigError


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def term_when_parent_dies(parent: int) -> None:
    """Has Linux send this process SIGTERM (a run saves and exits) when its parent `parent` dies,
    however it dies; elsewhere nothing. Safe in a `preexec_fn`."""
    if _libc is None:
        return
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(128 + signal.SIGTERM)


class RunError(Exception):
    """A failure during a run, not bad input: `error: ...` and exit status 1."""


class OutputFailed(RunError):
    """stdout or a run's metrics log cannot be written (a full disk): the command ends with
    `error: cannot write the output: ...` (stdout's later writes go nowhere) or `error: cannot
    write PATH: ...`, and status 1."""


class _CheckedOutput:
    """stdout, whose failed writes and flushes other than a reader that left (BrokenPipeError,
    kept) raise `OutputFailed`: an OSError from a print, anywhere in a command, was a traceback.
    It passes on whole lines, each in one write (the rest at a flush): print writes its text and
    its newline apart, and unbuffered (under the launcher) gloo's lines, written to the same
    stdout from C++, landed between them."""

    def __init__(self, stream):
        self._stream, self._line = stream, ""

    def _checked(self, method, *args):
        try:
            return method(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            drop_output()  # or every later print, and the exit's flush, fails again
            raise OutputFailed(f"cannot write the output: {e.strerror or e}") from None

    def write(self, text: str) -> int:
        lines, newline, self._line = (self._line + text).rpartition("\n")
        if newline:
            self._checked(self._stream.write, lines + newline)
        return len(text)

    def flush(self) -> None:
        if self._line:
            self._checked(self._stream.write, self.pop_partial_line())
        self._checked(self._stream.flush)

    def pop_partial_line(self) -> str:
        line, self._line = self._line, ""
        return line

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


class Stopped(Exception):
    """A run stopped by signal `signum` after saving what it had: exit status 128 + signum."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.status = 128 + signum


def fail(message: str, status: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


class Parser(argparse.ArgumentParser):
    """argparse for our commands: a bad flag is one `error:` line and status 2 (through `run`),
    not argparse's usage dump."""

    def error(self, message):
        if message.startswith("unrecognized arguments"):  # argparse names the flag, not the ones there are
            flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
            message += f"; allowed: {', '.join(flags)}"
        raise ConfigError(message)


def positive_int(text: str) -> int:
    """An argparse `type` for positive integer flags."""
    if not text.isdecimal() or int(text) < 1:  # isdigit: also "²", which int() refuses
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a positive integer")
    return int(text)


def stop_message(e: Signalled | KeyboardInterrupt) -> tuple[str, int]:
    """The line and status a stop signal ends a command with, before it took the signal over."""
    if isinstance(e, Signalled):
        return f"stopped by {signal.Signals(e.signum).name}", 128 + e.signum
    return "interrupted", 128 + signal.SIGINT


def drop_output() -> None:
    """Sends stdout to /dev/null once its reader has left, so that later prints and the exit's
    flush do not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _devnull_stdout():
    """stdout for a command started with it closed (`cmd >&-`, where Python's is None and a print
    failed with a traceback): /dev/null on descriptor 1, which the next file opened would take."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != 1:
        os.dup2(devnull, 1)
        os.close(devnull)
    return open(1, "w", closefd=False)


class Signalled(BaseException):  # not an Exception: no `except Exception` on the way out swallows it
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def ignore_signal(signum, frame) -> None:
    """A handler that does nothing, for a stop signal after the first: unlike SIG_IGN, one that had
    already arrived (Ctrl-C and a kill together) finds it, instead of Python printing 'Signal N
    ignored due to race condition' with a traceback."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_signals_to_catch() -> list[int]:
    """The stop signals a command takes over: all but a SIGHUP ignored from the start, `nohup`'s (a
    closed terminal must not stop the run). An ignored SIGINT is taken over: a shell ignores it for
    `cmd &` in a script, and a `kill -INT` must still stop the command, at any point, in one line."""
    return [sig for sig in STOP_SIGNALS if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN]


def stop(signum: int) -> Signalled | KeyboardInterrupt:
    """What a stop signal raises before a command took it over: Ctrl-C is Python's KeyboardInterrupt."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Signalled(signum)


def _stop(signum, frame) -> NoReturn:
    # The first stop wins: a second one (Ctrl-C and a kill together) raised again inside the
    # handling of the first, which ended with a traceback and status 1.
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is _stop:
            signal.signal(sig, ignore_signal)
    raise stop(signum)


class SignalHold:
    """A context in which SIGINT, SIGTERM and SIGHUP set `signum` (the first one wins) instead of
    interrupting; the previous handlers come back on exit. One entered inside another starts with
    the signal the outer one holds. A SIGHUP that is ignored (`nohup`) stays ignored. Outside the
    main thread Python cannot handle signals, so there it does nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def _set(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> "SignalHold":
        self.signum = held_signal()
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._set) for sig in stop_signals_to_catch()}
        _holds.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _holds.remove(self)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


_holds: list[SignalHold] = []  # the holds entered now, innermost last


def held_signal() -> int | None:
    """The stop signal that the innermost `SignalHold` entered now holds: None outside one, or
    where it caught none."""
    return _holds[-1].signum if _holds else None


_leaving_at_once: float | None = None  # see leave_at_once


def leave_at_once(linger_s: float = 0.0) -> None:
    """Makes `run` end this process as soon as its error is printed, `linger_s` later, without
    Python's exit handlers: among them jax.distributed's shutdown barrier, which waits for every
    process of the job, where the others may be waiting for this one in a device collective
    (`distributed.Lockstep`)."""
    global _leaving_at_once
    _leaving_at_once = linger_s


def run(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> NoReturn:
    """Runs `main(argv)`, turning our exceptions into one stderr line and the status above. A
    SIGTERM or SIGHUP that no command took over unwinds it (its `finally` blocks clean up) and
    ends it with one line, as Ctrl-C does; see `stop_signals_to_catch` for the ignored ones. A
    handler the caller set stays. After `leave_at_once`, the process ends on that line (or an
    unexpected error's traceback) at once."""
    global _leaving_at_once
    _leaving_at_once = None  # not an earlier run's in this process (a test's)
    try:
        _run(main, argv)
    except SystemExit as e:
        if _leaving_at_once is not None:
            _leave(e.code if isinstance(e.code, int) else 1, _leaving_at_once)
        raise
    except BaseException:
        if _leaving_at_once is not None:
            traceback.print_exc()
            _leave(1, _leaving_at_once)
        raise


def _leave(status: int, linger_s: float) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that left, a closed stream
            stream.flush()
    for sig in STOP_SIGNALS:  # a launcher's stop, as another process ends first, changes nothing now
        signal.signal(sig, ignore_signal)
    time.sleep(linger_s)
    os._exit(status)


def _run(main: Callable[[list[str]], int | None], argv: list[str] | None) -> NoReturn:
    untouched = (signal.default_int_handler, signal.SIG_DFL, signal.SIG_IGN)
    previous = {sig: signal.signal(sig, _stop) for sig in stop_signals_to_catch()
                if any(signal.getsignal(sig) is h for h in untouched)}
    stdout = sys.stdout or _devnull_stdout()
    sys.stdout = checked = _CheckedOutput(stdout)
    try:
        code = main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # now: at exit, a failure was Python's 'Exception ignored ...' and status 120
    except (Signalled, KeyboardInterrupt) as e:  # a stop before a command took the signal over: nothing to save yet
        line, status = stop_message(e)
        print(line, file=sys.stderr)
        raise SystemExit(status) from None
    except ConfigError as e:
        fail(str(e))
    except RunError as e:
        fail(str(e), 1)
    except Stopped as e:
        print(str(e), file=sys.stderr)
        raise SystemExit(e.status) from None
    except BrokenPipeError:  # the reader of our output left (`| head`): end quietly, as on SIGPIPE
        drop_output()
        raise SystemExit(128 + signal.SIGPIPE) from None
    finally:
        sys.stdout = stdout
        with contextlib.suppress(OSError):  # a line without its newline yet, as an error ends the command
            stdout.write(checked.pop_partial_line())
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise SystemExit(code or 0)


def path(text: str) -> str:
    """An argparse `type` for a file or folder: '' (an unset shell variable) would be the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a path")
    return text


def non_negative_int(text: str) -> int:
    """An argparse `type` for integer flags that may be 0."""
    if not text.isdecimal():
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a non-negative integer")
    return int(text)


def new_folder(out: str | Path) -> Path:
    """`out` (absolute) once it is free for a command's `--out`: new, or an empty folder; ConfigError otherwise."""
    if not str(out):
        raise ConfigError("--out '' is not allowed; allowed: a new or empty folder")
    path = Path(out).expanduser().resolve()  # `.` has no name to put a temporary folder beside
    try:
        blocked = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        taken = path.exists() and (not path.is_dir() or any(path.iterdir()))
    except OSError as e:  # a folder on the way without permission: was a traceback
        raise ConfigError(f"--out {str(path)!r} cannot be written: {e.strerror or e}") from None
    if blocked:  # mkdir would say only 'File exists'
        raise ConfigError(f"--out {str(path)!r} cannot be written: {str(blocked)!r} is a file, not a folder")
    if taken:
        raise ConfigError(f"--out {str(path)!r} already exists and is not an empty folder; remove it or choose another")
    return path


def _remove_leftovers(folder: Path, prefix: str) -> None:
    """Removes `folder`'s PREFIX<pid>.tmp whose process is gone: a killed command's temporary output
    (its `finally` never ran), which nothing else would ever remove."""
    for old in folder.iterdir():
        pid = old.name[len(prefix):-len(".tmp")]
        if old.name.startswith(prefix) and old.name.endswith(".tmp") and pid.isdecimal() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover: an earlier call of this process, or a process before it with our pid
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no pid can be
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def output_folder(out: str | Path, last: str) -> Iterator[Path]:
    """Yields a temporary folder beside `out` (see `new_folder`) to write into, then moves it to
    `out`: one rename, or into an existing empty folder (the working one, say) file by file with
    `last`, the file readers look for, last. A failure leaves no `out` and no temporary folder; the
    one a killed command left (beside the same `out`) goes at the next."""
    path = new_folder(out)
    prefix = f".{path.name}.{socket.gethostname()}."  # the host too: on a shared disk a pid is only this host's
    tmp = path.parent / f"{prefix}{os.getpid()}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(path.parent, prefix)
        tmp.mkdir()
        yield tmp
        if path.exists():
            for f in sorted(tmp.iterdir(), key=lambda f: f.name == last):
                os.replace(f, path / f.name)
        else:
            os.replace(tmp, path)
    except OSError as e:  # the output side: readers report their own errors
        # A full disk is a failure of the run (status 1, as for a checkpoint); an unwritable path is bad input.
        error = RunError if e.errno in (errno.ENOSPC, errno.EDQUOT) else ConfigError
        raise error(f"--out {str(path)!r} cannot be written: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_file(out: Path, text: str | bytes) -> None:
    """`text` (UTF-8 if str) into `out` whole or not at all: written beside it, then renamed over it,
    so that a full disk or a kill mid-write leaves the earlier file as it was, never half of one."""
    out, data = Path(out), text.encode() if isinstance(text, str) else text
    if out.exists() and not out.is_file():  # /dev/null, a pipe: nothing to rename over
        out.write_bytes(data)
        return
    out = out.resolve() if out.is_symlink() else out  # the file it points to, the link kept
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
