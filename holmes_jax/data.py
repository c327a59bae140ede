"""Token sources and deterministic batches.

Sources (`DataConfig.source`):
- `stdlib`: the `.py` files of this Python's standard library, read as bytes (vocab 256), in sorted
  path order. Every Python install has them, so the default run downloads nothing.
- a text file, or a folder of text files (all files under it, sorted), read as bytes.
- a flat token file ending in `.bin`: a headerless little-endian array of `DataConfig.token_dtype`
  (uint16 or uint32) token ids, e.g. written with `np.asarray(ids, np.uint16).tofile(path)`;
  `DataConfig.vocab_size` gives its vocabulary (default: max id + 1).

Text is cached as a uint8 memmap under `DataConfig.cache_dir`, keyed by the file list and sizes.
The last `val_fraction` of the tokens is the validation split. The batch for step k is a pure
function of (seed, split, k), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from holmes_jax.config import ConfigError, DataConfig

BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class TokenData:
    train: np.ndarray  # 1-D token ids (memmap)
    val: np.ndarray
    vocab_size: int
    description: str

    def batch(self, split: str, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
        """`batch_size` windows of `seq_len + 1` tokens (inputs and shifted targets), int32."""
        tokens = self.train if split == "train" else self.val
        span = seq_len + 1
        if len(tokens) < span:
            raise ConfigError(
                f"the {split} split holds {len(tokens)} tokens, fewer than DataConfig.seq_len + 1 = {span}"
            )
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, step])
        starts = rng.integers(0, len(tokens) - span + 1, size=batch_size)
        return np.stack([np.asarray(tokens[s : s + span], dtype=np.int32) for s in starts])


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _text_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if files:
            return files
        raise ConfigError(f"DataConfig.source = {source!r} is a folder with no files in it")
    raise ConfigError(f"DataConfig.source = {source!r} is not a readable file or folder; use 'stdlib', a text file or folder, or a .bin token file")


def _cached_bytes(files: list[Path], cache_dir: Path) -> np.ndarray:
    """Concatenates `files` into one uint8 memmap, built once per distinct file list."""
    key = hashlib.sha256()
    for f in files:
        key.update(f"{f}\0{f.stat().st_size}\0".encode())
    cache = cache_dir / f"bytes-{key.hexdigest()[:16]}.u8"
    if not cache.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".tmp{os.getpid()}")
        with open(partial, "wb") as out:
            for f in files:
                out.write(f.read_bytes())
        os.replace(partial, cache)  # atomic: a crash never leaves a half-written cache behind
    return np.memmap(cache, dtype=np.uint8, mode="r")


def load(cfg: DataConfig) -> TokenData:
    cache_dir = Path(cfg.cache_dir or Path.home() / ".cache" / "holmes_jax").expanduser()
    if cfg.source == "stdlib":
        tokens, vocab, what = _cached_bytes(_stdlib_files(), cache_dir), BYTE_VOCAB, "python stdlib sources (bytes)"
    elif cfg.source.endswith(".bin"):
        path = Path(cfg.source).expanduser()
        if not path.is_file():
            raise ConfigError(f"DataConfig.source = {cfg.source!r}: token file not found")
        tokens = np.memmap(path, dtype=np.dtype(cfg.token_dtype).newbyteorder("<"), mode="r")
        vocab = cfg.vocab_size or int(tokens.max()) + 1
        what = f"token file {path} ({cfg.token_dtype})"
    else:
        tokens, vocab, what = _cached_bytes(_text_files(cfg.source), cache_dir), BYTE_VOCAB, f"text {cfg.source} (bytes)"
    n_val = max(int(len(tokens) * cfg.val_fraction), cfg.seq_len + 1)
    if len(tokens) - n_val < cfg.seq_len + 1:
        raise ConfigError(
            f"DataConfig.source = {cfg.source!r} holds {len(tokens)} tokens, too few for DataConfig.seq_len = "
            f"{cfg.seq_len} with a validation split"
        )
    return TokenData(tokens[:-n_val], tokens[-n_val:], vocab, f"{what}: {len(tokens):,} tokens")
