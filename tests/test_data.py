import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import lock_folder
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


@pytest.mark.parametrize("name", ["TOKENS.BIN", "tokens.Bin"])
def test_a_token_file_suffix_in_upper_or_mixed_case_is_a_token_file(tmp_path, name):
    # was read as text, and refused as a binary file
    path = _write(tmp_path / name, (np.arange(10_000) % 1000).astype("<u2").tobytes())
    assert data.vocab_size(DataConfig(source=path, vocab_size=1000)) == 1000
    tokens = data.load(DataConfig(source=path, seq_len=16, cache_dir=str(tmp_path)))
    assert tokens.vocab_size == 1000 and "token file" in tokens.description
    np.testing.assert_array_equal(np.diff(tokens.batch("train", 0, 0, 2, 16), axis=1) % 1000, 1)


def test_the_text_cache_copies_a_large_file_in_pieces(tmp_path):
    import tracemalloc

    size = 16 << 20
    path = _write(tmp_path / "big.txt", b"a line of text\n" * (size // 15))
    tracemalloc.start()
    try:
        tokens = data.load(DataConfig(source=path, seq_len=16, cache_dir=str(tmp_path / "cache")))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 4, f"{peak / size:.2f} bytes of memory per byte of text"  # was the whole file
    assert len(tokens.train) + len(tokens.val) == (size // 15) * 15
    assert bytes(tokens.train[:30]) == b"a line of text\n" * 2


@pytest.mark.parametrize("source", ["/nonexistent/corpus", "/nonexistent/tokens.bin"])
def test_missing_sources_are_config_errors(source, tmp_path):
    with pytest.raises(ConfigError, match="DataConfig.source"):
        data.load(DataConfig(source=source, cache_dir=str(tmp_path)))


def test_corpus_too_small_is_a_config_error(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"xy" * 10)
    with pytest.raises(ConfigError, match="too few .* each split needs seq_len \\+ 1 = 65, so at least 130 tokens"):
        data.load(DataConfig(source=str(tmp_path / "t.txt"), seq_len=64, cache_dir=str(tmp_path)))


def _write(path, content: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return str(path)


def _bad_sources(d):
    for name, content in [("empty.txt", b""), ("blank/a.txt", b""), ("empty.bin", b""), ("odd.bin", b"\x01\x00\x02"),
                          ("six.bin", bytes(6)), ("short.bin", bytes(40)), ("text.txt", b"text " * 100),
                          ("afile", b"x"), ("wide.bin", np.arange(5000, dtype="<u2").tobytes())]:
        _write(d / name, content)
    (d / "nothing").mkdir()


DATA_ERRORS = {  # case: (source in the test folder, DataConfig fields, what the error names)
    "empty text file": ("empty.txt", {}, "holds no text"),
    "empty folder": ("nothing", {}, "a folder with no files"),
    "folder of empty files": ("blank", {}, "holds no text"),
    "empty .bin": ("empty.bin", {}, "is empty"),
    "odd-length .bin": ("odd.bin", {}, "holds 3 bytes, not a whole number of uint16 ids"),
    "uint32 .bin of 6 bytes": ("six.bin", {"token_dtype": "uint32"}, "check DataConfig.token_dtype"),
    ".bin shorter than a sequence": ("short.bin", {"seq_len": 32}, "too few for DataConfig.seq_len"),
    ".bin id beyond DataConfig.vocab_size": ("wide.bin", {"vocab_size": 4000},
                                             "holds token id 4999, outside DataConfig.vocab_size = 4000"),
    "unwritable cache dir": ("text.txt", {"cache_dir": "afile/cache"}, "DataConfig.cache_dir"),
}


@pytest.mark.parametrize("case", DATA_ERRORS)
def test_data_errors_are_config_errors_naming_the_field(tmp_path, case):
    _bad_sources(tmp_path)
    source, fields, names = DATA_ERRORS[case]
    fields = {"seq_len": 8, **fields, "cache_dir": str(tmp_path / fields.get("cache_dir", "cache"))}
    cfg = DataConfig(source=str(tmp_path / source), **fields)
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        data.load(cfg)
    assert not list(tmp_path.rglob("*.tmp*"))  # no partial cache left behind


def test_vocabulary_of_each_source_and_padding():
    assert data.vocab_size(DataConfig()) is None and data.vocab_size(DataConfig(source="some/text")) is None
    assert data.vocab_size(DataConfig(source="t.bin")) is None
    assert data.vocab_size(DataConfig(source="t.bin", vocab_size=50257)) == 50257
    assert [data.padded_vocab(n) for n in (1, 128, 129, 257, 50257)] == [128, 128, 256, 384, 50304]
    assert data.padded_vocab(300, 384) == 384


def test_ids_beyond_the_model_vocabulary_are_named_with_the_fix(tmp_path):
    path = _write(tmp_path / "t.bin", (np.arange(10_000) % 1000).astype("<u2").tobytes())
    scanned = data.load(DataConfig(source=path, seq_len=16, cache_dir=str(tmp_path)))
    assert (scanned.vocab_size, scanned.declared) == (1000, False)
    scanned.check_model_vocab(1000)
    with pytest.raises(ConfigError, match="ids up to 999 but ModelConfig.vocab_size = 256; set DataConfig.vocab_size"):
        scanned.check_model_vocab(256)
    declared = data.load(DataConfig(source=path, seq_len=16, vocab_size=1024, cache_dir=str(tmp_path)))
    assert (declared.vocab_size, declared.declared) == (1024, True)
    with pytest.raises(ConfigError, match="ModelConfig.vocab_size = 1000; leave ModelConfig.vocab_size unset"):
        declared.check_model_vocab(1000)


def test_prepared_folder_whose_tokens_disagree_with_meta_is_an_error(tmp_path):
    from holmes_jax import prepare

    _write(tmp_path / "a.txt", b"hello world, " * 100)
    meta = prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "p"), "bytes")
    cfg = DataConfig(source=str(tmp_path / "p"), seq_len=16)
    assert data.vocab_size(cfg) == 257 and data.load(cfg).vocab_size == 257
    with pytest.raises(ConfigError, match="disagrees with"):
        data.load(dataclasses.replace(cfg, vocab_size=300))
    with open(tmp_path / "p" / "tokens.bin", "r+b") as f:
        f.truncate(2 * (meta["tokens"] - 10))
    with pytest.raises(ConfigError, match="tokens.bin holds 1,291 tokens, meta.json says 1,301"):
        data.load(cfg)
    (tmp_path / "p" / "meta.json").write_text('{"dtype": "int8"}')
    with pytest.raises(ConfigError, match="meta.json needs tokenizer, dtype"):
        data.vocab_size(cfg)


def test_the_model_vocabulary_follows_the_data_unless_set(tmp_path):
    from helpers import small_configs

    path = _write(tmp_path / "t.bin", np.arange(5000, dtype="<u2").tobytes())
    vocab = lambda *args: small_configs(tmp_path, *args).model.vocab_size  # noqa: E731
    assert vocab() == 256  # stdlib bytes
    assert vocab(f"--gin.DataConfig.source={path}") == 256  # unknown without a scan: the preset's
    assert vocab(f"--gin.DataConfig.source={path}", "--gin.DataConfig.vocab_size=5000") == 5120
    assert vocab(f"--gin.DataConfig.source={path}", "--gin.DataConfig.vocab_size=5000",
                 "--gin.ParallelConfig.tp=3", "--gin.ParallelConfig.dp=1") == 5120  # was 5376, a multiple of tp
    # too: a checkpoint of tp 1 did not fit the model of tp 3, "Set the ModelConfig the run that wrote it used"
    assert vocab(f"--gin.DataConfig.source={path}", "--gin.ModelConfig.vocab_size=6000") == 6000


TRAIN_TOKEN_FILE_ERRORS = {  # case: (file content, arguments, what the error line names)
    "ids beyond the model": (np.arange(3000, dtype="<u2").tobytes(), [], "set DataConfig.vocab_size"),
    "ids beyond a set model vocabulary": (np.arange(3000, dtype="<u2").tobytes(),
                                          ["--gin.DataConfig.vocab_size=3000", "--gin.ModelConfig.vocab_size=2048"],
                                          "ModelConfig.vocab_size = 2048"),
    "odd length": (b"\x01\x00\x02", [], "DataConfig.token_dtype"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN_TOKEN_FILE_ERRORS)
def test_train_exits_2_with_one_error_line_on_bad_token_files(tmp_path, case):
    from helpers import run_module

    content, args, names = TRAIN_TOKEN_FILE_ERRORS[case]
    path = _write(tmp_path / "t.bin", content)
    workdir = tmp_path / "wd"
    r = run_module("holmes_jax.train", f"--gin.DataConfig.source={path}", f"--gin.TrainConfig.workdir={workdir}",
                   "--gin.TrainConfig.steps=2", *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], r.stderr
    assert not workdir.exists()


def test_the_text_cache_reads_an_edited_file_and_another_folder_of_the_same_name_anew(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    for project, letter in (("p1", b"A"), ("p2", b"B")):
        _write(tmp_path / project / "corpus" / "a.txt", letter * 400)
    for project, letter in (("p1", b"A"), ("p2", b"B")):  # the same relative name and size
        monkeypatch.chdir(tmp_path / project)
        tokens = data.load(DataConfig(source="corpus", seq_len=8, cache_dir=cache))
        assert set(np.unique(tokens.train)) == {letter[0]}
    edited = tmp_path / "p2" / "corpus" / "a.txt"
    edited.write_bytes(b"C" * 400)  # same size; a later modification time, as an editor leaves it
    later = edited.stat().st_mtime_ns + 10**9
    os.utime(edited, ns=(later, later))
    tokens = data.load(DataConfig(source="corpus", seq_len=8, cache_dir=cache))
    assert set(np.unique(tokens.train)) == {ord("C")}
    # p2's edited corpus replaced p2's old cache (each edit left a copy of the corpus); p1's stays
    caches = sorted(Path(cache).glob("*.u8"))
    assert len(caches) == 2 and {bytes(np.fromfile(c, np.uint8)[:1]) for c in caches} == {b"A", b"C"}


def test_a_text_folder_skips_hidden_paths_and_binary_files(tmp_path):
    corpus = tmp_path / "repo"
    _write(corpus / "notes.txt", b"notes " * 100)
    _write(corpus / ".git" / "objects" / "ab", b"git internals " * 100)
    _write(corpus / "model.bin.dat", b"\x00\x01" * 300)
    tokens = data.load(DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / "cache")))
    assert len(tokens.train) + len(tokens.val) == 600
    assert "binary files skipped: 1" in tokens.description
    (corpus / "notes.txt").unlink()
    with pytest.raises(ConfigError, match="is a folder with only binary files in it"):
        data.load(DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / "cache")))


