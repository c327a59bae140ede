"""Hugging Face export and import, `holmes_jax.load` and generation. One tiny trained LLaMA-style
run (grouped-query attention, biases, tied embeddings, a tokenizer.json in its data folder) serves
the run-level tests; the GPT-2 / LLaMA layouts are checked on freshly initialised parameters."""

import argparse
import contextlib
import json
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
import safetensors.numpy

from helpers import REPO, run_module, small_configs
from holmes_jax import build, export, generate, inference, prepare, sharding, train
from holmes_jax.config import ConfigError, DataConfig, ModelConfig
from holmes_jax.models import gpt, presets

RUN = ["--gin.ModelConfig.preset=llama-tiny", "--gin.ModelConfig.num_kv_heads=2", "--gin.ModelConfig.bias=True",
       "--gin.ModelConfig.tie_embeddings=True", "--gin.ModelConfig.rope_base=500000.0"]


def _tokenizer_json(text: str, path) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    tok.save(str(path))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of two steps, checkpointed at both, on a prepared data folder with a tokenizer.json."""
    root = tmp_path_factory.mktemp("run")
    folder = root / "data"
    text = (REPO / "holmes_jax" / "train.py").read_text()
    (root / "train.txt").write_text(text)
    _tokenizer_json(text, root / "bpe.json")
    prepare.prepare([str(root / "train.txt")], str(folder), str(root / "bpe.json"))
    cfgs = small_configs(root / "work", *RUN, "--gin.TrainConfig.steps=2", "--gin.CheckpointConfig.every=1",
                         "--gin.ParallelConfig.dp=1", "--gin.TrainConfig.eval_batches=1", f"--gin.DataConfig.source={folder}")
    train.run(cfgs, jax.devices()[:1], quiet=True)
    return root / "work"


def _expected_names(cfg: ModelConfig, arch: str) -> dict[str, tuple]:
    """Tensor names and shapes as transformers' GPT2LMHeadModel / LlamaForCausalLM name them."""
    h, f, v, kv = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size, cfg.num_kv_heads * cfg.head_dim
    if arch == "gpt2":
        names = {"transformer.wte.weight": (v, h), "transformer.wpe.weight": (cfg.max_seq_len, h),
                 "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
        layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
                 "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),  # Conv1D: (in, out)
                 "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,),
                 "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,)}
        prefix = "transformer.h"
    else:
        names = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),  # nn.Linear: (out, in)
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
                 "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
        prefix = "model.layers"
    for i in range(cfg.num_layers):
        names |= {f"{prefix}.{i}.{name}": shape for name, shape in layer.items()}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = (v, h)
    return names


@pytest.mark.parametrize("name, options", [
    ("gpt2", dict(preset="tiny", bias=True, tie_embeddings=False)),
    ("llama", dict(preset="llama-tiny", num_kv_heads=2, tie_embeddings=False)),
])
def test_the_files_follow_transformers_names_shapes_and_config(tmp_path, name, options):
    cfg = presets.resolve(ModelConfig(num_layers=2, hidden=64, num_heads=4, ffn_hidden=96, **options))
    params = jax.tree.map(np.asarray, gpt.GPT(cfg).init(0))
    out = export.save_hf(params, cfg, tmp_path / "hf")
    tensors = safetensors.numpy.load_file(out / "model.safetensors")
    assert {k: v.shape for k, v in tensors.items()} == _expected_names(cfg, name)
    assert all(v.dtype == np.float32 for v in tensors.values())
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == cfg.vocab_size and config["tie_word_embeddings"] is False
    assert config["eos_token_id"] is None  # no run, no data: no end-of-text
    if name == "gpt2":
        assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
        assert (config["n_layer"], config["n_embd"], config["n_head"], config["n_inner"], config["n_positions"]) == (
            2, 64, 4, 96, cfg.max_seq_len)
        assert config["activation_function"] == "gelu_new" and config["layer_norm_epsilon"] == 1e-5
        # q, k, v side by side in c_attn; Conv1D keeps our (in, out) layout.
        np.testing.assert_array_equal(tensors["transformer.h.1.attn.c_attn.weight"][:, 64:128], params["blocks"]["k"]["kernel"][1])
        np.testing.assert_array_equal(tensors["lm_head.weight"], params["head"]["out"]["kernel"].T)
    else:
        assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
        assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
                config["num_key_value_heads"], config["intermediate_size"], config["head_dim"]) == (2, 64, 4, 2, 96, 16)
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
        assert config["rms_norm_eps"] == 1e-5 and config["hidden_act"] == "silu" and config["attention_bias"] is False
        # nn.Linear stores (out, in): our kernels transposed.
        np.testing.assert_array_equal(tensors["model.layers.1.self_attn.k_proj.weight"], params["blocks"]["k"]["kernel"][1].T)
    jax.tree.map(np.testing.assert_array_equal, export.import_hf(out, cfg), params)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_folder_says_how_its_tokenizer_was_used(tmp_path, preset):
    # Without tokenizer_config.json, AutoTokenizer would pick the model type's tokenizer class:
    # LLaMA's adds '<s>', GPT-2's names special tokens a trained BPE may lack.
    import tokenizers

    _tokenizer_json("def f(x): return x\n" * 20, tmp_path / "bpe.json")
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "bpe.json"))
    tok.add_special_tokens([prepare.EOT_TEXT])  # as holmes-data prepare adds it
    tok.save(str(tmp_path / "tokenizer.json"))
    eot = tok.token_to_id(prepare.EOT_TEXT)
    cfg = presets.resolve(ModelConfig(preset=preset, num_layers=2, hidden=64, num_heads=4, ffn_hidden=96))
    params = jax.tree.map(np.asarray, gpt.GPT(cfg).init(0))
    out = export.save_hf(params, cfg, tmp_path / "hf", tmp_path / "tokenizer.json", eot)
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
        "add_bos_token": False, "add_eos_token": False, "split_special_tokens": True,
        "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_seq_len}
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eot
    no_tokenizer = export.save_hf(params, cfg, tmp_path / "bytes")  # a run that read bytes has neither file
    assert sorted(f.name for f in no_tokenizer.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.slow
def test_export_of_a_run_imports_back_to_its_checkpoint(run, tmp_path):
    cfg, _ = inference.read_configs(run)
    params, step = inference.restore_params(run, cfg)
    assert step == 2 and cfg.bias and cfg.num_kv_heads == 2
    out = export.export(run, tmp_path / "hf")
    tensors = safetensors.numpy.load_file(out / "model.safetensors")
    assert {k: v.shape for k, v in tensors.items()} == _expected_names(cfg, "llama") | {
        f"model.layers.{i}.{p}.bias": shape for i in range(cfg.num_layers) for p, shape in (
            ("self_attn.q_proj", (64,)), ("self_attn.k_proj", (32,)), ("self_attn.v_proj", (32,)),
            ("self_attn.o_proj", (64,)), ("mlp.gate_proj", (128,)), ("mlp.up_proj", (128,)), ("mlp.down_proj", (64,)))}
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] is config["mlp_bias"] is True and config["rope_theta"] == 500000.0
    assert config["tie_word_embeddings"] is True
    meta = json.loads((run.parent / "data" / "meta.json").read_text())
    assert config["eos_token_id"] == meta["eot_id"] and config["bos_token_id"] is None  # transformers stops there
    assert (out / "tokenizer.json").read_bytes() == (run.parent / "data" / "tokenizer.json").read_bytes()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, export.import_hf(out, cfg))
    first = safetensors.numpy.load_file(export.export(run, tmp_path / "hf1", step=1) / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(first[name], tensors[name])


@pytest.mark.parametrize("options, field", [
    (dict(norm="rmsnorm"), "norm='rmsnorm'"),  # rmsnorm with gelu and learned positions: neither class
    (dict(positions="rotary"), "positions='rotary'"),
    (dict(num_kv_heads=2), "ModelConfig.num_kv_heads"),  # GPT-2 has no grouped-query attention
])
def test_configs_no_hugging_face_class_computes_are_refused(options, field):
    cfg = presets.resolve(ModelConfig(preset="tiny", **options))
    with pytest.raises(ConfigError, match=field):
        export.hf_config(cfg)


def _saved(tmp_path, cfg, seed=0):
    params = jax.tree.map(np.asarray, gpt.GPT(cfg).init(seed))
    return export.save_hf(params, cfg, tmp_path / "hf"), params


def test_import_names_every_field_that_does_not_fit(tmp_path):
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, params = _saved(tmp_path, cfg)
    jax.tree.map(np.testing.assert_array_equal, export.import_hf(folder, cfg), params)
    # saved from LlamaModel, not LlamaForCausalLM: no 'model.' prefix (was "no tensor 'model.embed_tokens.weight'")
    base = {k.removeprefix("model."): v for k, v in safetensors.numpy.load_file(folder / "model.safetensors").items()}
    safetensors.numpy.save_file(base, tmp_path / "base.safetensors")
    (tmp_path / "base.safetensors").replace(folder / "model.safetensors")
    jax.tree.map(np.testing.assert_array_equal, export.import_hf(folder, cfg), params)
    wrong = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=128, ffn_hidden=96, norm_eps=1e-6))
    with pytest.raises(ConfigError, match=r"ModelConfig.hidden = 128 but the folder has 64.*ModelConfig.norm_eps"):
        export.import_hf(folder, wrong)
    with pytest.raises(ConfigError, match="ModelConfig.init_from"):
        export.import_hf(tmp_path / "nothing", cfg)
    gpt2 = presets.resolve(ModelConfig(preset="tiny", num_layers=2, hidden=64, ffn_hidden=96))
    with pytest.raises(ConfigError, match="ModelConfig.positions = 'learned' but the folder has 'rotary'"):
        export.import_hf(folder, gpt2)


