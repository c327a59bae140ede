"""A GPT / LLaMA-style decoder in Flax NNX, split into embed | blocks | head.

The layer maths lives in NNX modules (`Embedding`, `Block`, `Head`); `GPT` turns them into pure
functions over a params dict `{"embed", "blocks", "head"}` whose `blocks` leaves carry a leading
layer axis. The pipeline cuts that axis into stages and calls `embed`, `blocks` and `head_loss`
on the stages that own them; a one-stage run calls `loss`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from holmes_jax.config import ConfigError, ModelConfig

_INIT = nnx.initializers.normal(0.02)


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    # Norms give float32 whatever the compute dtype (Flax takes their statistics in float32 anyway):
    # the scaled output is rounded once, where the next matmul reads it in the compute dtype.
    if cfg.norm == "rmsnorm":
        return nnx.RMSNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=jnp.float32, rngs=rngs)
    # The variance as the mean of (x - mean)^2, as PyTorch's LayerNorm: Flax's default E[x^2] - E[x]^2
    # cancels when the mean is large against the spread (a mean of 3000 over a spread of 1 gave
    # outputs in the thousands).
    return nnx.LayerNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=jnp.float32, use_fast_variance=False, rngs=rngs)


def _linear(cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs, init=_INIT, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=jnp.dtype(cfg.compute_dtype), kernel_init=init, rngs=rngs)


def _rotary(x: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding over (batch, seq, heads, head_dim). Half-split convention: the
    pairs rotated together are (i, i + head_dim / 2), as in Hugging Face's LLaMA (`rotate_half`)."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def _cudnn_runs(cfg: ModelConfig, dtype, device) -> bool:
    """Whether cuDNN's fused attention runs: a CUDA GPU, 16-bit inputs, head sizes up to 128 in
    multiples of 8."""
    cuda = device.platform == "gpu" and "cuda" in device.client.platform_version.lower()
    return cuda and dtype in (jnp.bfloat16, jnp.float16) and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128


def _cudnn_refused(cfg: ModelConfig, device) -> bool:
    """Whether `cfg` asks for cuDNN's attention where it cannot run on `device`."""
    return cfg.attention == "cudnn" and not _cudnn_runs(cfg, jnp.dtype(cfg.compute_dtype), device)


def check_attention(cfg: ModelConfig, device) -> None:
    """ConfigError when `attention = 'cudnn'` asks for what cuDNN cannot run on `device` (else the
    step fails as it compiles, with a traceback)."""
    if _cudnn_refused(cfg, device):
        raise ConfigError(f"ModelConfig.attention = 'cudnn' is not allowed with ModelConfig.compute_dtype = "
                          f"{cfg.compute_dtype!r}, head_dim {cfg.head_dim} on {device.platform}: cuDNN attention "
                          f"needs a CUDA GPU, bfloat16 and a head_dim that is a multiple of 8 up to 128; "
                          f"allowed: 'auto' or 'xla'")


def runnable_on(cfg: ModelConfig, device) -> ModelConfig:
    """`cfg` to run on `device`: a run that chose 'cudnn' on a GPU, loaded where cuDNN cannot run
    (a CPU), gets 'auto', the same attention computed by XLA (it failed: "cuDNN is not detected")."""
    return dataclasses.replace(cfg, attention="auto") if _cudnn_refused(cfg, device) else cfg


def attention_implementation(cfg: ModelConfig, q: jax.Array) -> str:
    """cuDNN's fused (flash) attention where it runs; XLA's otherwise (CPU, float32), which builds
    the full score matrix."""
    if cfg.attention != "auto":
        return cfg.attention
    return "cudnn" if _cudnn_runs(cfg, q.dtype, jax.devices()[0]) else "xla"


