"""Checkpoints through orbax's CheckpointManager: periodic async saves, keep the newest K, and
restore onto any mesh (the restore target's shardings decide where each array lands).

Resuming checks what it restores: a checkpoint that cannot be read is set aside
(`<step>.damaged`) and the next older one is used, unless the error is this run's (no permission,
no memory), which ends the run and leaves the checkpoint; one whose array shapes do not fit the
configured model is a `ConfigError`, found from its metadata before any data is read. Several
processes agree: they restore the newest step every one of them could read, and set aside each
step any of them could not. A save that fails (a full disk) is a `RunError`, one written in the
background too, found after the step it fails in (`failed_write`; where it failed on some
processes only, the others' writes wait in orbax's barrier until it times out, 20 minutes after the
save began: the run leaves that save behind, and waits for its last one with the others,
`wait_with_others`). One run at a time writes a checkpoints directory: the run
holds its workdir's lock (`holmes_jax.train.lock_workdir`) before it makes a `Checkpointer`."""

from __future__ import annotations

import gc
import glob
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from holmes_jax import distributed
from holmes_jax.cli import RunError
from holmes_jax.config import CheckpointConfig, ConfigError

SHOWN_MISMATCHES = 4  # arrays named in the error when a checkpoint does not fit
STATE_FOLDER = "default"  # in a step's directory: orbax's folder for the one item we save
READ_WAIT_S = 4 * 3600  # how long processes wait for each other's checkpoint reads: a big one on slow storage


class _QuietOrbax(logging.Filter):
    """Drops orbax's log records: it logs each failed save with tracebacks from several threads,
    and every failure reaches us as an exception that we report in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" in record.pathname:
            return False
        # asyncio's "exception was never retrieved" for the futures of orbax's (and TensorStore's)
        # failed writes (a full disk) and reads (a damaged checkpoint), and its "Task was destroyed
        # but it is pending!" for an orbax task that a failed save left unfinished when the process
        # ends (seen with several processes). Only orbax runs asyncio in our processes, and the
        # failure reaches us through its call.
        if record.name != "asyncio":
            return True
        message = record.getMessage()
        pending_orbax_task = "Task was destroyed but it is pending" in message and f"{os.sep}orbax{os.sep}" in message
        return not ("exception was never retrieved" in message or pending_orbax_task)


logging.getLogger("absl").addFilter(_QuietOrbax())
logging.getLogger("asyncio").addFilter(_QuietOrbax())


def _is_closed_loop(error: BaseException | None) -> bool:
    """After orbax's background write fails (a full disk), its event loop is closed while
    TensorStore's other writes still finish; each of their callbacks then raises this on a native
    thread, where TensorStore prints it as a bare traceback of asyncio frames only. The failure
    itself reaches us through orbax and is reported in one line."""
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and all(f"{os.sep}asyncio{os.sep}" in frame.filename for frame in frames)


def _is_failed_read(unraisable) -> bool:
    """When one array of a restore cannot be read (a damaged checkpoint), orbax leaves its other
    reads behind unfinished; each raises its error, with a TensorStore spec dump, again when the
    garbage collector closes it (thousands of lines on stderr). The failure itself reaches us
    through the restore and is reported in one line."""
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine's
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _quiet(unraisable, hook) -> None:
    if not (_is_closed_loop(unraisable.exc_value) or _is_failed_read(unraisable)):
        hook(unraisable)


_excepthook, _unraisablehook = sys.excepthook, sys.unraisablehook
sys.excepthook = lambda kind, error, tb: None if _is_closed_loop(error) else _excepthook(kind, error, tb)
sys.unraisablehook = lambda unraisable: _quiet(unraisable, _unraisablehook)


def _close_failed_reads() -> None:
    """Closes the reads a failed restore left behind now, while their errors are dropped whoever
    holds sys.unraisablehook (a test runner replaces ours), not at some later collection."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: _quiet(unraisable, hook)
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def reason(error: Exception) -> str:
    """What went wrong, in a few words: the operating system's message when there is one (a full
    disk), else the error's first line without TensorStore's spec dump."""
    text = str(error).strip()
    if os_error := re.search(r": ([^:\n]+) \[os_error_code='\d+'\]", text):
        return os_error.group(1)
    first = text.splitlines()[0] if text else ""
    return re.split(r" See full TensorStore| \[tensorstore_spec=", first)[0] or type(error).__name__


def _not_damage(error: Exception) -> bool:
    """Errors that say this run cannot read a checkpoint now (no permission, no memory for it), not
    that the checkpoint is damaged: setting it aside and resuming from an older one would lose steps."""
    return (isinstance(error, (PermissionError, MemoryError))
            or any(code in str(error) for code in ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED")))


def _shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): tuple(leaf.shape) for path, leaf in leaves}