def test_a_text_folder_skips_the_prepared_folders_in_it(tmp_path):
    corpus = tmp_path / "corpus"
    _write(corpus / "notes.txt", b"notes " * 100)
    data.prepare.prepare([str(corpus)], str(corpus / "data"), "bytes")  # its tokenizer.json, meta.json: text
    tokens = data.load(DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / "cache")))
    assert len(tokens.train) + len(tokens.val) == 600


def test_a_binary_file_not_named_bin_is_an_error_not_bytes(tmp_path):
    path = _write(tmp_path / "train.u16", np.arange(5000, dtype="<u2").tobytes())  # token ids, another suffix
    with pytest.raises(ConfigError, match="is a binary file .* must be named NAME.bin"):
        data.load(DataConfig(source=path, seq_len=8, cache_dir=str(tmp_path / "cache")))


def test_a_prepared_folder_without_meta_json_is_an_error_not_text(tmp_path):
    from holmes_jax import prepare

    _write(tmp_path / "a.txt", b"hello world, " * 100)
    prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "p"), "bpe:300")
    (tmp_path / "p" / "meta.json").unlink()  # as an interrupted move into an existing folder leaves it
    with pytest.raises(ConfigError, match="holds tokens.bin but no meta.json"):  # not its tokenizer.json as bytes
        data.load(DataConfig(source=str(tmp_path / "p"), seq_len=8, cache_dir=str(tmp_path / "cache")))