def attend(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of q (batch, seq, heads, head_dim) over k, v (batch, seq, kv_heads, head_dim).
    With fewer kv heads, query head i reads kv head i // (heads / kv_heads), as Hugging Face's
    `repeat_kv` does."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention_implementation(cfg, q))


class Embedding(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.compute_dtype)
        self.tokens = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=dtype, embedding_init=_INIT, rngs=rngs)
        if cfg.positions == "learned":
            self.positions = nnx.Param(_INIT(rngs.params(), (cfg.max_seq_len, cfg.hidden), jnp.float32))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # Looked up and summed in float32, then cast: the lookup's gradient is a scatter-add over
        # every occurrence of a token, which in bfloat16 loses much of a frequent token's gradient.
        x = jnp.take(self.tokens.embedding[...], tokens, axis=0)
        if self.cfg.positions == "learned":
            # The table has max_seq_len rows: a longer sequence failed as a JAX broadcasting error.
            if tokens.shape[1] > self.cfg.max_seq_len:
                raise ConfigError(f"{tokens.shape[1]} tokens are too many: the learned positions stop at "
                                  f"ModelConfig.max_seq_len = {self.cfg.max_seq_len}")
            x = x + self.positions[: tokens.shape[1]]
        return x.astype(self.cfg.compute_dtype)


class Block(nnx.Module):
    """Pre-norm attention + MLP. q/k/v and the MLP's first matmul are column-parallel, the output
    projections row-parallel (see `param_specs`), so each block needs one all-reduce per half."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        h, f, kv = cfg.hidden, cfg.ffn_hidden, cfg.num_kv_heads * cfg.head_dim
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))  # GPT-2's residual scaling
        self.attn_norm = _norm(cfg, rngs)
        self.q = _linear(cfg, h, h, rngs, bias=cfg.bias)
        self.k, self.v = (_linear(cfg, h, kv, rngs, bias=cfg.bias) for _ in range(2))
        self.o = _linear(cfg, h, h, rngs, out_init, bias=cfg.bias)
        self.mlp_norm = _norm(cfg, rngs)
        self.up = _linear(cfg, h, f, rngs, bias=cfg.bias)
        if cfg.mlp == "swiglu":
            self.gate = _linear(cfg, h, f, rngs, bias=cfg.bias)
        self.down = _linear(cfg, f, h, rngs, out_init, bias=cfg.bias)

    def attention(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.q(x).reshape(b, s, cfg.num_heads, cfg.head_dim)
        k, v = (proj(x).reshape(b, s, cfg.num_kv_heads, cfg.head_dim) for proj in (self.k, self.v))
        if cfg.positions == "rotary":
            q, k = _rotary(q, cfg.rope_base), _rotary(k, cfg.rope_base)
        return self.o(attend(cfg, q, k, v).reshape(b, s, cfg.num_heads * cfg.head_dim))

    def mlp(self, x: jax.Array) -> jax.Array:
        if self.cfg.mlp == "swiglu":
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
        return self.down(jax.nn.gelu(self.up(x)))

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x = x + self.attention(self.attn_norm(x).astype(dtype))
        return x + self.mlp(self.mlp_norm(x).astype(dtype))


@jax.custom_vjp
def _float32_logits(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel, both in the compute dtype, with the products summed into float32 logits: a
    bfloat16 result rounded each logit before the float32 loss (by up to 1/32 near 8)."""
    return jnp.dot(x, kernel, preferred_element_type=jnp.float32)


def _float32_logits_fwd(x, kernel):
    return _float32_logits(x, kernel), (x, kernel)


def _float32_logits_bwd(saved, g):
    # The gradient goes back in the compute dtype, as it did from a bfloat16 matmul: a float32 one
    # would make the backward's two vocabulary-sized matmuls mixed float32 x bfloat16.
    x, kernel = saved
    return jax.vjp(jnp.dot, x, kernel)[1](g.astype(x.dtype))


_float32_logits.defvjp(_float32_logits_fwd, _float32_logits_bwd)


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = _norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.out = _linear(cfg, cfg.hidden, cfg.vocab_size, rngs)

    def __call__(self, x: jax.Array, embedding: Embedding) -> jax.Array:
        dtype = jnp.dtype(self.cfg.compute_dtype)
        x = self.norm(x).astype(dtype)
        kernel = embedding.tokens.embedding[...].T if self.cfg.tie_embeddings else self.out.kernel[...]
        return _float32_logits(x, kernel.astype(dtype))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss in float32."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