def mismatches(saved, target) -> list[str]:
    """'name: shape in the checkpoint, shape configured' for every array that differs; parameters
    only when any differ (the optimizer moments repeat them)."""
    have, want = _shapes(saved), _shapes(target)
    names = sorted(n for n in have.keys() | want.keys() if have.get(n) != want.get(n))
    names = [n for n in names if n.startswith("params.")] or names
    show = lambda shape: "absent" if shape is None else str(shape)
    return [f"{n}: {show(have.get(n))} in the checkpoint, {show(want.get(n))} configured" for n in names]


class _NotedFailure:
    """A commit future of a background write that notes its failure in `failures` when it ends:
    orbax reports it only once every process's write has ended (see `Checkpointer.failed_write`)."""

    def __init__(self, future, failures: list):
        self._future, self._failures = future, failures

    def result(self, timeout=None):
        try:
            return self._future.result(timeout=timeout)
        except Exception as e:
            self._failures.append(e)
            raise

    def cancel(self):
        return self._future.cancel()


def _noting_failures(handler: ocp.StandardCheckpointHandler, failures: list) -> ocp.StandardCheckpointHandler:
    """`handler`, whose background writes note their failures in `failures` (`_NotedFailure`).
    Its own method replaced, not a subclass: orbax finds a handler for its arguments by exact type."""
    save = handler.async_save

    async def async_save(*args, **kwargs):
        return [_NotedFailure(future, failures) for future in await save(*args, **kwargs) or []]
    handler.async_save = async_save
    return handler


