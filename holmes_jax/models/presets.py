"""Named model sizes and the per-layer cost table the planner and the metrics use.

The large presets follow Megatron's GPT shapes used by the Holmes paper (vocabulary padded to
51200, sequence 2048, learned positions, LayerNorm, GELU, tied embeddings); their parameter
counts land within 1% of their names.
"""

from __future__ import annotations

import dataclasses

from holmes_jax.config import ConfigError, ModelConfig

_GPT = dict(vocab_size=51200, max_seq_len=2048, positions="learned", norm="layernorm", mlp="gelu", tie_embeddings=True)

PRESETS: dict[str, dict] = {
    # CPU-sized: byte vocabulary, trains in minutes on 2 cores.
    "tiny": dict(
        num_layers=4, hidden=128, num_heads=4, ffn_hidden=512, vocab_size=256, max_seq_len=256,
        positions="learned", norm="layernorm", mlp="gelu", tie_embeddings=True,
    ),
    "125m": dict(_GPT, num_layers=12, hidden=768, num_heads=12, ffn_hidden=3072),
    "350m": dict(_GPT, num_layers=24, hidden=1024, num_heads=16, ffn_hidden=4096),
    "1.3b": dict(_GPT, num_layers=24, hidden=2048, num_heads=16, ffn_hidden=8192),
    "3.6b": dict(_GPT, num_layers=30, hidden=3072, num_heads=32, ffn_hidden=12288),
    "7.5b": dict(_GPT, num_layers=36, hidden=4096, num_heads=32, ffn_hidden=16384),
    "39.1b": dict(_GPT, num_layers=48, hidden=8192, num_heads=64, ffn_hidden=32768),
}


def resolve(cfg: ModelConfig) -> ModelConfig:
    """Fills the `None` fields of `cfg` from its preset and validates the result."""
    if cfg.preset not in PRESETS:
        raise ConfigError(f"ModelConfig.preset = {cfg.preset!r} is not known; choose one of {', '.join(PRESETS)}")
    filled = {k: v for k, v in PRESETS[cfg.preset].items() if getattr(cfg, k) is None}
    resolved = dataclasses.replace(cfg, **filled)
    resolved.validate()
    return resolved


@dataclasses.dataclass(frozen=True)
class PartCost:
    """One piece of the model: parameters and FLOPs of one microbatch's forward and backward."""

    params: int
    fwd_flops: float
    bwd_flops: float


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    embed: PartCost
    layers: tuple[PartCost, ...]
    head: PartCost  # final norm, output projection and loss
    activation_bytes: int  # one microbatch's hidden states at a stage boundary
    param_leaves: int = 1  # parameter arrays (a stage's layers are stacked: one array per block leaf)

    @property
    def params(self) -> int:
        return self.embed.params + sum(p.params for p in self.layers) + self.head.params


def layer_params(cfg: ModelConfig) -> int:
    h, f = cfg.hidden, cfg.ffn_hidden
    mlp = (3 if cfg.mlp == "swiglu" else 2) * h * f
    norms = 2 * (2 * h if cfg.norm == "layernorm" else h)
    return 4 * h * h + mlp + norms


def model_costs(cfg: ModelConfig, micro_batch: int, seq_len: int) -> ModelCosts:
    """Analytic costs of a resolved config for one microbatch of `micro_batch` sequences.

    FLOPs count multiply-adds as 2 and the backward pass as twice the forward, plus what the remat
    policy recomputes: the whole forward for 'full' (Megatron's 96 vs 72 coefficient), attention's
    s x s products for 'dots'.
    """
    h, f, v = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    tokens = micro_batch * seq_len
    matmul_params = 4 * h * h + (3 if cfg.mlp == "swiglu" else 2) * h * f
    attention = 4.0 * micro_batch * seq_len * seq_len * h
    layer_fwd = 2.0 * tokens * matmul_params + attention
    layer_bwd = 2.0 * layer_fwd + {"none": 0.0, "dots": attention, "full": layer_fwd}[cfg.remat]
    layer = PartCost(layer_params(cfg), layer_fwd, layer_bwd)

    embed_params = v * h + (cfg.max_seq_len * h if cfg.positions == "learned" else 0)
    embed = PartCost(embed_params, 0.0, 0.0)  # a gather: no matmul FLOPs
    head_fwd = 2.0 * tokens * h * v
    final_norm = 2 * h if cfg.norm == "layernorm" else h
    head = PartCost(final_norm + (0 if cfg.tie_embeddings else v * h), head_fwd, 2.0 * head_fwd)
    act_bytes = tokens * h * (2 if cfg.compute_dtype == "bfloat16" else 4)
    norm_leaves = 2 if cfg.norm == "layernorm" else 1  # scale (and bias)
    block_leaves = 2 * norm_leaves + 4 + (3 if cfg.mlp == "swiglu" else 2)  # norms, q k v o, the MLP's kernels
    embed_leaves = 1 + (cfg.positions == "learned")
    head_leaves = norm_leaves + (0 if cfg.tie_embeddings else 1)
    return ModelCosts(embed, (layer,) * cfg.num_layers, head, act_bytes, block_leaves + embed_leaves + head_leaves)
