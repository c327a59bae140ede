"""Hugging Face folders in and out.

`python -m holmes_jax.export --workdir W --out DIR [--step N] [--max-shard-size SIZE]` writes a run's
newest (or given) checkpoint as a folder `transformers` loads with
`AutoModelForCausalLM.from_pretrained(DIR)`:

- GPT-2 style (learned positions, layernorm, gelu) -> `GPT2LMHeadModel`. Its Conv1D weights are
  (in, out) like ours, q/k/v fused into `c_attn`; it always has biases (zeros when the run had none).
- LLaMA style (rotary, rmsnorm, swiglu) -> `LlamaForCausalLM`. Its nn.Linear weights are (out, in):
  transposed. Our rotary pairs (i, i + head_dim / 2) as its `rotate_half` does, so q and k need
  no permutation.

The folder holds model.safetensors (float32; past `--max-shard-size`, 5GB by default, the shards
model-00001-of-0000N.safetensors ... and model.safetensors.index.json, as `transformers` saves a
big model), config.json and, when the run trained with one, its tokenizer.json (the run's copy,
else its data folder's) with a tokenizer_config.json saying how that tokenizer was used
(`tokenizer_config`). Other mixes (say rmsnorm with gelu) have no Hugging Face class: ConfigError.

`ModelConfig.init_from = DIR` starts a fresh run from such a folder (ours or one downloaded
beforehand); `import_hf` reads it and checks that it fits the run's ModelConfig.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import safetensors.numpy

from holmes_jax import cli, inference
from holmes_jax.config import ConfigError, ModelConfig
from holmes_jax.models import gpt

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
_GPT2_BIASES = ("attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")


def architecture(cfg: ModelConfig) -> str:
    """The Hugging Face class that computes what `cfg` does."""
    style = (cfg.positions, cfg.norm, cfg.mlp)
    if style == ("learned", "layernorm", "gelu"):
        if cfg.num_kv_heads != cfg.num_heads:
            raise ConfigError(f"GPT2LMHeadModel has no grouped-query attention: ModelConfig.num_kv_heads = "
                              f"{cfg.num_kv_heads} must equal ModelConfig.num_heads = {cfg.num_heads}")
        return GPT2
    if style == ("rotary", "rmsnorm", "swiglu"):
        return LLAMA
    raise ConfigError(f"ModelConfig positions={cfg.positions!r}, norm={cfg.norm!r}, mlp={cfg.mlp!r} has no Hugging "
                      f"Face class: GPT2LMHeadModel needs learned, layernorm, gelu; LlamaForCausalLM rotary, "
                      f"rmsnorm, swiglu")


def hf_config(cfg: ModelConfig, end_of_text: int | None = None) -> dict:
    """config.json for `cfg`. The only token id is `end_of_text`, the one the run's data put after
    each document (where it put one): `transformers`' generate stops there. No begin-of-text: the
    runs' documents start without one."""
    common = dict(architectures=[architecture(cfg)], vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings,
                  bos_token_id=None, eos_token_id=end_of_text, torch_dtype="float32")
    if architecture(cfg) == GPT2:
        return dict(common, model_type="gpt2", n_layer=cfg.num_layers, n_embd=cfg.hidden, n_head=cfg.num_heads,
                    n_inner=cfg.ffn_hidden, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
                    activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    # rope_theta for transformers 4, rope_parameters for 5.
    return dict(common, model_type="llama", num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                intermediate_size=cfg.ffn_hidden, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                rope_theta=cfg.rope_base, rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_base),
                rope_scaling=None, hidden_act="silu", attention_bias=cfg.bias, mlp_bias=cfg.bias)


