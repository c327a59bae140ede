"""`python -m holmes_jax.train [--gin_file F ...] [--gin.NAME=VALUE ...]`: the one path a run takes.

configs (holmes_jax.configure) -> plan, mesh, model, optimizer state and jitted steps
(holmes_jax.build; restored when the workdir holds a checkpoint) -> the loop: batch, step, metrics,
periodic validation and checkpoints -> summary. See docs/design.md, "One run". What ends a run
early (the stop every process agrees on, a loss that stays non-finite) is in holmes_jax.guard; how
stop signals are held, and exit statuses, in holmes_jax.cli.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import optax

from holmes_jax import checkpoint, cli, configure, data, distributed, export, guard, metrics
from holmes_jax.build import Setup, build, make_eval_step, make_train_step, peak_tflops
from holmes_jax.checkpoint import Checkpointer
from holmes_jax.config import ConfigError
from holmes_jax.configure import Configs, load_configs
from holmes_jax.models import gpt
from holmes_jax.optimizer import make_schedule
from holmes_jax.pipeline import warmup
from holmes_jax.planning.workload import megatron_flops


@dataclasses.dataclass
class Hook:
    """Runs `fn(step, state)` after every step that one of `every` divides, and after the first
    and the last."""

    every: tuple[int, ...]
    fn: Callable[[int, dict], None]

    def due(self, step: int, first: int, last: int) -> bool:
        return any(step % n == 0 for n in self.every) or step in (first, last)


def train_steps(compiled, setup: Setup, state: dict, start: int, last: int, token_data: data.TokenData):
    """The loop itself: yields (step, state, outputs on the host) after each step. Batches are a
    pure function of (seed, step), so a resumed run sees the batches an uninterrupted one would;
    the next one is built while the device runs the step."""
    batch = _train_batch(setup, start + 1, token_data)
    for step in range(start + 1, last + 1):
        state, out = compiled(state, batch)
        guard.fault_point("step", step)
        if step < last:
            batch = _train_batch(setup, step + 1, token_data)
        yield step, state, jax.device_get(out)


def _train_batch(setup: Setup, step: int, token_data: data.TokenData) -> jax.Array:
    guard.fault_point("batch", step)
    return setup.batch("train", step - 1, token_data)


class Rows:
    """What the done line needs of a run's metrics rows, in memory that does not grow with the run
    (every row kept, a run logging each of a million steps held about 600 MB): its first and last
    rows and the step times of those after step `start` + 1 (the run's first step pays for warm-up)."""

    def __init__(self, start: int, rows: list[dict] = ()):
        self.start, self.first, self.last, self.step_times = start, None, None, array.array("d")
        for row in rows:
            self.add(row)

    def add(self, row: dict) -> None:
        self.first, self.last = self.first or row, row
        if row["step"] > self.start + 1:
            self.step_times.append(row["step_time_s"])


class StepLogger:
    """Collects step outputs and, when due, writes one metrics row (loss, speed, validation)."""

    def __init__(self, setup: Setup, eval_step, token_data: data.TokenData, log: metrics.MetricsLog | None,
                 peak_tflops_per_device: float, start: int = 0):
        cfgs, devices = setup.cfgs, setup.mesh.devices.size
        self.setup, self.eval_step, self.token_data, self.log = setup, eval_step, token_data, log
        self.tokens_per_step = cfgs.data.global_batch * cfgs.data.seq_len
        self.flops_per_device = megatron_flops(cfgs.data.global_batch, cfgs.data.seq_len, cfgs.model.num_layers,
                                               cfgs.model.hidden, cfgs.model.vocab_size, cfgs.model.remat) / devices
        self.peak = peak_tflops_per_device
        self.pending, self.t_last, self.rows = [], time.perf_counter(), Rows(start)

    def collect(self, out) -> None:
        self.pending.append(out)

    def row(self, step: int, state: dict, last: int) -> None:
        outs = self.pending
        elapsed = (time.perf_counter() - self.t_last) / len(outs)
        row = {"step": step, "loss": float(outs[-1]["loss"]), "grad_norm": float(outs[-1]["grad_norm"]),
               "skipped": sum(bool(o["skipped"]) for o in outs),  # steps since the last row whose update was skipped
               "lr": float(self.setup.schedule(optimizer_steps(state["opt_state"]) - 1)), "step_time_s": elapsed,
               "tokens_per_s": self.tokens_per_step / elapsed,
               "tflops_per_device": self.flops_per_device / elapsed / 1e12}
        row["mfu"] = row["tflops_per_device"] / self.peak
        if step % self.setup.cfgs.train.eval_every == 0 or step == last:
            row["val_loss"] = evaluate(self.setup, self.eval_step, self.setup.settled(state)["params"],
                                       self.token_data)
        try:
            self.log and self.log.write(row)
        finally:  # even when the console's reader left (BrokenPipeError): its steps are not the next row's
            self.rows.add(row)
            self.pending, self.t_last = [], time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leaves `seconds` spent outside the steps (a checkpoint save) out of the next row's step time."""
        self.t_last += seconds


def optimizer_steps(opt_state) -> int:
    """The updates the optimizer has made: the step count less the skipped steps, which is what its
    learning-rate schedule counts."""
    return int(optax.tree_utils.tree_get(opt_state, "count",
                                         filtering=lambda path, _: path[-1].tuple_name == "ScaleByScheduleState"))


def prepare_workdir(path: str) -> Path:
    """Creates the workdir and checks that it takes files; a path that cannot be a writable
    directory is bad input."""
    workdir = Path(path)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=workdir).close()
    except OSError as e:
        reason = "it is a file" if workdir.is_file() else e.strerror
        raise ConfigError(f"TrainConfig.workdir = {path!r} cannot be used: {reason}; "
                          "allowed: a directory this process can create and write") from None
    return workdir


