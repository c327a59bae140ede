"""`python -m holmes_jax.data prepare`: text to a token folder, and training on it."""

import contextlib
import io
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from holmes_jax import cli, data, prepare
from holmes_jax.config import ConfigError, DataConfig
from helpers import lock_folder, read_metrics, small_configs

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _cli(*args):
    """`python -m holmes_jax.data ARGS` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.run(data.main, list(args))
    return e.value.code, out.getvalue(), err.getvalue()


def _train_hf_tokenizer(path: Path, texts: list[str], special: list[str], size: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=special, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Seven Python sources (about 80 KB) as seven documents, and a hidden and a binary file prepare skips."""
    root = tmp_path_factory.mktemp("corpus")
    for src in sorted((STDLIB / "json").glob("*.py")) + [STDLIB / "textwrap.py", STDLIB / "string.py"]:
        shutil.copy(src, root / f"{src.parent.name}_{src.name}")
    (root / ".notes").write_text("hidden: never read")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "compiled.pyc").write_bytes(b"\x00\x01binary" * 10)
    return root


@pytest.fixture(scope="module", params=["bytes", "bpe:300", "tokenizer.json"])
def prepared(request, corpus, tmp_path_factory) -> tuple[str, Path]:
    """(tokenizer kind, prepared folder) for each kind of tokenizer."""
    root = tmp_path_factory.mktemp("prepared")
    spec = request.param
    if spec == "tokenizer.json":  # a tokenizer trained elsewhere (on other text), with </s> as end-of-text
        texts = [p.read_text() for p in sorted((STDLIB / "html").glob("*.py"))]
        spec = str(_train_hf_tokenizer(root / "tokenizer.json", texts, ["<s>", "</s>"]))
    code, out, err = _cli("prepare", str(corpus), "--out", str(root / "out"), "--tokenizer", spec)
    assert code == 0, err
    assert "documents" in out and "tokens" in out
    return request.param, root / "out"


