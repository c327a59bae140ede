"""Text to a prepared token folder: `python -m holmes_jax.data prepare SRC ... --out DIR --tokenizer T`.

Inputs: text files, folders of them (every file under the folder, linked folders included, sorted,
hidden paths skipped; a folder under it that cannot be listed is an error) and JSONL files
(`*.jsonl`, one JSON object a line with a "text" string).
Each text file is one document, each JSONL line one more; empty ones are skipped, and so are
binary files (a NUL byte in their first 8 KiB, as git decides: compiled `.pyc` files, images).
Text is read as UTF-8; bytes that are not UTF-8 become U+FFFD for the BPE tokenizers (the bytes
tokenizer keeps them).

Tokenizers (T):
- `bytes`: one token per byte (0-255) and end-of-text 256, so a vocabulary of 257.
- `bpe:N`: a byte-level BPE of at most N tokens trained on the inputs (end-of-text is id 0).
- a path to a Hugging Face `tokenizer.json`: its end-of-text token is the first of
  <|endoftext|>, <|end_of_text|>, </s>, <eos> it holds; without one, <|endoftext|> is added.
  A truncation or padding setting it holds is dropped: every document is tokenized whole.
A long document goes to the BPE tokenizers in pieces of about 64K characters cut before a space,
which gives the ids of the whole text wherever the tokenizer pre-tokenizes (a tokenizer.json
without a pre-tokenizer gets each document in one piece). So a text file is read in parts of
about 4 MB, and a corpus in one large file is never held whole (except for such a tokenizer).

DIR gets `tokens.bin` (every document followed by end-of-text, little-endian uint16 when the
vocabulary fits, else uint32), `tokenizer.json` (not for bytes) and `meta.json`. It is written
to a temporary folder beside DIR and renamed (into an existing empty DIR, its files are moved,
meta.json last), so a failure leaves no half-written DIR.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np

from holmes_jax import cli
from holmes_jax.config import ConfigError

# The prepared folder's format, which holmes_jax.data reads.
BYTE_VOCAB = 256
META_FILE, TOKEN_FILE, TOKENIZER_FILE = "meta.json", "tokens.bin", "tokenizer.json"


def count_documents(n: int) -> str:
    """'1 document', '2,048 documents'."""
    return f"{n:,} document{'' if n == 1 else 's'}"

EOT_TEXT = "<|endoftext|>"
EOT_NAMES = (EOT_TEXT, "<|end_of_text|>", "</s>", "<eos>")
BINARY_SNIFF = 8192  # a NUL byte among a file's first bytes marks it binary
# A tokenizer call holds about 250 bytes per character of its text (a 20 MB document in one call
# peaked at 4-5 GB), so it gets about BATCH_BYTES of text, a longer document cut in pieces of about
# PIECE_CHARS characters: 16 pieces a call keep its threads busy.
BATCH_BYTES = 1 << 20
PIECE_CHARS = 1 << 16
# Where a piece may end: before a space that follows a non-space character. Whitespace-splitting
# pre-tokenizers (ByteLevel's GPT-2 pattern, Llama-3's, Whitespace, a splitting Metaspace) start a new
# pre-token there (a space only ever leads a pre-token) and never look back past it, and the BPE
# model merges only inside a pre-token, so the pieces' ids joined are the whole text's ids. (Not a
# newline: Llama-3's pattern keeps ".\n" together.)
PIECE_END = re.compile(r".*\S(?= )", re.DOTALL)  # matched from a piece's start: up to its last such space
NEXT_PIECE_END = re.compile(r"\S ")
CUT_PROBE = "one two. three\nfour  five,six"  # a text to ask a tokenizer where it starts pre-tokens
# A text file is read in parts of about this many bytes, each cut where a piece may end, so a
# corpus in one file is never held whole (where the tokenizer lets it be cut).
FILE_PART_BYTES = 1 << 22
BPE_MAX = 1 << 20  # bpe:N's largest N: 4x the largest released vocabularies; the trainer aborts the process on a huge N
# The BPE trainer's time grows with the square of a word's length (a 300,000-letter line: 48 s, 3 MB:
# over 12 minutes, silent and deaf to Ctrl-C; byte-level pre-tokenizing makes a run of blanks one
# word too), so it learns from runs of non-space characters, and of whitespace, cut to pieces of at
# most this many; only the training sees the cuts, not the tokenizing.
BPE_RUN_MAX = 1000
LONG_RUN = re.compile(rf"\S{{{BPE_RUN_MAX}}}|\s{{{BPE_RUN_MAX}}}")


class Progress:
    """A one-line progress bar on stderr, redrawn at most twice a second (every 10 s when stderr is
    not a terminal, so logs stay short); silent for inputs that finish in under a second."""

    def __init__(self, label: str, total_bytes: int, stream=None):
        self.label, self.total, self.stream = label, max(total_bytes, 1), stream or sys.stderr
        self.done = self.documents = self.tokens = self.binary_files = 0
        self.tty = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.drawn = None  # the counters last drawn

    def advance(self, nbytes: int = 0, documents: int = 0, tokens: int = 0) -> None:
        self.done += nbytes
        self.documents += documents
        self.tokens += tokens
        now = time.monotonic()
        if now - self.start >= 1 and now - self.last >= (0.5 if self.tty else 10):
            self.last = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 20)
        line = (f"{self.label} [{bar:20}] {frac:4.0%} {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB, "
                f"{count_documents(self.documents)}, {self.tokens:,} tokens")
        self.stream.write(f"\r{line}" if self.tty else f"{line}\n")
        self.stream.flush()
        self.drawn = (self.done, self.documents, self.tokens)

    def close(self) -> None:
        """Draws the final counts, if a bar was drawn at all, and ends its line."""
        if self.drawn and self.drawn != (self.done, self.documents, self.tokens):
            self._draw()
        if self.drawn and self.tty:
            self.stream.write("\n")


def folder_files(folder: Path) -> list[Path]:
    """The files under `folder`, sorted, without hidden paths (a `.git` folder, say) and without
    the prepared folders under it (prepare's own output, written into its source folder). Linked
    folders are read like linked files, each real folder once (a link to a folder above is a loop).
    A folder under it that cannot be listed is an OSError, not left out (its files were dropped unsaid)."""
    files, seen = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True, onerror=_raise):
        real = os.path.realpath(root)
        if real in seen or (META_FILE in names and TOKEN_FILE in names):
            dirs.clear()  # met already (a symlink loop), or a prepared folder
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # sorted: which link to a folder counts is fixed
        files += [Path(root, n) for n in names if not n.startswith(".") and Path(root, n).is_file()]
    return sorted(files)


def _prepared(folder: Path) -> bool:
    try:
        return (folder / META_FILE).is_file() and (folder / TOKEN_FILE).is_file()
    except OSError:  # a folder that cannot be read: folder_files names it, not a file in it
        return False


def _raise(error: OSError) -> None:
    raise error


def is_binary(head: bytes) -> bool:
    """Whether a file starting with `head` is binary (a NUL byte in its first 8 KiB, as git decides)."""
    return b"\0" in head[:BINARY_SNIFF]


def input_files(sources: list[str]) -> list[Path]:
    files = []
    for source in sources:
        if not source.strip():  # Path('') is the current folder: an unset $CORPUS made it the corpus
            raise ConfigError(f"SRC {source!r} is not allowed; allowed: text files, folders or .jsonl files")
        path = Path(source).expanduser()
        try:
            if path.is_file():
                files.append(path)
            elif path.is_dir():
                if _prepared(path):  # was "no files to read": folder_files skips prepared folders
                    raise ConfigError(f"SRC {source!r} is a prepared folder (it holds {META_FILE} and {TOKEN_FILE}): "
                                      "give the text it was prepared from, or train on it as DataConfig.source")
                files += folder_files(path)
            else:
                raise ConfigError(f"SRC {source!r} is not a readable file or folder; "
                                  "give text files, folders or .jsonl files")
        except OSError as e:  # a folder without permission: was a traceback, or its files left out
            raise ConfigError(f"SRC {str(e.filename or source)!r} cannot be read: {e.strerror or e}") from None
    if not files:
        raise ConfigError(f"SRC {' '.join(sources)}: no files to read (empty folders; hidden files are skipped)")
    return files


class Part(NamedTuple):
    """A document, or a piece of one (a long text file is read in pieces); `ends` marks its last."""
    text: bytes
    ends: bool = True


def documents(files: list[Path], progress: Progress, cut: bool = True) -> Iterator[Part]:
    """The documents of `files` as UTF-8 bytes, advancing `progress` by the input bytes read. A
    text file is read in parts of about FILE_PART_BYTES cut before spaces (as PIECE_END) where
    `cut`, else whole."""
    for f in files:
        try:
            if f.suffix.lower() == ".jsonl":  # in any case: DOCS.JSONL is JSONL too
                with open(f, "rb") as lines:
                    yield from (Part(text) for text in _jsonl_documents(f, lines, progress))
            else:
                yield from _text_file(f, progress, cut)
        except OSError as e:
            raise ConfigError(f"SRC {str(f)!r} cannot be read: {e.strerror or e}") from None


def _text_file(f: Path, progress: Progress, cut: bool) -> Iterator[Part]:
    held = []  # what was read since the last cut
    with open(f, "rb") as stream:
        if is_binary(stream.read(BINARY_SNIFF)):
            progress.binary_files += 1
            progress.advance(os.fstat(stream.fileno()).st_size)
            return
        stream.seek(0)
        while block := stream.read(FILE_PART_BYTES):
            progress.advance(len(block))
            end = _last_cut(block) if cut else 0
            if end:  # all before the block's last cut is one part
                yield Part(b"".join(held + [memoryview(block)[:end]]), ends=False)
                held = [block[end:]]
            else:
                held.append(block)
    text = b"".join(held)
    if text:
        yield Part(text)


def _last_cut(block: bytes) -> int:
    """The byte offset of the last place PIECE_END may cut in `block`'s last 4 PIECE_CHARS bytes,
    or 0. Bytes that are not UTF-8 (a piece starting mid-character) stand for themselves."""
    tail = block[-4 * PIECE_CHARS:]
    text = tail.decode("utf-8", "surrogateescape")
    last = PIECE_END.match(text)
    if last is None:
        return 0
    return len(block) - len(tail) + len(text[:last.end()].encode("utf-8", "surrogateescape"))


def _jsonl_documents(f: Path, lines, progress: Progress) -> Iterator[bytes]:
    for n, line in enumerate(lines, 1):
        progress.advance(len(line))
        if n == 1:  # the byte-order mark some Windows editors write is no part of the JSON
            line = line.removeprefix(codecs.BOM_UTF8)
        if not line.strip():
            continue
        try:  # bytes that are not UTF-8 become U+FFFD, as in text files
            text = json.loads(line.decode("utf-8", "replace")).get("text")
        except (ValueError, AttributeError):
            text = None
        if not isinstance(text, str):
            raise ConfigError(f'SRC {str(f)!r}, line {n}: a .jsonl line must be a JSON object with a "text" string')
        if text:
            yield text.encode("utf-8", "replace")


class ByteTokenizer:
    vocab_size, eot_id = BYTE_VOCAB + 1, BYTE_VOCAB
    can_cut = True  # a document's ids are its bytes, however it is cut

    def encode(self, docs: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(d, np.uint8) for d in docs]

    def save(self, folder: Path) -> None:
        pass  # nothing to save: ids are the bytes


class HFTokenizer:
    """A `tokenizers.Tokenizer` with its end-of-text id."""

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eot = next((name for name in EOT_NAMES if name in vocab), None)
        if eot is None:
            tokenizer.add_special_tokens([EOT_TEXT])
            eot, vocab = EOT_TEXT, tokenizer.get_vocab(with_added_tokens=True)
        # A "<|endoftext|>" (or any special token) written in the text is text: only the separator
        # this module puts after each document is the end-of-text id.
        tokenizer.encode_special_tokens = True
        # A tokenizer.json may keep a truncation or padding setting (made for a model's inputs): it
        # would cut every document to that length, or pad it.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer, self.eot_id, self.vocab_size = tokenizer, vocab[eot], max(vocab.values()) + 1
        self.can_cut = _starts_words_at_spaces(tokenizer.pre_tokenizer)  # see PIECE_END

    def encode(self, docs: list[bytes]) -> list[np.ndarray]:
        # Every document in pieces (see PIECE_END), the pieces encoded about BATCH_BYTES at a time,
        # so memory stays bounded however long one document is.
        pieces = [(n, piece) for n, d in enumerate(docs) for piece in self._pieces(d.decode("utf-8", "replace"))]
        ids = [[np.zeros(0, np.uint32)] for _ in docs]
        for group in _batches(iter(pieces), BATCH_BYTES, size=lambda piece: len(piece[1])):
            # No special tokens: a tokenizer's template (a leading <s>, say) is not part of the text.
            encodings = self.tokenizer.encode_batch([text for _, text in group], add_special_tokens=False)
            for (n, _), e in zip(group, encodings):
                ids[n].append(np.asarray(e.ids, np.uint32))  # the library's ids are 32-bit
        return [np.concatenate(parts) for parts in ids]

    def _pieces(self, text: str) -> Iterator[str]:
        """`text` cut before spaces into pieces of about PIECE_CHARS characters (longer where a run
        has no space to cut at), or whole where the tokenizer does not start words there: a model
        without a pre-tokenizer (Llama-2's, with a normalizer that puts "▁" before the text) sees
        the text as one word."""
        start = 0
        while self.can_cut and len(text) - start > PIECE_CHARS:
            last = PIECE_END.match(text, start, start + PIECE_CHARS)
            if last:
                cut = last.end()
            else:  # no space in this piece's length: up to the next one
                later = NEXT_PIECE_END.search(text, start + PIECE_CHARS - 1)
                if later is None:
                    break
                cut = later.start() + 1
            yield text[start:cut]
            start = cut
        yield text[start:]

    def save(self, folder: Path) -> None:
        self.tokenizer.save(str(folder / TOKENIZER_FILE))


def _starts_words_at_spaces(pre_tokenizer) -> bool:
    """Whether `pre_tokenizer` starts a new pre-token at every space after a non-space, so a
    document cut there (PIECE_END) gets the ids of the whole. Not every one does (ByteLevel without
    its pattern, a Metaspace that does not split, Punctuation alone): merges across a space would
    change the ids at each cut. Asked on a probe text."""
    if pre_tokenizer is None:
        return False
    cuts = [m.start() + 1 for m in NEXT_PIECE_END.finditer(CUT_PROBE)]  # each such space
    words = [span for _, span in pre_tokenizer.pre_tokenize_str(CUT_PROBE)]
    return not any(start < cut < end for start, end in words for cut in cuts)


def bpe_training_pieces(text: str) -> Iterator[str]:
    """`text` in pieces, cut after every BPE_RUN_MAX characters of a longer run of non-space ones
    or of whitespace."""
    start = 0
    for run in LONG_RUN.finditer(text):
        yield text[start:run.end()]
        start = run.end()
    if start < len(text):
        yield text[start:]


def train_bpe(size: int, docs: Callable[[Progress], Iterator[Part]], total_bytes: int) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[EOT_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    progress = Progress(f"training bpe:{size}", total_bytes)
    texts = (piece for d in docs(progress) for piece in bpe_training_pieces(d.text.decode("utf-8", "replace")))
    tokenizer.train_from_iterator(texts, trainer)
    progress.close()
    return HFTokenizer(tokenizer)


def make_tokenizer(spec: str, docs: Callable[[Progress], Iterator[Part]], total_bytes: int):
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        size = spec[4:]
        if not (size.isascii() and size.isdigit()) or not BYTE_VOCAB + 1 < int(size) <= BPE_MAX:
            raise ConfigError(f"--tokenizer {spec!r}: bpe:N needs a whole N above {BYTE_VOCAB + 1} "
                              f"({BYTE_VOCAB} byte tokens, end-of-text and at least one merge) and at most "
                              f"{BPE_MAX:,}, e.g. bpe:8192")
        return train_bpe(int(size), docs, total_bytes)
    path = Path(spec).expanduser()
    try:
        found = path.is_file()
    except OSError as e:  # its folder without permission: was blamed on --out
        raise ConfigError(f"--tokenizer {spec!r} cannot be read: {e.strerror or e}") from None
    if not found:
        raise ConfigError(f"--tokenizer {spec!r} is not allowed; allowed: bytes, bpe:N (N > {BYTE_VOCAB + 1}) "
                          "or the path of a Hugging Face tokenizer.json")
    from tokenizers import Tokenizer

    try:
        return HFTokenizer(Tokenizer.from_file(str(path)))
    except Exception as e:  # the Rust side reports malformed files as plain Exceptions
        raise ConfigError(f"--tokenizer {spec!r}: not a tokenizer.json the tokenizers library reads ({e})") from None


def _batches(docs: Iterator, limit: int, size: Callable = len) -> Iterator[list]:
    """`docs` in lists of about `limit` bytes (as `size` counts them)."""
    batch, total = [], 0
    for doc in docs:
        batch.append(doc)
        total += size(doc)
        if total >= limit:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def prepare(sources: list[str], out: str, spec: str) -> dict:
    """Tokenizes `sources` with tokenizer `spec` into the folder `out`; returns its meta.json."""
    cli.new_folder(out)  # before the reading and tokenizing
    files = input_files(sources)
    total = sum(f.stat().st_size for f in files)
    with cli.output_folder(out, last=META_FILE) as tmp:
        tokenizer = make_tokenizer(spec, lambda progress: documents(files, progress), total)
        dtype = np.dtype("<u2" if tokenizer.vocab_size <= 1 << 16 else "<u4")
        progress = Progress("tokenizing", total)
        with open(tmp / TOKEN_FILE, "wb") as sink:
            eot = np.asarray([tokenizer.eot_id], dtype)
            parts = documents(files, progress, cut=tokenizer.can_cut)
            for batch in _batches(parts, BATCH_BYTES, size=lambda part: len(part.text)):
                # Joined straight into the file's dtype (the ids fit it): an int64 join held a huge
                # document at 8 bytes a token besides its copy in the dtype.
                encoded = tokenizer.encode([part.text for part in batch])
                ids = np.concatenate([piece for part, d in zip(batch, encoded)
                                      for piece in ((d, eot) if part.ends else (d,))], dtype=dtype, casting="unsafe")
                ids.tofile(sink)
                progress.advance(documents=sum(part.ends for part in batch), tokens=len(ids))
        progress.close()
        if progress.documents == 0:
            raise ConfigError(f"SRC {' '.join(sources)}: the corpus is empty "
                              "(its files and text fields are empty or binary)")
        tokenizer.save(tmp)
        meta = {"tokenizer": spec, "vocab_size": tokenizer.vocab_size, "dtype": dtype.name,
                "documents": progress.documents, "tokens": progress.tokens, "eot_id": tokenizer.eot_id,
                "sources": [str(s) for s in sources], "binary_files_skipped": progress.binary_files}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


if __name__ == "__main__":  # the command lives in holmes_jax.data, beside the other data tools
    print("error: the command is python -m holmes_jax.data prepare SRC ... --out DIR", file=sys.stderr)
    sys.exit(2)
