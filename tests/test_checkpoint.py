"""Checkpointer details a user meets on resuming, at unit level (no training): one run at a time per
checkpoints directory, and the one-line reasons given for a checkpoint that cannot be read."""

import os

import pytest

from holmes_jax import cli
from holmes_jax.checkpoint import Checkpointer, reason
from holmes_jax.config import CheckpointConfig, ConfigError


def test_a_second_run_on_the_same_checkpoints_is_refused_and_leaves_the_first_ones_save_alone(tmp_path):
    first = Checkpointer(tmp_path / "checkpoints", CheckpointConfig())
    in_flight = tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp"  # the first run's async save
    in_flight.mkdir()
    # it went on and deleted the save in flight as a failed save's leftover, then saved the same steps
    with pytest.raises(ConfigError, match=rf"TrainConfig.workdir = '{tmp_path}' is in use by another run "
                                          rf"\(process {os.getpid()} on .*\); allowed: "):
        Checkpointer(tmp_path / "checkpoints", CheckpointConfig())
    assert in_flight.is_dir()
    in_flight.rmdir()
    first.close()
    Checkpointer(tmp_path / "checkpoints", CheckpointConfig()).close()  # free once the first run ended


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
