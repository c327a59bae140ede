import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from holmes_jax.planning import workload
from holmes_jax.config import ConfigError, ModelConfig
from holmes_jax.models import gpt, presets


def _abstract_params(cfg):
    return jax.eval_shape(lambda: gpt.GPT(cfg).init(0))


@pytest.mark.parametrize("name, billions", [("125m", 0.125), ("350m", 0.35), ("1.3b", 1.3), ("3.6b", 3.6),
                                            ("7.5b", 7.5), ("39.1b", 39.1)])
def test_preset_parameter_counts_match_their_names(name, billions):
    cfg = presets.resolve(ModelConfig(preset=name))
    count = gpt.count_params(_abstract_params(cfg))
    assert abs(count / 1e9 - billions) / billions < 0.02, count  # as the presets' docstring says


@pytest.mark.parametrize("options", [
    {},
    dict(positions="rotary", norm="rmsnorm", mlp="swiglu", tie_embeddings=False),
    dict(bias=True, num_kv_heads=2),
    dict(positions="rotary", norm="rmsnorm", mlp="swiglu", bias=True, num_kv_heads=1),
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
    kv = cfg.num_kv_heads * cfg.head_dim
    assert costs.layers[0].fwd_flops == 2 * 128 * (2 * h * h + 2 * h * kv + mlp * h * f) + 4 * 2 * 64 * 64 * h
    assert costs.layers[0].bwd_flops == 2 * costs.layers[0].fwd_flops


def test_blocks_are_one_stack_with_a_leading_layer_axis():
    cfg = presets.resolve(ModelConfig(preset="tiny"))
    params = _abstract_params(cfg)
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.shape[0] == cfg.num_layers


@pytest.mark.parametrize("options", [{}, dict(positions="rotary", norm="rmsnorm", mlp="swiglu", tie_embeddings=False),
                                     dict(num_kv_heads=1, compute_dtype="bfloat16"),
                                     dict(positions="rotary", num_kv_heads=2)])
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


def test_tensor_parallelism_splits_the_vocabulary_where_it_divides_it():
    P = jax.sharding.PartitionSpec
    for tied in (True, False):
        params = _abstract_params(presets.resolve(ModelConfig(preset="tiny", tie_embeddings=tied)))
        specs = gpt.param_specs(params, tensor=2)
        assert specs["embed"]["tokens"]["embedding"] == P("tensor", None)
        assert specs["embed"]["positions"] == P()
        assert tied or specs["head"]["out"]["kernel"] == P(None, "tensor")
        assert gpt.param_specs(params, tensor=1)["embed"]["tokens"]["embedding"] == P()
    odd = _abstract_params(presets.resolve(ModelConfig(preset="tiny", vocab_size=255, tie_embeddings=False)))
    specs = gpt.param_specs(odd, tensor=2)  # 255 tokens do not split in two: replicated
    assert specs["embed"]["tokens"]["embedding"] == P() and specs["head"]["out"]["kernel"] == P()


@pytest.mark.parametrize("field, value", [("preset", "13b"), ("preset", ["tiny"]), ("norm", "batchnorm"),
                                          ("num_heads", 3)])
def test_bad_model_configs_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        presets.resolve(ModelConfig(preset="tiny", **{field: value}) if field != "preset" else ModelConfig(preset=value))


def _einsum_attention(q, k, v):
    """The attention the model computed before the fused kernel: scores, causal mask, softmax, with
    kv head j serving query heads j * groups .. (j + 1) * groups - 1."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_fused_attention_equals_the_einsum_attention(kv_heads):
    cfg = presets.resolve(ModelConfig(preset="tiny", num_kv_heads=kv_heads))
    assert gpt.attention_implementation(cfg, jnp.zeros((1,), jnp.float32)) == "xla"  # CPU, float32
    rng = np.random.default_rng(kv_heads)
    q = jnp.asarray(rng.normal(size=(2, 24, 4, cfg.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 24, kv_heads, cfg.head_dim)), jnp.float32) for _ in range(2))
    np.testing.assert_allclose(gpt.attend(cfg, q, k, v), _einsum_attention(q, k, v), rtol=0, atol=1e-5)


def test_cudnn_attention_where_it_cannot_run_is_a_config_error_before_anything_is_written(tmp_path):
    from helpers import small_configs
    from holmes_jax import train

    cfgs = small_configs(tmp_path / "run", "--gin.ParallelConfig.dp=1", "--gin.ModelConfig.attention='cudnn'")
    with pytest.raises(ConfigError, match="ModelConfig.attention = 'cudnn' is not allowed.* on cpu"):
        train.run(cfgs, jax.devices()[:1], quiet=True)
    assert not (tmp_path / "run").exists()
    gpt.check_attention(presets.resolve(ModelConfig(preset="tiny", attention="xla")), jax.devices()[0])


def test_new_presets_have_the_reference_parameter_counts():
    # The published sizes: GPT-2 small 124,439,808 and Llama 3 8B 8,030,261,248 parameters;
    # Llama 3.2 1B 1,235,814,400 (tied embeddings).
    for name, count in (("gpt2-small", 124_439_808), ("llama3-8b", 8_030_261_248), ("llama-1b", 1_235_814_400)):
        assert gpt.count_params(_abstract_params(presets.resolve(ModelConfig(preset=name)))) == count, name
    llama = presets.resolve(ModelConfig(preset="llama3-8b"))
    assert (llama.num_kv_heads, llama.rope_base, llama.norm_eps, llama.bias) == (8, 500000.0, 1e-5, False)
    tiny = presets.resolve(ModelConfig(preset="tiny", num_heads=8))
    assert (tiny.num_kv_heads, tiny.bias, tiny.norm_eps, tiny.rope_base) == (8, False, 1e-5, 10000.0)


def test_bias_and_grouped_query_shapes():
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", bias=True))
    params = _abstract_params(cfg)["blocks"]
    h, kv, layers = cfg.hidden, cfg.num_kv_heads * cfg.head_dim, cfg.num_layers
    assert cfg.num_kv_heads == 2 and kv < h
    assert params["q"]["kernel"].shape == (layers, h, h)
    assert params["k"]["kernel"].shape == params["v"]["kernel"].shape == (layers, h, kv)
    assert params["k"]["bias"].shape == (layers, kv)
    assert params["down"]["bias"].shape == (layers, h)
    assert "bias" not in _abstract_params(presets.resolve(ModelConfig(preset="llama-tiny")))["blocks"]["q"]


def test_norm_eps_and_rope_base_change_the_model():
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (1, 16)), jnp.int32)

    def logits(**options):
        cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=1, **options))
        return gpt.GPT(cfg).logits(gpt.GPT(cfg).init(0), tokens)

    ref = logits()
    assert ref.shape == (1, 16, 256) and ref.dtype == jnp.float32
    assert not np.allclose(ref, logits(norm_eps=0.5), atol=1e-4)
    assert not np.allclose(ref, logits(rope_base=500000.0), atol=1e-4)


def test_tensor_parallel_specs_cover_biases():
    specs = gpt.param_specs(_abstract_params(presets.resolve(ModelConfig(preset="llama-tiny", bias=True))))["blocks"]
    for name in ("q", "k", "v", "gate", "up"):  # column-parallel: the output axis split
        assert specs[name]["bias"] == jax.sharding.PartitionSpec(None, "tensor")
        assert specs[name]["kernel"] == jax.sharding.PartitionSpec(None, None, "tensor")
    for name in ("o", "down"):  # row-parallel: added after the all-reduce, replicated
        assert specs[name]["bias"] == jax.sharding.PartitionSpec(None, None)


@pytest.mark.parametrize("field, value", [("num_kv_heads", 3), ("num_kv_heads", 0), ("norm_eps", -1.0),
                                          ("rope_base", 0), ("bias", "yes"), ("attention", "flash"),
                                          ("init_from", "")])
def test_bad_new_fields_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
        presets.resolve(ModelConfig(preset="tiny", **{field: value}))


@pytest.mark.slow
def test_bias_and_grouped_query_attention_train_alike_under_tensor_parallelism(tmp_path):
    from helpers import small_configs
    from holmes_jax import build, data

    # 8 query heads share 4 kv heads, which tp = 4 splits whole: one kv head and its two query
    # heads on each rank, the finest split (tensor parallelism is XLA's sharding of the same
    # program, with no code of ours for a particular tp, so tp = 2 would take the same path)
    def losses(*bindings):
        cfgs = small_configs(tmp_path, "--gin.ModelConfig.preset=llama-tiny", "--gin.ModelConfig.bias=True",
                             "--gin.ModelConfig.num_heads=8", "--gin.ModelConfig.num_kv_heads=4", *bindings)
        setup = build.build(cfgs, jax.devices()[:8])
        step, state = build.make_train_step(setup), setup.init_state()
        batch = setup.batch("train", 0, data.load(cfgs.data))
        out = []
        for _ in range(3):
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        return out

    ref = losses("--gin.ParallelConfig.dp=8")
    np.testing.assert_allclose(losses("--gin.ParallelConfig.dp=2", "--gin.ParallelConfig.tp=4"), ref, rtol=0, atol=1e-5)
    assert ref[2] < ref[0]


@pytest.mark.parametrize("options", [
    {},
    dict(positions="rotary", norm="rmsnorm", mlp="swiglu", tie_embeddings=False),
    dict(bias=True, num_kv_heads=2, vocab_size=255),
    dict(positions="rotary", norm="rmsnorm", mlp="swiglu", bias=True, num_kv_heads=1, hidden=96),
])
@pytest.mark.parametrize("dp, tp", [(1, 1), (2, 1), (3, 1), (5, 1), (2, 2), (3, 4)])
def test_the_planners_zero1_rule_keeps_whole_what_the_runtime_keeps_whole(options, dp, tp):
    from holmes_jax.sharding import gradient_specs

    cfg = presets.resolve(ModelConfig(preset="tiny", **options))
    params = _abstract_params(cfg)
    specs = gradient_specs(params, None, dp, zero1=True, tp=tp)
    whole = {part: [x for x, spec in zip(jax.tree.leaves(params[part]),
                                         jax.tree.leaves(specs[part], is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))
                    if "data" not in spec] for part in params}
    expected = workload.zero1_whole(cfg, dp, tp)
    layer = gpt.count_params(params["blocks"])
    assert expected.layer_share == pytest.approx(sum(x.size for x in whole["blocks"]) / layer)
    shared = gpt.count_params(params["embed"]) + gpt.count_params(params["head"])
    assert expected.shared_share == pytest.approx(sum(x.size for x in whole["embed"] + whole["head"]) / shared)
    assert expected.leaves == sum(len(w) for w in whole.values())


def test_bf16_embedding_gradient_of_a_frequent_token_stays_close_to_fp32():
    # The lookup's gradient adds up every occurrence of a token: in bfloat16 half a batch of one
    # token got a gradient off by a quarter. Every other gradient is within bf16's usual ~0.5%.
    tokens = np.random.default_rng(3).integers(0, 256, (16, 257))
    tokens[np.random.default_rng(4).random(tokens.shape) < 0.5] = 32
    batch = jnp.asarray(tokens, jnp.int32)

    def grads(dtype):
        cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, compute_dtype=dtype))
        model = gpt.GPT(cfg)
        return jax.jit(jax.grad(model.loss))(model.init(0), batch)["embed"]

    ref, bf16 = grads("float32"), grads("bfloat16")
    for name in ("tokens", "positions"):
        a, b = jax.tree.leaves(bf16[name])[0], jax.tree.leaves(ref[name])[0]
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.02, name


def test_a_sequence_past_the_learned_positions_is_a_config_error_and_rotary_runs_past_max_seq_len():
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (1, 24)), jnp.int32)
    learned = gpt.GPT(presets.resolve(ModelConfig(preset="tiny", num_layers=1, max_seq_len=16)))
    params = learned.init(0)
    assert learned.logits(params, tokens[:, :16]).shape == (1, 16, 256)  # the whole table is usable
    # was JAX's 'Incompatible shapes for broadcasting' ValueError from inside the embedding
    with pytest.raises(ConfigError, match="24 tokens are too many: the learned positions stop at "
                                          "ModelConfig.max_seq_len = 16"):
        learned.logits(params, tokens)
    # Rotary positions have no table: past max_seq_len they go on, and causality keeps the first 16.
    rotary = gpt.GPT(presets.resolve(ModelConfig(preset="llama-tiny", num_layers=1, max_seq_len=16)))
    params = rotary.init(0)
    np.testing.assert_allclose(rotary.logits(params, tokens)[:, :16], rotary.logits(params, tokens[:, :16]),
                               rtol=0, atol=1e-5)


def test_tied_embeddings_get_the_gradients_of_both_uses():
    # With tie_embeddings the token table is the input lookup and the output layer: its gradient
    # is the sum of the two, each of them nonzero.
    model = gpt.GPT(presets.resolve(ModelConfig(preset="tiny", num_layers=1)))
    params = model.init(0)
    batch = jnp.asarray(np.random.default_rng(6).integers(0, 256, (2, 17)), jnp.int32)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    frozen = jax.lax.stop_gradient

    def output_use(p):  # the lookup's result held fixed
        return model.head_loss(p, frozen(model.blocks(p["blocks"], model.embed(p, inputs))), targets)

    def input_use(p):  # the output layer's table held fixed
        return model.head_loss(jax.tree.map(frozen, p), model.blocks(p["blocks"], model.embed(p, inputs)), targets)

    table = lambda g: g["embed"]["tokens"]["embedding"]  # noqa: E731
    both, out, inp = jax.jit(lambda p: [table(jax.grad(f)(p)) for f in (lambda p: model.loss(p, batch), output_use,
                                                                         input_use)])(params)
    assert float(jnp.linalg.norm(out)) > 0 and float(jnp.linalg.norm(inp)) > 0
    np.testing.assert_allclose(both, out + inp, rtol=0, atol=1e-7)


def test_bf16_training_follows_fp32_for_a_few_steps():
    from holmes_jax import optimizer
    from holmes_jax.config import TrainConfig

    rng = np.random.default_rng(7)
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 20, np.uint8).astype(np.int32)
    batches = [jnp.asarray(np.stack([text[s:s + 33] for s in rng.integers(0, len(text) - 33, 4)])) for _ in range(5)]
    tx, _ = optimizer.make_optimizer(TrainConfig(steps=5, warmup_steps=1, learning_rate=3e-3))

    def losses(dtype):
        model = gpt.GPT(presets.resolve(ModelConfig(preset="llama-tiny", num_layers=1, hidden=64, ffn_hidden=128,
                                                    compute_dtype=dtype)))

        @jax.jit
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(model.loss)(params, batch)
            return *optimizer.apply_gradients(tx, 1.0, params, opt_state, grads)[:2], loss

        params = model.init(0)
        opt_state, out = tx.init(params), []
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, batch)
            out.append(float(loss))
        return np.array(out)

    ref = losses("float32")
    assert ref[-1] < ref[0] - 0.5  # it learns, so the steps after the first move the weights
    np.testing.assert_allclose(losses("bfloat16"), ref, rtol=0, atol=0.05)


def test_layernorm_normalizes_an_input_whose_mean_dwarfs_its_spread():
    # E[x^2] - E[x]^2 in float32 cancels to about 0 for a mean of 3000 and a spread of 1, and the
    # output came out in the thousands; PyTorch's LayerNorm (and GPT-2's) subtracts the mean first.
    cfg = presets.resolve(ModelConfig(preset="tiny"))
    norm = gpt._norm(cfg, nnx.Rngs(0))
    x = 3000.0 + np.random.default_rng(8).normal(size=(4, cfg.hidden))
    centred = x - x.mean(-1, keepdims=True)
    expected = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + cfg.norm_eps)
    np.testing.assert_allclose(norm(jnp.asarray(x, jnp.float32)), expected, rtol=0, atol=1e-3)



def test_the_loss_is_the_mean_cross_entropy_of_the_next_token():
    # The logits themselves are checked against the published formulas in test_export (read as
    # transformers reads an exported folder).
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2))
    model = gpt.GPT(cfg)
    params = model.init(0)
    batch = np.random.default_rng(9).integers(0, cfg.vocab_size, (2, 21))
    logits = np.asarray(model.logits(params, jnp.asarray(batch[:, :-1])), np.float64)
    top = logits.max(-1)
    log_z = top + np.log(np.exp(logits - top[..., None]).sum(-1))
    expected = np.mean(log_z - np.take_along_axis(logits, batch[:, 1:, None], -1)[..., 0])
    assert float(model.loss(params, jnp.asarray(batch))) == pytest.approx(expected, rel=1e-5)

def test_the_learning_rate_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    from holmes_jax import optimizer
    from holmes_jax.config import TrainConfig

    lr, floor, warmup, steps = 2e-3, 2e-4, 4, 12
    _, schedule = optimizer.make_optimizer(TrainConfig(steps=steps, warmup_steps=warmup, learning_rate=lr,
                                                       min_lr_ratio=floor / lr))
    for k in range(steps + 3):  # k: the updates made before this one, which is step k + 1
        step = k + 1
        progress = min(max(step - warmup, 0) / (steps - warmup), 1.0)
        expected = lr * step / warmup if step < warmup else floor + (lr - floor) * 0.5 * (1 + np.cos(np.pi * progress))
        assert float(schedule(k)) == pytest.approx(expected, rel=1e-5, abs=1e-12), k


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_logits_reach_the_loss_unrounded_and_the_backward_stays_bf16(tied):
    # The head's norm outputs ones, so each logit is the sum of its kernel column: 64 + 1/128 for
    # token 0, 64 for token 1. bfloat16 holds 8 bits: a bfloat16 logit rounded the first to 64,
    # and the float32 loss saw the two tokens as equally likely.
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, hidden=64, tie_embeddings=tied,
                                      compute_dtype="bfloat16"))
    model = gpt.GPT(cfg)
    params = jax.tree.map(np.array, model.init(0))
    params["head"]["norm"]["scale"][:], params["head"]["norm"]["bias"][:] = 0.0, 1.0
    kernel = np.zeros((cfg.hidden, cfg.vocab_size), np.float32)
    kernel[:, :2] = 1.0
    kernel[0, 0] += 1 / 128
    if tied:
        params["embed"]["tokens"]["embedding"] = kernel.T.copy()
    else:
        params["head"]["out"]["kernel"] = kernel
    x = jnp.ones((1, 3, cfg.hidden), jnp.bfloat16)
    logits = model.head_logits(params, x)
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits[..., 0] - logits[..., 1], 1 / 128)
    targets = jnp.zeros((1, 3), jnp.int32)
    z = np.log(np.exp(64 + 1 / 128) + np.exp(64) + (cfg.vocab_size - 2))  # the other logits are 0
    np.testing.assert_allclose(model.head_loss(params, x, targets), z - (64 + 1 / 128), rtol=1e-5)
    # The backward's matmuls take bfloat16 operands, as they did when the logits were bfloat16.
    grad = jax.make_jaxpr(jax.grad(model.head_loss, argnums=(0, 1)))(params, x, targets)
    dots = [e for e in grad.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def _reference_logits(cfg, p, tokens, xp=np):
    """The model written out plainly over a params dict: numpy in float64 (`xp=np`) or jax.numpy
    (`xp=jnp`, to take its gradient). Query head i reads kv head i // (heads / kv_heads); rotary
    turns the pairs (i, i + head_dim / 2); eps inside the square root; GELU's tanh form."""
    b, s = tokens.shape
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def norm(x, n):
        if cfg.norm == "layernorm":
            x = x - x.mean(-1, keepdims=True)
        x = x / xp.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * n["scale"]
        return x + n["bias"] if cfg.norm == "layernorm" else x

    def linear(x, layer):
        return x @ layer["kernel"] + (layer["bias"] if "bias" in layer else 0.0)

    def rotary(x):
        angles = np.arange(s)[:, None] / cfg.rope_base ** (np.arange(0, d, 2) / d)[None, :]
        cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    table = p["embed"]["tokens"]["embedding"]
    x = table[tokens]
    if cfg.positions == "learned":
        x = x + p["embed"]["positions"][:s]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(cfg.num_layers):
        layer = jax.tree.map(lambda a: a[i], p["blocks"])
        h = norm(x, layer["attn_norm"])
        q = linear(h, layer["q"]).reshape(b, s, heads, d)
        k, v = (linear(h, layer[n]).reshape(b, s, kv_heads, d) for n in ("k", "v"))
        if cfg.positions == "rotary":
            q, k = rotary(q), rotary(k)
        k, v = (xp.repeat(a, heads // kv_heads, axis=2) for a in (k, v))  # kv head j serves query heads j*g..
        scores = xp.where(causal, xp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d), -1e30)
        weights = xp.exp(scores - scores.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
        x = x + linear(xp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, heads * d), layer["o"])
        h = norm(x, layer["mlp_norm"])
        if cfg.mlp == "swiglu":
            gate = linear(h, layer["gate"])
            inner = gate / (1 + xp.exp(-gate)) * linear(h, layer["up"])
        else:
            up = linear(h, layer["up"])
            inner = 0.5 * up * (1 + xp.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up ** 3)))
        x = x + linear(inner, layer["down"])
    kernel = table.T if cfg.tie_embeddings else p["head"]["out"]["kernel"]
    return norm(x, p["head"]["norm"]) @ kernel


def _reference_loss(logits, targets, xp=np):
    top = logits.max(-1, keepdims=True)
    log_z = top[..., 0] + xp.log(xp.exp(logits - top).sum(-1))
    return xp.mean(log_z - xp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0])