def test_the_tokens_bin_of_a_prepared_folder_reads_as_the_folder(tmp_path):
    folder = tmp_path / "p"
    ids = (np.arange(4000) * 17 + 65000) % 70000  # ids above 65535: uint32
    _write(folder / "tokens.bin", ids.astype("<u4").tobytes())
    meta = {"tokenizer": "t.json", "vocab_size": 70000, "dtype": "uint32", "documents": 1, "tokens": 4000, "eot_id": 0}
    (folder / "meta.json").write_text(json.dumps(meta))
    cfg = DataConfig(source=str(folder / "tokens.bin"), seq_len=8, val_fraction=0.25, cache_dir=str(tmp_path))
    assert data.vocab_size(cfg) == 70000  # the model follows the folder's vocabulary
    tokens = data.load(cfg)  # in meta.json's dtype, not DataConfig.token_dtype's uint16
    assert (tokens.vocab_size, tokens.declared) == (70000, True)
    np.testing.assert_array_equal(np.concatenate([tokens.train, tokens.val]), ids)


def test_text_caches_written_at_once_under_one_pid_do_not_mix(tmp_path, monkeypatch):
    # Processes on two hosts sharing the cache folder can have the same pid: here a second build
    # starts (same pid) while the first is between its files, on a filesystem without locks (with
    # them, the second would wait for the first).
    monkeypatch.setattr(data.fcntl, "flock", lambda *_: None)
    files = [Path(_write(tmp_path / "t" / name, name.encode() * 500)) for name in ("a", "b")]
    copy, nested = shutil.copyfileobj, {}

    def copyfileobj(source, out, length):
        if source.path.name == "b" and not nested:
            nested["started"] = True
            nested["cache"] = data._cached_bytes(files, tmp_path / "cache", "t", tmp_path / "t")
        return copy(source, out, length)

    monkeypatch.setattr(shutil, "copyfileobj", copyfileobj)
    outer = data._cached_bytes(files, tmp_path / "cache", "t", tmp_path / "t")
    assert bytes(outer) == bytes(nested["cache"]) == b"a" * 500 + b"b" * 500
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(outer.filename).name]