def _documents(folder: Path) -> tuple[dict, list[np.ndarray]]:
    meta = json.loads((folder / "meta.json").read_text())
    ids = np.fromfile(folder / "tokens.bin", dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
    ends = np.flatnonzero(ids == meta["eot_id"])
    return meta, np.split(ids, ends + 1)[:-1]  # each with its end-of-text


def test_prepared_folder_holds_each_document_then_end_of_text(prepared, corpus):
    kind, folder = prepared
    meta, docs = _documents(folder)
    files = sorted(p for p in corpus.iterdir() if p.suffix == ".py")
    texts = [p.read_text() for p in files]
    assert meta["documents"] == len(docs) == len(files) == 7 and meta["binary_files_skipped"] == 1
    assert meta["tokens"] == sum(len(d) for d in docs) == (folder / "tokens.bin").stat().st_size // 2
    assert meta["dtype"] == "uint16" and meta["tokenizer"].endswith(kind)
    assert all(d[-1] == meta["eot_id"] and meta["eot_id"] not in d[:-1] for d in docs)
    assert max(int(d.max()) for d in docs) < meta["vocab_size"]
    total_bytes = sum(len(t.encode()) for t in texts)
    if kind == "bytes":
        assert (meta["vocab_size"], meta["eot_id"]) == (257, 256) and not (folder / "tokenizer.json").exists()
        assert meta["tokens"] == total_bytes + 7
        decoded = [bytes(d[:-1].astype(np.uint8)).decode() for d in docs]
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert meta["vocab_size"] == tok.get_vocab_size() == (300 if kind == "bpe:300" else 400)
        eot = "<|endoftext|>" if kind == "bpe:300" else "</s>"
        assert meta["eot_id"] == tok.token_to_id(eot)
        assert meta["tokens"] < total_bytes / 1.5  # merges compress
        decoded = [tok.decode(d[:-1].tolist()) for d in docs]
    assert decoded == texts
    assert not list(folder.parent.glob(".*.tmp"))


@pytest.mark.slow
def test_training_on_a_prepared_folder_lowers_the_loss_with_the_data_vocabulary(prepared, tmp_path):
    import jax

    from holmes_jax import train

    _, folder = prepared
    meta = json.loads((folder / "meta.json").read_text())
    cfgs = small_configs(tmp_path, f"--gin.DataConfig.source={folder}", "--gin.TrainConfig.steps=30",
                         "--gin.TrainConfig.log_every=5", "--gin.ParallelConfig.dp=1")
    assert cfgs.model.vocab_size == data.padded_vocab(meta["vocab_size"]) > meta["vocab_size"]
    summary = train.run(cfgs, devices=jax.devices()[:1], quiet=True)  # one device: the quickest compile
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert summary["steps"] == 30 and all(np.isfinite(losses))
    assert losses[0] == pytest.approx(np.log(cfgs.model.vocab_size), abs=0.5)  # starts near uniform
    assert losses[-1] < losses[0] - 1.0


def test_a_model_vocabulary_set_below_the_data_is_an_error_before_any_step(prepared, tmp_path):
    from holmes_jax import train

    _, folder = prepared
    cfgs = small_configs(tmp_path / "wd", f"--gin.DataConfig.source={folder}", "--gin.ModelConfig.vocab_size=256")
    assert cfgs.model.vocab_size == 256  # set: kept
    with pytest.raises(ConfigError, match="ModelConfig.vocab_size = 256; leave ModelConfig.vocab_size unset"):
        train.run(cfgs, quiet=True)
    assert not (tmp_path / "wd").exists()


def test_jsonl_lines_are_documents_and_a_tokenizer_without_end_of_text_gets_one(tmp_path):
    lines = [{"text": "first document"}, {"text": ""}, {"text": "second, with ünïcode"}]
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    tok_path = _train_hf_tokenizer(tmp_path / "plain.json", ["first second document"] * 10, [], size=270)
    meta = prepare.prepare([str(src)], str(tmp_path / "out"), str(tok_path))
    assert meta["documents"] == 2 and meta["eot_id"] == 270 and meta["vocab_size"] == 271
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 270
    _, docs = _documents(tmp_path / "out")
    assert [tok.decode(d[:-1].tolist()) for d in docs] == ["first document", "second, with ünïcode"]


@pytest.mark.parametrize("setting", ["truncation", "padding"])
def test_a_tokenizer_json_that_truncates_or_pads_tokenizes_each_document_whole(tmp_path, setting):
    from tokenizers import Tokenizer

    texts = ["a first document, long enough to be cut", "a second one"]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    plain = _train_hf_tokenizer(tmp_path / "plain.json", texts * 10, ["<|endoftext|>"], size=300)
    tok = Tokenizer.from_file(str(plain))
    if setting == "truncation":  # as a tokenizer.json made for a model's inputs may hold it
        tok.enable_truncation(max_length=4)
    else:
        tok.enable_padding(length=64, pad_id=0, pad_token="<|endoftext|>")
    tok.save(str(tmp_path / "set.json"))
    prepare.prepare([str(src)], str(tmp_path / "out"), str(tmp_path / "set.json"))
    plain_tok = Tokenizer.from_file(str(plain))
    _, docs = _documents(tmp_path / "out")
    assert [d[:-1].tolist() for d in docs] == [plain_tok.encode(t, add_special_tokens=False).ids for t in texts]


def test_a_corpus_in_one_large_file_is_prepared_in_memory_far_below_its_size(tmp_path, monkeypatch):
    import tracemalloc

    size = 16 << 20
    (tmp_path / "big.txt").write_bytes(b"the quick brown fox jumps over the lazy dog\n" * (size // 44))
    monkeypatch.setattr(prepare, "FILE_PART_BYTES", 1 << 20, raising=False)  # the file is 16 parts
    tracemalloc.start()  # numpy reports its arrays to tracemalloc too
    try:
        prepare.prepare([str(tmp_path / "big.txt")], str(tmp_path / "out"), "bytes")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Read whole, it took 3 bytes a byte (the text, its uint16 ids); in parts, a few MB (a batch of
    # one or two parts, its ids, the next block being read) whatever the file's size.
    assert peak < size, f"{peak / size:.2f} bytes of memory per byte of text"
    ids = np.fromfile(tmp_path / "out" / "tokens.bin", "<u2")
    assert len(ids) == (size // 44) * 44 + 1 and ids[-1] == 256  # one document: one end-of-text
    np.testing.assert_array_equal(ids[:-1], np.fromfile(tmp_path / "big.txt", np.uint8))


def _long_document() -> str:
    """Text with the cases a cut could split: runs of spaces and newlines, punctuation before a
    newline, numbers, non-ASCII letters and a 3,000-letter run with no space to cut at."""
    words = ["the", "fox.", "\n", "\n\n", "  ", " \n ", "1234567", "café", "?!", "\t", "'s", "ünï", "   \n"]
    text = "".join(f"{words[(i * 7) % len(words)]}{' ' * (i % 3 == 0)}" for i in range(6000))
    return text[:5000] + "x" * 3000 + text[5000:]


@pytest.mark.parametrize("spec", ["bytes", "bpe:300"])
def test_a_long_document_is_encoded_in_pieces_to_the_ids_of_one_encoding(tmp_path, monkeypatch, spec):
    monkeypatch.setattr(prepare, "PIECE_CHARS", 200)
    monkeypatch.setattr(prepare, "BATCH_BYTES", 1000)  # a few pieces a tokenizer call
    monkeypatch.setattr(prepare, "FILE_PART_BYTES", 700)  # the file read in parts
    text = _long_document()
    (tmp_path / "long.txt").write_text(text)
    meta = prepare.prepare([str(tmp_path / "long.txt")], str(tmp_path / "out"), spec)
    _, docs = _documents(tmp_path / "out")
    assert meta["documents"] == len(docs) == 1
    if spec == "bytes":
        assert bytes(docs[0][:-1].astype(np.uint8)) == text.encode()
        return
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    pieces = list(prepare.HFTokenizer(whole)._pieces(text))
    assert len(pieces) > 20 and "".join(pieces) == text  # it was cut, at spaces after a non-space
    assert all(after.startswith(" ") and not before[-1].isspace() for before, after in zip(pieces, pieces[1:]))
    assert docs[0][:-1].tolist() == whole.encode(text, add_special_tokens=False).ids


# Pre-tokenizers (from tokenizers.pre_tokenizers, as P) and whether they start a pre-token at
# each space after a non-space, where a long document may be cut.
PRE_TOKENIZERS = {
    "byte-level": (lambda P: P.ByteLevel(add_prefix_space=False), True),
    "whitespace": (lambda P: P.Whitespace(), True),
    "metaspace": (lambda P: P.Metaspace(), True),
    "split-then-byte-level": (lambda P: P.Sequence([P.Split(" ", "merged_with_next"), P.ByteLevel(use_regex=False)]),
                              True),
    "byte-level-without-pattern": (lambda P: P.ByteLevel(add_prefix_space=False, use_regex=False), False),
    "metaspace-without-split": (lambda P: P.Metaspace(split=False), False),
    "punctuation": (lambda P: P.Punctuation(), False),
}


@pytest.mark.parametrize("name", PRE_TOKENIZERS)
def test_a_tokenizer_whose_merges_can_span_a_space_gets_each_document_whole(tmp_path, monkeypatch, name):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    monkeypatch.setattr(prepare, "PIECE_CHARS", 200)
    monkeypatch.setattr(prepare, "FILE_PART_BYTES", 700)
    text = _long_document()
    make, cuts = PRE_TOKENIZERS[name]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = make(pre_tokenizers)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert prepare.HFTokenizer(tok).can_cut == cuts
    (tmp_path / "long.txt").write_text(text)
    prepare.prepare([str(tmp_path / "long.txt")], str(tmp_path / "out"), _save(tok, tmp_path / "tokenizer.json"))
    _, docs = _documents(tmp_path / "out")
    # Cut at spaces, the last three gave other ids (merges across the cut spaces)
    assert docs[0][:-1].tolist() == tok.encode(text, add_special_tokens=False).ids


def _save(tokenizer, path: Path) -> str:
    tokenizer.save(str(path))
    return str(path)


def test_a_text_file_is_read_in_parts_cut_before_spaces_that_follow_a_non_space(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "PIECE_CHARS", 200)
    monkeypatch.setattr(prepare, "FILE_PART_BYTES", 700)
    raw = _long_document().encode()
    raw = raw[:2000] + b"\xff\xc3" + raw[2000:]  # bytes that are not UTF-8 stay as they are
    path = tmp_path / "long.txt"
    path.write_bytes(raw)
    parts = list(prepare.documents([path], prepare.Progress("reading", len(raw))))
    assert len(parts) > 5 and b"".join(part.text for part in parts) == raw
    assert [part.ends for part in parts] == [False] * (len(parts) - 1) + [True]  # one document
    for before, after in zip(parts, parts[1:]):
        assert after.text.startswith(b" ") and not before.text.decode("utf-8", "replace")[-1].isspace()
    assert list(prepare.documents([path], prepare.Progress("reading", len(raw)), cut=False)) == [prepare.Part(raw)]


# The peak resident set of this process's memory (VmHWM, in KiB): getrusage's ru_maxrss keeps the
# parent's peak across exec, and a test worker that grew large hid every growth below it.
_PEAK_SCRIPT = """
import re, sys
from tokenizers import Tokenizer
from holmes_jax import prepare
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1])
tokenizer = prepare.HFTokenizer(Tokenizer.from_file(sys.argv[1]))
text = open(sys.argv[2], "rb").read()
tokenizer.encode([b"warm up"])
before = peak()
if sys.argv[3] == "one call":  # how documents were encoded before
    ids = tokenizer.tokenizer.encode_batch([text.decode()], add_special_tokens=False)[0].ids
else:  # in calls of 256 KB, so the document is a dozen of them
    prepare.BATCH_BYTES, prepare.PIECE_CHARS = 1 << 18, 1 << 14
    ids = tokenizer.encode([text])[0]
print(peak() - before)
"""


def test_a_long_document_is_encoded_in_far_less_memory_than_in_one_call(tmp_path):
    # A tokenizer call holds about 250 bytes per character (a 20 MB document peaked at 4.8 GB). The
    # peak resident set, in a process of its own, of encoding a 3 MB document both ways.
    import subprocess
    import sys

    tok = _train_hf_tokenizer(tmp_path / "tok.json", [p.read_text() for p in sorted((STDLIB / "json").glob("*.py"))], [])
    (tmp_path / "doc.txt").write_bytes(b"the quick brown fox jumps over the lazy dog, said Holmes 1234.\n" * 50_000)
    growth = {how: int(subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tok), str(tmp_path / "doc.txt"), how],
                                      capture_output=True, text=True, check=True).stdout)
              for how in ("one call", "in pieces")}
    assert growth["in pieces"] * 3 < growth["one call"], f"peak growth in KiB: {growth}"


def test_a_folder_reads_linked_folders_once_and_stops_at_a_symlink_loop(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "x.txt").write_text("x")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "y.txt").write_text("y")
    (corpus / "b-linked").symlink_to(tmp_path / "elsewhere")
    (corpus / "c-linked-again").symlink_to(tmp_path / "elsewhere")  # the same folder: read once
    (corpus / "a" / "loop").symlink_to(corpus)
    assert [f.relative_to(corpus).as_posix() for f in prepare.folder_files(corpus)] == ["a/x.txt", "b-linked/y.txt"]
    meta = prepare.prepare([str(corpus)], str(tmp_path / "out"), "bytes")
    assert meta["documents"] == 2


@pytest.mark.parametrize("spec", ["bpe:300", "tokenizer.json"])
def test_end_of_text_written_in_the_text_is_text_not_a_document_break(tmp_path, spec):
    text = 'SEPARATOR = "<|endoftext|>"  # and </s> too\n' * 20
    (tmp_path / "src.py").write_text(text)
    if spec == "tokenizer.json":
        spec = str(_train_hf_tokenizer(tmp_path / "tok.json", [text] * 5, ["</s>", "<|endoftext|>"], size=300))
    meta = prepare.prepare([str(tmp_path / "src.py")], str(tmp_path / "out"), spec)
    meta, docs = _documents(tmp_path / "out")
    assert meta["documents"] == len(docs) == 1
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).decode(docs[0][:-1].tolist()) == text