def tokenizer_config(cfg: ModelConfig, end_of_text: str | None) -> dict:
    """tokenizer_config.json: without one, `AutoTokenizer` takes the model type's tokenizer
    class, whose defaults our runs did not train with (LLaMA's adds a begin-of-text '<s>', GPT-2's
    names '<|endoftext|>', which a trained BPE may lack). The generic fast tokenizer uses
    tokenizer.json as it is, as prepare encoded the text: no begin-of-text, `end_of_text` (its
    name) only after each document, and a special token's name written in the text is plain text."""
    return dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=None, eos_token=end_of_text,
                add_bos_token=False, add_eos_token=False, split_special_tokens=True,
                clean_up_tokenization_spaces=False, model_max_length=cfg.max_seq_len)


def _fields(hf: dict) -> dict:
    """The ModelConfig fields a config.json describes; ConfigError for what our model cannot compute."""
    arch = (hf.get("architectures") or [None])[0]
    if hf.get("model_type") == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"config.json activation_function = {hf['activation_function']!r}: only the tanh "
                              f"GELU (gelu_new) is supported")
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise ConfigError("config.json scale_attn_by_inverse_layer_idx / scale_attn_weights: only GPT-2's "
                              "plain 1/sqrt(head size) attention scale is supported")
        return dict(positions="learned", norm="layernorm", mlp="gelu", num_layers=hf["n_layer"], hidden=hf["n_embd"],
                    num_heads=hf["n_head"], num_kv_heads=hf["n_head"], ffn_hidden=hf.get("n_inner") or 4 * hf["n_embd"],
                    vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                    norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_embeddings=hf.get("tie_word_embeddings", True))
    if hf.get("model_type") == "llama":
        rope = hf.get("rope_parameters") or {}
        # transformers also reads the kind under its older key "type" (a linear scaling passed as plain)
        if hf.get("rope_scaling") or rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"config.json rope scaling {hf.get('rope_scaling') or rope!r} is not supported: "
                              f"only plain rotary positions (rope_type 'default')")
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1:  # transformers then turns only that share of each head
            raise ConfigError(f"config.json partial_rotary_factor = {partial!r} is not supported: only rotary "
                              f"positions over whole heads (1.0)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act = {hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            raise ConfigError("config.json attention_bias and mlp_bias differ; ModelConfig.bias covers both")
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        if heads < 1 or hidden % heads:
            raise ConfigError(f"config.json hidden_size = {hidden!r} is not a multiple of num_attention_heads = "
                              f"{heads!r}")
        head_dim = hf.get("head_dim") or hidden // heads  # null or absent: LlamaConfig's default
        if head_dim * heads != hidden:
            raise ConfigError(f"config.json head_dim = {head_dim!r}: only hidden_size / num_attention_heads")
        return dict(positions="rotary", norm="rmsnorm", mlp="swiglu", num_layers=hf["num_hidden_layers"],
                    hidden=hidden, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                    ffn_hidden=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                    norm_eps=hf.get("rms_norm_eps", 1e-6), rope_base=rope.get("rope_theta", hf.get("rope_theta", 1e4)),
                    tie_embeddings=hf.get("tie_word_embeddings", False), bias=hf.get("attention_bias", False))
    raise ConfigError(f"config.json model_type = {hf.get('model_type')!r} ({arch}) is not supported; "
                      f"allowed: 'gpt2' (GPT2LMHeadModel), 'llama' (LlamaForCausalLM)")


def check_fits(hf: dict, cfg: ModelConfig) -> None:
    """ConfigError naming every ModelConfig field that differs from what config.json describes."""
    try:
        fields = _fields(hf)
    except KeyError as e:
        raise ConfigError(f"ModelConfig.init_from: config.json has no {e.args[0]!r}") from None
    except (TypeError, AttributeError) as e:  # a field null or of another type
        raise ConfigError(f"ModelConfig.init_from: config.json has a field of the wrong type ({e})") from None
    wrong = []
    for name, want in fields.items():
        have = getattr(cfg, name)
        same = math.isclose(have, want, rel_tol=1e-9) if isinstance(want, float) else have == want
        if not same:
            wrong.append(f"ModelConfig.{name} = {have!r} but the folder has {want!r}")
    if wrong:
        raise ConfigError("ModelConfig.init_from: the Hugging Face model does not fit the ModelConfig: "
                          + "; ".join(wrong))


def _pairs(cfg: ModelConfig) -> list[tuple[str, tuple, int | None, bool]]:
    """(Hugging Face name, our leaf path, layer or None, transposed) of every tensor that maps one to
    one; GPT-2's fused c_attn (and its zero biases) are handled apart."""
    if architecture(cfg) == GPT2:
        top = {"transformer.wte.weight": ("embed", "tokens", "embedding"), "transformer.wpe.weight": ("embed", "positions"),
               "transformer.ln_f.weight": ("head", "norm", "scale"), "transformer.ln_f.bias": ("head", "norm", "bias")}
        layer = {"ln_1.weight": ("attn_norm", "scale"), "ln_1.bias": ("attn_norm", "bias"),
                 "ln_2.weight": ("mlp_norm", "scale"), "ln_2.bias": ("mlp_norm", "bias"),
                 "attn.c_proj.weight": ("o", "kernel"), "mlp.c_fc.weight": ("up", "kernel"),
                 "mlp.c_proj.weight": ("down", "kernel")}
        if cfg.bias:
            layer |= {"attn.c_proj.bias": ("o", "bias"), "mlp.c_fc.bias": ("up", "bias"), "mlp.c_proj.bias": ("down", "bias")}
        prefix, linear = "transformer.h", {}
    else:
        top = {"model.embed_tokens.weight": ("embed", "tokens", "embedding"), "model.norm.weight": ("head", "norm", "scale")}
        layer = {"input_layernorm.weight": ("attn_norm", "scale"), "post_attention_layernorm.weight": ("mlp_norm", "scale")}
        projections = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
                       "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down"}
        linear = {f"{hf}.weight": (ours, "kernel") for hf, ours in projections.items()}  # nn.Linear: (out, in)
        if cfg.bias:
            layer |= {f"{hf}.bias": (ours, "bias") for hf, ours in projections.items()}
        prefix = "model.layers"
    pairs = [(name, path, None, False) for name, path in top.items()]
    for i in range(cfg.num_layers):
        pairs += [(f"{prefix}.{i}.{name}", ("blocks",) + path, i, False) for name, path in layer.items()]
        pairs += [(f"{prefix}.{i}.{name}", ("blocks",) + path, i, True) for name, path in linear.items()]
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", ("head", "out", "kernel"), None, True))
    return pairs


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _hf_tensors(cfg: ModelConfig) -> list[tuple[str, tuple, tuple, Callable]]:
    """Every Hugging Face tensor of `cfg` (GPT-2's zero biases included) as (name, shape, the
    canonical leaves it is made of, `make(*leaves)`: the float32 tensor, from those leaves as
    numpy arrays), the tensors of the same leaves one after another: a writer reads each leaf once."""
    abstract = jax.eval_shape(lambda: gpt.GPT(cfg).init(0))
    groups = {}  # leaves -> their tensors, in the order first met

    def add(name: str, shape: tuple, leaves: tuple, make: Callable) -> None:
        groups.setdefault(leaves, []).append((name, tuple(shape), leaves, make))
    for name, path, layer, transposed in _pairs(cfg):
        shape = _get(abstract, path).shape[0 if layer is None else 1:]
        add(name, shape[::-1] if transposed else shape, (path,), functools.partial(_copy, layer, transposed))
    if architecture(cfg) == GPT2:
        h = cfg.hidden
        for i in range(cfg.num_layers):
            pre = f"transformer.h.{i}."
            fused = [("kernel", "weight", (h, 3 * h))] + ([("bias", "bias", (3 * h,))] if cfg.bias else [])
            for ours, theirs, shape in fused:  # q, k, v side by side
                add(pre + f"attn.c_attn.{theirs}", shape, tuple(("blocks", p, ours) for p in "qkv"),
                    functools.partial(_fused, i))
            if not cfg.bias:  # GPT-2 always adds biases: zeros compute the same
                widths = (3 * h, h, cfg.ffn_hidden, h)
                for name, width in zip(_GPT2_BIASES, widths):
                    add(pre + name, (width,), (), functools.partial(np.zeros, width, np.float32))
    return [tensor for tensors in groups.values() for tensor in tensors]


