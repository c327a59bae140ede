import jax
import jax.numpy as jnp
import numpy as np
import pytest

from holmes_jax.planning import workload
from holmes_jax.config import ConfigError, ModelConfig
from holmes_jax.models import gpt, presets


def _abstract_params(cfg):
    return jax.eval_shape(lambda: gpt.GPT(cfg).init(0))


@pytest.mark.parametrize("name, billions", [("3.6b", 3.6), ("7.5b", 7.5), ("39.1b", 39.1)])
def test_preset_parameter_counts_match_their_names(name, billions):
    cfg = presets.resolve(ModelConfig(preset=name))
    count = gpt.count_params(_abstract_params(cfg))
    assert abs(count / 1e9 - billions) / billions < 0.03, count


@pytest.mark.parametrize("options", [
    {},
    dict(positions="rotary", norm="rmsnorm", mlp="swiglu", tie_embeddings=False),
])
def test_analytic_costs_count_the_real_parameters(options):
    cfg = presets.resolve(ModelConfig(preset="tiny", **options))
    params = _abstract_params(cfg)
    costs = workload.model_costs(cfg, micro_batch=2, seq_len=64)
    assert costs.params == gpt.count_params(params)
    assert len(costs.layers) == cfg.num_layers
    assert costs.layers[0].params * cfg.num_layers == gpt.count_params(params["blocks"])
    assert costs.param_leaves == len(jax.tree.leaves(params))
    # The forward of a layer: 2 FLOPs per matmul weight per token plus attention's two s×s products.
    h, f = cfg.hidden, cfg.ffn_hidden
    mlp = 3 if cfg.mlp == "swiglu" else 2
    assert costs.layers[0].fwd_flops == 2 * 128 * (4 * h * h + mlp * h * f) + 4 * 2 * 64 * 64 * h
    assert costs.layers[0].bwd_flops == 2 * costs.layers[0].fwd_flops


def test_blocks_are_one_stack_with_a_leading_layer_axis():
    cfg = presets.resolve(ModelConfig(preset="tiny"))
    params = _abstract_params(cfg)
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.shape[0] == cfg.num_layers


@pytest.mark.parametrize("options", [{}, dict(positions="rotary", norm="rmsnorm", mlp="swiglu", tie_embeddings=False)])
def test_the_model_is_causal(options):
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=2, **options))
    model = gpt.GPT(cfg)
    params = model.init(0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 16)), jnp.int32)
    hidden = jax.jit(lambda p, t: model.blocks(p["blocks"], model.embed(p, t)))
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 256)
    a, b = hidden(params, tokens), hidden(params, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_bf16_compute_and_remat_stay_close_to_fp32():
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 33)), jnp.int32)
    ref_cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=2))
    params = gpt.GPT(ref_cfg).init(0)
    ref_loss, ref_grads = jax.value_and_grad(gpt.GPT(ref_cfg).loss)(params, batch)
    remat_loss, remat_grads = jax.value_and_grad(gpt.GPT(presets.resolve(ModelConfig(preset="tiny", num_layers=2, remat=True))).loss)(params, batch)
    np.testing.assert_allclose(remat_loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), remat_grads, ref_grads)
    bf16_loss = gpt.GPT(presets.resolve(ModelConfig(preset="tiny", num_layers=2, compute_dtype="bfloat16"))).loss(params, batch)
    assert abs(float(bf16_loss) - float(ref_loss)) < 0.05
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # master weights stay fp32


def test_tensor_parallel_specs():
    params = _abstract_params(presets.resolve(ModelConfig(preset="tiny")))
    specs = gpt.param_specs(params)
    assert specs["blocks"]["q"]["kernel"] == jax.sharding.PartitionSpec(None, None, "tensor")
    assert specs["blocks"]["o"]["kernel"] == jax.sharding.PartitionSpec(None, "tensor", None)
    assert specs["blocks"]["down"]["kernel"] == jax.sharding.PartitionSpec(None, "tensor", None)
    assert specs["blocks"]["attn_norm"]["scale"] == jax.sharding.PartitionSpec(None, None)
    staged = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2,) + x.shape, x.dtype), params)  # (stage, layer, ...)
    staged_specs = gpt.param_specs(staged, stage_axis="stage")
    assert staged_specs["blocks"]["q"]["kernel"] == jax.sharding.PartitionSpec("stage", None, None, "tensor")
    assert staged_specs["blocks"]["down"]["kernel"] == jax.sharding.PartitionSpec("stage", None, "tensor", None)
    assert specs["embed"]["tokens"]["embedding"] == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("field, value", [("preset", "13b"), ("norm", "batchnorm"), ("num_heads", 3)])
def test_bad_model_configs_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        presets.resolve(ModelConfig(preset="tiny", **{field: value}) if field != "preset" else ModelConfig(preset=value))
