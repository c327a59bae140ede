"""`generate` called again and again in one process (a library user's loop over prompts): it
compiles a bounded number of programs, its padding changes no output, and it reads the
tokenizer's JSON and vocabulary once, not on every call."""

import math

import jax
import numpy as np
import pytest

from holmes_jax import generate, inference
from holmes_jax.config import ConfigError, ModelConfig
from holmes_jax.models import gpt, presets


def _model(positions: str = "learned", max_seq_len: int = 64, tokenizer=None) -> inference.Model:
    """A one-layer model on random parameters, scaled up so that its logits differ clearly."""
    cfg = presets.resolve(ModelConfig(preset="tiny", num_layers=1, hidden=64, num_heads=4, ffn_hidden=96,
                                      vocab_size=384, max_seq_len=max_seq_len, positions=positions))
    params = jax.tree.map(lambda p: p * 4, gpt.GPT(cfg).init(0))
    return inference.Model(cfg, params, tokenizer, 0)


def _unpadded_choices(m: inference.Model, prompt: list[int], new: list[int]) -> list[int]:
    """The greedy choice after `prompt` + new[:i], for each i, from forwards over exactly those
    contexts (no padding): one forward over them all where they fit in max_seq_len (position j's
    logits see the first j + 1 tokens only), else one per context (its last max_seq_len tokens)."""
    ids, known, limit = prompt + new, generate._known_ids(m), m.config.max_seq_len
    if len(ids) - 1 <= limit:
        logits = np.asarray(m.logits(np.array([ids[:-1]])))[0, len(prompt) - 1:]
    else:
        logits = np.stack([np.asarray(m.logits(np.array([ids[:i][-limit:]])))[0, -1]
                           for i in range(len(prompt), len(ids))])
    return [int(i) for i in np.argmax(logits[:, :known], axis=-1)]


def test_generate_compiles_a_bounded_number_of_programs_over_many_prompt_lengths():
    m = _model(max_seq_len=48)  # a config no other test compiles for
    before = generate._last_logits._cache_size()  # compiled programs of the forward, one per shape and model
    for length in range(1, 25):
        generate.generate(m, [65] * length, 3, greedy=True)
    # Padded lengths 4, 8, 16, 32: one program each, where each prompt length compiled its own.
    assert generate._last_logits._cache_size() - before <= math.ceil(math.log2(m.config.max_seq_len))


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_padded_generation_gives_what_the_unpadded_forward_gives(positions):
    m = _model(positions, max_seq_len=32)
    rng = np.random.default_rng(0)
    # Contexts padded to 8, to 16 and to 32, and a prompt past max_seq_len (its last 32 tokens).
    for length, new in ((5, 4), (3, 10), (19, 3), (40, 2)):
        prompt = [int(i) for i in rng.integers(0, 256, length)]
        out = generate.generate(m, prompt, new, greedy=True)
        assert len(out) == new and out == _unpadded_choices(m, prompt, out), (length, new)
    tokens = rng.integers(0, 256, (1, 32)).astype(np.int32)
    for n in (12, 21):  # the logits themselves, to float32 rounding, at lengths compiled above
        padded = np.zeros((1, generate._padded_length(n, 32)), np.int32)
        padded[0, :n] = tokens[0, :n]
        np.testing.assert_allclose(generate._last_logits(m.gpt, m.params, padded, n),
                                   m.logits(tokens[:, :n])[0, -1], rtol=1e-5, atol=1e-5)


def test_padded_lengths_are_powers_of_two_up_to_max_seq_len():
    assert [generate._padded_length(n, 48) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]


def _tokenizer(unk_token: str | None):
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=unk_token))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=[unk_token] if unk_token else [])
    tok.train_from_iterator(["abc abd abe " * 20], trainer)
    return tok


class _CountingTokenizer:
    """A tokenizer that counts the calls of its whole-JSON and whole-vocabulary reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.reads = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def to_str(self, *args, **kwargs):
        self.reads += 1
        return self.tokenizer.to_str(*args, **kwargs)

    def get_vocab(self, *args, **kwargs):
        self.reads += 1
        return self.tokenizer.get_vocab(*args, **kwargs)


def test_encode_and_generate_read_the_tokenizers_json_and_vocabulary_once():
    tok = _CountingTokenizer(_tokenizer("<unk>"))
    m = _model(tokenizer=tok)
    for _ in range(3):
        assert generate.encode(m, "abc abe") == tok.tokenizer.encode("abc abe", add_special_tokens=False).ids
        generate.generate(m, generate.encode(m, "abd"), 1, greedy=True)
    assert tok.reads == 2  # its JSON for the unknown token, its vocabulary for the ids it knows


def test_tokens_added_after_the_first_read_are_known():
    tok = _tokenizer("<unk>")
    before = generate._tokenizer_ids(tok)
    tok.add_tokens(["zz"])  # cached before, the new id stayed out of what generate may sample
    assert generate._tokenizer_ids(tok) == before + 1 == tok.token_to_id("zz") + 1


def test_each_tokenizer_keeps_its_own_unknown_token():
    with_unk, without = _tokenizer("<unk>"), _tokenizer(None)
    assert generate._unknown_id(with_unk) == with_unk.token_to_id("<unk>")
    assert generate._unknown_id(without) is None
    for tok in (with_unk, without, with_unk):  # asked again, in turn: each its own answer
        with pytest.raises(ConfigError, match="no token for 'z'"):
            generate.encode(_model(tokenizer=tok), "abc z")
        assert generate.encode(_model(tokenizer=tok), "abc") == tok.encode("abc", add_special_tokens=False).ids


def test_models_of_one_config_share_the_compiled_forward():
    first = _model(max_seq_len=32)
    generate.generate(first, [65, 66], 3, greedy=True)
    before = generate._last_logits._cache_size()
    # Another load of the run, or another checkpoint of it: the same config, its own parameters.
    params = jax.tree.map(lambda p: -p, first.params)
    second = inference.Model(first.config, params, None, 1)
    out = generate.generate(second, [65, 66], 3, greedy=True)
    assert generate._last_logits._cache_size() == before
    assert out == _unpadded_choices(second, [65, 66], out)  # with its own parameters
    assert out != generate.generate(first, [65, 66], 3, greedy=True)


def test_a_run_that_chose_cudnn_attention_on_a_gpu_runs_on_a_cpu(tmp_path):
    # generate and holmes_jax.load failed on a CPU with "cuDNN is not detected" (a traceback)
    (tmp_path / "config.gin").write_text("ModelConfig.attention = 'cudnn'\nModelConfig.compute_dtype = 'bfloat16'\n")
    cfg, _ = inference.read_configs(tmp_path)
    assert (cfg.attention, cfg.compute_dtype) == ("auto", "bfloat16")
    m = inference.Model(cfg, gpt.GPT(cfg).init(0), None, 0)
    assert np.isfinite(np.asarray(m.logits(np.array([[1, 2, 3]])))).all()
    chosen = presets.resolve(ModelConfig(preset="tiny", attention="xla"))  # a choice that runs here stays
    assert gpt.runnable_on(chosen, jax.devices()[0]) is chosen