def _copy(layer: int | None, transposed: bool, leaf: np.ndarray) -> np.ndarray:
    """Layer `layer` of `leaf` (all of it for None), transposed or not: a copy, so that a shard holds
    only its own tensors, not the whole stacked leaves they are views of."""
    x = leaf if layer is None else leaf[layer]
    return np.array(x.T if transposed else x, np.float32, order="C")


def _fused(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.concatenate([q[layer], k[layer], v[layer]], axis=-1)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every Hugging Face tensor `cfg` reads, with the shape it must have (GPT-2's zero biases
    may be absent)."""
    return {name: shape for name, shape, leaves, _ in _hf_tensors(cfg) if leaves}


def _full_names(found: dict, cfg: ModelConfig) -> dict:
    """`found` keyed by the causal-LM class's names also when it was saved from the base model
    (GPT2Model, LlamaModel: no 'transformer.' or 'model.' prefix)."""
    prefix = "transformer." if architecture(cfg) == GPT2 else "model."
    if any(k.startswith(prefix) for k in found):
        return found
    return {prefix + k if not k.startswith("lm_head") else k: v for k, v in found.items()}


_FLOATS = ("float32", "float16", "bfloat16", "float64")


def _check_tensors(found: dict[str, tuple[str, tuple, str, Path]], cfg: ModelConfig, read, files: str) -> None:
    """ConfigError when a tensor `cfg` needs is missing, not floating point or of another shape, or
    a GPT-2 bias is nonzero while `cfg` has none; each names the tensor as its file does and that
    file. `found`: our name -> (dtype name, shape, name in the file, file) of every tensor there;
    `read(name)` reads one (only those biases are read); `files`: where a missing one was looked for."""
    for name, shape in _expected_shapes(cfg).items():
        if name not in found:
            raise ConfigError(f"ModelConfig.init_from: no tensor {name!r} in {files}")
        dtype, have, stored, path = found[name]
        if dtype not in _FLOATS:
            raise ConfigError(f"ModelConfig.init_from: tensor {stored!r} in {str(path)!r} is {dtype}; allowed: "
                              f"{', '.join(_FLOATS)}")
        if tuple(have) != tuple(shape):
            raise ConfigError(f"ModelConfig.init_from: tensor {stored!r} in {str(path)!r} is {tuple(have)}, the "
                              f"ModelConfig needs {tuple(shape)}")
    if architecture(cfg) == GPT2 and not cfg.bias:
        for i in range(cfg.num_layers):
            for bias in (f"transformer.h.{i}.{b}" for b in _GPT2_BIASES):
                if bias in found and np.any(read(bias) != 0):
                    _, _, stored, path = found[bias]
                    raise ConfigError(f"ModelConfig.bias = False but tensor {stored!r} in {str(path)!r} (GPT-2 "
                                      f"layer {i}) is nonzero; set ModelConfig.bias = True")


def _part(tensor, name: str, transposed: bool, offset: int, shape: tuple, index: tuple) -> np.ndarray:
    """float32 values at `index` (a slice per axis) of a leaf of `shape` (one layer's) that is
    Hugging Face tensor `name`, transposed or not, from its column `offset` on (GPT-2's fused
    c_attn); only that part is read."""
    index = [slice(*i.indices(n)) for i, n in zip(index, shape)]
    if offset:
        index[-1] = slice(index[-1].start + offset, index[-1].stop + offset)
    x = np.asarray(tensor(name)[tuple(index[::-1] if transposed else index)], np.float32)
    return x.T if transposed else x


def _leaf_readers(tensor, cfg: ModelConfig, abstract: dict) -> dict:
    """Our leaf path -> `read(index)`, the float32 values of that canonical leaf at `index` (a
    slice per axis), from the Hugging Face tensors (`tensor(name)`: one, by its causal-LM name, to
    slice), already checked against `cfg`; `abstract`: the shapes of `cfg`'s parameters."""
    readers, layers = {}, {}  # layers: stacked leaf -> (name, transposed, column offset) per layer
    for name, path, layer, transposed in _pairs(cfg):
        if layer is None:
            readers[path] = functools.partial(_part, tensor, name, transposed, 0, _get(abstract, path).shape)
        else:
            layers.setdefault(path, []).append((name, transposed, 0))
    if architecture(cfg) == GPT2:  # q, k and v: column blocks of c_attn
        fused = [("kernel", "weight")] + ([("bias", "bias")] if cfg.bias else [])
        for i in range(cfg.num_layers):
            for j, p in enumerate("qkv"):
                for ours, theirs in fused:
                    layers.setdefault(("blocks", p, ours), []).append(
                        (f"transformer.h.{i}.attn.c_attn.{theirs}", False, j * cfg.hidden))
    for path, parts in layers.items():
        shape = _get(abstract, path).shape[1:]
        readers[path] = lambda index, parts=parts, shape=shape: np.stack(
            [_part(tensor, *part, shape, index[1:]) for part in parts[index[0]]])
    return readers


INDEX = "model.safetensors.index.json"


def _tensor_files(folder: Path) -> list[Path]:
    """model.safetensors, or (without one) every shard a model.safetensors.index.json lists: the
    order `transformers` looks in, so a folder holding both gives its model."""
    index = folder / INDEX
    if not (folder / "model.safetensors").is_file() and index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(name, str) and name for name in weight_map.values()):
            raise ConfigError(f"ModelConfig.init_from: {str(index)!r} has no weight_map of tensor names to "
                              f"shard file names")
        names = sorted(set(weight_map.values()))
    else:
        names = ["model.safetensors"]
    for name in names:
        if not (folder / name).is_file():
            raise ConfigError(f"ModelConfig.init_from = {str(folder)!r} has no {name}")
    return [folder / name for name in names]


_HEADER_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' names


def check_hf_folder(folder: str | Path, cfg: ModelConfig) -> Path:
    """`folder` as a Path, once its config.json and its tensors' names, types and shapes fit `cfg`
    (a ConfigError otherwise). It reads the tensor headers, not the weights (only GPT-2's biases when
    `cfg` has none), so a run checks its init_from before it writes anything."""
    return _checked_reader(folder, cfg)[0]


def _checked_reader(folder: str | Path, cfg: ModelConfig):
    """`check_hf_folder`'s folder and what it found there: our name -> (dtype name, shape, name in
    the file, file) of every tensor."""
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"ModelConfig.init_from = {str(folder)!r} is not allowed; allowed: a Hugging Face model "
                          f"folder with config.json and model.safetensors")
    check_fits(_read_json(folder / "config.json"), cfg)
    found, files = {}, _tensor_files(folder)
    for path in files:
        try:
            with safetensors.safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    dtype = _HEADER_DTYPES.get(tensor.get_dtype(), tensor.get_dtype())
                    found[name] = (dtype, tuple(tensor.get_shape()), name, path)
        except (OSError, safetensors.SafetensorError) as e:
            raise ConfigError(f"ModelConfig.init_from: {str(path)!r} cannot be read as safetensors ({e})") from None
    found = _full_names(found, cfg)  # our name -> (..., the name in the file, the file)

    def read(name: str) -> np.ndarray:
        *_, stored, path = found[name]
        with safetensors.safe_open(path, framework="numpy") as f:
            return f.get_tensor(stored)
    where = (repr(str(files[0])) if len(files) == 1 else
             f"the {len(files)} shards model.safetensors.index.json lists in {str(folder)!r}")
    _check_tensors(found, cfg, read, where)
    return folder, found