def test_import_reads_a_tensor_at_a_time_and_only_those_the_model_takes(tmp_path):
    # the files were read whole: an 8B model's bfloat16 weights (16 GB) beside their float32 copies,
    # and tensors the model never takes (GPT-2's causal-mask buffers)
    import tracemalloc

    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, params = _saved(tmp_path, cfg)
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    unused = {f"transformer.h.{i}.attn.bias": np.ones((1, 1, 1024, 1024), np.float32) for i in range(2)}  # 4 MB each
    safetensors.numpy.save_file(tensors | unused, folder / "model.safetensors")
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tracemalloc.start()  # numpy reports its arrays to tracemalloc too
    try:
        imported = export.import_hf(folder, cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    jax.tree.map(np.testing.assert_array_equal, imported, params)
    assert peak < 2 * model_bytes + (1 << 20), f"peak {peak:,} bytes for a model of {model_bytes:,}"


def _drop(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


def _index_only(folder, index: dict) -> None:
    """A sharded folder: its index and no model.safetensors (which transformers would read first)."""
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


DAMAGED_FOLDERS = {  # case: (what is written over the saved folder, what the error names)
    "config.json not JSON": (lambda f, c, t: (f / "config.json").write_text("{broken"), "cannot be read as JSON"),
    "a field missing": (lambda f, c, t: (f / "config.json").write_text(json.dumps(_drop(c, "intermediate_size"))),
                        "config.json has no 'intermediate_size'"),
    "a field null": (lambda f, c, t: (f / "config.json").write_text(json.dumps(c | {"num_attention_heads": None})),
                     "wrong type"),
    # was a ZeroDivisionError traceback
    "no heads": (lambda f, c, t: (f / "config.json").write_text(json.dumps(c | {"num_attention_heads": 0})),
                 "hidden_size = 64 is not a multiple of num_attention_heads = 0"),
    # was "config.json has no 'head_dim'"
    "heads that do not divide hidden": (lambda f, c, t: (f / "config.json").write_text(json.dumps(
        _drop(c, "head_dim") | {"num_attention_heads": 5})), "hidden_size = 64 is not a multiple of num_attention_heads = 5"),
    # transformers reads these as a linear scaling and as rotary on half of each head: they were
    # imported as plain rotary positions over whole heads
    "rope scaling under the older key": (lambda f, c, t: (f / "config.json").write_text(json.dumps(
        c | {"rope_parameters": {"type": "linear", "factor": 4.0, "rope_theta": 10000.0}})), "rope scaling .* is not supported"),
    "partial rotary": (lambda f, c, t: (f / "config.json").write_text(json.dumps(c | {"partial_rotary_factor": 0.5})),
                       "partial_rotary_factor = 0.5 is not supported"),
    "an index without weight_map": (lambda f, c, t: _index_only(f, {}), "has no weight_map"),
    "a weight_map of numbers": (lambda f, c, t: _index_only(f, {"weight_map": {"model.norm.weight": 1}}),
                                "has no weight_map"),
    "an empty weight_map": (lambda f, c, t: _index_only(f, {"weight_map": {}}), "has no weight_map"),
    "integer tensors": (lambda f, c, t: safetensors.numpy.save_file({k: v.astype(np.int32) for k, v in t.items()},
                                                                     f / "model.safetensors"),
                        "allowed: float32, float16, bfloat16"),
    "not safetensors": (lambda f, c, t: (f / "model.safetensors").write_bytes(b"\x00" * 64), "cannot be read as safetensors"),
    "a tensor missing": (lambda f, c, t: safetensors.numpy.save_file(_drop(t, "model.layers.1.mlp.up_proj.weight"),
                                                                      f / "model.safetensors"),
                         "no tensor 'model.layers.1.mlp.up_proj.weight'"),
    "a tensor of another shape": (lambda f, c, t: safetensors.numpy.save_file(
        t | {"model.norm.weight": np.ones(65, np.float32)}, f / "model.safetensors"), r"is \(65,\), the ModelConfig needs \(64,\)"),
}


@pytest.mark.parametrize("case", DAMAGED_FOLDERS)
def test_a_damaged_folder_is_one_error_naming_what_is_wrong(tmp_path, case):
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, _ = _saved(tmp_path, cfg)
    damage, names = DAMAGED_FOLDERS[case]
    damage(folder, json.loads((folder / "config.json").read_text()), safetensors.numpy.load_file(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=names):
        export.import_hf(folder, cfg)


def test_export_writes_only_a_new_or_empty_folder(tmp_path):
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, params = _saved(tmp_path, cfg)
    before = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    with pytest.raises(ConfigError, match="already exists and is not an empty folder"):
        export.save_hf(params, cfg, folder)  # an old export's files would be read with the new ones
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == before
    (tmp_path / "empty").mkdir()
    assert export.save_hf(params, cfg, tmp_path / "empty") == (tmp_path / "empty").resolve()
    assert sorted(f.name for f in (tmp_path / "empty").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["empty", "hf"]  # no temporary folder left


def test_a_tiny_temperature_samples_the_largest_logit():
    rng = np.random.default_rng(0)
    assert generate._sample(np.array([1.0, 3.0, 2.0], np.float32), 1e-310, None, rng) == 1


def test_gpt2_biases_round_trip_as_zeros_and_nonzero_ones_need_bias(tmp_path):
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, params = _saved(tmp_path, cfg)
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    assert not tensors["transformer.h.0.attn.c_attn.bias"].any()  # GPT-2 always has biases: zeros
    jax.tree.map(np.testing.assert_array_equal, export.import_hf(folder, cfg), params)
    tensors["transformer.h.1.mlp.c_fc.bias"][3] = 0.5
    safetensors.numpy.save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ConfigError, match="ModelConfig.bias = False"):
        export.import_hf(folder, cfg)
    with_bias = export.import_hf(folder, presets.resolve(ModelConfig(preset="tiny", num_layers=2, hidden=64,
                                                                     ffn_hidden=96, bias=True)))
    assert with_bias["blocks"]["up"]["bias"][1, 3] == 0.5


def test_a_fresh_run_starts_from_init_from(tmp_path):
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128))
    folder, params = _saved(tmp_path, cfg, seed=7)
    cfgs = small_configs(tmp_path / "run", "--gin.ModelConfig.preset=llama-tiny", f"--gin.ModelConfig.init_from={folder}",
                         "--gin.ParallelConfig.dp=2", "--gin.ParallelConfig.tp=2", "--gin.ParallelConfig.pp=2")
    setup = build.build(cfgs, jax.devices()[:8])
    state = setup.canonical(setup.init_state())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state["params"], params)
    assert int(state["step"]) == 0


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_a_sharded_import_reads_each_device_part_once(tmp_path, monkeypatch, style):
    """With shardings, each device's part of a leaf is read from the files alone (GPT-2's q, k and v
    as column blocks of c_attn): the values read add up to one model, not one per process or per
    replica, and every shard equals the whole import's."""
    kw = dict(preset="tiny") if style == "gpt2" else dict(preset="llama-tiny", num_kv_heads=2)
    cfg = presets.resolve(ModelConfig(num_layers=4, hidden=64, num_heads=4, ffn_hidden=96,
                                      bias=True, tie_embeddings=False, **kw))
    folder, params = _saved(tmp_path, cfg, seed=3)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("stage", "data", "tensor"))
    shapes = jax.eval_shape(lambda: gpt.GPT(cfg).init(0))
    shardings = sharding.canonical_shardings(mesh, optax.adam(1e-3), shapes)["params"]
    # one leaf kept whole on every device: its part is read once, not eight times
    shardings["head"]["norm"]["scale"] = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    read, opened = [], safetensors.safe_open  # the sizes of the values taken from the files

    class Counted:
        """A safetensors file, or a tensor's slice, that counts the values read through it."""
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get_slice(self, name):
            return Counted(self.inner.get_slice(name))

        def get_tensor(self, name):
            return counted(self.inner.get_tensor(name))

        def __getitem__(self, index):
            return counted(self.inner[index])

    def counted(x):
        read.append(x.size)
        return x

    @contextlib.contextmanager
    def counted_open(*args, **kwargs):
        with opened(*args, **kwargs) as f:
            yield Counted(f)
    monkeypatch.setattr(safetensors, "safe_open", counted_open)
    imported = export.import_hf(folder, cfg, shardings)
    assert sum(read) == sum(x.size for x in jax.tree.leaves(params))
    for got, want, sh in zip(jax.tree.leaves(imported), jax.tree.leaves(params), jax.tree.leaves(shardings)):
        assert got.sharding == sh
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_a_run_refuses_an_init_from_that_does_not_fit_before_writing_anything(tmp_path):
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128))
    folder, _ = _saved(tmp_path, cfg)
    workdir = tmp_path / "run"
    cfgs = small_configs(workdir, "--gin.ModelConfig.preset=llama-tiny", "--gin.ModelConfig.num_layers=4",
                         f"--gin.ModelConfig.init_from={folder}")
    with pytest.raises(ConfigError, match="num_layers = 4 but the folder has 2"):
        train.run(cfgs, jax.devices()[:1], quiet=True)
    (folder / "model.safetensors").unlink()
    cfgs = small_configs(workdir, "--gin.ModelConfig.preset=llama-tiny", f"--gin.ModelConfig.init_from={folder}")
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        train.run(cfgs, jax.devices()[:1], quiet=True)
    tensors = safetensors.numpy.load_file(_saved(tmp_path / "again", cfg)[0] / "model.safetensors")
    safetensors.numpy.save_file(_drop(tensors, "model.embed_tokens.weight"), folder / "model.safetensors")
    with pytest.raises(ConfigError, match="no tensor 'model.embed_tokens.weight'"):  # found in the headers
        train.run(cfgs, jax.devices()[:1], quiet=True)
    assert not workdir.exists()