def test_processes_starting_together_build_the_text_cache_once(tmp_path, monkeypatch):
    # Each process of a run built its own copy at once (the corpus's size in temporary files each);
    # now one builds while the others wait on the cache folder's lock, then read its cache.
    import threading

    files = [Path(_write(tmp_path / "t" / name, name.encode() * 500)) for name in ("a", "b")]
    copy, copied, start = shutil.copyfileobj, [], threading.Barrier(2)

    def slow_copy(source, out, length):
        copied.append(source.path.name)
        time.sleep(0.3)  # the other starts while this one is still writing
        return copy(source, out, length)
    monkeypatch.setattr(shutil, "copyfileobj", slow_copy)
    caches = []

    def process():
        start.wait()
        caches.append(bytes(data._cached_bytes(files, tmp_path / "cache", "t", tmp_path / "t")))
    threads = [threading.Thread(target=process, daemon=True) for _ in range(2)]  # daemon: a hung one ends with pytest
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a process still waits for the cache"
    assert caches == [b"a" * 500 + b"b" * 500] * 2
    assert copied == ["a", "b"]  # once: were ['a', 'a', 'b', 'b']


def test_the_text_cache_reads_new_content_given_the_old_size_and_modification_time(tmp_path):
    # `cp -p`, `touch -r`, rsync -t or an unpacked archive can leave new text with the old size and mtime.
    corpus = tmp_path / "a.txt"
    cfg = DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / "c"))
    corpus.write_bytes(b"A" * 400)
    assert set(np.unique(data.load(cfg).train)) == {ord("A")}
    old = corpus.stat()
    corpus.write_bytes(b"B" * 400)
    os.utime(corpus, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert set(np.unique(data.load(cfg).train)) == {ord("B")}


def test_a_prepared_folder_whose_tokens_bin_ends_in_part_of_an_id_says_prepare_it_again(tmp_path):
    folder = tmp_path / "p"
    _write(folder / "a.txt", b"hello world, " * 100)
    data.prepare.prepare([str(folder / "a.txt")], str(tmp_path / "p" / "out"), "bytes")
    with open(tmp_path / "p" / "out" / "tokens.bin", "r+b") as f:  # uint16 ids cut short by one byte
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(ConfigError, match="not a whole number of uint16 ids .*; prepare the folder again"):
        data.load(DataConfig(source=str(tmp_path / "p" / "out"), seq_len=8, cache_dir=str(tmp_path / "c")))


def test_a_text_folder_reads_linked_folders_and_stops_at_a_symlink_loop(tmp_path):
    corpus = tmp_path / "corpus"
    _write(corpus / "a" / "x.txt", b"x" * 100)
    _write(tmp_path / "elsewhere" / "y.txt", b"y" * 100)
    (corpus / "linked").symlink_to(tmp_path / "elsewhere")  # a corpus assembled from links
    (corpus / "a" / "loop").symlink_to(corpus)  # a link to a folder above
    tokens = data.load(DataConfig(source=str(corpus), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c")))
    assert bytes(np.concatenate([tokens.train, tokens.val])) == b"x" * 100 + b"y" * 100


def test_rows_of_a_batch_are_those_windows_of_the_whole_batch(tmp_path):
    tokens = data.load(DataConfig(cache_dir=str(tmp_path)))
    whole = tokens.batch("train", seed=3, step=7, batch_size=8, seq_len=16)
    np.testing.assert_array_equal(tokens.batch("train", 3, 7, 8, 16, rows=[5, 1, 6]), whole[[5, 1, 6]])


@pytest.mark.parametrize("written, token_dtype", [("<i8", "uint16"), ("<u4", "uint16"), ("<i8", "uint32")])
def test_ids_wider_than_the_token_dtype_are_an_error_not_every_second_id_zero(tmp_path, written, token_dtype):
    # np.array(ids).tofile writes int64: read as uint16 it was each id followed by three 0 ids, trained on
    # without complaint (the vocabulary check passes)
    path = _write(tmp_path / "ids.bin", (np.arange(5000) % 1000 + 1).astype(written).tobytes())
    cfg = DataConfig(source=path, seq_len=8, token_dtype=token_dtype, vocab_size=1024, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="every second id is 0.*set DataConfig.token_dtype to the file's type"):
        data.load(cfg)
    ids = (np.arange(5000) % 1000 + 1).astype(np.dtype(token_dtype).newbyteorder("<"))
    _write(tmp_path / "ids.bin", ids.tobytes())  # the same ids in the right type
    tokens = data.load(cfg)
    np.testing.assert_array_equal(np.concatenate([tokens.train, tokens.val]), ids)


@pytest.mark.parametrize("vocab_size", [None, 1024])
def test_uint16_ids_read_as_uint32_are_an_error_naming_the_dtype(tmp_path, vocab_size):
    # pairs of ids read as one: ids in the billions, so the model took a vocabulary of billions
    # (or the error said to raise DataConfig.vocab_size to that)
    path = _write(tmp_path / "ids.bin", (np.arange(5000) % 1000 + 1).astype("<u2").tobytes())
    cfg = DataConfig(source=path, seq_len=8, token_dtype="uint32", vocab_size=vocab_size, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="as uint32, beyond any vocabulary.*set DataConfig.token_dtype"):
        data.load(cfg)
    assert data.load(dataclasses.replace(cfg, token_dtype="uint16")).vocab_size == (vocab_size or 1001)


@pytest.mark.parametrize("left", [0, 500])
def test_a_text_cache_cut_short_is_built_again(tmp_path, left):
    # what a host that crashed before the cache reached its disk can leave under the cache's name
    path = _write(tmp_path / "a.txt", b"0123456789" * 100)
    cfg = DataConfig(source=path, seq_len=8, cache_dir=str(tmp_path / "c"))
    data.load(cfg)
    [cache] = (tmp_path / "c").iterdir()
    with open(cache, "r+b") as f:
        f.truncate(left)
    tokens = data.load(cfg)  # was the cut-short bytes, or a traceback for an empty file
    assert bytes(np.concatenate([tokens.train, tokens.val])) == b"0123456789" * 100


@pytest.mark.parametrize("when", ["before the cache", "while the cache is written"])
def test_a_text_file_removed_after_the_folder_was_listed_is_named(tmp_path, monkeypatch, when):
    corpus = tmp_path / "corpus"
    for name in ("a.txt", "b.txt"):
        _write(corpus / name, name.encode() * 100)
    if when == "before the cache":
        listed = data._text_files

        def list_then_remove(*args):
            files = listed(*args)
            (corpus / "b.txt").unlink()
            return files

        monkeypatch.setattr(data, "_text_files", list_then_remove)
    else:
        copy = shutil.copyfileobj

        def copy_then_remove(source, out, length):
            copy(source, out, length)
            (corpus / "b.txt").unlink(missing_ok=True)

        monkeypatch.setattr(shutil, "copyfileobj", copy_then_remove)
    # was a FileNotFoundError traceback, or "DataConfig.cache_dir ... cannot be written"
    with pytest.raises(ConfigError, match=r"DataConfig.source: '.*b\.txt' cannot be read \(No such file"):
        data.load(DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / "c")))
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_stop_while_the_text_cache_is_written_leaves_no_partial_copy(tmp_path, monkeypatch):
    path = _write(tmp_path / "a.txt", b"text " * 100)

    def interrupted(source, out, length):
        raise KeyboardInterrupt  # Ctrl-C (or the trainer's stop signal) during a long copy

    monkeypatch.setattr(shutil, "copyfileobj", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.load(DataConfig(source=path, seq_len=8, cache_dir=str(tmp_path / "c")))
    assert list((tmp_path / "c").iterdir()) == []  # was a .tmp file as large as the corpus, never removed


def test_a_folder_named_bin_without_meta_json_is_named_as_a_folder(tmp_path):
    _write(tmp_path / "corpus.bin" / "a.txt", b"text " * 100)
    with pytest.raises(ConfigError, match="'.*corpus.bin' is a folder without meta.json"):  # was "not found"
        data.load(DataConfig(source=str(tmp_path / "corpus.bin"), seq_len=8, cache_dir=str(tmp_path / "c")))


def test_a_full_cache_disk_is_a_run_error_and_leaves_no_partial_copy(tmp_path, monkeypatch):
    # status 1 as for a full disk under a checkpoint or --out (README's table), not 2 "bad input"
    import errno

    from holmes_jax import cli

    path = _write(tmp_path / "a.txt", b"text " * 100)

    def disk_full(source, out, length):
        out.write(source.read(10))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", disk_full)
    with pytest.raises(cli.RunError, match="DataConfig.cache_dir = .* cannot be written \\(No space left on device\\); "
                                           "free space there"):
        data.load(DataConfig(source=path, seq_len=8, cache_dir=str(tmp_path / "c")))
    assert list((tmp_path / "c").iterdir()) == []


def test_a_source_file_that_fails_mid_copy_is_named_not_the_cache_folder(tmp_path, monkeypatch):
    import errno
    import io

    path = _write(tmp_path / "a.txt", b"text " * 100)

    class FailingDisk(io.BytesIO):
        def read(self, size=-1):
            if size == data.COPY_CHUNK:  # the copy's reads fail, not the look for binary files before it
                raise OSError(errno.EIO, "Input/output error")
            return super().read(size)

    monkeypatch.setattr(data, "_open_text", lambda p: FailingDisk(b"text " * 100))
    with pytest.raises(ConfigError, match="DataConfig.source: '.*a.txt' cannot be read \\(Input/output error\\)"):
        data.load(DataConfig(source=path, seq_len=8, cache_dir=str(tmp_path / "c")))  # was "cache_dir cannot be written"
    assert list((tmp_path / "c").iterdir()) == []


def test_the_text_cache_reaches_the_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    # renamed before its data was written out, a host crash could leave a cache of the right size
    # holding zeros, which no later run would notice
    path = _write(tmp_path / "a.txt", b"text " * 100)
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a))) or replace(a, b))
    data.load(DataConfig(source=path, seq_len=8, cache_dir=str(tmp_path / "c")))
    assert [name for name, _ in events] == ["fsync", "replace"] and events[0][1] == events[1][1]


