"""A trained run as a Python object: `holmes_jax.load(workdir)`.

    m = holmes_jax.load("runs/default")
    m.config, m.step        # the resolved ModelConfig, the checkpoint's step
    m.params                # canonical parameters {"embed", "blocks", "head"}, float32
    m.tokenizer             # tokenizers.Tokenizer, or None: the run read bytes (or a .bin's ids)
    m.end_of_text           # the id its data put after each document, or None
    m.logits(tokens)        # int (batch, seq) -> float32 (batch, seq, vocab)

The configs come from the run's config.gin (parsed with gin, which replaces any gin config the
calling process had), the parameters from the newest checkpoint (or `step`) under
WORKDIR/checkpoints, restored without the optimizer state onto the first local device. The
forward is the model's own (no pipeline), so any device count can load any run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

from holmes_jax import configure, prepare
from holmes_jax import data as data_sources
from holmes_jax.checkpoint import SHOWN_MISMATCHES, mismatches, reason
from holmes_jax.config import ConfigError, DataConfig, ModelConfig
from holmes_jax.models import gpt


def read_configs(workdir: str | Path) -> tuple[ModelConfig, DataConfig]:
    """The resolved model config (to run on this process's first device) and the data config a
    run was trained with."""
    gin_file = Path(workdir) / "config.gin"
    if not gin_file.is_file():
        raise ConfigError(f"--workdir {str(workdir)!r} holds no config.gin: not the workdir of a holmes_jax run")
    cfgs = configure.load_configs(["--gin_file", str(gin_file)])
    return gpt.runnable_on(cfgs.model, jax.devices()[0]), cfgs.data


def restore_params(workdir: str | Path, cfg: ModelConfig, step: int | None = None, device=None) -> tuple[dict, int]:
    """(canonical parameters of checkpoint `step`, default the newest, on `device`; that step).
    Only the parameters are read: the optimizer state stays on disk."""
    with open_params(workdir, cfg, step, device) as saved:
        return saved.read(), saved.step


@contextlib.contextmanager
def open_params(workdir: str | Path, cfg: ModelConfig, step: int | None = None, device=None) -> Iterator[SavedParams]:
    """Checkpoint `step` (default the newest) of the run in `workdir`, once it fits `cfg`, to read
    its parameters from, a few leaves at a time if need be (`SavedParams.read`): a big model's whole
    tree in float32 is more host memory than an export needs."""
    # True == 1 and 2.0 == 2 would pass the membership test below and then fail in orbax, blamed
    # on a damaged checkpoint; "2" would be refused while the message lists 2.
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise ConfigError(f"step = {step!r} is not allowed; allowed: None (the newest checkpoint) or an int")
    directory = (Path(workdir) / "checkpoints").absolute()
    if not directory.is_dir():
        raise ConfigError(f"--workdir {str(workdir)!r} has no checkpoint under {directory}")
    # The handler lets the manager read a step's metadata (its arrays' shapes) before any data.
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False),
                                    item_handlers=ocp.PyTreeCheckpointHandler())
    try:  # closed on every path: a library caller (`holmes_jax.load`) keeps running
        step, abstract = _checked_step(manager, workdir, directory, cfg, step)
        yield SavedParams(manager, directory, step, abstract,
                          jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0]))
    finally:
        manager.close()


@dataclasses.dataclass
class SavedParams:
    """The parameters of a checkpoint step (`open_params`), read when asked for."""
    manager: Any  # ocp.CheckpointManager
    directory: Path
    step: int
    abstract: dict  # the ModelConfig's parameter shapes
    sharding: jax.sharding.Sharding

    def read(self, paths: list[tuple] | None = None) -> dict:
        """The canonical parameter tree, or (given `paths`, tuples of keys) only the leaves at
        those paths, in the same nested dicts."""
        tree = self.abstract if paths is None else _subtree(self.abstract, paths)
        target = {"params": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.sharding),
                                         tree)}
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        try:
            return self.manager.restore(self.step, args=args)["params"]
        except Exception as e:  # a truncated file after a crash or a full disk
            raise _unreadable(self.manager, self.directory, self.step, e) from None


def _subtree(tree: dict, paths: list[tuple]) -> dict:
    """The leaves of `tree` at `paths` (tuples of keys), in the same nested dicts."""
    out = {}
    for path in paths:
        node, leaf = out, tree
        for key in path[:-1]:
            node, leaf = node.setdefault(key, {}), leaf[key]
        node[path[-1]] = leaf[path[-1]]
    return out


def _unreadable(manager, directory: Path, step: int, e: Exception) -> ConfigError:
    others = " or ".join(str(s) for s in sorted(manager.all_steps()) if s != step)
    allowed = f"allowed: --step {others}" if others else "there is no other checkpoint"
    return ConfigError(f"checkpoint step {step} in {directory} cannot be read ({reason(e)}); {allowed}")


def _checked_step(manager, workdir, directory: Path, cfg: ModelConfig, step: int | None) -> tuple[int, dict]:
    """(`step` (None: the newest), `cfg`'s parameter shapes), once the checkpoint there holds
    parameters of those shapes."""
    steps = list(manager.all_steps())
    if not steps:
        raise ConfigError(f"--workdir {str(workdir)!r} has no checkpoint under {directory}")
    step = max(steps) if step is None else int(step)
    if step not in steps:
        raise ConfigError(f"--step {step} is not allowed; the checkpoints of {str(workdir)!r} are at steps "
                          f"{', '.join(map(str, sorted(steps)))}")
    abstract = jax.eval_shape(lambda: gpt.GPT(cfg).init(0))
    try:
        saved = manager.item_metadata(step)
        if saved is None:
            raise FileNotFoundError("its metadata is missing")
        # Checked first: orbax refuses another shape blaming the checkpoint, and leaves an array
        # the checkpoint lacks (a bias) as a placeholder that fails at the first forward.
        wrong = mismatches({"params": saved.tree.get("params", {})}, {"params": abstract})
    except Exception as e:  # a truncated file after a crash or a full disk
        raise _unreadable(manager, directory, step, e) from None
    if wrong:
        more = f" (and {len(wrong) - SHOWN_MISMATCHES} more)" if len(wrong) > SHOWN_MISMATCHES else ""
        raise ConfigError(f"checkpoint step {step} in {directory} does not fit the ModelConfig of "
                          f"{Path(workdir) / 'config.gin'}: {'; '.join(wrong[:SHOWN_MISMATCHES])}{more}; "
                          f"allowed: the ModelConfig of the run that wrote the checkpoint")
    return step, abstract


def tokenizer_file(workdir: str | Path, data: DataConfig) -> Path | None:
    """The tokenizer.json a run trained with: the copy in its workdir, else (a run from before
    runs kept one) its data folder's, found from here; None when the run read bytes."""
    kept = Path(workdir) / "tokenizer.json"
    return kept if kept.is_file() else data_sources.tokenizer_path(data)


@dataclasses.dataclass(eq=False)  # == on its parameters' arrays would raise, not compare
class Model:
    config: ModelConfig
    params: dict
    tokenizer: Any  # tokenizers.Tokenizer | None
    step: int
    end_of_text: int | None = None  # the id the data put after each document; None: it put none
    token_file: str | None = None  # the .bin the run read ids from, with no tokenizer to turn text into them

    def __post_init__(self):
        self.gpt = gpt.GPT(self.config)
        self._logits = jax.jit(self.gpt.logits)

    def __repr__(self) -> str:
        # Not the fields' own: the parameters print every value, a tokenizer its whole vocabulary.
        count = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(self.params))
        vocab = None if self.tokenizer is None else self.tokenizer.get_vocab_size()
        tokenizer = None if self.tokenizer is None else f"<tokenizers.Tokenizer of {vocab} ids>"
        return (f"Model(config={self.config!r}, step={self.step}, params=<{count:,} parameters>, "
                f"tokenizer={tokenizer}, end_of_text={self.end_of_text!r}, token_file={self.token_file!r})")

    def logits(self, tokens) -> jax.Array:
        """Float32 next-token logits (batch, seq, vocab) of int `tokens` (batch, seq)."""
        tokens = np.asarray(tokens)
        cfg = self.config
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ConfigError(f"tokens must be an integer array (batch, seq); got {tokens.dtype} {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
            raise ConfigError(f"token ids must lie in [0, ModelConfig.vocab_size = {cfg.vocab_size})")
        # More tokens than learned positions: the model's embedding raises the ConfigError as it traces.
        return self._logits(self.params, tokens.astype(np.int32))


def run_tokens(workdir: str | Path, data: DataConfig) -> tuple[Any, int | None, str | None]:
    """How a run's text became ids: (its tokenizers.Tokenizer or None for bytes, the end-of-text id
    its data put after each document or None, the .bin it read ids from with no tokenizer or None)."""
    path = tokenizer_file(workdir, data)
    if path is not None:
        import tokenizers

        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # a damaged copy: the tokenizers library raises a bare Exception
            raise ConfigError(f"{str(path)!r} cannot be read as a tokenizer.json ({reason(e)}); copy the run's "
                              f"data folder's tokenizer.json there again") from None
        # As holmes-data prepare tokenized the training text: a special token's name written in the
        # text ('<|endoftext|>' in a prompt) is plain text, not that token's id.
        tokenizer.encode_special_tokens = True
        vocab = tokenizer.get_vocab(with_added_tokens=True)  # holmes-data prepare's end-of-text rule
        return tokenizer, next((vocab[name] for name in prepare.EOT_NAMES if name in vocab), None), None
    meta = _data_meta(workdir, data)
    if meta is None:
        return None, None, data.source if data_sources.is_token_file(data.source) else None
    spec = _read_tokenizer_spec(meta)
    if spec not in ("bytes", None):  # its ids are that tokenizer's: text read as bytes would be other ids
        raise ConfigError(f"the run's data was prepared with --tokenizer {spec!r} ({str(meta)!r}) but there is no "
                          f"tokenizer.json in {str(workdir)!r} or in its data folder {data.source!r}; copy the data's "
                          f"tokenizer.json to {str(Path(workdir) / 'tokenizer.json')!r}")
    return None, prepare.BYTE_VOCAB, None  # prepared as bytes: ids 0-255 and end-of-text 256


def _data_meta(workdir: str | Path, data: DataConfig) -> Path | None:
    """The meta.json of the prepared data a run read: its copy in the workdir, else the data
    folder's; None when the run read no prepared folder."""
    kept = Path(workdir) / data_sources.RUN_META_FILE
    folder = data_sources.prepared_folder(data.source)
    return kept if kept.is_file() else folder / data_sources.META_FILE if folder else None


def _read_tokenizer_spec(meta: Path) -> str | None:
    """The --tokenizer a prepared folder's meta.json names (None where it names none)."""
    try:
        found = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{str(meta)!r} cannot be read as JSON ({e})") from None
    return found.get("tokenizer") if isinstance(found, dict) else None


def load(workdir: str | Path, step: int | None = None) -> Model:
    """The model of a run's newest checkpoint (or of `step`)."""
    workdir = Path(workdir).expanduser()
    cfg, data = read_configs(workdir)
    params, step = restore_params(workdir, cfg, step)
    tokenizer, eot, token_file = run_tokens(workdir, data)
    return Model(cfg, params, tokenizer, step, eot, token_file)