@pytest.mark.slow
def test_load_gives_the_runs_model(run):
    m = inference.load(run)
    cfg, _ = inference.read_configs(run)
    assert m.config == cfg and m.step == 2
    assert m.tokenizer.get_vocab_size() == 201  # the data's tokenizer, <|endoftext|> added by prepare
    assert m.end_of_text == json.loads((run.parent / "data" / "meta.json").read_text())["eot_id"] == 200
    # The run keeps a copy: found from any working folder, and after the data folder moves.
    assert inference.tokenizer_file(run, inference.read_configs(run)[1]) == run / "tokenizer.json"
    params, _ = inference.restore_params(run, cfg)
    jax.tree.map(np.testing.assert_array_equal, m.params, params)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 20))
    logits = m.logits(tokens)
    assert logits.shape == (2, 20, 256) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, gpt.GPT(cfg).logits(params, tokens), rtol=1e-6, atol=1e-6)
    assert inference.load(run, step=1).step == 1
    for bad in (tokens[0], tokens + 256, tokens.astype(float)):
        with pytest.raises(ConfigError, match="token"):
            m.logits(bad)
    with pytest.raises(ConfigError, match="--step 5 is not allowed.*1, 2"):
        inference.load(run, step=5)


@pytest.mark.slow
def test_greedy_generation_is_the_argmax_of_the_logits(run):
    m = inference.load(run)
    prompt = generate.encode(m, "def f(x):")
    assert prompt == m.tokenizer.encode("def f(x):").ids
    new = generate.generate(m, prompt, 4, greedy=True)
    assert new == generate.generate(m, prompt, 4, greedy=True)
    ids = list(prompt)
    for token in new:
        assert token == int(np.argmax(m.logits(np.asarray([ids]))[0, -1]))
        ids.append(token)
    sampled = [generate.generate(m, prompt, 4, top_k=5, seed=s) for s in (0, 0)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 4
    as_bytes = inference.Model(m.config, m.params, None, m.step)  # a run that read bytes
    assert generate.encode(as_bytes, "hé") == [104, 0xC3, 0xA9]
    assert generate.decode(as_bytes, [104, 105, 0xC3]) == "hi\ufffd"  # a cut UTF-8 sequence prints as U+FFFD


@pytest.mark.slow
def test_the_command_lines(run, tmp_path):
    done = run_module("holmes_jax.export", "--workdir", str(run), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    done = run_module("holmes_jax.generate", "--workdir", str(run), "--prompt", "import ", "--max-tokens", "3", "--greedy")
    assert done.returncode == 0, done.stderr
    m = inference.load(run)
    prompt = generate.encode(m, "import ")
    assert done.stdout == generate.decode(m, prompt + generate.generate(m, prompt, 3, greedy=True)) + "\n"
    for module, args, message in (
        ("holmes_jax.export", ["--workdir", str(tmp_path), "--out", str(tmp_path / "x")], "holds no config.gin"),
        ("holmes_jax.generate", ["--workdir", str(run), "--prompt", "x", "--temperature", "0"], "--temperature"),
    ):
        done = run_module(module, *args)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_importing_the_package_starts_no_jax():
    code = ("import sys, holmes_jax; f = holmes_jax.load, holmes_jax.plan; assert 'jax' not in sys.modules; "
            "print('no jax')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no jax"


@pytest.mark.parametrize("head_dim", [None, "absent"])
def test_a_llama_config_without_head_dim_means_hidden_over_heads(tmp_path, head_dim):
    # LlamaConfig takes a null or absent head_dim as hidden_size / num_attention_heads; a null one
    # was refused as 'a field of the wrong type'.
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, params = _saved(tmp_path, cfg)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(_drop(config, "head_dim") | ({} if head_dim else {"head_dim": None})))
    jax.tree.map(np.testing.assert_array_equal, export.import_hf(folder, cfg), params)


def test_a_folder_with_both_model_safetensors_and_an_index_gives_model_safetensors(tmp_path):
    # transformers reads model.safetensors first; the import read the index's shards (here an
    # older model's) and started the run from other weights than transformers gives.
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, params = _saved(tmp_path, cfg)
    older = safetensors.numpy.load_file(_saved(tmp_path / "older", cfg, seed=1)[0] / "model.safetensors")
    safetensors.numpy.save_file(older, folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "model-00001-of-00001.safetensors" for name in older}}))
    jax.tree.map(np.testing.assert_array_equal, export.import_hf(folder, cfg), params)