def test_meta_json_counts_must_be_integers_not_true(tmp_path):
    from holmes_jax import prepare

    _write(tmp_path / "a.txt", b"hello world, " * 100)
    prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "p"), "bytes")
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    (tmp_path / "p" / "meta.json").write_text(json.dumps(dict(meta, eot_id=True)))  # was read as id 1
    with pytest.raises(ConfigError, match="meta.json needs tokenizer, dtype"):
        data.load(DataConfig(source=str(tmp_path / "p"), seq_len=16))


@pytest.mark.parametrize("cache", ["corpus/cache", "corpus", "."])
def test_a_cache_folder_in_above_or_as_the_text_folder_is_not_read_as_text(tmp_path, cache):
    corpus = tmp_path / "corpus"
    _write(corpus / "a.txt", b"hello world " * 100)
    _write(corpus / "bytes-notes.txt", b"more text " * 10)  # a name like the cache's is still text
    cfg = DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / cache))
    # In the folder: each run read the caches of the runs before as text (1,300, 2,600, 5,200
    # tokens); as it or above it: no text at all ("a folder with no files in it").
    for _ in range(3):
        tokens = data.load(cfg)
        assert bytes(np.concatenate([tokens.train, tokens.val])) == b"hello world " * 100 + b"more text " * 10
    assert len(list((tmp_path / cache).glob("*.u8"))) == 1


