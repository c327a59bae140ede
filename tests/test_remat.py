"""Remat policies: the config, the analytic costs, the TFLOPS formula and the planner's stash sizes."""

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.planning import search as plan, workload
from holmes_jax.config import ConfigError, ModelConfig
from holmes_jax.planning.workload import megatron_flops
from holmes_jax.models import gpt, presets
from holmes_jax.pipeline.runtime import _Layers, _depends_on_input


def test_the_old_booleans_name_policies_and_others_are_refused():
    assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"
    gin.parse_config("ModelConfig.remat = True")
    assert ModelConfig().remat == "full"
    with pytest.raises(ConfigError, match=r"ModelConfig.remat = 'some'.*'none', 'full', 'dots'"):
        presets.resolve(ModelConfig(remat="some"))


def test_the_backward_counts_what_each_policy_recomputes():
    costs = {r: workload.model_costs(presets.resolve(ModelConfig(preset="125m", remat=r)), 2, 1024).layers[0]
             for r in ("none", "dots", "full")}
    fwd = costs["none"].fwd_flops
    attention = 4.0 * 2 * 1024 * 1024 * 768  # the two s x s products
    assert costs["none"].bwd_flops == 2 * fwd
    assert costs["dots"].bwd_flops == 2 * fwd + attention
    assert costs["full"].bwd_flops == 3 * fwd


def test_megatron_formula_counts_only_full_recompute():
    args = (8, 2048, 24, 2048, 51200)
    without, recompute = megatron_flops(*args, False), megatron_flops(*args, True)
    assert recompute > without
    assert megatron_flops(*args, "full") == recompute
    assert megatron_flops(*args, "dots") == megatron_flops(*args, "none") == without


@pytest.mark.parametrize("dtype, mlp, kv_heads", [("float32", "gelu", None), ("float32", "swiglu", None),
                                                 ("bfloat16", "gelu", None), ("bfloat16", "swiglu", 1)])
def test_planned_stash_is_what_the_runtime_keeps(dtype, mlp, kv_heads):
    """The planner's bytes per layer and microbatch are the residuals the pipeline's forward keeps
    (also with fewer kv heads: narrower k and v); 'none' keeps the most. With tp, the
    column-parallel part is split, the norms' and the residual stream's are whole. ('none' was
    Korthikanti et al.'s 16-bit estimate, 0.5-0.6 of what the runtime keeps.)"""
    micro_batch, seq = 2, 64
    stash = {}
    for remat in ("none", "dots", "full"):
        # XLA's attention, as on this CPU ('auto' plans bfloat16 as a CUDA GPU runs it: cuDNN's, no scores kept)
        cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=2, mlp=mlp, compute_dtype=dtype, remat=remat,
                                          num_kv_heads=kv_heads, attention="xla"))
        model = gpt.GPT(cfg)
        blocks = jax.eval_shape(lambda: model.init(0))["blocks"]
        act = jnp.zeros((micro_batch, seq, cfg.hidden), jnp.dtype(dtype))
        kept = _Layers(model, blocks, act, None).kept
        runtime = sum(k.size * k.dtype.itemsize for k in kept) / cfg.num_layers
        planned = plan._stash_bytes(cfg, workload.model_costs(cfg, micro_batch, seq), 1, micro_batch, seq)
        stash[remat] = runtime
        assert planned == runtime, (remat, planned, runtime)
        on_two = plan._stash_bytes(cfg, workload.model_costs(cfg, micro_batch, seq), 2, micro_batch, seq)
        assert on_two == runtime if remat == "full" else runtime / 2 < on_two < runtime, remat  # 'full': its input
    assert stash["full"] < stash["dots"] < stash["none"]


def test_what_depends_on_the_input_is_followed_through_calls_and_never_missed_in_loops():
    # A residual wrongly found not to depend on the layer input would be rebuilt from a zero
    # input in the backward: wrong gradients, silently. Two swaps in a scan give (p, h) back in
    # order; one pass through its body says they come back swapped.
    def swapped_twice(p, h):
        return list(jax.lax.scan(lambda c, _: ((c[1], c[0]), None), (p, h), None, length=2)[0])

    def called(p, h):
        return list(jax.jit(lambda p, h: (p * 2, h + p))(p, h))

    depends = lambda fn: _depends_on_input(jax.make_jaxpr(fn)(1.0, 2.0).jaxpr, [False, True])  # noqa: E731
    assert depends(swapped_twice)[1]  # the output that is h (marking p too is merely conservative)
    assert depends(called) == [False, True]  # calls are followed output by output


def test_every_remat_policy_gives_the_gradients_of_none():
    # A policy only changes what the backward keeps and what it recomputes, never the result.
    # GPT blocks in float32 are test_pipeline's (every policy, with stages); here LLaMA's (rotary,
    # SwiGLU, one kv head), in bfloat16.
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 33)), jnp.int32)
    results = {}
    for remat in ("none", "full", "dots"):
        model = gpt.GPT(presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, remat=remat, num_kv_heads=1,
                                                    compute_dtype="bfloat16")))
        results[remat] = jax.jit(jax.value_and_grad(model.loss))(model.init(0), batch)
    loss, grads = results["none"]
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
    for remat in ("full", "dots"):
        assert float(results[remat][0]) == pytest.approx(float(loss), rel=1e-6), remat
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(results[remat][1]), jax.tree.leaves(grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale,
                                       err_msg=f"{remat} {jax.tree_util.keystr(path)}")