def saved_steps(checkpoints: Path) -> list[int]:
    """The steps whose checkpoints `checkpoints` holds: orbax names each step's directory by its
    number (a save in flight, `<step>.orbax-checkpoint-tmp`, and a damaged one set aside are not)."""
    try:
        return sorted(int(entry.name) for entry in checkpoints.iterdir() if entry.name.isdecimal() and entry.is_dir())
    except OSError:  # none yet; a file or an unreadable directory is refused with its reason later
        return []


LOCK_FILE = ".lock"  # in a run's workdir, held by its process 0 (lock_workdir)


def lock_workdir(workdir: Path):
    """The open lock file of `workdir`, locked for this run until it is closed (the kernel drops the
    lock when the process dies, however): a second run on the workdir would interleave its rows
    with ours in metrics.jsonl, rewrite config.gin, and with checkpoints save the same steps as
    ours, prune ours, and delete our save in flight as a failed save's leftover. Process 0 holds
    it for its job; readers (report, export, generate) never take it."""
    path = workdir.absolute() / LOCK_FILE  # in the workdir itself: a run without checkpoints has no checkpoints/
    try:
        lock = open(path, "a+")
    except OSError as e:  # a `.lock` that is a folder, or another user's
        raise ConfigError(f"TrainConfig.workdir = {str(workdir)!r} cannot be used: {e.strerror} ({path}); "
                          "allowed: a directory this process can create and write") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise ConfigError(f"TrainConfig.workdir = {str(path.parent)!r} is in use by another run ({holder}, which "
                          f"holds {path}); allowed: a workdir no other run is using: wait for that run to end, or "
                          "choose another") from None
    except OSError:  # a file system without locks (some network ones): nothing to guard with
        return lock
    lock.truncate(0)
    lock.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def run(cfgs: Configs, devices=None, quiet: bool = False) -> dict:
    """Trains per `cfgs`; returns the summary. Everything is validated before the workdir is touched.
    With several processes, all of them step and checkpoint; process 0 alone prints and writes.
    Raises `cli.Stopped` after a signal (the step's checkpoint written) and `cli.RunError` when
    the loss stays non-finite or a write fails. A signal before the loop stops the run with nothing
    saved: at once with one process; with several, where they next meet (`distributed.every_process`),
    all alike. An error on one process (process 0's lock, its writes) stops the others there too.
    One that stopped alone left the others waiting for it in a device collective (orbax's, a
    restore's) until the launcher's SIGKILL. In the loop, a process that fails alone ends at once,
    and so the others' collective with it (`distributed.Lockstep`)."""
    if jax.process_count() == 1:
        return _run(cfgs, devices, quiet)
    with cli.SignalHold(), distributed.errors_told():
        return _run(cfgs, devices, quiet)


