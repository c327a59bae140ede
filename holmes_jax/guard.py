"""What ends a run early, and how every process ends it after the same step.

- In the loop, SIGINT, SIGTERM and SIGHUP only set a flag (`cli.SignalHold`). The loop lets the step
  in flight finish, saves a checkpoint of it and raises `cli.Stopped` (exit status 128 + the signal
  number).
- `StopVote`: with several processes, a two-numbers-per-device all-reduce after each step, so all
  stop after the same one, for a signal or for a checkpoint write that failed in the background.
  (JAX's `multihost_utils.reached_preemption_sync_point` reacts to SIGTERM only, and only under
  `jax.distributed`.)
- `BadSteps`: steps whose loss or gradient norm was not finite (the jitted step skipped their
  update); too many in a row end the run with `cli.RunError` (exit status 1).
- `fault_point`: the one place a test injects a fault, from `HOLMES_FAULT`.
"""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from holmes_jax.cli import STOP_SIGNALS, RunError
from holmes_jax.config import ConfigError

FAULT_ENV = "HOLMES_FAULT"
FAULT_POINTS = ("batch", "step")


class StopVote:
    """`vote(signum, write_failed)`: the same (signal number or None, whether a checkpoint write
    failed) on every process: the largest signal any process caught, and whether any process's
    background write failed. One process needs no collective; several reduce two numbers per device
    in the mesh."""

    def __init__(self, mesh):
        self._mesh = mesh
        if jax.process_count() > 1:
            self._numbers = NamedSharding(mesh, P(mesh.axis_names, None))
            self._max = jax.jit(lambda numbers: jnp.max(numbers, axis=0), out_shardings=NamedSharding(mesh, P()))

    def vote(self, signum: int | None, write_failed: bool = False) -> tuple[int | None, bool]:
        if jax.process_count() == 1:
            return signum, write_failed
        numbers = jax.make_array_from_callback((self._mesh.devices.size, 2), self._numbers,
                                               lambda index: np.array([[signum or 0, write_failed]], np.int32))
        signum, write_failed = (int(n) for n in self._max(numbers))
        return signum or None, bool(write_failed)


class BadSteps:
    """Counts steps in a row whose update was skipped (non-finite loss or gradient norm). A resume
    goes on with the count its checkpoint was saved with (`record`): a run stopped in a diverging
    stretch (a stop saves even a skipped step) ends at the same step as one left alone."""

    def __init__(self, limit: int, say, record: dict | None = None):
        self.limit, self.say = limit, say
        saved = (record or {}).get("bad_steps")
        valid = (isinstance(saved, list) and len(saved) == 2 and all(type(n) is int and n > 0 for n in saved))
        self.in_a_row, self.first = saved if valid else (0, None)

    def record(self) -> dict:
        """The count, for a checkpoint's record."""
        return {"bad_steps": [self.in_a_row, self.first]} if self.in_a_row else {}

    def add(self, step: int, out: dict) -> None:
        if not out["skipped"]:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.first = step if self.in_a_row == 1 else self.first
        self.say(f"step {step}: loss {float(out['loss']):.4g}, gradient norm {float(out['grad_norm']):.4g}: "
                 f"not finite, update skipped ({self.in_a_row} in a row; TrainConfig.max_bad_steps = {self.limit})")

    def check(self, step: int, newest_checkpoint: int | None) -> None:
        """Raises `RunError` once `limit` steps in a row were skipped."""
        if self.in_a_row < self.limit:
            return
        where = (f"the newest checkpoint is step {newest_checkpoint}" if newest_checkpoint is not None
                 else "no checkpoint was written")
        raise RunError(f"the loss or gradient norm was not finite for {self.in_a_row} steps in a row "
                       f"(steps {self.first}-{step}); stopped ({where}). Lower TrainConfig.learning_rate or "
                       f"TrainConfig.grad_clip, or raise TrainConfig.max_bad_steps")


def injected_fault() -> tuple[int, str, int] | None:
    """(signal, point, step) from `HOLMES_FAULT=signal:INT|TERM|HUP:batch|step:STEP`, or None."""
    text = os.environ.get(FAULT_ENV)
    if not text:
        return None
    kind, name, point, step = (text.split(":") + [""] * 4)[:4]
    if (kind != "signal" or f"SIG{name}" not in {s.name for s in STOP_SIGNALS} or point not in FAULT_POINTS
            or not step.isdecimal() or int(step) < 1 or text.count(":") != 3):  # steps count from 1: 0 never comes
        raise ConfigError(f"{FAULT_ENV} = {text!r} is not allowed; allowed: signal:INT|TERM|HUP:batch|step:STEP "
                          f"with STEP >= 1, e.g. signal:TERM:batch:3")
    return signal.Signals[f"SIG{name}"], point, int(step)


def fault_point(point: str, step: int) -> None:
    """Sends this process the signal `HOLMES_FAULT` names when the loop reaches `point` of `step`:
    'batch' while the step's batch is built (the step before still running), 'step' right after the
    step is dispatched."""
    fault = injected_fault()
    if fault is not None and fault[1:] == (point, step):
        os.kill(os.getpid(), fault[0])