def test_import_reads_sharded_bfloat16_folders(tmp_path):
    """How transformers saves large models: bfloat16 tensors in shards named by an index."""
    import ml_dtypes

    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, params = _saved(tmp_path, cfg)
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        safetensors.numpy.save_file({k: tensors[k].astype(ml_dtypes.bfloat16) for k in keys}, folder / shard)
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    back = export.import_hf(folder, cfg)
    want = jax.tree.map(lambda x: np.asarray(x.astype(ml_dtypes.bfloat16), np.float32), params)
    jax.tree.map(np.testing.assert_array_equal, back, want)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(back))


def _model_favouring(token: int, vocab: int = 384, tokenizer=None, **fields) -> inference.Model:
    """A Model whose next-token logits are 64 for `token`, 32 for the byte 'A' and 0 for the rest,
    whatever the context: its head's norm outputs ones and its output kernel picks the columns."""
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, hidden=64, num_heads=4, ffn_hidden=96,
                                      vocab_size=vocab, tie_embeddings=False))
    params = jax.tree.map(np.array, gpt.GPT(cfg).init(0))
    params["head"]["norm"]["scale"][:], params["head"]["norm"]["bias"][:] = 0.0, 1.0
    kernel = np.zeros((cfg.hidden, vocab), np.float32)
    kernel[:, token], kernel[:, ord("A")] = 1.0, 0.5
    params["head"]["out"]["kernel"] = kernel
    return inference.Model(cfg, params, tokenizer, 0, **fields)


def test_generation_never_writes_the_padding_rows_of_the_vocabulary():
    # 257 ids (bytes and end-of-text) padded to 384: ids 257-383 were never in the data.
    for m in (_model_favouring(300), _model_favouring(300, end_of_text=256)):
        assert generate.generate(m, [65], 3, greedy=True) == [65] * 3
        assert generate.generate(m, [65], 3, top_k=1) == [65] * 3
        assert "\ufffd" not in generate.decode(m, generate.generate(m, [65], 3, temperature=1e-3))


def test_generation_stops_at_end_of_text_and_an_empty_prompt_starts_a_document():
    m = _model_favouring(256, end_of_text=256)
    assert generate.generate(m, [65, 66], 5, greedy=True) == []  # the model ended the document
    assert generate.generate(m, [65, 66], 5, top_k=1) == []
    after = _model_favouring(300, end_of_text=256)
    assert generate.generate(after, [], 3, greedy=True) == [65] * 3
    with pytest.raises(ConfigError, match="--prompt is empty"):  # text read as bytes: no end-of-text
        generate.generate(_model_favouring(200, vocab=256), [], 3, greedy=True)


