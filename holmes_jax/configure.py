"""A run's configs from the command line: gin files and `--gin.NAME=VALUE` bindings, parsed into
the typed dataclasses of holmes_jax.config and validated (the model resolved from its preset)."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import gin

from holmes_jax import data
from holmes_jax.config import CheckpointConfig, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from holmes_jax.models import presets

DEFAULT_GIN = Path(__file__).resolve().parent.parent / "configs" / "default.gin"
USAGE = """usage: python -m holmes_jax.train [--gin_file FILE ...] [--gin.NAME=VALUE ...]

Trains a GPT. Without --gin_file, configs/default.gin is used. NAME is a config field such as
TrainConfig.steps, TrainConfig.workdir, ParallelConfig.dp, ParallelConfig.tp, ModelConfig.preset."""


@dataclasses.dataclass(frozen=True)
class Configs:
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    train: TrainConfig
    checkpoint: CheckpointConfig


def _gin_value(text: str) -> str:
    """A gin literal for `text`; bare words (paths, 'gpipe') become strings so users need no quotes."""
    if text.startswith(("@", "%")):
        return text
    try:
        return repr(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return repr(text)


def parse_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits argv into gin files and gin bindings ('Class.field = value')."""
    files, bindings = [], []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if arg == "--gin_file" or arg.startswith("--gin_file="):
            value = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else None)
            if not value:
                raise ConfigError("--gin_file needs a file name")
            files.append(value)
        elif arg.startswith("--gin."):
            name, eq, value = arg[len("--gin."):].partition("=")
            if not eq:
                if not args:
                    raise ConfigError(f"--gin.{name} needs a value: --gin.{name}=VALUE")
                value = args.pop(0)
            bindings.append(f"{name} = {_gin_value(value)}")
        else:
            raise ConfigError(f"unknown argument {arg!r}; allowed: --gin_file FILE, --gin.NAME=VALUE, --help")
    return files, bindings


def load_configs(argv: list[str]) -> Configs:
    """Parses gin files and bindings into validated configs (the model resolved from its preset)."""
    files, bindings = parse_args(argv)
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"--gin_file {f!r}: no such file")
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(files or [str(DEFAULT_GIN)], bindings)
        cfgs = Configs(ModelConfig(), ParallelConfig(), DataConfig(), TrainConfig(), CheckpointConfig())
    except ConfigError:
        raise
    except Exception as e:  # gin reports unknown names and unparsable values with assorted types
        raise ConfigError("gin: " + " ".join(str(e).split())) from None
    for c in (cfgs.parallel, cfgs.data, cfgs.train, cfgs.checkpoint):
        c.validate()
    model = cfgs.model
    if model.vocab_size is None and (declared := data.vocab_size(cfgs.data)):  # unset: follow the data's
        model = dataclasses.replace(model, vocab_size=data.padded_vocab(declared, math.lcm(128, cfgs.parallel.tp)))
    return dataclasses.replace(cfgs, model=presets.resolve(model))