def _read_json(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"ModelConfig.init_from: {str(path)!r} cannot be read as JSON ({e})") from None
    if not isinstance(found, dict):
        raise ConfigError(f"ModelConfig.init_from: {str(path)!r} holds no JSON object")
    return found


def import_hf(folder: str | Path, cfg: ModelConfig, shardings: dict | None = None) -> dict:
    """Canonical float32 parameters of the Hugging Face model in `folder`, which must fit `cfg`:
    numpy arrays, or, given `shardings` (a NamedSharding per leaf), global arrays of which each
    process reads only the parts its devices hold, each part once (whole, an 8B model was 32 GB of
    float32 in every process). Only the tensors `cfg` takes are read."""
    found = _checked_reader(folder, cfg)[1]
    abstract = jax.eval_shape(lambda: gpt.GPT(cfg).init(0))
    with contextlib.ExitStack() as stack:
        files = {path: stack.enter_context(safetensors.safe_open(path, framework="numpy"))
                 for path in {path for *_, path in found.values()}}
        readers = _leaf_readers(lambda name: files[found[name][3]].get_slice(found[name][2]), cfg, abstract)

        def leaf(key_path, like, sharding=None):
            read = readers[tuple(k.key for k in key_path)]
            if sharding is None:
                return read((slice(None),) * like.ndim)
            parts = {}  # a part that several devices hold (replicas) is read once

            def part(index):
                key = tuple(i.indices(n) for i, n in zip(index, like.shape))
                if key not in parts:
                    parts[key] = read(index)
                return parts[key]
            return jax.make_array_from_callback(like.shape, sharding, part)
        if shardings is None:
            return jax.tree_util.tree_map_with_path(leaf, abstract)
        return jax.tree_util.tree_map_with_path(leaf, abstract, shardings)