def test_an_infinite_temperature_is_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="allowed: a finite positive number"):
        generate._positive_float("inf")
    with pytest.raises(ConfigError, match="--temperature inf"):
        generate.generate(_model_favouring(300), [65], 2, temperature=float("inf"), top_k=2)


@pytest.mark.parametrize("kernel_value", [np.nan, 1e38])
def test_non_finite_logits_are_an_error_naming_the_checkpoint(kernel_value):
    # NaN (a diverged run) or overflow to infinity: greedy wrote the NaN's id as if the model chose
    # it, sampling failed with numpy's 'probabilities contain NaN' traceback.
    m = _model_favouring(300)
    m.params["head"]["out"]["kernel"][:, 66] = kernel_value
    for options in (dict(greedy=True), dict(), dict(top_k=3)):
        with pytest.raises(ConfigError, match=r"checkpoint step 0 gives logits that are not finite "
                                              r"\(NaN or infinity\): .*allowed: an earlier checkpoint \(--step\)"):
            generate.generate(m, [65], 2, **options)


def test_prompts_get_no_special_tokens_and_only_the_tokenizers_ids_come_out(tmp_path):
    import tokenizers

    _tokenizer_json("abc abd abe " * 20, tmp_path / "bpe.json")
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "bpe.json"))
    unk = tok.token_to_id("<unk>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", unk)])
    m = _model_favouring(300, tokenizer=tok)  # a template that adds a leading token, as LLaMA's adds <s>
    assert generate.encode(m, "abc") == tok.encode("abc", add_special_tokens=False).ids
    assert unk not in generate.encode(m, "abc")
    n = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    assert all(i < n for i in generate.generate(m, generate.encode(m, "abc"), 3, greedy=True))


def _shard(folder, tensors: dict, shards: int = 2) -> list[str]:
    """Rewrites `folder`'s model.safetensors as `shards` files named by an index, as transformers saves."""
    (folder / "model.safetensors").unlink()
    names, files = sorted(tensors), [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i * shards // len(names)] for i, name in enumerate(names)}
    for file in files:
        safetensors.numpy.save_file({k: tensors[k] for k, v in weight_map.items() if v == file}, folder / file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


def test_a_tensor_error_names_the_tensor_and_the_file_it_is_in(tmp_path):
    def shard_of(folder, name):  # the file the index puts `name` in, as a pattern
        file = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
        return folder / file, re.escape(str(folder / file))

    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, _ = _saved(tmp_path, cfg)
    _shard(folder, safetensors.numpy.load_file(folder / "model.safetensors"))
    name = "model.norm.weight"
    file, pattern = shard_of(folder, name)
    tensors = safetensors.numpy.load_file(file)
    safetensors.numpy.save_file(tensors | {name: np.ones(65, np.float32)}, file)
    with pytest.raises(ConfigError, match=rf"tensor '{name}' in '{pattern}' is \(65,\), the ModelConfig needs \(64,\)"):
        export.import_hf(folder, cfg)
    safetensors.numpy.save_file(_drop(tensors, name), file)
    with pytest.raises(ConfigError, match=rf"no tensor '{name}' in the 2 shards model.safetensors.index.json lists in "
                                          rf"'{re.escape(str(folder))}'"):
        export.import_hf(folder, cfg)
    # The original GPT-2 files name tensors without GPT2LMHeadModel's 'transformer.' prefix.
    gpt2 = presets.resolve(ModelConfig(preset="tiny", num_layers=2, hidden=64, ffn_hidden=96))
    folder, _ = _saved(tmp_path / "gpt2", gpt2)
    tensors = {k.removeprefix("transformer."): v for k, v in safetensors.numpy.load_file(folder / "model.safetensors").items()}
    tensors["h.1.mlp.c_fc.bias"][3] = 0.5
    shards = _shard(folder, tensors)
    with pytest.raises(ConfigError, match=rf"ModelConfig.bias = False but tensor 'h.1.mlp.c_fc.bias' in "
                                          rf"'{shard_of(folder, 'h.1.mlp.c_fc.bias')[1]}'"):
        export.import_hf(folder, gpt2)
    for file in shards + ["model.safetensors.index.json"]:
        (folder / file).unlink()
    safetensors.numpy.save_file(tensors | {"h.0.ln_1.weight": tensors["h.0.ln_1.weight"].astype(np.int32)},
                                folder / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"tensor 'h.0.ln_1.weight' in '{re.escape(str(folder / 'model.safetensors'))}' "
                                          rf"is I32; allowed: float32"):
        export.import_hf(folder, gpt2)


@pytest.mark.slow
def test_load_refuses_a_step_that_is_not_an_int(run):
    # True == 1 and 2.0 == 2: once taken for steps 1 and 2, then blamed on a damaged checkpoint.
    for bad in (True, 2.0, "2"):
        with pytest.raises(ConfigError, match=f"step = {bad!r} is not allowed; allowed: None"):
            inference.load(run, step=bad)
    assert inference.load(run, step=np.int64(1)).step == 1


def test_a_prompt_becomes_the_ids_the_training_text_did(tmp_path):
    import tokenizers

    # A special token's name written in the text was text to holmes-data prepare, not its id.
    text = "abc <|endoftext|> abd"
    _tokenizer_json("abc abd abe <|endoftext|> " * 20, tmp_path / "bpe.json")
    prepared = prepare.HFTokenizer(tokenizers.Tokenizer.from_file(str(tmp_path / "bpe.json")))
    prepared.save(tmp_path)  # as a run keeps its data folder's tokenizer.json
    tokenizer, eot, _ = inference.run_tokens(tmp_path, DataConfig())
    assert eot == prepared.eot_id
    m = _model_favouring(300, tokenizer=tokenizer, end_of_text=eot)
    prompt = generate.encode(m, text)
    assert prompt == prepared.encode([text.encode()])[0].tolist() and eot not in prompt
    assert "<|endoftext|>" in generate.decode(m, prompt)  # printed as given, not dropped as a special token


@pytest.mark.parametrize("name", ["tokens.bin", "TOKENS.BIN"])
def test_a_run_on_a_token_file_is_read_as_ids_whatever_the_suffix_case(tmp_path, name):
    # No tokenizer: generate takes ids, and reads the file for its vocabulary's end.
    assert inference.run_tokens(tmp_path, DataConfig(source=str(tmp_path / name))) == (None, None, str(tmp_path / name))


@pytest.mark.parametrize("unk_token", ["<unk>", None])
def test_a_prompt_the_tokenizer_cannot_spell_is_refused(tmp_path, unk_token):
    import tokenizers

    # A tokenizer without all bytes in its alphabet: an unknown character becomes its unknown
    # token, or (without one) vanishes; either way the model and the printout lose it.
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=unk_token))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(["abc abd abe " * 20],
                            tokenizers.trainers.BpeTrainer(vocab_size=100, special_tokens=[unk_token] if unk_token else []))
    m = _model_favouring(300, tokenizer=tok)
    assert generate.decode(m, generate.encode(m, "abe  abc")) == "abe  abc"
    with pytest.raises(ConfigError, match=r"--prompt 'ab z中 az' is not allowed: the run's tokenizer has no token "
                                          r"for 'z', '中'; allowed:"):
        generate.encode(m, "ab z中 az")


