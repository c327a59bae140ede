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


def _dtype_bytes(cfg: ModelConfig) -> int:
    return 2 if cfg.compute_dtype == "bfloat16" else 4


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
    act_bytes = tokens * h * _dtype_bytes(cfg)
    norm_leaves = 2 if cfg.norm == "layernorm" else 1  # scale (and bias)
    linears = 4 + (3 if cfg.mlp == "swiglu" else 2)  # q k v o, the MLP's kernels
    block_leaves = 2 * norm_leaves + linears * (2 if cfg.bias else 1)  # norms, kernels (and biases)
    embed_leaves = 1 + (cfg.positions == "learned")
    head_leaves = norm_leaves + (0 if cfg.tie_embeddings else 1)
    return ModelCosts(embed, (layer,) * cfg.num_layers, head, act_bytes, block_leaves + embed_leaves + head_leaves)


def _attention_scores(cfg: ModelConfig) -> bool:
    """Whether a layer forms attention's s x s scores: XLA's attention does, cuDNN's fused (flash)
    attention never does. 'auto' is read as a run on a CUDA GPU would resolve it
    (models.gpt.attention_implementation): cuDNN for bfloat16 compute and head sizes up to 128 in
    multiples of 8, else XLA. The planner plans GPU clusters; a bfloat16 run on CPU forms the
    scores all the same, so there its figure is low."""
    if cfg.attention != "auto":
        return cfg.attention != "cudnn"
    cudnn_runs = cfg.compute_dtype == "bfloat16" and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128
    return not cudnn_runs


def layer_residual_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1) -> float:
    """What one layer's vjp keeps of one microbatch with nothing recomputed (remat 'none'), per
    device: as JAX's autodiff saves it (the runtime stashes exactly these, pipeline.runtime._Layers).
    Whole on every tp rank: the residual stream, both norms' inputs, outputs and per-token
    statistics in float32, the normed inputs of the column-parallel matmuls in the compute dtype.
    Split over tp (column-parallel, by heads or ffn columns): q, k, v and the attention's output,
    six ffn-wide arrays (gelu's or SwiGLU's pieces), and with XLA's attention its float32 scores,
    its probabilities in the compute dtype and two float32 per-row statistics."""
    h, f, kv, heads = cfg.hidden, cfg.ffn_hidden, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads
    tokens, c = micro_batch * seq_len, _dtype_bytes(cfg)
    whole = tokens * (6 * h * 4 + 4 * 4 + 2 * h * c)
    split = tokens * (2 * h + 2 * kv + 6 * f) * c
    if _attention_scores(cfg):
        split += micro_batch * heads * seq_len * (seq_len * (4 + c) + 2 * 4)
    return whole + split / tp


def layer_work_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, stash_bytes: float, tp: int = 1) -> float:
    """What one layer's backward holds at once beyond the stash, per device: the larger of what
    the remat policy recomputes (the residuals 'none' keeps less what the policy stashed) and the
    gradients it makes on the way (of the residual stream and a norm's float32 activation, two
    ffn-wide ones, and with XLA's attention of the float32 scores): the backward frees what it
    recomputed as it makes the gradients, so it does not hold both whole (on CPU, XLA's compile
    holds within 5% of the larger in bench/checkpoint_memory.py's layouts). On every device kind:
    the same arrays exist wherever the backward runs."""
    h, f, heads = cfg.hidden, cfg.ffn_hidden, cfg.num_heads
    tokens, c = micro_batch * seq_len, _dtype_bytes(cfg)
    recomputed = max(layer_residual_bytes(cfg, micro_batch, seq_len, tp) - stash_bytes, 0.0)
    gradients = tokens * 2 * h * 4 + tokens * 2 * f * c / tp
    if _attention_scores(cfg):
        gradients += micro_batch * heads * seq_len * seq_len * 4 / tp
    return max(recomputed, gradients)


def head_work_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1) -> float:
    """What the last stage's head holds at once for one microbatch, per device: the float32
    logits (rows x seq x vocab, float32 for the loss in any compute dtype, models.gpt) and their
    float32 gradient (the softmax fused into it), split over tp where tp splits the vocabulary
    (`vocab_split_params`), else whole on every rank. With 128k ids and 4k tokens a row that is
    4 GB a row: on large vocabularies more than any layer's work."""
    logits = micro_batch * seq_len * cfg.vocab_size * 4
    return 2 * logits / (tp if vocab_split_params(cfg, tp) else 1)


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
