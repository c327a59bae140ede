"""Step metrics: tokens/s, TFLOPS per device (Megatron's formula), MFU; console, metrics.jsonl and
TensorBoard event files."""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from pathlib import Path

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import scalar

from holmes_jax import cli

# tensorboardX warns on every NaN it writes; a non-finite step already gets our own one line.
logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)


# Dense bf16 peak TFLOP/s of one device, by the first words of `device.device_kind` (lower case),
# from NVIDIA's datasheets (half their "with sparsity" figures). The PCIe and NVL cards peak lower
# than the SXM ones of the same name: matched first.
_PEAK_TFLOPS = {"nvidia h100 pcie": 756.0, "nvidia h800 pcie": 756.0, "nvidia h100 nvl": 835.0,
                "nvidia h200 nvl": 835.0, "nvidia a100": 312.0, "nvidia h100": 989.0, "nvidia h200": 989.0,
                "nvidia h800": 989.0, "nvidia gh200": 989.0, "nvidia a800": 312.0, "nvidia b200": 2250.0,
                "nvidia gb200": 2500.0, "nvidia l40s": 362.0, "nvidia l40": 181.0, "nvidia l4": 121.0}


def device_peak_tflops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    # whole words: "nvidia l4" is not the start of an "NVIDIA L40", nor "nvidia a10" of an A100
    return next((v for k, v in _PEAK_TFLOPS.items()
                 if kind.startswith(k) and not kind[len(k):len(k) + 1].isalnum()), None)