def test_generation_refuses_ids_outside_the_vocabulary_a_top_k_below_one_and_points_temperature_0_to_greedy():
    m = _model_favouring(300)
    with pytest.raises(ConfigError, match=r"token id -1, outside \[0, ModelConfig.vocab_size = 384\)"):
        generate.generate(m, [65, -1], 2, greedy=True)  # -1 would read the vocabulary's last row
    with pytest.raises(ConfigError, match="token id 384, outside"):
        generate.generate(m, [384], 2, greedy=True)
    for k in (0, -1):  # 0 sampled among all ids, -1 among all but the least likely
        with pytest.raises(ConfigError, match=f"--top-k {k} is not allowed; allowed: a positive integer"):
            generate.generate(m, [65], 2, top_k=k)
    with pytest.raises(ConfigError, match=r"--temperature 0 is not allowed.*\(--greedy for temperature 0\)"):
        generate.generate(m, [65], 2, temperature=0)
    with pytest.raises(argparse.ArgumentTypeError, match=r"--greedy for temperature 0"):
        generate._positive_float("0")
    with pytest.raises(ConfigError, match="257 tokens are too many: the learned positions stop at"):
        m.logits(np.zeros((1, 257), np.int64))


def _layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * weight + bias


def _causal_attention(q, k, v):
    """(seq, heads, head_dim) each -> (seq, heads * head_dim)."""
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones(scores.shape[1:], bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdims=True), v).reshape(len(q), -1)


def _hf_logits(folder, ids):
    """Logits of `ids` as transformers' GPT2LMHeadModel / LlamaForCausalLM compute them from the
    folder's config.json and tensors (float64): Conv1D x @ W + b, nn.Linear x @ W.T + b, gelu_new,
    rotate_half rotary, repeat_kv."""
    c = json.loads((folder / "config.json").read_text())
    t = {k: v.astype(np.float64) for k, v in safetensors.numpy.load_file(folder / "model.safetensors").items()}
    s = len(ids)
    if c["model_type"] == "gpt2":
        eps, heads = c["layer_norm_epsilon"], c["n_head"]
        x = t["transformer.wte.weight"][ids] + t["transformer.wpe.weight"][:s]
        for i in range(c["n_layer"]):
            w = {k.removeprefix(f"transformer.h.{i}."): v for k, v in t.items()}
            qkv = _layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps) @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]
            q, k, v = (a.reshape(s, heads, -1) for a in np.split(qkv, 3, axis=-1))
            x = x + _causal_attention(q, k, v) @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]
            up = _layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps) @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"]
            gelu_new = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up ** 3)))
            x = x + gelu_new @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]
        x = _layer_norm(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], eps)
        return x @ t.get("lm_head.weight", t["transformer.wte.weight"]).T
    eps, heads, kv_heads, dim = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    angles = np.arange(s)[:, None] / c["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, None] for f in (np.cos, np.sin))

    def rotary(x):
        return x * cos + np.concatenate([-x[..., dim // 2:], x[..., : dim // 2]], -1) * sin

    def rms_norm(x, weight):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * weight

    x = t["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in t.items()}

        def linear(x, name):
            return x @ w[name + ".weight"].T + w.get(name + ".bias", 0)

        a = rms_norm(x, w["input_layernorm.weight"])
        q = rotary(linear(a, "self_attn.q_proj").reshape(s, heads, dim))
        k, v = (np.repeat(y.reshape(s, kv_heads, dim), heads // kv_heads, axis=1) for y in (
            rotary(linear(a, "self_attn.k_proj").reshape(s, kv_heads, dim)), linear(a, "self_attn.v_proj")))
        x = x + linear(_causal_attention(q, k, v), "self_attn.o_proj")
        m = rms_norm(x, w["post_attention_layernorm.weight"])
        gate = linear(m, "mlp.gate_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(m, "mlp.up_proj"), "mlp.down_proj")
    return rms_norm(x, t["model.norm.weight"]) @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


@pytest.mark.parametrize("options", [
    dict(preset="tiny", bias=True, tie_embeddings=False),
    dict(preset="tiny", num_layers=1),  # GPT-2 without biases: zeros in the folder
    dict(preset="llama-tiny", num_kv_heads=2, bias=True, tie_embeddings=True, rope_base=500000.0),
    dict(preset="llama-tiny", num_layers=1, num_kv_heads=1),
])
def test_the_exported_folder_computes_our_logits_the_way_transformers_reads_it(tmp_path, options):
    # Export then import is symmetric: a mapping wrong both ways (a kernel transposed, q and k
    # swapped in c_attn) would round-trip. This reads the folder as transformers does instead.
    cfg = presets.resolve(ModelConfig(**dict(dict(num_layers=2, hidden=64, num_heads=4, ffn_hidden=96), **options)))
    rng = np.random.default_rng(1)  # every parameter random: norms and biases away from ones and zeros
    params = jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, 0.3, x.shape).astype(np.float32), gpt.GPT(cfg).init(0))
    folder = export.save_hf(params, cfg, tmp_path / "hf")
    ids = rng.integers(0, cfg.vocab_size, 20)
    ours = np.asarray(gpt.GPT(cfg).logits(params, ids[None]))[0]
    np.testing.assert_allclose(ours, _hf_logits(folder, ids), rtol=0, atol=1e-4)


def test_a_full_disk_while_writing_the_weights_is_a_run_error(tmp_path, monkeypatch):
    # safetensors wraps the OS error in its own, the errno only in the text: a full disk is a
    # failure of the run (status 1), not bad input (2) as an unwritable --out is.
    from holmes_jax import cli

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, hidden=64, num_heads=4, ffn_hidden=96))
    with pytest.raises(cli.RunError, match="No space left on device"):
        export.save_hf(jax.tree.map(np.asarray, gpt.GPT(cfg).init(0)), cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


@pytest.mark.parametrize("kept", ["the workdir's copy", "the data folder's"])
def test_a_run_whose_tokenizer_json_is_gone_is_refused_not_read_as_bytes(tmp_path, kept):
    # Its data was tokenized with a BPE: with neither tokenizer.json left, a prompt became bytes
    # (other ids) and the export said end-of-text 256 (a byte run's) where the data's was 0.
    meta = {"tokenizer": "bpe:512", "vocab_size": 512, "dtype": "uint16", "documents": 1, "tokens": 2, "eot_id": 0}
    data = tmp_path / "data"
    data.mkdir()
    where = tmp_path / "data_meta.json" if kept == "the workdir's copy" else data / "meta.json"
    where.write_text(json.dumps(meta))
    source = DataConfig(source=str(tmp_path / "moved" if kept == "the workdir's copy" else data))
    with pytest.raises(ConfigError, match=r"--tokenizer 'bpe:512'.*no tokenizer.json.*copy"):
        inference.run_tokens(tmp_path, source)
    where.write_text("{broken")  # was read as bytes too
    with pytest.raises(ConfigError, match="meta.json' cannot be read as JSON"):
        inference.run_tokens(tmp_path, source)
    where.write_text(json.dumps(meta | {"tokenizer": "bytes"}))  # bytes have no tokenizer.json
    assert inference.run_tokens(tmp_path, source) == (None, prepare.BYTE_VOCAB, None)


def test_the_weights_file_is_as_readable_as_the_folders_other_files(tmp_path):
    # safetensors writes its file 0600: a team's exported folder had weights only its writer could read
    import os
    import stat

    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, hidden=64, ffn_hidden=96))
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):  # the umask's mode, not a fixed one
        old = os.umask(umask)
        try:
            folder, _ = _saved(tmp_path / oct(umask), cfg)
        finally:
            os.umask(old)
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()}
        assert modes == {"config.json": mode, "model.safetensors": mode}, {k: oct(v) for k, v in modes.items()}