_REFERENCE_SHAPES = [
    dict(preset="tiny"),  # GPT: learned positions, layernorm, gelu, tied
    dict(preset="tiny", bias=True, num_kv_heads=2),
    dict(preset="llama-tiny"),  # LLaMA: rotary, rmsnorm, swiglu, untied, 4 heads over 2 kv heads
    dict(preset="llama-tiny", num_heads=8, num_kv_heads=2, bias=True, tie_embeddings=True),
    dict(preset="llama-tiny", num_kv_heads=1, norm="layernorm", mlp="gelu"),
]


def _randomised(params, seed):
    # Every parameter moved off its initial value, so unit scales and zero biases hide no mistake.
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(tree, [jnp.asarray(x + rng.normal(scale=0.1, size=x.shape), jnp.float32)
                                     for x in leaves])


@pytest.mark.parametrize("options", _REFERENCE_SHAPES)
def test_the_forward_and_loss_match_a_numpy_reference(options):
    # A norm_eps near the activations' variance and a small rope_base make both count in the logits.
    cfg = presets.resolve(ModelConfig(num_layers=2, norm_eps=0.01, rope_base=100.0, **options))
    model = gpt.GPT(cfg)
    params = _randomised(model.init(0), 10)
    batch = np.random.default_rng(11).integers(0, cfg.vocab_size, (2, 21))
    expected = _reference_logits(cfg, jax.tree.map(lambda x: np.asarray(x, np.float64), params), batch[:, :-1])
    logits = np.asarray(model.logits(params, jnp.asarray(batch[:, :-1])))
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert float(model.loss(params, jnp.asarray(batch))) == pytest.approx(
        _reference_loss(expected, batch[:, 1:]), rel=1e-5)


