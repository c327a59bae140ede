"""What reads a run back: `python -m holmes_jax.generate` (and `holmes_jax.load`) on bad input or a
damaged checkpoint ends with one error line."""

import contextlib
import glob
import io
import os
import re
import shutil

import jax
import numpy as np
import pytest

from holmes_jax import cli, generate, inference, prepare, train
from holmes_jax.config import ConfigError
from helpers import small_configs


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run with checkpoints at steps 1 and 2."""
    workdir = tmp_path_factory.mktemp("run")
    train.run(small_configs(workdir, "--gin.ParallelConfig.dp=1", "--gin.TrainConfig.steps=2",
                            "--gin.CheckpointConfig.every=1"), devices=jax.devices()[:1], quiet=True)
    return workdir


def _generate(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.run(generate.main, [str(a) for a in args])
    return e.value.code, out.getvalue(), err.getvalue()


def test_a_prompt_that_is_not_utf8_is_one_error_line(run_dir):
    prompt = b"ab\xff".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    code, _, err = _generate("--workdir", run_dir, "--prompt", prompt, "--max-tokens", 1)
    assert code == 2 and err.startswith("error: --prompt") and "UTF-8" in err and len(err.splitlines()) == 1, err


def test_a_damaged_checkpoint_is_one_error_line_naming_the_others(run_dir, tmp_path):
    run_dir = shutil.copytree(run_dir, tmp_path / "run")  # the other tests keep theirs whole
    code, out, err = _generate("--workdir", run_dir, "--prompt", "ab", "--max-tokens", 1, "--greedy")
    assert code == 0 and out.startswith("ab"), err
    for f in glob.glob(str(run_dir / "checkpoints" / "2" / "default" / "ocdbt.process_0" / "d" / "*")):
        os.truncate(f, 10)  # a crash or a full disk
    code, _, err = _generate("--workdir", run_dir, "--prompt", "ab", "--max-tokens", 1)
    assert code == 2 and err.startswith("error: checkpoint step 2 in ") and "cannot be read" in err, err
    assert err.strip().endswith("allowed: --step 1") and len(err.splitlines()) == 1, err
    code, out, err = _generate("--workdir", run_dir, "--prompt", "ab", "--max-tokens", 1, "--step", 1)
    assert code == 0 and out.startswith("ab"), err


def _with_model_bindings(run_dir, tmp_path, **fields) -> object:
    """A copy of the run whose config.gin sets other ModelConfig `fields`: a model the checkpoint is not."""
    copy = shutil.copytree(run_dir, tmp_path / "other_model")
    gin = copy / "config.gin"
    values = {f"ModelConfig.{name}": value for name, value in fields.items()}
    lines = [(line.split(" = ")[0], line) for line in gin.read_text().splitlines()]
    gin.write_text("\n".join(f"{name} = {values[name]!r}" if name in values else line for name, line in lines))
    return copy


@pytest.mark.parametrize("fields, named", [
    (dict(ffn_hidden=256), "params.blocks.up.kernel: (2, 64, 128) in the checkpoint, (2, 64, 256) configured"),
    (dict(tie_embeddings=False), "params.head.out.kernel: absent in the checkpoint, (64, 256) configured"),
])
def test_a_checkpoint_of_another_model_is_one_error_line_naming_the_arrays(run_dir, tmp_path, fields, named):
    # Another shape was blamed on a damaged checkpoint; an array it lacks loaded as a placeholder
    # that failed with a traceback at the first forward.
    other = _with_model_bindings(run_dir, tmp_path, **fields)
    code, out, err = _generate("--workdir", other, "--prompt", "ab", "--max-tokens", 1, "--greedy")
    assert code == 2 and not out and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: checkpoint step 2 in {other / 'checkpoints'} does not fit the ModelConfig of "
                          f"{other / 'config.gin'}: "), err
    assert named in err and "cannot be read" not in err, err
    with pytest.raises(ConfigError, match=re.escape(named)):
        inference.load(other, step=1)


def _with_data_source(run_dir, tmp_path, source) -> object:
    """A copy of the run whose config.gin names another DataConfig.source (the model's shapes unchanged)."""
    copy = shutil.copytree(run_dir, tmp_path / "run")
    gin = copy / "config.gin"
    gin.write_text("\n".join(f"DataConfig.source = {str(source)!r}" if line.startswith("DataConfig.source")
                             else line for line in gin.read_text().splitlines()))
    return copy


def test_a_run_on_a_token_file_refuses_a_text_prompt_in_one_line(run_dir, tmp_path):
    ids = tmp_path / "ids.bin"
    np.arange(200, dtype=np.uint16).tofile(ids)  # ids with no tokenizer: "ab" as bytes would be other tokens
    code, out, err = _generate("--workdir", _with_data_source(run_dir, tmp_path, ids), "--prompt", "ab",
                               "--max-tokens", 1, "--greedy")
    assert code == 2 and not out and err.startswith("error: the run read token ids from") and "ids.bin" in err, err
    assert len(err.splitlines()) == 1, err


def test_a_damaged_tokenizer_json_is_one_error_line(run_dir, tmp_path):
    copy = shutil.copytree(run_dir, tmp_path / "run")
    (copy / "tokenizer.json").write_text("{broken")
    code, _, err = _generate("--workdir", copy, "--prompt", "ab", "--max-tokens", 1)
    assert code == 2 and err.startswith("error: ") and "tokenizer.json" in err and len(err.splitlines()) == 1, err


def test_a_run_on_prepared_bytes_knows_its_end_of_text(run_dir, tmp_path):
    (tmp_path / "doc.txt").write_text("hello world\n" * 20)
    prepare.prepare([str(tmp_path / "doc.txt")], str(tmp_path / "data"), "bytes")
    assert inference.load(_with_data_source(run_dir, tmp_path, tmp_path / "data")).end_of_text == 256
    assert inference.load(run_dir).end_of_text is None  # text read as bytes: documents have no end mark


def test_a_run_on_prepared_bytes_keeps_its_end_of_text_when_its_data_folder_moves(tmp_path):
    (tmp_path / "doc.txt").write_text("hello world\n" * 40)
    prepare.prepare([str(tmp_path / "doc.txt")], str(tmp_path / "data"), "bytes")
    workdir = tmp_path / "run"
    train.run(small_configs(workdir, f"--gin.DataConfig.source='{tmp_path / 'data'}'", "--gin.ParallelConfig.dp=1",
                            "--gin.TrainConfig.steps=1", "--gin.DataConfig.seq_len=16"),
              devices=jax.devices()[:1], quiet=True)
    (tmp_path / "data").rename(tmp_path / "moved")  # or a relative source read from another folder
    # was None: generation did not stop at end-of-text, export wrote eos_token_id null
    assert inference.load(workdir).end_of_text == 256
    code, out, err = _generate("--workdir", workdir, "--prompt", "", "--max-tokens", 2, "--greedy")
    assert code == 0, err  # was 'error: --prompt is empty'


def test_a_run_resumed_on_other_data_drops_the_copies_of_the_data_it_left(tmp_path):
    (tmp_path / "doc.txt").write_text("hello world\n" * 40)
    prepare.prepare([str(tmp_path / "doc.txt")], str(tmp_path / "data"), "bytes")
    workdir = tmp_path / "run"
    for source, steps in ((tmp_path / "data", 1), (tmp_path / "doc.txt", 2)):  # then text read as bytes
        train.run(small_configs(workdir, f"--gin.DataConfig.source='{source}'", "--gin.ParallelConfig.dp=1",
                                f"--gin.TrainConfig.steps={steps}", "--gin.DataConfig.seq_len=16",
                                "--gin.ModelConfig.vocab_size=384", "--gin.CheckpointConfig.every=1"),
                  devices=jax.devices()[:1], quiet=True)
    assert not (workdir / "data_meta.json").exists()
    assert inference.load(workdir).end_of_text is None  # was 256: the first data's, kept in the workdir


def test_a_prompt_generate_refuses_is_refused_before_the_checkpoint_is_read(run_dir, tmp_path, monkeypatch):
    # a big model's checkpoint takes minutes to read: the error came only after it
    ids = tmp_path / "ids.bin"
    np.arange(200, dtype=np.uint16).tofile(ids)
    token_file_run = _with_data_source(run_dir, tmp_path, ids)

    def restore_params(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(inference, "restore_params", restore_params)
    for workdir, prompt, error in ((run_dir, b"ab\xff".decode("utf-8", "surrogateescape"), "error: --prompt"),
                                   (run_dir, "", "error: --prompt is empty"),  # bytes: no end-of-text to start after
                                   (token_file_run, "ab", "error: the run read token ids from")):
        code, out, err = _generate("--workdir", workdir, "--prompt", prompt, "--max-tokens", 1)
        assert code == 2 and not out and err.startswith(error) and len(err.splitlines()) == 1, err