def _run(cfgs: Configs, devices, quiet: bool) -> dict:
    lead = jax.process_index() == 0
    say = (lambda *a: None) if quiet or not lead else (lambda *a: print(*a, flush=True))
    guard.injected_fault()  # a malformed HOLMES_FAULT is bad input: found before anything runs
    checkpoints = Path(cfgs.train.workdir) / "checkpoints"
    if cfgs.checkpoint.enabled:
        checkpoint.check_directory(checkpoints)
    if (saved := saved_steps(checkpoints)) and not cfgs.checkpoint.enabled:
        # Such a run starts from step 1: it replaced the checkpointed run's metrics.jsonl rows and
        # config.gin, and a later run with checkpoints resumed that run beside this one's rows.
        raise ConfigError(f"TrainConfig.workdir = {cfgs.train.workdir!r} holds checkpoints (the newest at step "
                          f"{saved[-1]}): with CheckpointConfig.enabled = False this run would start from step 1 "
                          f"and replace their run's metrics.jsonl and config.gin; allowed: CheckpointConfig.enabled "
                          f"= True (it resumes from them), another TrainConfig.workdir, or {checkpoints} moved away")
    if cfgs.model.init_from and not saved:  # a resumed run ignores it
        export.check_hf_folder(cfgs.model.init_from, cfgs.model)
    setup = build(cfgs, devices)  # before the data: a layout that cannot work must not wait for a long prepare
    token_data = data.load(cfgs.data)
    # Before the vocabulary check, which other data may fail on one process alone: every process stops here.
    distributed.check_same_data(data.describe_identity(token_data.identity))
    token_data.check_model_vocab(cfgs.model.vocab_size)
    tcfg = cfgs.train
    say(f"holmes_jax: {cfgs.model.preset} model, "
        f"{gpt.count_params(jax.eval_shape(lambda: setup.model.init(0))):,} parameters; "
        f"mesh {dict(setup.mesh.shape)}, stage layers {list(setup.pipeline.stage_layers)}, "
        f"{setup.plan.schedule} over {setup.plan.microbatches} microbatch{'es' * (setup.plan.microbatches > 1)} on "
        f"{setup.mesh.devices.size} {setup.mesh.devices.flat[0].platform} device{'s' * (setup.mesh.devices.size > 1)}")
    say(f"data: {token_data.description}")
    if tcfg.warmup_steps >= tcfg.steps:  # a short trial run on a long run's config, say: no error, but said
        say(f"note: TrainConfig.warmup_steps = {tcfg.warmup_steps} >= steps = {tcfg.steps}: the learning rate "
            f"rises for the whole run and never decays")
    say(setup.plan.explain())

    workdir = prepare_workdir(tcfg.workdir)
    # Held until the last checkpoint is written; taken before the Checkpointer, whose clean-up of
    # failed saves would delete another run's save in flight.
    with lock_workdir(workdir) if lead else contextlib.nullcontext():
        ckpt, peer_died = None, False  # peer_died: the run ends because another process stopped: its saves cannot end
        lockstep = distributed.Lockstep()  # the loop: an error there on this process alone ends it at once
        try:
            # in the try: a peer that died in the manager's sync is one line, as in a step
            ckpt = Checkpointer(checkpoints, cfgs.checkpoint) if cfgs.checkpoint.enabled else None
            return _resume_and_train(cfgs, setup, token_data, workdir, ckpt, lockstep, say, quiet)
        except BrokenPipeError:  # stdout's reader left before or after the loop: nothing more to save
            raise
        except OSError as e:  # metrics.jsonl, config.gin; checkpoint writes report their own
            raise cli.RunError(f"cannot write {e.filename or workdir}: {e.strerror}") from None
        except (jax.errors.JaxRuntimeError, ValueError) as e:  # XLA's out-of-memory: a page of traceback
            if not distributed.xla_error(e):
                raise
            if "RESOURCE_EXHAUSTED" not in str(e):
                if jax.process_count() > 1:  # a peer that died: gloo's or NCCL's 'connection reset' under a traceback
                    peer_died = True
                    raise cli.RunError(f"a step failed, most likely because another process of this job stopped or "
                                       f"its network failed (see that process's output): "
                                       f"{str(e).splitlines()[0][:300]}") from None
                raise
            predicted = max(setup.plan.prediction.stage_memory_bytes)
            raise cli.RunError(f"out of device memory ({str(e).splitlines()[0][:300]}); the plan predicted "
                               f"{predicted / 1e9:.3g} GB per device: try ModelConfig.remat = 'dots' or 'full', more "
                               "ParallelConfig.microbatches, or a smaller DataConfig.global_batch") from None
        finally:
            if ckpt:
                with cli.SignalHold():  # a signal while the last writes are waited for must not cut them short
                    ckpt.close(peer_died or lockstep.left)  # the others will not get to the save's sync


