import numpy as np
import pytest

from holmes_jax import data
from holmes_jax.config import ConfigError, DataConfig


def test_stdlib_corpus_is_bytes_and_batches_are_a_pure_function_of_seed_and_step(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    tokens = data.load(cfg)
    assert tokens.vocab_size == 256 and len(tokens.train) > 1_000_000 and len(tokens.val) > 0
    again = data.load(cfg)  # from the cache
    a = tokens.batch("train", seed=3, step=7, batch_size=4, seq_len=16)
    b = again.batch("train", seed=3, step=7, batch_size=4, seq_len=16)
    assert a.shape == (4, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, tokens.batch("train", seed=3, step=8, batch_size=4, seq_len=16))
    assert not np.array_equal(a, tokens.batch("train", seed=4, step=7, batch_size=4, seq_len=16))
    # Windows are real slices of the corpus: consecutive tokens.
    start = bytes(np.asarray(tokens.train)).find(bytes(a[0].astype(np.uint8)))
    assert start >= 0


def test_text_folder_and_validation_split(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_bytes(b"a" * 5000)
    (tmp_path / "docs" / "b.txt").write_bytes(b"b" * 5000)
    tokens = data.load(DataConfig(source=str(tmp_path / "docs"), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c")))
    assert len(tokens.train) == 9000 and len(tokens.val) == 1000
    assert set(np.unique(tokens.val)) == {ord("b")}  # files in sorted order, the tail held out


def test_token_file_format(tmp_path):
    ids = np.arange(10_000) % 1000
    path = tmp_path / "tokens.bin"
    ids.astype("<u2").tofile(path)
    tokens = data.load(DataConfig(source=str(path), seq_len=16, cache_dir=str(tmp_path)))
    assert tokens.vocab_size == 1000
    batch = tokens.batch("train", 0, 0, 2, 16)
    np.testing.assert_array_equal(np.diff(batch, axis=1) % 1000, 1)


@pytest.mark.parametrize("source", ["/nonexistent/corpus", "/nonexistent/tokens.bin"])
def test_missing_sources_are_config_errors(source, tmp_path):
    with pytest.raises(ConfigError, match="DataConfig.source"):
        data.load(DataConfig(source=source, cache_dir=str(tmp_path)))


def test_corpus_too_small_is_a_config_error(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"xy" * 10)
    with pytest.raises(ConfigError, match="too few"):
        data.load(DataConfig(source=str(tmp_path / "t.txt"), seq_len=64, cache_dir=str(tmp_path)))
