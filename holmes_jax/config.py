"""Typed run configuration, bindable from gin.

Each dataclass is `@gin.configurable`, so `--gin.TrainConfig.steps=10` (or a line in a gin file)
changes the default the class is built with. Fields a preset fills in are `None` here; see
`holmes_jax.models.presets.resolve`. `validate()` on each class raises `ConfigError` naming the
field and what is allowed; the command-line tools turn that into `error: ...` and exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import gin


REMAT = ("none", "full", "dots")
LR_SCHEDULES = ("cosine", "wsd", "constant")
WIRE_BYTES = {"float32": 4, "bfloat16": 2}  # bytes per number of what crosses `data`: *_dtype in ParallelConfig


class ConfigError(ValueError):
    """Bad user input: a config field, a topology entry, a flag or an infeasible plan."""


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    # Compared one by one, type included: `in` on a dict of choices raised TypeError for a list
    # value, and 1 or 0.0 passed as True or False.
    if not any(type(value) is type(choice) and value == choice for choice in allowed):
        raise ConfigError(f"{name} = {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")


FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2**-23) * 2.0**127  # its smallest normal and largest numbers


def is_number(value: Any) -> bool:
    """A finite int or float: True and False are not numbers here, and inf or nan (gin reads 1e999
    as inf) would make every step's loss nan."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_positive(name: str, value: Any, allow_none: bool = False) -> None:
    """The one positive-integer check: every config, flag and file field uses it."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} = {value!r} is not allowed; allowed: a positive integer")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. `None` fields come from `preset`."""

    preset: str = "tiny"  # a named size (holmes_jax/models/presets.py) that fills the None fields
    num_layers: int | None = None  # transformer blocks
    hidden: int | None = None  # model width
    num_heads: int | None = None  # attention heads; divides hidden
    ffn_hidden: int | None = None  # the MLP's inner width
    vocab_size: int | None = None  # token ids the embedding holds; unset: the data's (prepared, .bin) rounded up to a multiple of 128, else the preset's
    max_seq_len: int | None = None  # longest sequence (learned positions' table size)
    positions: str | None = None  # learned | rotary
    norm: str | None = None  # layernorm | rmsnorm
    mlp: str | None = None  # gelu | swiglu
    tie_embeddings: bool | None = None  # the output projection reuses the token embedding
    num_kv_heads: int | None = None  # grouped-query attention; unset in the preset too: num_heads
    bias: bool | None = None  # biases in the attention and MLP projections (GPT-2); unset: False
    norm_eps: float | None = None  # unset: 1e-5 (GPT-2, Megatron, LLaMA 3)
    rope_base: float | None = None  # rotary frequency base (LLaMA 3: 500000); unset: 10000
    compute_dtype: str = "float32"  # float32 | bfloat16; master weights stay float32
    # none keeps every residual; full keeps the block's input and recomputes its forward; dots keeps
    # the weight matmuls' outputs and recomputes the rest. Old booleans: True is full, False none.
    remat: str = "none"  # what each block's backward recomputes: none | full | dots
    attention: str = "auto"  # auto (cuDNN flash attention on CUDA GPUs in bf16) | xla | cudnn
    init_from: str | None = None  # a Hugging Face folder (GPT-2 or LLaMA) a fresh run starts from

    def __post_init__(self):
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def validate(self) -> None:
        """Checks a resolved config (all fields set)."""
        for name in ("num_layers", "hidden", "num_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            check_positive(f"ModelConfig.{name}", getattr(self, name))
        if self.hidden % self.num_heads:
            raise ConfigError(
                f"ModelConfig.hidden = {self.hidden} must be divisible by ModelConfig.num_heads = {self.num_heads}"
            )
        if self.positions == "rotary" and self.head_dim % 2:
            raise ConfigError(f"ModelConfig.hidden = {self.hidden} / ModelConfig.num_heads = {self.num_heads} = "
                              f"{self.head_dim} must be even: ModelConfig.positions = 'rotary' turns pairs of a "
                              "head's dimensions")
        check_positive("ModelConfig.num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelConfig.num_kv_heads = {self.num_kv_heads} must divide "
                              f"ModelConfig.num_heads = {self.num_heads}")
        for name in ("norm_eps", "rope_base"):
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} = {value!r} must be a finite positive number")
        check_choice("ModelConfig.bias", self.bias, (True, False))
        check_choice("ModelConfig.positions", self.positions, ("learned", "rotary"))
        check_choice("ModelConfig.norm", self.norm, ("layernorm", "rmsnorm"))
        check_choice("ModelConfig.mlp", self.mlp, ("gelu", "swiglu"))
        check_choice("ModelConfig.tie_embeddings", self.tie_embeddings, (True, False))
        check_choice("ModelConfig.compute_dtype", self.compute_dtype, ("float32", "bfloat16"))
        check_choice("ModelConfig.remat", self.remat, REMAT)
        check_choice("ModelConfig.attention", self.attention, ("auto", "xla", "cudnn"))
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ConfigError(f"ModelConfig.init_from = {self.init_from!r} is not allowed; "
                              f"allowed: None or the path of a Hugging Face model folder")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the devices are laid out: mesh (stage, data, tensor) sizes and the pipeline."""

    dp: int | None = None  # None: all devices left after pp * tp
    tp: int = 1  # tensor parallelism: devices of one node that split each layer
    pp: int = 1  # pipeline stages
    stage_layers: tuple[int, ...] | None = None  # explicit layers per stage; wins over `partition`
    partition: str = "auto"  # auto | uniform | params | holmes-ratio
    microbatches: int = 1  # pipeline microbatches (gradient accumulation when pp = 1)
    schedule: str = "gpipe"  # gpipe | 1f1b
    zero1: bool = True  # shard optimizer state over `data`
    grad_reduce_dtype: str = "float32"  # float32 | bfloat16: what gradients cross `data` in (bfloat16: half the bytes)
    update_gather_dtype: str = "float32"  # float32 | bfloat16: what ZeRO-1's all-gather of the updates moves
    placement: str = "holmes"  # holmes | naive
    topology: str | None = None  # TOML file; None: an emulated topology of the local devices
    profile: str | None = None  # measured profile JSON (python -m holmes_jax.profile); None: analytic costs
    cpu_devices: int = 8  # devices the CPU backend exposes in one process

    def validate(self) -> None:
        check_positive("ParallelConfig.dp", self.dp, allow_none=True)
        check_positive("ParallelConfig.tp", self.tp)
        check_positive("ParallelConfig.pp", self.pp)
        check_positive("ParallelConfig.microbatches", self.microbatches)
        check_positive("ParallelConfig.cpu_devices", self.cpu_devices)
        check_choice("ParallelConfig.partition", self.partition, ("auto", "uniform", "params", "holmes-ratio"))
        check_choice("ParallelConfig.schedule", self.schedule, ("gpipe", "1f1b"))
        check_choice("ParallelConfig.placement", self.placement, ("holmes", "naive"))
        check_choice("ParallelConfig.zero1", self.zero1, (True, False))
        check_choice("ParallelConfig.grad_reduce_dtype", self.grad_reduce_dtype, WIRE_BYTES)
        check_choice("ParallelConfig.update_gather_dtype", self.update_gather_dtype, WIRE_BYTES)
        if self.profile is not None and (not isinstance(self.profile, str) or not self.profile):
            raise ConfigError(f"ParallelConfig.profile = {self.profile!r} is not allowed; "
                              f"allowed: None or the path of a profile JSON file")
        # '' would silently mean None (the local topology) and a number fails deep in pathlib
        if self.topology is not None and (not isinstance(self.topology, str) or not self.topology):
            raise ConfigError(f"ParallelConfig.topology = {self.topology!r} is not allowed; "
                              f"allowed: None or the path of a topology TOML file")
        if self.stage_layers is not None:
            layers = self.stage_layers  # a bare number (`stage_layers=4` with pp = 1) is not a list of counts
            if (not isinstance(layers, (tuple, list)) or len(layers) != self.pp
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers)):
                raise ConfigError(
                    f"ParallelConfig.stage_layers = {self.stage_layers!r} must list {self.pp} positive layer "
                    f"counts, one per pipeline stage (ParallelConfig.pp = {self.pp})"
                )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. `source`: 'stdlib' (Python's own sources, bytes), a text file or
    folder, a prepared folder (`python -m holmes_jax.data prepare`), or a flat token file (`*.bin`,
    `token_dtype` integers, see holmes_jax.data)."""

    source: str = "stdlib"  # stdlib | a text file or folder (bytes) | a prepared folder | a NAME.bin token file
    token_dtype: str = "uint16"  # for token files: uint16 | uint32
    vocab_size: int | None = None  # for .bin files (the model then follows it); text is bytes (256)
    seq_len: int = 128  # tokens per sequence
    global_batch: int = 16  # sequences per step, over all data replicas
    val_fraction: float = 0.01  # the tail of the tokens held out for validation
    cache_dir: str | None = None  # None: ~/.cache/holmes_jax

    def validate(self) -> None:
        # '' is the current folder, which would silently train on (or cache into) whatever is there
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"DataConfig.source = {self.source!r} is not allowed; allowed: 'stdlib', "
                              f"a text file or folder, a prepared folder or a NAME.bin token file")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise ConfigError(f"DataConfig.cache_dir = {self.cache_dir!r} is not allowed; allowed: None or a folder path")
        check_positive("DataConfig.seq_len", self.seq_len)
        check_positive("DataConfig.global_batch", self.global_batch)
        check_positive("DataConfig.vocab_size", self.vocab_size, allow_none=True)
        check_choice("DataConfig.token_dtype", self.token_dtype, ("uint16", "uint32"))
        if not is_number(self.val_fraction) or not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"DataConfig.val_fraction = {self.val_fraction!r} must be a number in (0, 0.5)")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimisation (AdamW, a linear warm-up then `lr_schedule`), its length, logging and validation.
    Step n of the warm-up uses learning_rate * n / warmup_steps; the decay ends at step `steps`."""

    steps: int = 300  # the length of the run; the learning-rate schedule spans it
    stop_after: int | None = None  # end early after this step (a time-limited job); a rerun resumes
    seed: int = 0  # parameters' initialisation and the batch order
    workdir: str = "runs/default"  # metrics.jsonl, tensorboard/, config.gin, plan.json, checkpoints/, data copies
    learning_rate: float = 3e-3  # the peak, reached at step warmup_steps
    warmup_steps: int = 20  # linear warm-up: step 1 at learning_rate / warmup_steps, this step at the peak
    # wsd (warm-up, stable, decay) suits a run whose length is not known up front: rerun with more
    # `steps` before its decay starts and it resumes, still at the peak, on the longer schedule.
    lr_schedule: str = "cosine"  # cosine: decay to the floor at `steps` | wsd: the peak, then a linear decay over decay_fraction | constant: the peak
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps that decays to the floor
    min_lr_ratio: float = 0.1  # the decay ends at the floor learning_rate * min_lr_ratio (not for constant)
    weight_decay: float = 0.1  # AdamW's decoupled weight decay (kernels and embeddings, not norms or biases)
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    grad_clip: float = 1.0  # the global gradient norm is clipped to this
    log_every: int = 10  # steps between metrics rows (and the first, the last and each validation step)
    eval_every: int = 100  # steps between validation losses (and the last step)
    eval_batches: int = 4  # validation batches averaged per validation loss
    max_bad_steps: int = 5  # steps in a row with a non-finite loss or gradient norm (skipped) before the run fails

    def validate(self) -> None:
        for name in ("steps", "log_every", "eval_every", "eval_batches", "max_bad_steps"):
            check_positive(f"TrainConfig.{name}", getattr(self, name))
        check_positive("TrainConfig.stop_after", self.stop_after, allow_none=True)
        # the step counter and the schedule's arithmetic are 32-bit: steps = 10**10 overflowed as the
        # step compiled, a traceback after config.gin and plan.json were written
        for name in ("steps", "stop_after", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, int) and value >= 2**31:
                raise ConfigError(f"TrainConfig.{name} = {value} is not allowed; allowed: below 2**31 = 2147483648 "
                                  "(steps are counted in 32-bit integers)")
        # JAX's PRNG key takes a C long: 2**63 and up fail at initialisation with an OverflowError
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"TrainConfig.seed = {self.seed!r} must be an integer in [0, 2**63)")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"TrainConfig.warmup_steps = {self.warmup_steps!r} must be a non-negative integer")
        if not isinstance(self.workdir, str) or not self.workdir:
            raise ConfigError(f"TrainConfig.workdir = {self.workdir!r} must be a non-empty path")
        for name in ("learning_rate", "grad_clip"):  # used in float32: 1e-46 was 0, 1e39 inf there
            value = getattr(self, name)
            if not is_number(value) or not FLOAT32_TINY <= value <= FLOAT32_MAX:
                raise ConfigError(f"TrainConfig.{name} = {value!r} must be a finite positive number in float32's "
                                  f"range, {FLOAT32_TINY:.4g} to {FLOAT32_MAX:.4g}")
        check_choice("TrainConfig.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if not is_number(self.decay_fraction) or not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"TrainConfig.decay_fraction = {self.decay_fraction!r} must be a number in (0, 1]")
        for name in ("min_lr_ratio", "weight_decay"):
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value <= 1:
                raise ConfigError(f"TrainConfig.{name} = {value!r} must be a number in [0, 1]")
        for name in ("beta1", "beta2"):  # Adam divides by 1 - beta ** step: 1 makes every update NaN
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value < 1:
                raise ConfigError(f"TrainConfig.{name} = {value!r} must be a number in [0, 1)")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Saving the run to WORKDIR/checkpoints and resuming from the newest."""

    enabled: bool = True  # save checkpoints, and resume from the newest
    every: int = 100  # steps between saves; the last step is always saved
    keep: int = 3  # newest checkpoints kept

    def validate(self) -> None:
        check_choice("CheckpointConfig.enabled", self.enabled, (True, False))
        check_positive("CheckpointConfig.every", self.every)
        check_positive("CheckpointConfig.keep", self.keep)