MAX_SHARD_SIZE = 5 * 10**9  # huggingface_hub's default, and transformers 4's (5's is 50GB)


def save_hf(params: dict, cfg: ModelConfig, out: str | Path, tokenizer: Path | None = None,
            end_of_text: int | None = None, max_shard_size: int = MAX_SHARD_SIZE) -> Path:
    """Writes `params` of `cfg` as a Hugging Face folder `out`, which must be new or empty (and
    copies `tokenizer`, a tokenizer.json); returns its absolute path. The weights are
    model.safetensors, or shards of at most `max_shard_size` bytes (`_write_weights`)."""
    def read(paths: tuple) -> list[np.ndarray]:
        return [np.asarray(_get(params, path), np.float32) for path in paths]
    return _write_folder(read, cfg, out, tokenizer, end_of_text, max_shard_size)


def _write_folder(read: Callable[[tuple], list], cfg: ModelConfig, out: str | Path, tokenizer: Path | None,
                  end_of_text: int | None, max_shard_size: int) -> Path:
    """`save_hf`, the leaves read by `read(paths)` (a tuple of leaf paths -> their arrays)."""
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ConfigError(f"max_shard_size = {max_shard_size!r} is not allowed; allowed: a positive number of bytes")
    config = hf_config(cfg, end_of_text)
    with cli.output_folder(out, last="config.json") as tmp:
        _write_weights(tmp, cfg, read, max_shard_size)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
            name = None if end_of_text is None else _token_name(tokenizer, end_of_text)
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg, name), indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out).expanduser().resolve()


