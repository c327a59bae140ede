"""Token sources and deterministic batches.

Sources (`DataConfig.source`):
- `stdlib`: the `.py` files of this Python's standard library, read as bytes (vocab 256), in sorted
  path order. Every Python install has them, so the default run downloads nothing.
- a text file, or a folder of text files (the files under it, sorted, without hidden paths and
  binary files, as `prepare` reads a folder), read as bytes.
- a flat token file ending in `.bin` (`.BIN` too): a headerless little-endian array of
  `DataConfig.token_dtype` (uint16 or uint32) token ids, e.g. written with `np.asarray(ids, np.uint16).tofile(path)`;
  `DataConfig.vocab_size` gives its vocabulary (default: unknown; its ids are scanned once). Every
  second id 0 is refused: ids of a wider type (uint32, int64) read as narrower ones.
- a prepared folder (it holds `meta.json`), written by `python -m holmes_jax.data prepare`
  (holmes_jax.prepare): `tokens.bin` in the dtype and vocabulary its meta.json names.

`vocab_size(cfg)` is the vocabulary the data declares (a prepared folder's, or
`DataConfig.vocab_size` for a `.bin`), which the trainer gives the model unless
`ModelConfig.vocab_size` is set; byte text declares none, so a preset keeps its own (every preset
has at least 256); `TokenData.check_model_vocab` rejects a model too small for the ids.

Text is cached as a uint8 memmap under `DataConfig.cache_dir`, keyed by the files' absolute paths,
sizes, modification and change times and inodes, so an edited or replaced file (its modification
time set back, as `cp -p` or `touch -r` leave it) or another folder of the same name is read anew
(the new cache replaces the older one of the same source file or folder);
a cache whose size is not the files' (cut short by a crash) is built again.
The last `val_fraction` of the tokens is the validation split. The batch for step k is a pure
function of (seed, split, k), so a resumed run sees exactly the batches an uninterrupted one would,
on the same data: the data's `identity` (its length, vocabulary and a hash of a bounded sample of
its ids) is kept in the run's workdir, and a resume on data that differs from it says so; the
processes of a job compare theirs at start.
Each row is a window starting at a uniformly random position of its split, drawn anew for each
step: with replacement, no epochs (a token may be read several times in a run, or never).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sysconfig
import uuid
from pathlib import Path

import numpy as np

from holmes_jax import cli, prepare
from holmes_jax.config import ConfigError, DataConfig
from holmes_jax.prepare import BYTE_VOCAB, META_FILE, TOKEN_FILE, TOKENIZER_FILE

LARGEST_ID = 1 << 24  # 16x prepare's largest bpe:N: a larger id in a token file is a misread file
SCAN_CHUNK = 1 << 24  # token ids read at a time when scanning a file for its largest id
COPY_CHUNK = 1 << 20  # bytes read at a time when copying text files into the cache
# A prepared source's meta.json as a run keeps it in its workdir (its end-of-text id, for export and
# generate, also where the data folder is not found from there).
RUN_META_FILE = "data_meta.json"
# The text cache's own files, as _cached_bytes and _write_cache name them: a cache
# (bytes-FOLDER-VERSION.u8), its lock (bytes-FOLDER.lock), a partial one (CACHE.UUID.tmp).
CACHE_FILE = re.compile(r"bytes-[0-9a-f]{12}(-[0-9a-f]{16}\.u8(\.[0-9a-f]{32}\.tmp)?|\.lock)")
# What `identity` hashes: this many evenly spaced blocks of this many ids, the first and last among them.
SAMPLE_BLOCKS, SAMPLE_BLOCK = 16, 1 << 16


@dataclasses.dataclass(frozen=True)
class TokenData:
    train: np.ndarray  # 1-D token ids (memmap)
    val: np.ndarray
    vocab_size: int  # the ids are below it
    description: str
    source: str = ""  # DataConfig.source
    declared: bool = True  # vocab_size is the data's own (bytes, meta.json, DataConfig.vocab_size), not scanned
    identity: dict = dataclasses.field(default_factory=dict)  # `identity` of the whole token stream

    def check_model_vocab(self, model_vocab: int) -> None:
        """ConfigError unless every id fits a model with `model_vocab` embeddings (otherwise the run
        trains to NaN without complaint)."""
        if self.vocab_size <= model_vocab:
            return
        fix = ("leave ModelConfig.vocab_size unset (the model then follows the data) or set it"
               if self.declared else "set DataConfig.vocab_size (the model then follows it) or ModelConfig.vocab_size")
        raise ConfigError(f"DataConfig.source = {self.source!r} has token ids up to {self.vocab_size - 1} but "
                          f"ModelConfig.vocab_size = {model_vocab}; {fix} to at least {self.vocab_size}")

    def batch(self, split: str, seed: int, step: int, batch_size: int, seq_len: int,
              rows: list[int] | None = None) -> np.ndarray:
        """`batch_size` windows of `seq_len + 1` tokens (inputs and shifted targets), int32; only
        the windows numbered `rows` where given (a process reads the rows its devices hold; the
        windows are the same whichever rows are read)."""
        tokens = self.train if split == "train" else self.val
        span = seq_len + 1
        if len(tokens) < span:
            raise ConfigError(
                f"the {split} split holds {len(tokens)} tokens, fewer than DataConfig.seq_len + 1 = {span}"
            )
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, step])
        starts = rng.integers(0, len(tokens) - span + 1, size=batch_size)
        if rows is not None:
            starts = starts[rows]
        return np.stack([np.asarray(tokens[s : s + span], dtype=np.int32) for s in starts])


def identity(tokens, vocab: int) -> dict:
    """What identifies a token stream, cheaply: its length, vocabulary and a hash of a bounded
    sample of its ids (`SAMPLE_BLOCKS` blocks, a few MiB read at every start, never the whole
    corpus). No paths, inodes, times or cache keys: hosts with identical copies of a corpus agree.
    An edit that keeps the length and lies between the sampled blocks goes unseen."""
    n, digest = len(tokens), hashlib.sha256()
    if n <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
        starts = range(0, n, SAMPLE_BLOCK)
    else:
        starts = [i * (n - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]
    for start in starts:  # as 4-byte ids: the same ids in a uint16 or a uint32 file are the same data
        digest.update(np.asarray(tokens[start : start + SAMPLE_BLOCK], dtype="<u4").tobytes())
    return {"tokens": n, "vocab_size": vocab, "sample": digest.hexdigest()[:16]}


def describe_identity(found: dict) -> str:
    """`found` (an `identity`) in words, e.g. '363,640 tokens (vocabulary 256, sampled ids hashing to 1a2b...)'."""
    return f"{found['tokens']:,} tokens (vocabulary {found['vocab_size']}, sampled ids hashing to {found['sample']})"


def identity_changes(old: dict, new: dict) -> list[str]:
    """How the data of identity `new` differs from `old`'s, e.g. ['363,640 -> 387,611 tokens']."""
    changes = []
    if old["tokens"] != new["tokens"]:
        changes.append(f"{old['tokens']:,} -> {new['tokens']:,} tokens")
    elif old["sample"] != new["sample"]:
        changes.append(f"other contents, the same {new['tokens']:,} tokens")
    if old["vocab_size"] != new["vocab_size"]:
        changes.append(f"vocabulary {old['vocab_size']} -> {new['vocab_size']}")
    return changes