def test_one_document_is_counted_in_the_singular(tmp_path):
    (tmp_path / "one.txt").write_text("a single document\n" * 50)
    code, out, err = _cli("prepare", str(tmp_path / "one.txt"), "--out", str(tmp_path / "out"), "--tokenizer", "bytes")
    assert code == 0, err
    assert ": 1 document, " in out  # was '1 documents'
    assert "1 document)" in data.load(DataConfig(source=str(tmp_path / "out"), seq_len=8)).description


def test_jsonl_bytes_that_are_not_utf8_become_replacement_characters(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(b'{"text": "caf\xe9"}\n{"text": "ok"}\n')
    prepare.prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"), "bytes")
    _, docs = _documents(tmp_path / "out")
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in docs] == ["caf\ufffd", "ok"]


def test_a_jsonl_file_may_start_with_a_byte_order_mark(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    meta = prepare.prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"), "bytes")
    _, docs = _documents(tmp_path / "out")
    assert meta["documents"] == 2 and [bytes(d[:-1].astype(np.uint8)) for d in docs] == [b"first", b"second"]


def test_a_jsonl_suffix_in_upper_or_mixed_case_is_read_as_jsonl(tmp_path):
    # such files were read as plain text: each file one document, its JSON syntax trained on
    (tmp_path / "DOCS.JSONL").write_text('{"text": "first"}\n{"text": "second"}\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "more.JsonL").write_text('{"text": "third"}\n')
    meta = prepare.prepare([str(tmp_path / "DOCS.JSONL"), str(tmp_path / "folder")], str(tmp_path / "out"), "bytes")
    _, docs = _documents(tmp_path / "out")
    assert meta["documents"] == 3 and [bytes(d[:-1].astype(np.uint8)) for d in docs] == [b"first", b"second", b"third"]


@pytest.mark.parametrize("char", ["x", " ", "\n"])
def test_bpe_learns_from_a_very_long_run_in_pieces_and_tokenizes_it_whole(tmp_path, char):
    # The trainer's time grows with the square of a word's length (a 3 MB line of one letter took
    # over 12 minutes; 200,000 spaces, one word to it too, 25 s): it learns from runs cut to
    # BPE_RUN_MAX characters, so no token is longer.
    text = "a line\n" + char * (20 * prepare.BPE_RUN_MAX) + " and some words after it\n"
    (tmp_path / "long.txt").write_text(text)
    prepare.prepare([str(tmp_path / "long.txt")], str(tmp_path / "out"), "bpe:300")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert max(len(token) for token in tokenizer.get_vocab()) <= prepare.BPE_RUN_MAX
    _, docs = _documents(tmp_path / "out")
    assert tokenizer.decode(docs[0][:-1].tolist()) == text  # the cuts are the training's only


def test_out_may_be_the_empty_working_folder_and_a_folder_named_like_a_token_file(tmp_path, monkeypatch):
    (tmp_path / "text.txt").write_text("some text " * 50)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    code, _, err = _cli("prepare", str(tmp_path / "text.txt"), "--out", ".")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["meta.json", "tokens.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "text.txt"]  # no temporary folder left
    prepare.prepare([str(tmp_path / "text.txt")], str(tmp_path / "corpus.bin"), "bytes")
    tokens = data.load(DataConfig(source=str(tmp_path / "corpus.bin"), seq_len=8))
    assert tokens.vocab_size == 257 and "prepared" in tokens.description
    assert data.vocab_size(DataConfig(source=str(tmp_path / "corpus.bin"))) == 257


def test_progress_line_reports_bytes_documents_and_tokens(monkeypatch):
    clock = iter(range(0, 1000, 20))  # every reading 20 s later: each advance draws
    monkeypatch.setattr(prepare.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    bar = prepare.Progress("tokenizing", 4_000_000, stream)
    bar.advance(2_000_000, documents=3, tokens=12_345)
    bar.advance(2_000_000, documents=1, tokens=5)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines == ["tokenizing [##########          ]  50% 2.0/4.0 MB, 3 documents, 12,345 tokens",
                     "tokenizing [####################] 100% 4.0/4.0 MB, 4 documents, 12,350 tokens"]


def test_help_names_the_tokenizers_and_the_output():
    code, out, _ = _cli("prepare", "--help")
    assert code == 0
    for word in ("SRC", "--out DIR", "--tokenizer T", "bpe:N", "tokenizer.json", "meta.json", ".jsonl"):
        assert word in out


BAD_INPUTS = {  # case: (arguments after `prepare`, {d} the test's folder; what the error line names)
    "missing SRC": ("{d}/nope --out {d}/out", "SRC '"),
    "empty folder": ("{d}/empty --out {d}/out", "no files to read"),
    "empty files": ("{d}/blank --out {d}/out", "the corpus is empty"),
    "empty files, bpe": ("{d}/blank --out {d}/out --tokenizer bpe:300", "the corpus is empty"),
    "bad jsonl": ("{d}/bad.jsonl --out {d}/out", "line 2"),
    "bad jsonl, bpe": ("{d}/bad.jsonl --out {d}/out --tokenizer bpe:300", "line 2"),  # raised inside the trainer
    "bad tokenizer": ("{d}/text.txt --out {d}/out --tokenizer gpt2", "--tokenizer 'gpt2' is not allowed"),
    "bpe too small": ("{d}/text.txt --out {d}/out --tokenizer bpe:200", "bpe:N needs a whole N above 257"),
    "bpe not a number": ("{d}/text.txt --out {d}/out --tokenizer bpe:lots", "bpe:N needs a whole N"),
    "bpe a digit, not a number": ("{d}/text.txt --out {d}/out --tokenizer bpe:\u00b2", "bpe:N needs a whole N"),
    "bpe too large": ("{d}/text.txt --out {d}/out --tokenizer bpe:2000000", "at most 1,048,576"),  # larger aborts
    "broken tokenizer.json": ("{d}/text.txt --out {d}/out --tokenizer {d}/broken.json", "not a tokenizer.json"),
    "unwritable DIR": ("{d}/text.txt --out {d}/text.txt/sub", "cannot be written: '{d}/text.txt' is a file, not a folder"),
    "DIR not empty": ("{d}/text.txt --out {d}/taken", "already exists"),
    "no SRC": ("--out {d}/out", "SRC"),
    "a prepared folder": ("{d}/prepared --out {d}/out", "is a prepared folder (it holds meta.json and tokens.bin)"),
}


@pytest.mark.parametrize("source", ["", " "])
def test_an_empty_src_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch, source):
    # `prepare "$CORPUS"` with CORPUS unset prepared whatever folder the command ran in
    (tmp_path / "notes.txt").write_text("not meant for the corpus " * 20)
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli("prepare", source, "--out", str(tmp_path / "out"))
    assert (code, out) == (2, "") and err == f"error: SRC {source!r} is not allowed; allowed: text files, folders or .jsonl files\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_error_line_and_leaves_nothing_behind(tmp_path, case):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "text.txt").write_text("some text " * 50)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "prepared").mkdir()  # was "no files to read": a prepared folder's files are not text
    (tmp_path / "prepared" / "meta.json").write_text("{}")
    (tmp_path / "prepared" / "tokens.bin").write_bytes(b"\0\0")
    args, names = BAD_INPUTS[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = _cli("prepare", *args.format(d=tmp_path).split())
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and names.format(d=tmp_path.resolve()) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no DIR, no temporary folder


LOCKED_INPUTS = {  # case: (arguments after `prepare`, {d} the test's folder; what the error line names)
    "a folder in SRC": ("{d}/corpus --out {d}/out", "SRC '{d}/corpus/locked' cannot be read: Permission denied"),
    "SRC itself": ("{d}/corpus/locked --out {d}/out", "SRC '{d}/corpus/locked' cannot be read: Permission denied"),
    "a file in it": ("{d}/corpus/locked/b.txt --out {d}/out", "SRC '{d}/corpus/locked/b.txt' cannot be read"),
    "the tokenizer": ("{d}/corpus/a.txt --out {d}/out --tokenizer {d}/corpus/locked/tokenizer.json",
                      "--tokenizer '{d}/corpus/locked/tokenizer.json' cannot be read: Permission denied"),
}


@pytest.mark.parametrize("case", LOCKED_INPUTS)
def test_a_folder_without_permission_is_one_error_line_naming_it(tmp_path, monkeypatch, case):
    (tmp_path / "corpus" / "locked").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("read " * 50)
    (tmp_path / "corpus" / "locked" / "b.txt").write_text("never read " * 50)
    lock_folder(monkeypatch, tmp_path / "corpus" / "locked")
    args, names = LOCKED_INPUTS[case]
    # were: a.txt prepared alone (the locked folder's files left out unsaid), "no files to read",
    # a PermissionError traceback, and "--out ... cannot be written"
    code, out, err = _cli("prepare", *args.format(d=tmp_path).split())
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and names.format(d=tmp_path) in err, err
    assert not (tmp_path / "out").exists()