def _shards(tensors: list[tuple], max_shard_size: int) -> list[list[tuple]]:
    """`tensors` ((name, shape, ...), float32) cut, in order, into shards of at most
    `max_shard_size` bytes; a tensor larger than that gets a shard of its own."""
    shards, size = [[]], 0
    for tensor in tensors:
        nbytes = _nbytes(tensor[1])
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def _nbytes(shape: tuple) -> int:
    return 4 * math.prod(shape)  # float32


def _write_weights(folder: Path, cfg: ModelConfig, read: Callable[[tuple], list], max_shard_size: int) -> None:
    """Writes `cfg`'s Hugging Face tensors into `folder` as transformers' save_pretrained does:
    model.safetensors when they fit in `max_shard_size` bytes, else model-00001-of-0000N.safetensors
    ... and model.safetensors.index.json. The leaves come from `read(paths)`, a few at a time:
    at most the leaves of one tensor and one shard's tensors are held (an 8B model was 32 GB of
    leaves and as much again of tensors)."""
    tensors = _hf_tensors(cfg)
    shards = _shards(tensors, max_shard_size)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    # safetensors makes its files 0600: the mode the umask gives a new file (the folder's, less
    # execute), so that whoever may read the folder's other files may read the weights too
    mode = folder.stat().st_mode & 0o666
    held = leaves = None
    for file, shard in zip(files, shards):
        written = {}
        for name, _, paths, make in shard:
            if paths != held:
                leaves = None  # dropped before the next ones are read
                leaves, held = read(paths), paths
            written[name] = make(*leaves)
        _save_file(written, folder / file, mode)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(shape) for _, shape, *_ in tensors)},
                 "weight_map": {t[0]: file for file, shard in zip(files, shards) for t in shard}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _save_file(tensors: dict[str, np.ndarray], path: Path, mode: int) -> None:
    try:
        safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
    except safetensors.SafetensorError as e:  # a full disk, say: its I/O errors come wrapped,
        code = re.search(r"\(os error (\d+)\)", str(e))  # the errno in the text ('... (os error 28)')
        raise (OSError(int(code[1]), str(e)) if code else OSError(str(e))) from None
    path.chmod(mode)