def test_a_folder_in_a_text_folder_that_cannot_be_listed_is_named_not_left_out(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    _write(corpus / "a.txt", b"read " * 100)
    _write(corpus / "locked" / "b.txt", b"never read " * 100)
    lock_folder(monkeypatch, corpus / "locked")
    # was a run on a.txt alone, without a word about the folder left out
    with pytest.raises(ConfigError, match=r"DataConfig.source: '.*locked' cannot be read \(Permission denied\)"):
        data.load(DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / "c")))


@pytest.mark.parametrize("name", ["", "a.txt", "ids.bin", "tokens.bin"])
def test_a_source_in_a_folder_without_permission_is_an_error_line_not_a_traceback(tmp_path, monkeypatch, name):
    _write(tmp_path / "locked" / "a.txt", b"text " * 100)
    lock_folder(monkeypatch, tmp_path / "locked")
    source = str(tmp_path / "locked" / name) if name else str(tmp_path / "locked")
    with pytest.raises(ConfigError, match=r"DataConfig.source: '.*locked.*' cannot be read \(Permission denied\)"):
        data.load(DataConfig(source=source, seq_len=8, cache_dir=str(tmp_path / "c")))  # was a PermissionError


def test_a_cache_folder_without_permission_is_an_error_line_not_a_traceback(tmp_path, monkeypatch):
    path = _write(tmp_path / "a.txt", b"text " * 100)
    (tmp_path / "locked").mkdir()
    lock_folder(monkeypatch, tmp_path / "locked")
    with pytest.raises(ConfigError, match=r"DataConfig.cache_dir = '.*locked' cannot be read \(Permission denied\)"):
        data.load(DataConfig(source=path, seq_len=8, cache_dir=str(tmp_path / "locked")))  # was a PermissionError


