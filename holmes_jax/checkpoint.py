"""Checkpoints through orbax's CheckpointManager: periodic async saves, keep the newest K, and
restore onto any mesh (the restore target's shardings decide where each array lands)."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from holmes_jax.config import CheckpointConfig


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True, enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state_fn, force: bool = False) -> None:
        """Saves `state_fn()` every `cfg.every` steps, or now when `force` (the last step, an
        interruption). A function, so the checkpoint layout is only built on steps that save."""
        if (force or step % self.cfg.every == 0) and step != self._manager.latest_step():
            self._manager.save(step, args=ocp.args.StandardSave(state_fn()), force=True)

    def restore(self, step: int, target):
        """`target`: arrays or `jax.ShapeDtypeStruct`s carrying the shardings to restore onto."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target
        )
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        """Waits for async saves to finish: a run must never exit with a checkpoint half-written."""
        self._manager.wait_until_finished()
        self._manager.close()