@pytest.mark.parametrize("options", _REFERENCE_SHAPES[1:4])
def test_the_gradients_match_the_reference(options):
    # The model's gradient (scanned layers, fused attention, the float32-logits head with its own
    # backward, tied tables used twice) against autodiff of the plain reference.
    cfg = presets.resolve(ModelConfig(num_layers=2, **options))
    model = gpt.GPT(cfg)
    params = _randomised(model.init(0), 12)
    batch = jnp.asarray(np.random.default_rng(13).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    ref = jax.jit(jax.grad(lambda p: _reference_loss(_reference_logits(cfg, p, inputs, jnp), targets, jnp)))(params)
    ours = jax.jit(jax.grad(model.loss))(params, batch)
    # One scale for all: k's bias has no gradient without rotary (it adds one constant to a row of
    # scores), so both sides are rounding noise there.
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def _ops(jaxpr):
    from jax._src import core

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in core.jaxprs_in_params(eqn.params):
            yield from _ops(sub)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_bf16_runs_its_matmuls_in_bf16_and_its_softmax_norms_and_loss_in_float32(preset):
    # Forward and backward: every exp (attention's softmax, the loss's logsumexp), log and rsqrt
    # (the norms) is float32; the weight matmuls take bfloat16 operands; the parameters stay float32.
    cfg = presets.resolve(ModelConfig(preset=preset, num_layers=2, compute_dtype="bfloat16"))
    model = gpt.GPT(cfg)
    params = model.init(0)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(model.loss))(params, jnp.zeros((2, 17), jnp.int32))
    ops = list(_ops(jaxpr.jaxpr))
    for name in ("exp", "log", "rsqrt"):
        dtypes = {str(v.aval.dtype) for e in ops if e.primitive.name == name for v in e.invars + e.outvars}
        assert dtypes == {"float32"}, (name, dtypes)
    weight_matmuls = [e for e in ops if e.primitive.name == "dot_general"
                      and not e.params["dimension_numbers"][1][0]]  # no batch dims: not attention's
    assert weight_matmuls and all(v.aval.dtype == jnp.bfloat16 for e in weight_matmuls for v in e.invars)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(jaxpr.out_avals))
