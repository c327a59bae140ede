"""Checkpointer details a user meets on resuming, at unit level (no training): the one-line reasons
given for a checkpoint that cannot be read. One run at a time per workdir is the run's lock
(holmes_jax.train.lock_workdir, tested in test_train)."""

import pytest

from holmes_jax import cli
from holmes_jax.checkpoint import Checkpointer, reason
from holmes_jax.config import CheckpointConfig


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