def is_identity(found) -> bool:
    """Whether `found` is an `identity` (one a checkpoint's record holds; a record edited by hand is
    as good as none: it only serves a notice)."""
    fields = {"tokens": int, "vocab_size": int, "sample": str}
    return isinstance(found, dict) and all(type(found.get(k)) is t for k, t in fields.items())


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    root = _stdlib_root()
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _text_files(source: str, cache_dir: Path) -> tuple[list[Path], int]:
    """The files of a text source and how many binary files of its folder were skipped. The cache's
    files are not text of the source, though the cache folder may be in the source folder or be
    it (each run would read the last run's cache as more text, doubling the corpus); only they are
    left out, so a cache folder above the source's leaves its text in."""
    path = Path(source).expanduser()
    if path.is_file():
        if _binary_file(path):  # token ids under another name would otherwise train as bytes
            raise ConfigError(f"DataConfig.source = {source!r} is a binary file (a NUL byte in its first "
                              f"{prepare.BINARY_SNIFF // 1024} KiB), not text; a flat token file must be "
                              "named NAME.bin")
        return [path], 0
    if path.is_dir():
        if (path / TOKEN_FILE).is_file():  # its tokenizer.json would otherwise train as text
            raise ConfigError(f"DataConfig.source = {source!r} holds {TOKEN_FILE} but no {META_FILE}: an incomplete "
                              "prepared folder (an interrupted prepare?); prepare it again into a new folder")
        cache = cache_dir.resolve()
        try:
            listed = prepare.folder_files(path)
        except OSError as e:  # a folder under it without permission: its files were left out unsaid
            raise _unreadable(Path(e.filename or path), e) from None
        files = [f for f in listed if not _in_cache(f, cache)]
        text = [f for f in files if not _binary_file(f)]
        if text:
            return text, len(files) - len(text)
        what = "only binary files in it" if files else "no files in it (hidden ones are skipped)"
        raise ConfigError(f"DataConfig.source = {source!r} is a folder with {what}")
    raise ConfigError(f"DataConfig.source = {source!r} is not a readable file or folder; use 'stdlib', a text file or folder, a prepared folder or a .bin token file")