def run_config(cfgs: Configs, setup: Setup) -> str:
    """The operative config as this run used it, for config.gin: on CPU, `ParallelConfig.cpu_devices`
    is the device count the backend has, which HOLMES_CPU_DEVICES (a launcher's --devices-per-process)
    sets over the config's (distributed.initialize). A rerun from config.gin, without the launcher
    or under one not given --devices-per-process, then gets the devices this run had."""
    text = configure.operative_config(cfgs)
    if setup.mesh.devices.flat[0].platform != "cpu":
        return text  # the setting does nothing on other devices
    line = f"ParallelConfig.cpu_devices = {len(jax.local_devices(backend='cpu'))}"
    return re.sub(r"^ParallelConfig\.cpu_devices = .*$", lambda _: line, text, flags=re.MULTILINE)


def _trained_run(record: dict, workdir: Path) -> tuple[str | None, dict | None]:
    """The config text and data identity (None where unknown) of the run that saved a checkpoint
    whose `record` (`Checkpointer.record`) is given. A checkpoint of an earlier version has no
    record: the workdir's config.gin stands for its settings, and its data is unknown."""
    config, identity = record.get("config"), record.get("data_identity")
    if not isinstance(config, str):
        saved = workdir / "config.gin"
        config = saved.read_text() if saved.is_file() else None
    return config, identity if data.is_identity(identity) else None


def _learning_rate_moved(trained_settings: str, tcfg, start: int) -> str | None:
    """Where the learning rate of the first resumed step differs from the checkpointed run's
    schedule, a line saying so: a cosine run resumed with more steps goes from its floor back up."""
    before = configure.train_config_of(trained_settings)
    if before is None:
        return None
    old, new = (float(make_schedule(c)(start)) for c in (before, tcfg))
    if math.isclose(old, new, rel_tol=1e-6):
        return None
    return (f"the learning rate at step {start + 1} is {new:.3g}, where the checkpointed run's schedule "
            f"had {old:.3g}")


def _saved_record(ckpt: Checkpointer, step: int) -> dict:
    """Checkpoint `step`'s record as process 0 reads it: whole on process 0, the only one that
    compares runs; elsewhere only the bad-step count, which every process acts on alike."""
    lead = jax.process_index() == 0
    record = ckpt.record(step) if lead else {}
    bad_steps = distributed.every_process("bad-step count", json.dumps(record.get("bad_steps")))[0]
    return record if lead else {"bad_steps": json.loads(bad_steps)}