def check_directory(directory: str | Path) -> None:
    """`ConfigError` where checkpoints could not be read back from `directory`: orbax finds each
    process's part of a save by a glob under the step's folder, and with '[1]' in the path it found
    none and committed a step without its arrays."""
    directory = Path(directory).absolute()
    if glob.escape(str(directory)) != str(directory):
        raise ConfigError(f"TrainConfig.workdir = {str(directory.parent)!r} cannot hold checkpoints: "
                          "orbax reads '[', '*' and '?' in their path as a pattern, and a checkpoint saved "
                          "there could not be read back; allowed: a workdir whose path has none of them")


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        self.cfg, self.directory = cfg, Path(directory).absolute()
        check_directory(self.directory)
        try:  # now, not at the first save `cfg.every` steps in
            self.directory.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.directory).close()
        except OSError as e:
            why = "it is a file" if self.directory.is_file() else e.strerror
            raise ConfigError(f"TrainConfig.workdir = {str(self.directory.parent)!r} cannot hold checkpoints in "
                              f"{self.directory}: {why}; allowed: a workdir whose checkpoints/ is a "
                              "directory this process can create and write") from None
        # An error before (process 0's lock, a host's disk) stops every process here, not in the
        # manager's sync, a device collective that would wait for the failed one for ever.
        distributed.meet("checkpoints")
        # cleanup_tmp_directories: a save that failed (a full disk) leaves a temporary directory;
        # the next run removes it instead of keeping the space taken.
        self._write_failures = []  # this process's background writes that failed, as they fail (`_noting_failures`)
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True, enable_async_checkpointing=True,
                                               cleanup_tmp_directories=True)
        handler = _noting_failures(ocp.StandardCheckpointHandler(), self._write_failures)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handler)
        self._newest_save = None  # the step of the newest save, which may still be written in the background
        self._finished_save = None  # the newest save whose background write is known to have ended
        self._failure_reported = False  # failed_write or failed_elsewhere gave the run its error

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state_fn, force: bool = False, record: dict | None = None) -> None:
        """Saves `state_fn()` every `cfg.every` steps, or now when `force` (the last step, a
        signal). A function, so the checkpoint layout is only built on steps that save. A failed
        write (this save's, or the previous async one's) is a `RunError`. `record` (JSON values:
        what the run that saves it was, see `record`) goes into the step's metadata, which orbax's
        primary process writes into the step's folder before the folder is committed: a checkpoint
        that exists has its record, and a save that dies leaves neither."""
        if (force or step % self.cfg.every == 0) and step != self._manager.latest_step():
            state = state_fn()  # outside: its failures (out of device memory, say) are the run's, not a write's
            try:
                self._manager.save(step, args=ocp.args.StandardSave(state), force=True, custom_metadata=record)
            except Exception as e:
                # With several processes, XLA's error here is orbax's collective with the others
                # failing (a save begins with one), not a write (this process's own are noted in
                # `_write_failures`): another process stopped, which `train.run` says
                if jax.process_count() > 1 and not self._write_failures and distributed.xla_error(e):
                    raise
                raise RunError(f"cannot write checkpoints in {self.directory} (saving step {step}, or the one "
                               f"before it in the background): {reason(e)}") from None
            self._newest_save = step

    def record(self, step: int) -> dict:
        """The `record` step `step` was saved with; {} for one saved without (by an earlier
        version) or whose metadata cannot be read (the record only serves notices, and the state's
        own reading decides whether the checkpoint is usable)."""
        try:
            found = self._manager.metadata(step).custom_metadata
        except Exception:  # orbax's errors for a missing or malformed metadata file vary
            return {}
        return found if isinstance(found, dict) else {}

    def restore(self, step: int, target):
        """`target`: arrays or `jax.ShapeDtypeStruct`s carrying the shardings to restore onto.
        Read with orbax's handler, not its manager: the manager's restore ends with a barrier of
        every process's devices, where the others would wait for ever on a process whose read
        failed. `restore_newest` has the processes agree on the outcome instead."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target
        )
        handler = ocp.StandardCheckpointHandler()
        try:
            return handler.restore(self.directory / str(step) / STATE_FOLDER, args=ocp.args.StandardRestore(abstract))
        finally:
            handler.close()

    def restore_newest(self, target, say) -> tuple[int, dict] | None:
        """(step, state) of the newest checkpoint that every process reads, or None when there is
        none. Says in one line each which checkpoint could not be read (and on which processes,
        where only some could not) and which one is used instead. Every process calls it."""
        # Each process's own listing can lag (an NFS client): the steps are those any process sees.
        seen = sorted(self._manager.all_steps())
        listed = distributed.every_process("checkpoint steps", json.dumps(seen))
        steps = sorted({step for text in listed for step in json.loads(text)}, reverse=True)
        damaged = []
        try:
            return self._restore_newest(steps, set(seen), damaged, target, say)
        finally:
            if damaged:
                _close_failed_reads()

    def _restore_newest(self, steps: list[int], seen: set[int], damaged: list[int], target,
                        say) -> tuple[int, dict] | None:
        # Every process takes the same path through this loop, decided by the verdicts all of them
        # exchanged, so each makes the same `every_process` calls in the same order.
        for step in steps:
            saved, error = None, None
            try:
                if step not in seen:
                    raise FileNotFoundError("this process does not list it")
                # orbax's own error for this names a missing handler, not a missing folder
                if not (self.directory / str(step) / STATE_FOLDER).is_dir():
                    raise FileNotFoundError(f"its {STATE_FOLDER}/ folder is missing")
                saved = self._manager.item_metadata(step)
                if saved is None:
                    raise FileNotFoundError("its metadata is missing")
            except Exception as e:
                error = e
            if self._unreadable(step, error, damaged, say):
                continue
            if wrong := mismatches(saved.tree, target):
                more = f" (and {len(wrong) - SHOWN_MISMATCHES} more)" if len(wrong) > SHOWN_MISMATCHES else ""
                raise ConfigError(f"checkpoint step {step} in {self.directory} does not fit the configured model: "
                                  f"{'; '.join(wrong[:SHOWN_MISMATCHES])}{more}. Set the ModelConfig the run that "
                                  f"wrote it used, or choose another TrainConfig.workdir")
            state, error = None, None
            try:
                state = self.restore(step, target)
            except Exception as e:
                error = e
            if self._unreadable(step, error, damaged, say):
                del state  # read here, but not by every process
                continue
            if damaged:
                self._set_aside(damaged)
                say(f"using checkpoint step {step} instead; the damaged ones are renamed <step>.damaged")
            return step, state
        if steps:
            raise RunError(f"no checkpoint in {self.directory} can be read (steps {', '.join(map(str, steps))}); "
                           "move that directory away to start afresh")
        return None

    def _unreadable(self, step: int, error: Exception | None, damaged: list[int], say) -> bool:
        """Whether any process could not read `step` (`error`: this process's, None when it could).
        Then counts it as damaged and says so, naming the processes that could not read it where
        others could; or ends the run on every process where an error is a run's own."""
        verdict = "" if error is None else json.dumps({"reason": reason(error), "damage": not _not_damage(error)})
        # the wait covers the slowest process's read of its shards (orbax's own barrier has no limit)
        texts = distributed.every_process("checkpoint read", verdict, timeout_s=READ_WAIT_S)
        verdicts = [json.loads(text) if text else None for text in texts]
        failed = [i for i, v in enumerate(verdicts) if v]
        if not failed:
            return False
        here = jax.process_index()
        if not_damage := [i for i in failed if not verdicts[i]["damage"]]:  # no process may set it aside
            i = here if here in not_damage else not_damage[0]
            where = "here" if i == here else f"on process {i}"
            raise RunError(f"checkpoint step {step} in {self.directory} cannot be read {where} "
                           f"({verdicts[i]['reason']}); it is left as it is") from None
        damaged.append(step)
        i = here if here in failed else failed[0]
        where = ("" if len(failed) == len(verdicts)
                 else f" on process{'es' * (len(failed) > 1)} {', '.join(map(str, failed))}")
        say(f"checkpoint step {step} cannot be read{where} ({verdicts[i]['reason']}); trying an older one")
        return True

    def _set_aside(self, steps: list[int]) -> None:
        """Renames damaged step directories so that orbax ignores them and the run can save those
        steps again. Process 0 renames; every process waits for it, through the key-value store
        (a device barrier would open a communicator over every device before the warm-up, which
        across NIC classes cannot connect). A step with no directory here (listed by another
        process only) is left: there is nothing to rename."""
        distributed.every_process("checkpoint set aside: all read", "")
        if jax.process_index() == 0:
            for step in steps:
                if not (self.directory / str(step)).exists():
                    continue
                aside, n = self.directory / f"{step}.damaged", 1
                while aside.exists():  # set aside before, at the same step
                    aside, n = self.directory / f"{step}.damaged{n}", n + 1
                (self.directory / str(step)).rename(aside)
        distributed.every_process("checkpoint set aside: renamed", "")
        self._manager.reload()

    def failed_write(self) -> RunError | None:
        """Without waiting for a write still under way: the `RunError` of the newest save once its
        background write has ended in failure (a full disk), else None; each failure once. Cheap
        enough after every step: the next save, which reported it, can be hours away."""
        # This process's own failure at once: where only some processes' writes fail, orbax's flag
        # below stays up until its barrier for the others times out (AsyncOptions.timeout_secs, 20
        # minutes), and then says only that the barrier timed out.
        if self._write_failures:
            error = self._write_failures[0]
            self._write_failures.clear()
            self._finished_save, self._failure_reported = self._newest_save, True
            return self._write_error(error)
        # orbax's flag drops when the save's background work ends, failed or not (with several
        # processes, once every process's has ended), and waiting for it then costs nothing.
        if self._newest_save in (None, self._finished_save) or self._manager.is_saving_in_progress():
            return None
        self._finished_save = self._newest_save
        try:
            self.wait()
        except RunError as e:
            self._failure_reported = True
            return e
        return None

    def failed_elsewhere(self) -> RunError:
        """The error of a run that stops because another process's background write failed. Not
        waited for: orbax's barrier holds this process's write until its timeout (the run leaves
        it behind, `train`'s `Lockstep`)."""
        self._failure_reported = True
        return RunError(f"cannot write checkpoints in {self.directory} (saving step {self._newest_save}): the "
                        f"write failed on another process")

    def wait(self) -> None:
        """Waits for the save in the background to be written; one that fails is a `RunError`."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._write_error(e) from None

    def wait_with_others(self) -> None:
        """`wait`, called by every process at the same point (the run's end, a stop). A write that
        failed on some processes only ends it on all of them within a poll, with this process's
        failure or `failed_elsewhere`: orbax's barrier held the others' writes, and so their
        exits, until its timeout (20 minutes)."""
        if jax.process_count() == 1:
            return self.wait()
        while True:
            failed = self.failed_write()
            saving = "saving" if self._manager.is_saving_in_progress() else "written"
            states = distributed.every_process("checkpoint written", "failed" if failed else saving, signals=False)
            if "failed" in states:
                raise failed or self.failed_elsewhere()
            if "saving" not in states:
                return self.wait()
            time.sleep(0.25)  # a key per process each time: four a second, for a save of minutes

    def _write_error(self, error: Exception) -> RunError:
        saving = "" if self._newest_save is None else f" (saving step {self._newest_save})"
        return RunError(f"cannot write checkpoints in {self.directory}{saving}: {reason(error)}")

    def close(self, peer_died: bool = False) -> None:
        """Waits for async saves to finish: a run must never exit with a checkpoint half-written.
        Not after another process of the job died (`peer_died`): the save in flight can never end
        then, as orbax's background write waits in a barrier for every process, the dead one too,
        until JAX's heartbeat timeout (a minute or more), and jaxlib then aborts this process with a
        stack dump before the run's error line. That save stays a temporary folder, which the next
        run removes; the checkpoints before it are whole."""
        if peer_died:
            return
        try:
            self.wait()
        except RunError:
            # The run ends with that failure, already reported: orbax's own report of it can say
            # only that a barrier timed out (a write failed on some processes only).
            if not self._failure_reported:
                raise
        finally:
            self._manager.close()