def _token_name(tokenizer: Path, token_id: int) -> str:
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(tokenizer)).id_to_token(token_id)


def export(workdir: str | Path, out: str | Path, step: int | None = None,
           max_shard_size: int = MAX_SHARD_SIZE) -> Path:
    """Writes checkpoint `step` (default the newest) of the run in `workdir` to the folder `out`,
    reading the checkpoint a few leaves at a time (see `_write_weights`)."""
    cfg, data = inference.read_configs(workdir)
    architecture(cfg)  # before the restore: an unexportable config or a taken --out fails fast
    cli.new_folder(out)
    _, eot, _ = inference.run_tokens(workdir, data)  # before the restore: a damaged tokenizer.json fails fast
    with inference.open_params(workdir, cfg, step, jax.devices("cpu")[0]) as saved:
        def read(paths: tuple) -> list[np.ndarray]:
            tree = saved.read(list(paths)) if paths else {}
            return [np.asarray(_get(tree, path), np.float32) for path in paths]
        return _write_folder(read, cfg, out, inference.tokenizer_file(workdir, data), eot, max_shard_size)


_SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # transformers' units


def shard_size(text: str) -> int:
    """An argparse `type` for --max-shard-size: bytes, or a number with a unit ('5GB', '1.5GB')."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]B)?", text.strip(), re.ASCII | re.IGNORECASE)
    size = float(found[1]) * _SIZE_UNITS[(found[2] or "").upper()] if found else 0
    size = round(size) if math.isfinite(size) else 0  # 400 digits are inf as a float: no size at all
    if size < 1 or (found and not found[2] and "." in found[1]):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a number of bytes or a size with "
                                         f"a unit KB, MB, GB or TB (powers of 1000), e.g. 5GB")
    return size


def main(argv: list[str]) -> int:
    p = cli.Parser(prog="python -m holmes_jax.export",
                   description="Write a run's checkpoint as a Hugging Face folder (GPT2LMHeadModel or LlamaForCausalLM).")
    p.add_argument("--workdir", required=True, type=cli.path, help="the run's TrainConfig.workdir")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--step", type=cli.non_negative_int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--max-shard-size", type=shard_size, default=MAX_SHARD_SIZE,
                   help="the largest weights file, e.g. 500MB; bigger models are written as shards with an index "
                        "(default: 5GB)")
    args = p.parse_args(argv)
    out = export(args.workdir, args.out, args.step, args.max_shard_size)
    names = sorted(f.name for f in out.iterdir())
    shards = [name for name in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name)]
    if len(shards) > 2:  # the first and the last: a 70B model has dozens
        names[names.index(shards[0]):names.index(shards[-1]) + 1] = [f"{shards[0]} ... {shards[-1]}"]
    print(f"wrote {args.out}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    cli.run(main)