def _resume_and_train(cfgs: Configs, setup: Setup, token_data, workdir: Path, ckpt: Checkpointer | None,
                      lockstep: distributed.Lockstep, say, quiet: bool) -> dict:
    lead, tcfg = jax.process_index() == 0, cfgs.train
    restored = ckpt.restore_newest(setup.abstract_canonical(), say) if ckpt else None
    resumed = restored is not None
    if resumed:
        start, state = restored[0], setup.staged(restored[1])
        say(f"resumed from checkpoint at step {start}")
    else:
        state, start = setup.init_state(), 0
    del restored  # its canonical arrays would stay on the devices beside the state for the whole run
    last = min(tcfg.steps, tcfg.stop_after or tcfg.steps)
    if start >= last:  # config.gin is left as it was: these settings trained nothing
        say(f"nothing to do: the checkpoint is at step {start}, the run ends at step {last}")
        return {"steps": start}
    # What this run is, kept in every checkpoint it saves: a later resume compares against the run
    # that trained the checkpoint it restores. The workdir's config.gin describes the latest run,
    # which may have died before its first save.
    record = {"config": run_config(cfgs, setup), "data_identity": token_data.identity}
    restored_record = _saved_record(ckpt, start) if resumed else {}
    if lead:  # only now: a checkpoint that does not fit must not leave this run's config behind
        settings, saved = record["config"], workdir / "config.gin"
        trained_settings, trained_on = _trained_run(restored_record, workdir) if resumed else (None, None)
        if trained_settings and (changed := configure.changed_settings(trained_settings, settings)):
            # Legitimate (a longer run, a new learning rate), but new data or seq_len means other
            # batches than an uninterrupted run's: say which.
            say(f"resumed with settings changed since the checkpointed run: {'; '.join(changed)}")
            if moved := _learning_rate_moved(trained_settings, tcfg, start):
                say(moved)
        # The data's identity likewise: new data (a file added to a text folder, a folder prepared
        # again) means other batches than an uninterrupted run's, legitimate but said.
        if trained_on and (changes := data.identity_changes(trained_on, token_data.identity)):
            say(f"resumed on data changed since the checkpointed run: {'; '.join(changes)}")
        # Whole or not at all: a full disk mid-write must not leave half of the config that export,
        # generate and a resume from an earlier version's checkpoint read.
        cli.replace_file(saved, settings)
        # Export and generate read the data's meta.json and tokenizer here, from any folder; a run
        # resumed on other data drops the copies it no longer has, or they would speak for it.
        folder = data.prepared_folder(cfgs.data.source)
        for name, source in ((data.RUN_META_FILE, folder and folder / data.META_FILE),
                             ("tokenizer.json", data.tokenizer_path(cfgs.data))):
            if source:
                cli.replace_file(workdir / name, source.read_bytes())
            else:
                (workdir / name).unlink(missing_ok=True)
        cli.replace_file(workdir / "plan.json", setup.plan.to_json(indent=1))  # what `holmes_jax.report` compares against

    distributed.meet("compile")  # a signal held since the start stops every process here, before the long compile
    t0 = time.perf_counter()
    compiled = make_train_step(setup).lower(state, setup.batch("train", start, token_data)).compile()
    mem = compiled.memory_analysis()
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s"
        + (f"; temporary memory {mem.temp_size_in_bytes / 2**20:.1f} MiB per device" if mem else ""))
    warmup.warm_up(setup, compiled.as_text(), say)  # communicators across clusters, over sockets
    peak, peak_what = peak_tflops(list(setup.mesh.devices.flat))
    say(f"MFU is against the {peak_what}")

    log = metrics.MetricsLog(workdir / "metrics.jsonl", tcfg.steps, quiet, first=start + 1, stop=last) if lead else None
    logger = StepLogger(setup, make_eval_step(setup), token_data, log, peak, start)
    bad = guard.BadSteps(tcfg.max_bad_steps, say, restored_record)

    def save(step: int, state: dict, force: bool) -> None:
        t0 = time.perf_counter()
        ckpt and ckpt.save(step, lambda: setup.canonical(state), force=force, record={**record, **bad.record()})
        logger.exclude(time.perf_counter() - t0)

    # a row on validation steps too: the validation loss is written in a row
    hooks = [Hook((tcfg.log_every, tcfg.eval_every), lambda step, state: logger.row(step, state, last))]
    if ckpt:
        # A skipped step's state is the last good one: saved under this step it would push good
        # checkpoints out of the newest `keep` while the loss diverges. The last step's is saved
        # (as a stop's is): it is what the run ends with, and a rerun finds nothing left to do.
        hooks.append(Hook((cfgs.checkpoint.every,), lambda step, state: (bad.in_a_row and step < last)
                          or save(step, state, step == last)))
    vote = guard.StopVote(setup.mesh)
    unwritable = []  # a console line or metrics row that could not be written (a full disk): stops the run
    # The log closes (its TensorBoard events flushed) however the loop ends.
    distributed.meet("train")  # no step for a signal held since the compile
    with cli.SignalHold() as signals, contextlib.closing(log) if log else contextlib.nullcontext(), lockstep:
        for step, state, out in train_steps(compiled, setup, state, start, last, token_data):
            logger.collect(out)
            with _stop_if_output_fails(signals, unwritable):  # a skipped step's line
                bad.add(step, out)
            # A checkpoint write that failed in the background (a full disk) ends the run now, not at
            # the next save; every process stops after the same step, the earlier checkpoints kept.
            failed_write = ckpt and ckpt.failed_write()
            stopping, write_failed = vote.vote(signals.signum, failed_write is not None)  # alike on every process
            if write_failed:  # not agreed(): orbax's thread holds every process's exit for the failed save's
                raise failed_write or ckpt.failed_elsewhere()  # barrier (20 minutes); each leaves at once
            if stopping and log:  # the run ends after this step: its row has no time left to estimate
                log.stop = step
            for hook in hooks:
                if stopping or hook.due(step, start + 1, last):
                    with _stop_if_output_fails(signals, unwritable):
                        hook.fn(step, state)
            with lockstep.agreed():
                bad.check(step, ckpt and ckpt.latest_step())
            if stopping:
                # Even a skipped step: its state is what an uninterrupted run holds after it.
                save(step, state, True)
                ckpt and ckpt.wait_with_others()
                sig = signal.Signals(stopping)
                # at the last step a rerun of the same command finds nothing to do: no 'resume' then
                resume = ": run the same command again to resume" if step < last else ", the run's last step"
                saved = f"checkpoint saved at step {step}{resume}" if ckpt else "checkpoints are off, nothing saved"
                with lockstep.agreed():
                    if unwritable:
                        raise cli.OutputFailed(f"{unwritable[0]} after step {step}; {saved}")
                    raise cli.Stopped(sig, f"stopped by {sig.name} after step {step}; {saved}")
        if ckpt:  # the last step's save written, a signal held off, before the run says it is done
            ckpt.wait_with_others()
    if unwritable:  # at the last step: the run is done and saved, its output is not
        raise unwritable[0]
    return summarize(logger.rows, setup.plan.prediction.step_time_s, say)