# --------------------------------------------------------------------------- sharded export

def _index(folder) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


@pytest.mark.parametrize("options", [
    dict(preset="tiny", bias=True, tie_embeddings=False),
    dict(preset="tiny", tie_embeddings=True),  # GPT-2 without biases: its zero biases in the shards too
    dict(preset="llama-tiny", num_kv_heads=2, bias=True, tie_embeddings=True),
    dict(preset="llama-tiny", tie_embeddings=False),
])
def test_a_sharded_export_follows_the_limit_and_imports_back(tmp_path, options):
    # An 8B model was one 32 GB model.safetensors (a 70B one's 280 GB, past what the Hub takes per file).
    import os
    import stat

    cfg = presets.resolve(ModelConfig(**dict(dict(num_layers=2, hidden=64, num_heads=4, ffn_hidden=96), **options)))
    params = jax.tree.map(np.asarray, gpt.GPT(cfg).init(0))
    limit = 40_000  # bytes: several tensors a shard, while the embeddings (vocab x 64 float32) are larger
    old = os.umask(0o027)
    try:
        folder = export.save_hf(params, cfg, tmp_path / "hf", max_shard_size=limit)
    finally:
        os.umask(old)
    index = _index(folder)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (folder / "model.safetensors").exists()
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(f.name for f in folder.iterdir()) == sorted(files + ["config.json", "model.safetensors.index.json"])
    total = 0
    for file in files:
        tensors = safetensors.numpy.load_file(folder / file)
        assert sorted(tensors) == sorted(k for k, v in index["weight_map"].items() if v == file)
        size = sum(x.nbytes for x in tensors.values())
        assert size <= limit or len(tensors) == 1, (file, size, list(tensors))  # only a lone oversized tensor
        total += size
    assert any(len(safetensors.numpy.load_file(folder / f)) == 1 for f in files)  # the embeddings, alone
    assert index["metadata"]["total_size"] == total
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()}
    assert set(modes.values()) == {0o640}, {k: oct(v) for k, v in modes.items()}  # the umask's, as config.json
    jax.tree.map(np.testing.assert_array_equal, export.import_hf(folder, cfg), params)
    whole = export.save_hf(params, cfg, tmp_path / "whole")  # the same tensors as one model.safetensors
    one = safetensors.numpy.load_file(whole / "model.safetensors")
    assert one.keys() == index["weight_map"].keys()
    for file in files:
        for name, x in safetensors.numpy.load_file(folder / file).items():
            np.testing.assert_array_equal(x, one[name])