def measure_matmul_peak_tflops(devices, size: int = 512, repeats: int = 5) -> float:
    """Achieved matmul TFLOP/s of one device when all `devices` multiply at once (they share the
    host's cores on CPU, so per-device peak is the aggregate over the count)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    a = jax.device_put(jnp.ones((len(devices), size, size), jnp.float32), sharding)
    mm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=sharding)
    mm(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * size**3 / best / 1e12


RESUMED_FROM = "resumed_from"  # in a resumed run's first metrics.jsonl row: the step of its checkpoint


class MetricsLog:
    """Appends one JSON object per logged step to `path` (an earlier run's rows from `first` on
    dropped), writes each of its numbers as a TensorBoard scalar (tag = the JSON key) under
    `path`'s folder/tensorboard, and, unless quiet, prints a progress line with an ETA (none at
    `stop`). `first` is the step this run starts at (a resumed run's checkpoint + 1), `stop` the step
    it ends at (default `total_steps`; a run that a signal stops sets it to that step). A resumed
    run's first row says so: `resumed_from` (`RESUMED_FROM`), the checkpoint's step, for readers that
    tell its warm-up from its steady steps."""

    RECENT = 5  # logged windows the ETA averages over

    def __init__(self, path, total_steps: int, quiet: bool = False, first: int = 1, stop: int | None = None):
        self.path, self.total_steps, self.quiet, self.first = Path(path), total_steps, quiet, first
        self.stop = stop or total_steps
        folder = self.path.parent / "tensorboard"
        folder.mkdir(parents=True, exist_ok=True)
        # Written in this thread, not queued for tensorboardX's writer thread: each row is on disk
        # once `write` returns (a crash lost the newest rows) and a full disk raises here (the thread
        # printed tracebacks).
        # A name of its own: tensorboardX names the file by the second and opens it with 'wb', so a
        # resumed run started in the same second emptied the earlier run's file.
        self.tensorboard = EventsWriter(str(folder / "events"), filename_suffix=f".{time.time_ns()}")
        self._windows = collections.deque(maxlen=self.RECENT)  # (steps, seconds) between logged rows
        self._first_step_s = None  # this run's first step warms up: the ETA uses it only alone
        self._last_step = None

    def write(self, row: dict) -> None:
        """Writes `row`; a file that cannot be written (a full disk) raises `cli.OutputFailed`, which
        stops a run after the next step, every process alike, that step saved."""
        try:
            self._write_files(row)
        except OSError as e:
            raise cli.OutputFailed(f"cannot write {e.filename or self.path}: {e.strerror or e}") from None
        if self._last_step is None:
            self._first_step_s = row["step_time_s"]
        else:
            steps = row["step"] - self._last_step
            self._windows.append((steps, steps * row["step_time_s"]))
        self._last_step = row["step"]
        if self.quiet:
            return
        parts = [f"step {row['step']:>{len(str(self.total_steps))}}/{self.total_steps}", f"loss {row['loss']:.4f}"]
        if "val_loss" in row:
            parts.append(f"val {row['val_loss']:.4f}")
        parts += [f"{milliseconds(row['step_time_s'])} ms/step", f"{row['tokens_per_s']:,.0f} tok/s",
                  f"{row['tflops_per_device']:.3g} TFLOPS/dev"]
        if row.get("mfu") is not None:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        if row["step"] < self.stop:
            parts.append(f"ETA {duration(self.eta_s(row['step']))}")
        print(" | ".join(parts), flush=True)

    def _write_files(self, row: dict) -> None:
        if self._last_step is None:
            self._take_over()
        resumed = {RESUMED_FROM: self.first - 1} if self._last_step is None and self.first > 1 else {}
        with open(self.path, "a") as f:
            f.write(json.dumps(strict_json(row | resumed), allow_nan=False) + "\n")
        # `row`'s numbers, not the marker: TensorBoard marks the resume with its START event below
        values = [scalar(key, value).value[0] for key, value in row.items() if key != "step" and value is not None]
        if self._last_step is None:
            # A resumed run logs again the steps a stopped one logged after its checkpoint.
            # TensorBoard drops an earlier file's events from a restart's START on, instead of
            # drawing both runs' values at those steps.
            self.tensorboard.write_event(Event(wall_time=time.time(), step=self.first,
                                               session_log=SessionLog(status=SessionLog.START)))
        self.tensorboard.write_event(Event(wall_time=time.time(), step=row["step"], summary=Summary(value=values)))
        self.tensorboard.flush()

    def _take_over(self) -> None:
        """Before this run's first row: drops the rows an earlier run wrote from `first` on, as
        TensorBoard drops their events at this run's START. This run does those steps again (from
        its checkpoint, or from the start without checkpoints); a row of a step it does not reach
        (it stops sooner, logs less often) stayed, and the report drew it after this run's rows.
        Drops a partial last row too (a write cut short by a crash, a full disk), or this run's
        first row would be glued to it and neither could be read; a whole last row without its
        newline (saved so by an editor) is a row like the others, ended with one."""
        if not self.path.is_file():
            return
        *lines, last = self.path.read_bytes().split(b"\n")  # `last` is b"" after a whole last row
        if _step_of(last) is not None:  # only a whole row reads as one: a cut-short one lacks its '}'
            lines.append(last)
        kept = [line for line in lines if not _is_row_from(line, self.first)]
        if len(kept) < len(lines) or last:  # a crash while it is rewritten leaves it as it was
            cli.replace_file(self.path, b"".join(line + b"\n" for line in kept))

    def eta_s(self, step: int) -> float:
        """Seconds to `stop`: the mean step time of the recent logged windows times the steps left.
        This run's first step is left out once there are others, as the run's summary and the report
        leave it out: it warms up (a resumed run's took the time of 27 steady steps on CPU; logged
        every 5 steps, the ETA came out 10x too long)."""
        if not self._windows:
            return self._first_step_s * max(self.stop - step, 0)
        steps, seconds = map(sum, zip(*self._windows))
        return seconds / steps * max(self.stop - step, 0)

    def close(self) -> None:
        self.tensorboard.close()


def _step_of(line: bytes) -> int | None:
    """The step of the metrics row on `line`, or None when it is not one."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: brackets nested too deep (was a traceback)
        return None
    return row["step"] if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _is_row_from(line: bytes, step: int) -> bool:
    """Whether `line` is a metrics row of `step` or later; a line that is none is kept as it is."""
    return (row_step := _step_of(line)) is not None and row_step >= step


def strict_json(row: dict) -> dict:
    """`row` with each number that is not finite (a skipped step's loss) as None: JSON has no NaN, and
    strict readers (jq, JavaScript's JSON.parse) refuse Python's `NaN`."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in row.items()}


def milliseconds(seconds: float) -> str:
    """'172', '4.27', '0.613': whole milliseconds from 100 ms up, three significant figures below, so
    that a fast step (a small model on a GPU) reads as what tok/s says, not as '0'."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def duration(seconds: float) -> str:
    """'42s', '3m07s', '2h05m'."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