@contextlib.contextmanager
def _stop_if_output_fails(signals: cli.SignalHold, unwritable: list):
    """A line whose reader left (`train | head`) stops the run as a signal does: at the next stop
    vote, that step saved. So does output that cannot be written, a line or a metrics row
    (`cli.OutputFailed`, noted in `unwritable`)."""
    try:
        yield
    except BrokenPipeError:
        cli.drop_output()
        signals.signum = signals.signum or signal.SIGPIPE
    except cli.OutputFailed as e:
        unwritable.append(e)
        signals.signum = signals.signum or signal.SIGPIPE


def evaluate(setup: Setup, eval_step, params, token_data: data.TokenData) -> float:
    # Each loss is read before the next batch goes out: with all of them in flight at once (150
    # batches on 8 CPU devices), XLA's CPU runtime gave up on a rendezvous after 40 s and aborted.
    batches = range(setup.cfgs.train.eval_batches)
    losses = [float(eval_step(params, setup.batch("val", i, token_data))) for i in batches]
    return float(np.mean(np.asarray(losses, np.float32)))


def summarize(rows: Rows, predicted_step_s: float, say) -> dict:
    first, last = rows.first, rows.last
    step_time = float(np.median(rows.step_times or [first["step_time_s"]]))
    # Tokens/s and TFLOPS at that step time: medians of their own (of an even count of rows, the
    # mean of two) disagreed with it. A row's figure times its step time is the same in every row.
    tokens_per_step = first["tokens_per_s"] * first["step_time_s"]
    tflop_per_step = first["tflops_per_device"] * first["step_time_s"]
    summary = {
        "steps": last["step"],
        "first_loss": first["loss"],
        "final_loss": last["loss"],
        "val_loss": last.get("val_loss"),
        "step_time_s": step_time,
        "predicted_step_time_s": predicted_step_s,
        "tokens_per_s": tokens_per_step / step_time,
        "tflops_per_device": tflop_per_step / step_time,
    }
    losses = f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
    if rows.start:  # the first loss is of the first step after the checkpoint, not of step 1
        losses = (f"loss {summary['first_loss']:.3f} (step {first['step']}) -> {summary['final_loss']:.3f} "
                  f"(step {summary['steps']})")
    say(f"done: step {summary['steps']}, {losses}"
        + (f", val {summary['val_loss']:.3f}" if summary["val_loss"] is not None else "")
        + f"; {metrics.milliseconds(summary['step_time_s'])} ms/step, {summary['tokens_per_s']:,.0f} tokens/s, "
        f"{summary['tflops_per_device']:.3g} TFLOPS/device (Megatron formula); "
        f"the plan predicted {metrics.milliseconds(predicted_step_s)} ms/step")
    return summary


def main(argv: list[str]) -> int:
    cfgs = load_configs(argv)
    # Before any backend starts: jax.distributed for several processes, the CPU device count.
    distributed.initialize(cfgs.parallel.cpu_devices)
    distributed.check_same_settings(configure.operative_config(cfgs))  # else ranks would wait on each other for ever
    run(cfgs)
    return 0


if __name__ == "__main__":
    cli.run(main)