def test_a_meta_json_vocabulary_that_leaves_out_its_end_of_text_id_is_an_error(tmp_path):
    from holmes_jax import prepare

    _write(tmp_path / "a.txt", b"hello world, " * 100)
    prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "p"), "bytes")
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    # was loaded as vocabulary 100: a model of 128 embeddings for ids up to 256, trained to NaN;
    # 256 leaves out the end-of-text id alone
    for vocab_size in (100, 256):
        (tmp_path / "p" / "meta.json").write_text(json.dumps(dict(meta, vocab_size=vocab_size)))  # edited by hand
        with pytest.raises(ConfigError, match=f"meta.json says eot_id 256, not below its vocab_size {vocab_size}"):
            data.load(DataConfig(source=str(tmp_path / "p"), seq_len=16))


def test_a_text_file_whose_name_is_not_utf8_is_read(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"hello world " * 100)  # a Latin-1 name, from an old archive
    # was a UnicodeEncodeError
    tokens = data.load(DataConfig(source=str(corpus), seq_len=8, cache_dir=str(tmp_path / "c")))
    assert bytes(np.concatenate([tokens.train, tokens.val])) == b"hello world " * 100


def test_a_text_folder_that_grows_from_one_file_to_several_replaces_its_cache(tmp_path):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    _write(corpus / "a.txt", b"a" * 400)
    cfg = DataConfig(source=str(corpus), seq_len=8, cache_dir=str(cache))
    data.load(cfg)
    _write(corpus / "b.txt", b"b" * 400)
    tokens = data.load(cfg)
    assert bytes(np.concatenate([tokens.train, tokens.val])) == b"a" * 400 + b"b" * 400
    # the one file's cache was keyed by the file, the two files' by the folder: it stayed behind
    assert [len(np.fromfile(c, np.uint8)) for c in cache.glob("*.u8")] == [800]


