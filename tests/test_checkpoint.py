"""Checkpointer details a user meets on resuming, at unit level (no training): the one-line reasons
given for a checkpoint that cannot be read, and the processes of a run agreeing on which one they
resume from. One run at a time per workdir is the run's lock (holmes_jax.train.lock_workdir,
tested in test_train)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from holmes_jax import cli, distributed, inference
from holmes_jax.checkpoint import Checkpointer, reason
from holmes_jax.config import CheckpointConfig, ConfigError, ModelConfig


def test_a_tensorstore_error_is_named_without_its_spec_dump():
    error = ValueError('NOT_FOUND: Error opening "zarr" driver: Metadata at "step/.zarray" does not exist '
                       "[tensorstore_spec='{\"context\":{\"cache_pool\":{}},\"driver\":\"zarr\"}']")
    assert reason(error) == 'NOT_FOUND: Error opening "zarr" driver: Metadata at "step/.zarray" does not exist'


def test_an_empty_step_folder_is_said_to_be_missing_its_state(tmp_path):
    (tmp_path / "3").mkdir()  # a copy cut short; orbax blamed a handler not registered
    ckpt, said = Checkpointer(tmp_path, CheckpointConfig()), []
    with pytest.raises(cli.RunError, match=r"no checkpoint in .* can be read \(steps 3\)"):
        ckpt.restore_newest({}, said.append)
    ckpt.close()
    assert said == ["checkpoint step 3 cannot be read (its default/ folder is missing); trying an older one"]


def test_a_state_that_cannot_be_built_is_the_runs_error_not_a_failed_write(tmp_path):
    def out_of_memory():  # as building the canonical state on the devices can fail
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 4 GB")

    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    # train names it as out of device memory; it was "cannot write checkpoints in ...", the disk blamed
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        ckpt.save(1, out_of_memory, force=True)
    ckpt.save(2, lambda: {"w": jnp.zeros(4)}, force=True)  # and the checkpointer still saves
    ckpt.close()
    assert ckpt.latest_step() == 2


# --------------------------------------------------------------------------- several processes


def _save_steps(directory, steps) -> None:
    """Checkpoints of a one-array state, `w` = the step, at each of `steps`."""
    ckpt = Checkpointer(directory, CheckpointConfig())
    for step in steps:
        ckpt.save(step, lambda: {"w": jnp.full(4, float(step))}, force=True)
    ckpt.close()


def _two_processes(monkeypatch, other_steps=None, other_reads=()):
    """This process as process 0 of two: process 1 lists `other_steps` (default: what this one
    lists) and gives `other_reads` as its read verdicts, in order, then reads everything else."""
    other_reads = list(other_reads)

    def every_process(name, text, timeout_s=None):
        if name == "checkpoint steps":
            return [text, text if other_steps is None else json.dumps(other_steps)]
        if name == "checkpoints" or name.startswith("checkpoint set aside"):  # a barrier
            return [text, ""]
        assert name == "checkpoint read", name
        return [text, other_reads.pop(0) if other_reads else ""]
    monkeypatch.setattr(distributed, "every_process", every_process)


def _fails(why: str, damage: bool = True) -> str:
    return json.dumps({"reason": why, "damage": damage})


def test_a_step_another_process_cannot_read_is_set_aside_by_all(tmp_path, monkeypatch):
    from jax.experimental import multihost_utils

    def device_barrier(name):  # over every device before the warm-up: across NIC classes it cannot connect
        raise AssertionError(f"a device barrier: {name}")

    _save_steps(tmp_path, [2, 3])
    monkeypatch.setattr(multihost_utils, "sync_global_devices", device_barrier)
    # process 1 reads step 3's metadata, then not its arrays (its host sees a truncated file)
    _two_processes(monkeypatch, other_reads=["", _fails("truncated")])
    ckpt, said = Checkpointer(tmp_path, CheckpointConfig()), []
    step, state = ckpt.restore_newest({"w": jnp.zeros(4)}, said.append)
    ckpt.close()
    assert step == 2 and np.asarray(state["w"]).tolist() == [2.0] * 4
    assert said == ["checkpoint step 3 cannot be read on process 1 (truncated); trying an older one",
                    "using checkpoint step 2 instead; the damaged ones are renamed <step>.damaged"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3.damaged"]


def test_a_step_this_process_cannot_read_while_another_can_is_set_aside(tmp_path, monkeypatch):
    _save_steps(tmp_path, [2, 3])
    _two_processes(monkeypatch)
    restore = Checkpointer.restore

    def truncated_here(self, step, target):
        if step == 3:
            raise ValueError("DATA_LOSS: truncated")
        return restore(self, step, target)
    monkeypatch.setattr(Checkpointer, "restore", truncated_here)
    ckpt, said = Checkpointer(tmp_path, CheckpointConfig()), []
    step, _ = ckpt.restore_newest({"w": jnp.zeros(4)}, said.append)
    ckpt.close()
    assert step == 2
    assert said[0] == "checkpoint step 3 cannot be read on process 0 (DATA_LOSS: truncated); trying an older one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3.damaged"]


def test_a_step_only_another_process_lists_is_not_restored(tmp_path, monkeypatch):
    _save_steps(tmp_path, [2])
    _two_processes(monkeypatch, other_steps=[2, 5])  # this host's listing lags behind
    ckpt, said = Checkpointer(tmp_path, CheckpointConfig()), []
    step, _ = ckpt.restore_newest({"w": jnp.zeros(4)}, said.append)
    ckpt.close()
    assert step == 2
    assert said[0] == ("checkpoint step 5 cannot be read on process 0 (this process does not list it); "
                       "trying an older one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]  # nothing of step 5 here to rename


def test_a_step_another_process_cannot_read_now_is_left_and_ends_the_run(tmp_path, monkeypatch):
    _save_steps(tmp_path, [2, 3])
    _two_processes(monkeypatch, other_reads=["", _fails("Permission denied", damage=False)])
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    with pytest.raises(cli.RunError, match=r"checkpoint step 3 in .* cannot be read on process 1 \(Permission "
                                           r"denied\); it is left as it is"):
        ckpt.restore_newest({"w": jnp.zeros(4)}, [].append)
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3"]


# --------------------------------------------------------------------------- inference.restore_params


@pytest.fixture
def opened_managers(monkeypatch):
    """The CheckpointManagers opened from here on, each with whether it was closed."""
    opened = []

    class Recorded(ocp.CheckpointManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.closed = False
            opened.append(self)

        def close(self):
            self.closed = True
            super().close()
    monkeypatch.setattr(ocp, "CheckpointManager", Recorded)
    return opened


def test_restore_params_closes_its_manager_when_there_is_no_checkpoint(tmp_path, opened_managers):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="has no checkpoint under"):
        inference.restore_params(tmp_path, ModelConfig())
    assert len(opened_managers) == 1 and opened_managers[0].closed


def test_restore_params_closes_its_manager_when_the_step_is_not_there(tmp_path, opened_managers):
    _save_steps(tmp_path / "checkpoints", [2])  # its Checkpointer's manager is the first opened
    with pytest.raises(ConfigError, match=r"--step 7 is not allowed; the checkpoints of .* are at steps 2"):
        inference.restore_params(tmp_path, ModelConfig(), step=7)
    assert len(opened_managers) == 2 and all(manager.closed for manager in opened_managers)