def _in_cache(path: Path, cache: Path) -> bool:
    real = path.resolve()
    return real.parent == cache and CACHE_FILE.fullmatch(real.name) is not None


def _binary_file(path: Path) -> bool:
    with _open_text(path) as f:
        try:
            return prepare.is_binary(f.read(prepare.BINARY_SNIFF))
        except OSError as e:
            raise _unreadable(path, e) from None


def _open_text(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise _unreadable(path, e) from None


class _NamedReads:
    """An open source file whose read errors name it: copied into the cache, an error of either
    file was blamed on the cache folder."""

    def __init__(self, file, path: Path):
        self.file, self.path = file, path

    def read(self, size: int) -> bytes:
        try:
            return self.file.read(size)
        except OSError as e:
            raise _unreadable(self.path, e) from None


def _unreadable(path: Path, e: OSError) -> ConfigError:
    return ConfigError(f"DataConfig.source: {str(path)!r} cannot be read ({e.strerror or e})")


def _cached_bytes(files: list[Path], cache_dir: Path, source: str, root: Path) -> np.ndarray:
    """Concatenates `files` into one uint8 memmap, built once per distinct list of files and versions.
    A new version's cache replaces the older ones of the same source `root` (the file or folder the
    source names), which would otherwise pile up, a copy of the corpus for each edit."""
    key = hashlib.sha256()
    stats = []
    for f in files:
        try:
            stats.append(f.stat())
        except OSError as e:  # removed since the folder was listed
            raise _unreadable(f, e) from None
    resolved = [f.resolve() for f in files]
    for f, stat in zip(resolved, stats):
        # The change time and inode too: a write or a replacing rename always changes them, while
        # `cp -p`, `touch -r` or an unpacked archive can give new content the old size and mtime.
        # os.fsencode: a name that is not UTF-8 (an old archive's Latin-1) holds surrogates str.encode refuses.
        key.update(os.fsencode(f))
        key.update(f"\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0{stat.st_ino}\0".encode())
    size = sum(stat.st_size for stat in stats)
    if not size:
        raise ConfigError(f"DataConfig.source = {source!r} holds no text: its files are empty")
    # The source's own path, not the files' common folder: a folder grown from one file to several
    # changed it (the one file's cache stayed behind), and folders of links into one folder shared
    # it (each run removed the other's cache).
    where = hashlib.sha256(os.fsencode(root.resolve())).hexdigest()[:12]
    cache = cache_dir / f"bytes-{where}-{key.hexdigest()[:16]}.u8"
    if not _whole(cache, size, cache_dir):
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            # The processes of a run start together: one builds the cache while the others wait
            # for it (each built its own copy at once, the corpus's size in temporary files each).
            lock_path = cache_dir / f"bytes-{where}.lock"
            with open(lock_path, "a") as lock:
                try:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
                    except OSError as e:  # a filesystem without locks: each process builds its own, as before
                        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                            raise
                    if not _whole(cache, size, cache_dir):
                        _write_cache(files, cache, where)
                finally:  # not left in the folder: one still waiting on it looks at the cache again
                    with contextlib.suppress(OSError):
                        lock_path.unlink()
        except OSError as e:
            message = f"DataConfig.cache_dir = {str(cache_dir)!r} cannot be written ({e.strerror or e}); "
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a failure of the run (status 1, as for --out and checkpoints)
                raise cli.RunError(message + "free space there or choose another folder") from None
            raise ConfigError(message + "choose a writable folder") from None  # bad input
    return np.memmap(cache, dtype=np.uint8, mode="r")


def _whole(cache: Path, size: int, cache_dir: Path) -> bool:
    """Whether `cache` is there with all its `size` bytes: one of another size was cut short (a host
    that crashed before its data reached the disk) and is built again."""
    try:
        return cache.stat().st_size == size
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:  # a folder without permission: was a traceback
        raise ConfigError(f"DataConfig.cache_dir = {str(cache_dir)!r} cannot be read ({e.strerror or e}); "
                          "choose a readable folder") from None


def _write_cache(files: list[Path], cache: Path, where: str) -> None:
    """Writes `files` one after another as `cache`, whole or not at all, and removes the older
    caches of the same folder (`where`)."""
    # A name of its own, not the pid: processes on other hosts (or containers) sharing the
    # cache folder may have the same pid and would write into one file.
    partial = cache.with_name(f"{cache.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(partial, "xb") as out:
            for f in files:
                with _open_text(f) as text:  # in pieces: a file may be larger than memory
                    shutil.copyfileobj(_NamedReads(text, f), out, COPY_CHUNK)
            out.flush()
            os.fsync(out.fileno())  # else a host crash can leave the renamed cache full of zeros
        os.replace(partial, cache)  # atomic: readers see the whole cache or none
        for older in cache.parent.glob(f"bytes-{where}-*.u8"):  # a run mapping one keeps reading it
            if older != cache:
                with contextlib.suppress(OSError):
                    older.unlink()
    finally:  # also on an error in the sources or a stop signal: no partial copy is left behind
        with contextlib.suppress(OSError):  # nothing to remove when it was renamed or never made
            partial.unlink()


def _token_file(path: Path, dtype: str, source: str, fix: str = "check DataConfig.token_dtype") -> np.ndarray:
    """The ids of a flat token file; ConfigError when it is missing, empty or not whole ids (`fix` says what to do)."""
    if not path.is_file():
        raise ConfigError(f"DataConfig.source = {source!r}: token file {str(path)!r} not found")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise ConfigError(f"DataConfig.source = {source!r}: token file {str(path)!r} is empty")
    if size % itemsize:
        raise ConfigError(f"DataConfig.source = {source!r}: token file {str(path)!r} holds {size} bytes, not a whole "
                          f"number of {dtype} ids ({itemsize} bytes each); {fix}")
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def _scan(tokens: np.ndarray) -> tuple[int, bool]:
    """The largest id and whether an id at an odd position is not 0, read in chunks so a file
    larger than memory is scanned in bounded memory."""
    top, odd_ids = 0, False
    for i in range(0, len(tokens), SCAN_CHUNK):  # SCAN_CHUNK is even: a chunk's odd positions are the file's
        chunk = tokens[i : i + SCAN_CHUNK]
        top, odd_ids = max(top, int(chunk.max())), odd_ids or bool(chunk[1::2].any())
    return top, odd_ids


def prepared_folder(source: str) -> Path | None:
    """The folder of a prepared source (one holding meta.json; a folder may be named x.bin), else None.
    The folder's own tokens.bin counts as the folder: its dtype and vocabulary are in meta.json."""
    path = Path(source).expanduser()
    try:  # a folder without permission fails the look for meta.json: was a traceback
        if path.name == TOKEN_FILE and (path.parent / META_FILE).is_file():
            return path.parent
        return path if source != "stdlib" and (path / META_FILE).is_file() else None
    except OSError as e:
        raise _unreadable(path, e) from None


def read_meta(folder: Path) -> dict:
    """A prepared folder's meta.json, its fields checked."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"DataConfig.source = {str(folder)!r}: unreadable {META_FILE} ({e})") from None
    counts = ("vocab_size", "documents", "tokens", "eot_id")
    ok = (isinstance(meta, dict) and meta.get("dtype") in ("uint16", "uint32") and isinstance(meta.get("tokenizer"), str)
          and all(type(meta.get(k)) is int and meta[k] >= 0 for k in counts))  # JSON true is no count
    if not ok:
        raise ConfigError(f"DataConfig.source = {str(folder)!r}: {META_FILE} needs tokenizer, dtype (uint16 | uint32) "
                          f"and the non-negative integers {', '.join(counts)}; prepare the folder again")
    if meta["eot_id"] >= meta["vocab_size"]:  # an edited vocab_size below the ids: the model trained to NaN
        raise ConfigError(f"DataConfig.source = {str(folder)!r}: {META_FILE} says eot_id {meta['eot_id']}, not below "
                          f"its vocab_size {meta['vocab_size']}; prepare the folder again")
    return meta


def vocab_size(cfg: DataConfig) -> int | None:
    """The vocabulary the data declares, known without reading tokens: a prepared folder's, a
    `.bin`'s `DataConfig.vocab_size`; None for byte text and for a `.bin` without one."""
    folder = prepared_folder(cfg.source)
    if folder:
        return read_meta(folder)["vocab_size"]
    return cfg.vocab_size if is_token_file(cfg.source) else None


def is_token_file(source: str) -> bool:
    """Whether `source` names a flat token file: NAME.bin, the suffix in any case (TOKENS.BIN too)."""
    return source.lower().endswith(".bin")


def tokenizer_path(cfg: DataConfig) -> Path | None:
    """The tokenizer.json of a prepared source that has one (bytes have none)."""
    folder = prepared_folder(cfg.source)
    return folder / TOKENIZER_FILE if folder and (folder / TOKENIZER_FILE).is_file() else None


def padded_vocab(n: int, multiple: int = 128) -> int:
    """`n` rounded up to a multiple of `multiple` (fast embedding and output matmuls, tensor-parallel splits)."""
    return -(-n // multiple) * multiple


def load(cfg: DataConfig) -> TokenData:
    cache_dir = Path(cfg.cache_dir or Path.home() / ".cache" / "holmes_jax").expanduser()
    declared = True
    folder = prepared_folder(cfg.source)
    if cfg.source == "stdlib":
        tokens = _cached_bytes(_stdlib_files(), cache_dir, cfg.source, _stdlib_root())
        vocab, what = BYTE_VOCAB, "python stdlib sources (bytes)"
    elif is_token_file(cfg.source) and not folder:
        path = Path(cfg.source).expanduser()
        if path.is_dir():  # a text folder named x.bin, say: found, but not a token file
            raise ConfigError(f"DataConfig.source = {cfg.source!r} is a folder without {META_FILE}: neither a "
                              ".bin token file nor a prepared folder")
        tokens = _token_file(path, cfg.token_dtype, cfg.source)
        top, odd_ids = _scan(tokens)
        if top and not odd_ids and len(tokens) % 2 == 0:  # each id followed by the 0 bytes of a wider one
            raise ConfigError(f"DataConfig.source = {cfg.source!r}: every second id is 0, as when ids of a wider type "
                              f"(uint32, or int64 from np.array(ids).tofile) are read as {cfg.token_dtype}; set "
                              "DataConfig.token_dtype to the file's type (uint16 | uint32) or write the ids with "
                              "np.asarray(ids, np.uint16).tofile(path)")
        if top >= LARGEST_ID:  # pairs of uint16 ids read as one uint32: ids in the billions
            raise ConfigError(f"DataConfig.source = {cfg.source!r} holds token id {top:,} as {cfg.token_dtype}, beyond "
                              f"any vocabulary, as when uint16 ids are read as uint32; set DataConfig.token_dtype "
                              f"to the file's type")
        if cfg.vocab_size is not None and top >= cfg.vocab_size:
            raise ConfigError(f"DataConfig.source = {cfg.source!r} holds token id {top}, outside "
                              f"DataConfig.vocab_size = {cfg.vocab_size}; set it to at least {top + 1}")
        vocab, declared = cfg.vocab_size or top + 1, cfg.vocab_size is not None
        what = f"token file {path} ({cfg.token_dtype})"
    elif folder:
        meta = read_meta(folder)
        if cfg.vocab_size is not None and cfg.vocab_size != meta["vocab_size"]:
            raise ConfigError(f"DataConfig.vocab_size = {cfg.vocab_size} disagrees with {folder / META_FILE} "
                              f"(vocab_size {meta['vocab_size']}); leave it unset for a prepared folder")
        # Its dtype is meta.json's, not DataConfig.token_dtype: a part id is a cut-short file.
        tokens = _token_file(folder / TOKEN_FILE, meta["dtype"], cfg.source, "prepare the folder again")
        if len(tokens) != meta["tokens"]:
            raise ConfigError(f"DataConfig.source = {cfg.source!r}: {TOKEN_FILE} holds {len(tokens):,} tokens, "
                              f"{META_FILE} says {meta['tokens']:,}; prepare the folder again")
        vocab = meta["vocab_size"]
        what = f"prepared {folder} ({meta['tokenizer']} tokenizer, vocabulary {vocab}, {prepare.count_documents(meta['documents'])})"
    else:
        files, skipped = _text_files(cfg.source, cache_dir)
        tokens = _cached_bytes(files, cache_dir, cfg.source, Path(cfg.source).expanduser())
        skip_note = f", binary files skipped: {skipped}" if skipped else ""
        vocab, what = BYTE_VOCAB, f"text {cfg.source} (bytes{skip_note})"
    span = cfg.seq_len + 1
    n_val = max(int(len(tokens) * cfg.val_fraction), span)
    if len(tokens) - n_val < span:
        raise ConfigError(
            f"DataConfig.source = {cfg.source!r} holds {len(tokens)} tokens, too few for DataConfig.seq_len = "
            f"{cfg.seq_len} with a validation split: each split needs seq_len + 1 = {span}, so at least {2 * span} tokens"
        )
    return TokenData(tokens[:-n_val], tokens[-n_val:], vocab, f"{what}: {len(tokens):,} tokens", cfg.source, declared,
                     identity(tokens, vocab))


def main(argv: list[str]) -> int:
    parser = cli.Parser(prog="python -m holmes_jax.data", description="Data tools for holmes_jax training runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    prep = commands.add_parser(
        "prepare", help="tokenize text into a folder that DataConfig.source can name",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize text files, folders of text files and JSONL files into DIR, for "
                    "--gin.DataConfig.source=DIR.",
        epilog="Binary files (a NUL byte in their first 8 KiB) and empty documents are skipped.\n\n"
               "DIR gets tokens.bin (documents, each followed by the end-of-text id; uint16, or uint32 for\n"
               "vocabularies over 65536), tokenizer.json (not for bytes) and meta.json (tokenizer,\n"
               "vocab_size, dtype, documents, tokens, eot_id, sources, binary_files_skipped). A run on\n"
               "DIR gives the model DIR's vocabulary rounded up to a multiple of 128 unless\n"
               "ModelConfig.vocab_size is set.\n\n"
               "example:\n  python -m holmes_jax.data prepare corpus/ --out data/corpus-bpe --tokenizer bpe:8192")
    prep.add_argument("sources", nargs="+", metavar="SRC",
                      help="a text file (one document), a folder (every file under it, sorted; hidden ones skipped) "
                           "or a .jsonl file (one document per line, its \"text\" field)")
    prep.add_argument("--out", required=True, metavar="DIR", help="the folder to create (must not exist or be empty)")
    prep.add_argument("--tokenizer", default="bytes", metavar="T",
                      help="bytes (ids 0-255, end-of-text 256; the default), bpe:N (a byte-level BPE of N tokens "
                           "trained on SRC) or the path of a Hugging Face tokenizer.json")
    if not argv:
        raise ConfigError("a command is needed; allowed: prepare (see python -m holmes_jax.data prepare --help)")
    args = parser.parse_args(argv)
    meta = prepare.prepare(args.sources, args.out, args.tokenizer)
    skipped = meta["binary_files_skipped"]
    print(f"{args.out}: {prepare.count_documents(meta['documents'])}, {meta['tokens']:,} tokens, vocabulary {meta['vocab_size']} "
          f"({meta['dtype']}, end-of-text {meta['eot_id']})" + (f"; skipped {skipped} binary files" if skipped else ""))
    return 0


if __name__ == "__main__":
    cli.run(main)