def test_text_folders_of_links_into_one_folder_keep_their_own_caches(tmp_path):
    real = tmp_path / "real"
    for name in "wxyz":
        _write(real / f"{name}.txt", name.encode() * 400)
    for folder, names in (("first", "wx"), ("second", "yz")):
        (tmp_path / folder).mkdir()
        for name in names:
            (tmp_path / folder / f"{name}.txt").symlink_to(real / f"{name}.txt")
    cache = tmp_path / "cache"
    for folder in ("first", "second"):
        data.load(DataConfig(source=str(tmp_path / folder), seq_len=8, cache_dir=str(cache)))
    # Both were keyed by the folder their files lie in: each run removed the other's cache as an
    # older version of its own and built its own again (two runs sharing the cache folder).
    firsts = {bytes(np.fromfile(c, np.uint8)[:1]) for c in cache.glob("*.u8")}
    assert firsts == {b"w", b"y"}


def _identity(tmp_path, folder: str, files: dict[str, bytes], cache: str = "cache") -> dict:
    for name, content in files.items():
        _write(tmp_path / folder / name, content)
    return data.load(DataConfig(source=str(tmp_path / folder), seq_len=8, cache_dir=str(tmp_path / cache))).identity


def test_the_data_identity_is_of_the_contents_not_of_paths_or_caches(tmp_path):
    # Hosts' copies of one corpus have other paths, inodes, times and cache keys: the same identity.
    corpus = {"a.txt": b"first file " * 500, "b.txt": b"second file " * 700}
    here = _identity(tmp_path, "here", corpus)
    assert here["tokens"] == 500 * 11 + 700 * 12
    assert _identity(tmp_path, "there", corpus, cache="other-cache") == here
    assert _identity(tmp_path, "grown", {**corpus, "c.txt": b"c" * 100})["tokens"] == here["tokens"] + 100
    # the same size, one byte other, at its start or its end: other contents
    for changed in (b"F" + corpus["a.txt"][1:], corpus["a.txt"][:-1] + b"!"):
        other = _identity(tmp_path, f"edited-{changed[:1]!r}", {**corpus, "a.txt": changed})
        assert other["tokens"] == here["tokens"] and other["sample"] != here["sample"]


def test_the_data_identity_reads_a_bounded_sample_of_a_large_corpus():
    # a scan of the whole corpus at every start of every process would cost minutes on a large one
    class Recorded:  # 10^10 ids, none stored: the windows read are noted
        def __init__(self, n):
            self.n, self.windows = n, []

        def __len__(self):
            return self.n

        def __getitem__(self, window: slice):
            start, stop, _ = window.indices(self.n)
            self.windows.append((start, stop))
            return np.full(stop - start, start % 251, np.uint16)

    tokens = Recorded(10**10)
    identity = data.identity(tokens, 50257)
    assert identity["tokens"] == 10**10 and identity["vocab_size"] == 50257
    assert sum(stop - start for start, stop in tokens.windows) <= data.SAMPLE_BLOCKS * data.SAMPLE_BLOCK
    assert tokens.windows[0][0] == 0 and tokens.windows[-1][1] == 10**10  # its first and last ids among them