# ModelConfig.remat -> the jax.checkpoint policy of each block (None: no checkpoint, the backward
# keeps every residual). 'dots' keeps the outputs of the weight matmuls and recomputes the rest
# (attention's s x s products, norms, activations) in the backward.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class GPT:
    """Pure functions of a resolved `ModelConfig` over params `{"embed", "blocks", "head"}`."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        parts = nnx.eval_shape(lambda: self._modules(nnx.Rngs(0)))
        self._defs = {name: nnx.split(module)[0] for name, module in parts.items()}

    # Equal where the configs are: its functions depend on nothing else, so a jit taking the model
    # as a static argument compiles once per config, not once per object.
    def __eq__(self, other) -> bool:
        return isinstance(other, GPT) and other.cfg == self.cfg

    def __hash__(self) -> int:
        return hash(self.cfg)

    def _modules(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        cfg = self.cfg

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        return {"embed": Embedding(cfg, rngs), "blocks": stacked_blocks(rngs), "head": Head(cfg, rngs)}

    def init(self, seed: int) -> dict:
        """Float32 master parameters; the blocks stacked on a leading layer axis."""
        return {name: nnx.to_pure_dict(nnx.state(m)) for name, m in self._modules(nnx.Rngs(seed)).items()}

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array:
        return nnx.merge(self._defs["embed"], params["embed"])(tokens)

    def layer(self, layer_params: dict, h: jax.Array) -> jax.Array:
        """One block under the config's remat policy: what its backward keeps and what it recomputes."""

        def run(layer_params, h):
            return nnx.merge(self._defs["blocks"], layer_params)(h)

        policy = REMAT_POLICIES[self.cfg.remat]
        return run(layer_params, h) if policy is None else jax.checkpoint(run, policy=policy)(layer_params, h)

    def blocks(self, block_params: dict, x: jax.Array) -> jax.Array:
        """Runs the layers of `block_params` (leading layer axis) over `x` in order."""
        return jax.lax.scan(lambda h, lp: (self.layer(lp, h), None), x, block_params)[0]

    def head_logits(self, params: dict, x: jax.Array) -> jax.Array:
        embedding = nnx.merge(self._defs["embed"], params["embed"])
        return nnx.merge(self._defs["head"], params["head"])(x, embedding)

    def head_loss(self, params: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
        return cross_entropy(self.head_logits(params, x), targets)

    def logits(self, params: dict, tokens: jax.Array) -> jax.Array:
        """Float32 next-token logits (batch, seq, vocab) of `tokens` (batch, seq): no pipeline."""
        return self.head_logits(params, self.blocks(params["blocks"], self.embed(params, tokens)))

    def loss(self, params: dict, batch: jax.Array) -> jax.Array:
        """Mean loss of `batch` (batch, seq + 1): inputs are all but the last token, targets shifted."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        return self.head_loss(params, self.blocks(params["blocks"], self.embed(params, inputs)), targets)


# Megatron-style tensor parallelism: column-parallel kernels (and their biases) split their
# output axis over `tensor`, row-parallel ones their input axis (their biases, added after the
# all-reduce, are replicated). Block leaves carry the leading layer axis.
_COLUMN = {"q", "k", "v", "up", "gate"}
_ROW = {"o", "down"}


def param_specs(params: dict, stage_axis: str | None = None, tensor: int = 1) -> dict:
    """PartitionSpecs for `params`: tensor parallelism inside blocks; with `tensor` > 1 ranks, the
    token embedding and the output projection split over the vocabulary (where `tensor` divides
    it), so each rank computes its share of the logits; everything else replicated. Block leaves
    lead with the layer axis, or with (stage, layer) when `stage_axis` names the mesh axis the
    pipeline splits stages over."""

    def spec(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        vocab_axis = {("embed", "tokens"): 0, ("head", "out"): leaf.ndim - 1}.get(tuple(names[:2]))
        if vocab_axis is not None and tensor > 1 and leaf.shape[vocab_axis] % tensor == 0:
            return P(*["tensor" if i == vocab_axis else None for i in range(leaf.ndim)])
        if names[0] != "blocks":
            return P()
        dims = [None] * leaf.ndim
        dims[0] = stage_axis
        if names[-1] in ("kernel", "bias") and names[1] in _COLUMN:
            dims[-1] = "tensor"
        if names[-1] == "kernel" and names[1] in _ROW:
            dims[-2] = "tensor"
        return P(*dims)

    return jax.tree_util.tree_map_with_path(spec, params)


def count_params(params: dict) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
