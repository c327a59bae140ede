"""What a model costs, from its config alone: parameters and FLOPs per part, activation bytes,
and Megatron's per-iteration FLOPs formula (what the Holmes paper's TFLOPS use)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from holmes_jax.config import ModelConfig


class Part(NamedTuple):
    """One piece of the model: parameters and FLOPs of one microbatch's forward and backward
    (the whole part, before tensor parallelism)."""

    params: float
    fwd_flops: float
    bwd_flops: float


def micro_batch(global_batch: int, dp: int, microbatches: int) -> int:
    """Sequences in one microbatch on one data replica."""
    return global_batch // (dp * microbatches)


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    embed: Part
    layers: tuple[Part, ...]
    head: Part  # final norm, output projection and loss
    activation_bytes: int  # one microbatch's hidden states at a stage boundary
    param_leaves: int = 1  # parameter arrays (a stage's layers are stacked: one array per block leaf)

    @property
    def params(self) -> int:
        return self.embed.params + sum(p.params for p in self.layers) + self.head.params


def _matmul_params(cfg: ModelConfig) -> int:
    """One block's weight matrices: q and o (h x h), k and v (h x kv: grouped-query attention
    shares kv heads), the MLP's two (three with SwiGLU) h x f."""
    h, f = cfg.hidden, cfg.ffn_hidden
    kv = cfg.num_kv_heads * cfg.head_dim
    return 2 * h * h + 2 * h * kv + (3 if cfg.mlp == "swiglu" else 2) * h * f


def layer_params(cfg: ModelConfig) -> int:
    h, f = cfg.hidden, cfg.ffn_hidden
    norms = 2 * (2 * h if cfg.norm == "layernorm" else h)
    # Linear biases: q and o h each, k and v kv each, the MLP's up (and gate) f, its down h.
    biases = (3 * h + 2 * cfg.num_kv_heads * cfg.head_dim + (2 if cfg.mlp == "swiglu" else 1) * f) if cfg.bias else 0
    return _matmul_params(cfg) + norms + biases


def model_costs(cfg: ModelConfig, micro_batch: int, seq_len: int) -> ModelCosts:
    """Analytic costs of a resolved config for one microbatch of `micro_batch` sequences.

    FLOPs count multiply-adds as 2 and the backward pass as twice the forward, plus what the remat
    policy recomputes: the whole forward for 'full' (Megatron's 96 vs 72 coefficient), attention's
    s x s products for 'dots'.
    """
    h, v = cfg.hidden, cfg.vocab_size
    tokens = micro_batch * seq_len
    # Every query head attends (grouped-query attention shares k and v, not the s x s products).
    attention = 4.0 * micro_batch * seq_len * seq_len * h
    layer_fwd = 2.0 * tokens * _matmul_params(cfg) + attention
    layer_bwd = 2.0 * layer_fwd + {"none": 0.0, "dots": attention, "full": layer_fwd}[cfg.remat]
    layer = Part(layer_params(cfg), layer_fwd, layer_bwd)

    embed_params = v * h + (cfg.max_seq_len * h if cfg.positions == "learned" else 0)
    embed = Part(embed_params, 0.0, 0.0)  # a gather: no matmul FLOPs
    head_fwd = 2.0 * tokens * h * v
    final_norm = 2 * h if cfg.norm == "layernorm" else h
    head = Part(final_norm + (0 if cfg.tie_embeddings else v * h), head_fwd, 2.0 * head_fwd)
    act_bytes = tokens * h * (2 if cfg.compute_dtype == "bfloat16" else 4)
    norm_leaves = 2 if cfg.norm == "layernorm" else 1  # scale (and bias)
    linears = 4 + (3 if cfg.mlp == "swiglu" else 2)  # q k v o, the MLP's kernels
    block_leaves = 2 * norm_leaves + linears * (2 if cfg.bias else 1)  # norms, kernels (and biases)
    embed_leaves = 1 + (cfg.positions == "learned")
    head_leaves = norm_leaves + (0 if cfg.tie_embeddings else 1)
    return ModelCosts(embed, (layer,) * cfg.num_layers, head, act_bytes, block_leaves + embed_leaves + head_leaves)


@dataclasses.dataclass(frozen=True)
class Zero1Whole:
    """What ZeRO-1 over `dp` replicas cannot split and keeps whole on every replica: all-reduced,
    updated by each replica and held with its Adam moments in full."""

    layer_share: float  # of one layer's parameters
    shared_share: float  # of the embedding's and head's together
    leaves: int  # such parameter arrays (a stage's layers are stacked: one array per block leaf)


def vocab_split_params(cfg: ModelConfig, tp: int) -> int:
    """The token embedding's and output projection's parameters where tensor parallelism splits
    them over the vocabulary (models.gpt.param_specs: tp > 1 dividing it), else 0."""
    if tp == 1 or cfg.vocab_size % tp:
        return 0
    return cfg.vocab_size * cfg.hidden * (1 if cfg.tie_embeddings else 2)


def zero1_whole(cfg: ModelConfig, dp: int, tp: int = 1) -> Zero1Whole:
    """The runtime's ZeRO-1 rule (holmes_jax.sharding) from the config alone: a parameter array is
    split over `data` along its first axis that tensor parallelism leaves alone and `dp` divides;
    one with no such axis stays whole, and with one replica (dp = 1) all do. Power-of-two models
    keep nearly everything whole with a dp of 3 or 6, for instance. Arrays: (shape, the axis tensor
    parallelism splits or None)."""
    h, f, v, kv = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size, cfg.num_kv_heads * cfg.head_dim
    vocab = vocab_split_params(cfg, tp) > 0
    mlp_in = 2 if cfg.mlp == "swiglu" else 1  # up (and gate)
    norms = [((h,), None)] * (2 if cfg.norm == "layernorm" else 1)  # scale (and bias)
    layer = 2 * norms + [((h, h), 1), ((h, kv), 1), ((h, kv), 1), ((h, h), 0)] + [((h, f), 1)] * mlp_in + [((f, h), 0)]
    if cfg.bias:  # column-parallel biases are split over `tensor` along their only axis
        layer += [((h,), 0), ((kv,), 0), ((kv,), 0), ((h,), None)] + [((f,), 0)] * mlp_in + [((h,), None)]
    shared = [((v, h), 0 if vocab else None)] + ([((cfg.max_seq_len, h), None)] if cfg.positions == "learned" else [])
    shared += norms + ([] if cfg.tie_embeddings else [((h, v), 1 if vocab else None)])

    def whole(arrays):
        kept = [shape for shape, tensor in arrays
                if dp == 1 or not any(size % dp == 0 for axis, size in enumerate(shape) if axis != tensor)]
        return sum(math.prod(shape) for shape in kept), len(kept)

    def total(arrays):
        return sum(math.prod(shape) for shape, _ in arrays)

    (layer_whole, layer_leaves), (shared_whole, shared_leaves) = whole(layer), whole(shared)
    return Zero1Whole(layer_whole / total(layer), shared_whole / total(shared), layer_leaves + shared_leaves)


def megatron_flops(batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int, recompute) -> float:
    """FLOPs of one training iteration by Megatron's formula (what the Holmes paper's TFLOPS use).

    With activation recompute: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h));
    without: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
    `recompute`: a `ModelConfig.remat` policy or a bool. Only 'full' counts as recompute: Megatron's
    formula has no term for 'dots', which recomputes attention's s x s products only (the
    formula's s/(6h) share), so its TFLOPS are those of the work without recompute.
    """
    b, s, l, h, v = batch, seq_len, num_layers, hidden, vocab
    if recompute in (True, "full"):
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
