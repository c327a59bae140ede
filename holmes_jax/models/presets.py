"""Named model sizes (plain data: no JAX, so planning can resolve them).

The large presets follow Megatron's GPT shapes used by the Holmes paper (vocabulary padded to
51200, sequence 2048, learned positions, LayerNorm, GELU, tied embeddings); their parameter
counts land within 2% of their names (350m has 357 million, 1.3b 1.32 billion). `gpt2-small` is
GPT-2's smallest model exactly (biases, vocabulary 50257), `llama3-8b` Llama 3 8B's shapes and
`llama-1b` Llama 3.2 1B's; their runs export to Hugging Face (`holmes_jax.export`). Both use the
plain rotary frequencies: Llama 3.2's long-context scaling is not implemented, so the published
Llama 3.2 1B checkpoint, which asks for it, is refused on import (Llama 3 8B's asks for none).
"""

from __future__ import annotations

import dataclasses

from holmes_jax.config import ConfigError, ModelConfig

_LLAMA3 = dict(vocab_size=128256, max_seq_len=8192, positions="rotary", norm="rmsnorm", mlp="swiglu",
               rope_base=500000.0)
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
    "gpt2-small": dict(
        num_layers=12, hidden=768, num_heads=12, ffn_hidden=3072, vocab_size=50257, max_seq_len=1024,
        positions="learned", norm="layernorm", mlp="gelu", tie_embeddings=True, bias=True,
    ),
    # LLaMA-style: RMSNorm, SwiGLU, rotary positions, no biases, grouped-query attention.
    "llama-tiny": dict(
        num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, ffn_hidden=384, vocab_size=256, max_seq_len=256,
        positions="rotary", norm="rmsnorm", mlp="swiglu", tie_embeddings=False,
    ),
    "llama-1b": dict(_LLAMA3, num_layers=16, hidden=2048, num_heads=32, num_kv_heads=8, ffn_hidden=8192,
                     tie_embeddings=True),
    "llama3-8b": dict(_LLAMA3, num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                      tie_embeddings=False),
}

# What a field is when neither the config nor its preset sets it.
_DEFAULTS = dict(bias=False, norm_eps=1e-5, rope_base=10000.0)


def preset_values(name: str) -> dict:
    """The fields preset `name` gives a config that sets none of them (see `resolve`)."""
    values = {**_DEFAULTS, **PRESETS[name]}
    values.setdefault("num_kv_heads", values["num_heads"])
    return values


def resolve(cfg: ModelConfig) -> ModelConfig:
    """Fills the `None` fields of `cfg` from its preset and validates the result."""
    if not isinstance(cfg.preset, str) or cfg.preset not in PRESETS:  # a list would not even hash
        raise ConfigError(f"ModelConfig.preset = {cfg.preset!r} is not known; choose one of {', '.join(PRESETS)}")
    filled = {k: v for k, v in {**_DEFAULTS, **PRESETS[cfg.preset]}.items() if getattr(cfg, k) is None}
    resolved = dataclasses.replace(cfg, **filled)
    if resolved.num_kv_heads is None:  # after the preset, so a `num_heads` override carries over
        resolved = dataclasses.replace(resolved, num_kv_heads=resolved.num_heads)
    resolved.validate()
    return resolved