def test_the_writer_holds_one_shard_of_tensors_not_the_model(tmp_path):
    # The tensors were all made (transposed copies, c_attn) before one file was written: an 8B
    # model's 32 GB of parameters and as much again.
    import tracemalloc

    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=4, hidden=256, num_heads=4, ffn_hidden=512,
                                      tie_embeddings=False))
    params = jax.tree.map(np.asarray, gpt.GPT(cfg).init(0))
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))  # 10 MB
    limit, slack = model_bytes // 16, 1 << 18
    tracemalloc.start()  # numpy reports its arrays to tracemalloc too
    try:
        folder = export.save_hf(params, cfg, tmp_path / "hf", max_shard_size=limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(set(_index(folder)["weight_map"].values())) >= 16
    assert peak < 2 * limit + slack < model_bytes // 4, f"peak {peak:,} bytes for shards of {limit:,}"


@pytest.mark.slow
def test_an_export_reads_the_checkpoint_a_few_leaves_at_a_time(run, tmp_path, monkeypatch, capsys):
    # The whole tree was restored first: 32 GB for an 8B model, on top of the tensors made from it.
    from holmes_jax import cli

    reads = []
    read = inference.SavedParams.read

    def recorded(self, paths=None):
        reads.append(paths)
        return read(self, paths)
    monkeypatch.setattr(inference.SavedParams, "read", recorded)
    cfg, _ = inference.read_configs(run)
    folder = tmp_path / "hf"
    with pytest.raises(SystemExit) as done:
        cli.run(export.main, ["--workdir", str(run), "--out", str(folder), "--max-shard-size", "20KB"])
    files = sorted(set(_index(folder)["weight_map"].values()))
    assert done.value.code == 0 and len(files) > 2
    assert capsys.readouterr().out == (f"wrote {folder}: config.json, {files[0]} ... {files[-1]}, "  # not dozens of names
                                       f"model.safetensors.index.json, tokenizer.json, tokenizer_config.json\n")
    leaves = [path for paths in reads for path in paths]
    assert None not in reads and all(len(paths) == 1 for paths in reads)  # LLaMA: each tensor from one leaf
    assert sorted(leaves) == sorted({path for path in leaves}) and len(leaves) == len(jax.tree.leaves(
        jax.eval_shape(lambda: gpt.GPT(cfg).init(0))))  # each leaf once, all of them
    params, _ = inference.restore_params(run, cfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, export.import_hf(folder, cfg))


def test_max_shard_size_takes_transformers_sizes_and_refuses_others_in_one_line(tmp_path, capsys):
    from holmes_jax import cli

    for text, size in (("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1.5GB", 1_500_000_000), ("2kb", 2000),
                       ("1000", 1000), ("1TB", 10**12)):
        assert export.shard_size(text) == size
    for bad in ("0", "abc", "5XB", "1.5", "-1", "", "0.0001KB", "5 GiB", "9" * 400):  # 400 digits: inf
        with pytest.raises(SystemExit) as stopped:
            cli.run(export.main, ["--workdir", str(tmp_path), "--out", str(tmp_path / "hf"), f"--max-shard-size={bad}"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.startswith("error: argument --max-shard-size: ") and f"{bad!r}" in err
        assert len(err.splitlines()) == 1, err
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, hidden=64, ffn_hidden=96))
    with pytest.raises(ConfigError, match="max_shard_size = 0 is not allowed"):
        export.save_hf(jax.tree.map(np.asarray, gpt.GPT(cfg).init(0)), cfg, tmp_path / "hf", max_shard_size=0)
    assert not (tmp_path / "hf").exists()


def test_a_failure_after_some_shards_leaves_no_folder_and_no_shards(tmp_path, monkeypatch):
    # Each shard is written as it fills: a full disk at the second must not leave the first behind.
    from holmes_jax import cli

    save_file, written = safetensors.numpy.save_file, []

    def full_at_the_second(tensors, path, **kwargs):
        if written:
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        written.append(path)
        save_file(tensors, path, **kwargs)
    monkeypatch.setattr(safetensors.numpy, "save_file", full_at_the_second)
    cfg = presets.resolve(ModelConfig(preset="llama-tiny", num_layers=2, hidden=64, num_heads=4, ffn_hidden=96))
    with pytest.raises(cli.RunError, match="No space left on device"):
        export.save_hf(jax.tree.map(np.asarray, gpt.GPT(cfg).init(0)), cfg, tmp_path / "hf", max_shard_size=40_000)
    assert written and list(tmp_path.iterdir()) == []  # neither hf nor the temporary folder beside it


def test_top_k_samples_exactly_k_ids_and_a_tie_goes_to_the_lower_id_as_greedy_picks():
    logits = np.array([1.0, 3.0, 3.0, 3.0, 0.0], np.float32)  # ids 1, 2 and 3 tie for the most likely
    rng = np.random.default_rng(0)
    assert {generate._sample(logits, 1.0, 2, rng) for _ in range(200)} == {1, 2}
    assert {generate._sample(logits, 1.0, 1, rng) for _ in range(50)} == {int(np.argmax(logits))}
    # Through a model: 'A' (32) then 256 known ids tied at 0; a high temperature makes them all likely.
    m = _model_favouring(300)
    assert set(generate.generate(m, [65], 40, top_k=2, temperature=1e3, seed=1)) == {0, 65}
    assert generate.generate(m, [65], 3, top_k=1) == generate.generate(m, [65], 3, greedy=True)


def test_the_context_is_padded_to_the_longest_a_forward_sees_rounded_up_to_a_power_of_two(monkeypatch):
    seen, forward = [], generate._last_logits

    def recording(model, params, tokens, n):
        seen.append((tokens.shape[1], n))
        return forward(model, params, tokens, n)
    monkeypatch.setattr(generate, "_last_logits", recording)
    m = _model_favouring(300, end_of_text=256)
    assert generate.generate(m, [65, 66, 67], 4, greedy=True) == [65] * 4
    # the longest context, 6 (the 4th new token is sampled, never fed back), up to a power of two
    assert seen == [(8, 3), (8, 4), (8, 5), (8, 6)]
    seen.clear()
    assert generate.generate(m, [], 2, greedy=True) == [65] * 2  # after the end-of-text a document starts with
    assert seen == [(2, 1), (2, 2)]
    seen.clear()
    long = [65] * m.config.max_seq_len  # past max_seq_len the context is its last max_seq_len tokens
    generate.generate(m, long, 2, greedy=True)
    assert seen == [(m.config.max_seq_len, m.config.max_seq_len)] * 2


def test_generate_takes_token_ids_and_refuses_text_or_other_numbers_in_one_error():
    m = _model_favouring(300)
    assert generate.generate(m, np.array([65, 66]), 2, greedy=True) == [65, 65]  # an array of ids, as a list
    with pytest.raises(ConfigError, match="generate takes token ids.*generate.encode"):
        generate.generate(m, "AB", 2, greedy=True)
    for bad in ([65.0], [[65, 66]]):  # a float id would be truncated; a batch is not one prompt
        with pytest.raises(ConfigError, match="prompt of .* is not allowed; allowed: a list of int token ids"):
            generate.generate(m, bad, 2, greedy=True)
    for k in (2.5, True):  # 2.5 failed as an index deep in numpy; True passed as 1
        with pytest.raises(ConfigError, match=f"--top-k {k} is not allowed"):
            generate.generate(m, [65], 2, top_k=k)


def test_a_model_prints_its_config_and_sizes_not_its_arrays(tmp_path):
    import tokenizers

    _tokenizer_json("abc abd abe " * 20, tmp_path / "bpe.json")
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "bpe.json"))
    m = _model_favouring(300, tokenizer=tok, end_of_text=256)
    count = sum(leaf.size for leaf in jax.tree.leaves(m.params))
    assert repr(m) == (f"Model(config={m.config!r}, step=0, params=<{count:,} parameters>, "
                       f"tokenizer=<tokenizers.Tokenizer of {tok.get_vocab_size()} ids>, end_of_text=256, token_file=None)")
    assert "tokenizer=None" in repr(_model_favouring(300))
    assert m == m and m != _model_favouring(300)  # identity: comparing the arrays raised


def test_generation_runs_the_head_at_the_last_context_position_only():
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, hidden=64, num_heads=4, ffn_hidden=96, vocab_size=4096))
    model, length = gpt.GPT(cfg), 64
    params = model.init(0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, length)).astype(np.int32)
    np.testing.assert_allclose(generate._last_logits(model, params, tokens, 5), model.logits(params, tokens)[0, 4],
                               rtol=1e-5, atol=1e-5)
    full = jax.jit(model.logits).lower(params, tokens).compile().cost_analysis()["flops"]
    last = generate._last_logits.lower(model, params, tokens, 5).compile().cost_analysis()["flops"]
    head = 2 * length * cfg.hidden * cfg.vocab_size  # the output projection at every position: most of this forward
    assert last < full - head / 2
