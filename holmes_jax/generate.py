"""`python -m holmes_jax.generate --workdir W --prompt TEXT --max-tokens N [--greedy]
[--temperature X] [--top-k K] [--seed S] [--step N]`: prints the prompt and a continuation from a
run's newest checkpoint (or that of step N).

Text becomes tokens with the run's tokenizer.json (no special tokens added: training added none),
or as UTF-8 bytes when the run read bytes; bytes that are not valid UTF-8 print as U+FFFD. A run
on a .bin token file has no way from text to its ids: an error. A special token's name in the
prompt is text, as in the training text; a character the tokenizer has no token for is refused.
Only ids the tokenizer (or bytes) knows are generated, not the padding rows of the embedding.
--top-k K samples among exactly K ids, a tie with the K-th going to the lower id as --greedy's
argmax does, so that --top-k 1 is --greedy (transformers and nanoGPT keep every id tied with the
K-th).
Generation stops early at the end-of-text id the data put after each document; an empty prompt
starts a new document after one.
There is no KV cache: every new token reruns the model over its context, padded to one fixed
length per call, the longest context the call sees rounded up to a power of two (at most
`max_seq_len`), so that the forward compiles once per such length and model config in a
process, not once per prompt length or loaded Model. The context is the last `max_seq_len` tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import numbers
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from holmes_jax import cli, inference, prepare
from holmes_jax.config import ConfigError
from holmes_jax.inference import Model
from holmes_jax.models import gpt


def encode(m: Model, text: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes a terminal passed that are not UTF-8 arrive as lone surrogates
        raise ConfigError(f"--prompt {text!r} is not allowed; allowed: UTF-8 text") from None
    if m.token_file is not None:  # its ids are not bytes: encoding text as bytes would feed the model noise
        raise ConfigError(f"the run read token ids from {m.token_file!r} and has no tokenizer.json, so text cannot "
                          f"become its ids; generate from a run on text or on a holmes-data prepare folder")
    if m.tokenizer is None:
        return list(text.encode("utf-8"))
    # A template's special tokens (a leading <s>, say) were not in the training data either.
    encoding = m.tokenizer.encode(text, add_special_tokens=False)
    unknown = _unknown_characters(m.tokenizer, text, encoding)
    if unknown:  # they would become the unknown token or vanish, and the printed prompt lose them
        raise ConfigError(f"--prompt {text!r} is not allowed: the run's tokenizer has no token for "
                          f"{', '.join(map(repr, unknown))}; allowed: text of characters its tokens spell")
    return encoding.ids


def _unknown_characters(tokenizer, text: str, encoding) -> list[str]:
    """The characters of `text` (each once, in order) that `encoding` spells with the tokenizer's
    unknown token or drops. Dropped whitespace is fine: many pre-tokenizers split on it."""
    unk = _unknown_id(tokenizer)
    spans = [(token == unk, range(start, end)) for token, (start, end) in zip(encoding.ids, encoding.offsets)]
    covered = {i for _, span in spans for i in span}
    as_unknown = {i for is_unk, span in spans if is_unk for i in span}
    unknown = [c for i, c in enumerate(text) if i in as_unknown or (i not in covered and not c.isspace())]
    return list(dict.fromkeys(unknown))


def _per_tokenizer(read):
    """`read(tokenizer)`, read once per tokenizer object and vocabulary size (tokens added later
    are read again): what it reads (the whole JSON, the whole vocabulary) takes milliseconds for a
    big vocabulary, on every encode or generate call else."""
    cache = weakref.WeakKeyDictionary()  # the entry goes with its tokenizer

    @functools.wraps(read)
    def cached(tokenizer):
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if cache.get(tokenizer, (None,))[0] != size:
            cache[tokenizer] = (size, read(tokenizer))
        return cache[tokenizer][1]
    return cached


@_per_tokenizer
def _unknown_id(tokenizer) -> int | None:
    model = json.loads(tokenizer.to_str())["model"]  # the unknown token: unk_id (Unigram) or unk_token
    return model["unk_id"] if "unk_id" in model else tokenizer.token_to_id(model.get("unk_token") or "")


@_per_tokenizer
def _tokenizer_ids(tokenizer) -> int:
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def decode(m: Model, ids: list[int]) -> str:
    if m.tokenizer is None:  # ids past the bytes (a vocabulary larger than 256) print as U+FFFD
        return bytes(i if i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")
    return m.tokenizer.decode(ids)


def generate(m: Model, prompt: list[int], max_tokens: int, greedy: bool = False, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0) -> list[int]:
    """Up to `max_tokens` new token ids after the token ids `prompt` (`encode(m, text)` for text;
    greedy: the most likely each time, else sampled, among the `top_k` most likely if given),
    ending before the run's end-of-text id if the model writes it."""
    prompt = _token_ids(prompt)
    _check(m, prompt, greedy, temperature, top_k)
    eot = _end_of_text(m)
    start = [] if prompt else [eot]  # every training document follows an end-of-text
    known = min(_known_ids(m), m.config.vocab_size)
    # The longest context a forward sees: the last new token is sampled, never fed back.
    longest = min(len(start) + len(prompt) + max_tokens - 1, m.config.max_seq_len)
    length = _padded_length(longest, m.config.max_seq_len)
    rng = np.random.default_rng(seed)
    ids = start + list(prompt)
    for _ in range(max_tokens):
        context = ids[-m.config.max_seq_len:]
        padded = np.zeros((1, length), np.int32)
        padded[0, : len(context)] = context  # causal: the padding after the context changes nothing before it
        logits = np.asarray(_last_logits(m.gpt, m.params, jnp.asarray(padded), len(context)), np.float64)[:known]
        if not np.isfinite(logits).all():  # argmax would pick a NaN's id, sampling fail on NaN probabilities
            raise ConfigError(f"checkpoint step {m.step} gives logits that are not finite (NaN or infinity): its "
                              f"parameters are not finite or overflow, as after a run diverged; allowed: an earlier "
                              f"checkpoint (--step)")
        token = int(np.argmax(logits)) if greedy else _sample(logits, temperature, top_k, rng)
        if token == eot:
            break
        ids.append(token)
    return ids[len(start) + len(prompt):]


def _padded_length(longest: int, max_seq_len: int) -> int:
    """The length a call's contexts are padded to: `longest` rounded up to a power of two, at most
    `max_seq_len`. Each length the forward sees compiles once per process: padding to the exact
    longest context compiled again for each new prompt length. A forward over at most twice the
    tokens (no more than `max_seq_len`) is the price; finer steps would compile more programs."""
    return min(1 << (longest - 1).bit_length(), max_seq_len)


def _token_ids(prompt) -> list[int]:
    """`prompt` as a list of Python ints, refused when it is text or not integers (a str would
    fail on comparing letters with ids, a float id be truncated)."""
    if isinstance(prompt, str):
        raise ConfigError(f"prompt = {prompt!r} is not allowed: generate takes token ids; "
                          f"allowed: a list of ints, such as generate.encode(m, text)")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ConfigError(f"prompt of {ids.dtype} {ids.shape} is not allowed; allowed: a list of int token ids")
    return [int(i) for i in ids]


def _check(m: Model, prompt: list[int], greedy: bool = False, temperature: float = 1.0,
           top_k: int | None = None) -> None:
    """Raises ConfigError for what `generate` cannot do; needs no parameters, so that the command
    refuses a prompt before it waits for a big checkpoint to be read."""
    if not prompt and _end_of_text(m) is None:
        raise ConfigError("--prompt is empty: generation needs at least one token")
    outside = [i for i in prompt if not 0 <= i < m.config.vocab_size]  # a negative id would read a row from the end
    if outside:
        raise ConfigError(f"--prompt holds token id {outside[0]}, outside [0, ModelConfig.vocab_size = "
                          f"{m.config.vocab_size})")
    if not greedy and not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"--temperature {temperature} is not allowed; allowed: a finite positive number "
                          "(--greedy for temperature 0)")
    if not greedy and top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
                                             or top_k < 1):  # else 0 samples among all ids, -1 among all but one
        raise ConfigError(f"--top-k {top_k} is not allowed; allowed: a positive integer")


def _end_of_text(m: Model) -> int | None:
    return m.end_of_text if m.end_of_text is not None and m.end_of_text < m.config.vocab_size else None


def _known_ids(m: Model) -> int:
    """How many ids the run's text has: the vocabulary is padded (to a multiple of 128) with rows no
    data held, which would print as nothing (tokenizer) or U+FFFD (bytes)."""
    if m.tokenizer is not None:
        return _tokenizer_ids(m.tokenizer)
    if m.token_file is not None:
        return m.config.vocab_size
    return prepare.BYTE_VOCAB + (m.end_of_text is not None)


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(model: gpt.GPT, params: dict, tokens: jax.Array, n: jax.Array) -> jax.Array:
    """The logits after the first `n` of `tokens` (1, length)."""
    hidden = model.blocks(params["blocks"], model.embed(params, tokens))
    # The head at that one position only: at every position it would cost length x hidden x vocab.
    return model.head_logits(params, jax.lax.dynamic_slice_in_dim(hidden, n - 1, 1, axis=1))[0, 0]


def _sample(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    logits = np.asarray(logits, np.float64)  # a tiny temperature is 0 in float32
    if top_k is not None and top_k < len(logits):
        # Exactly top_k ids: those above the k-th largest, then the lowest of those tied with it (as
        # argmax picks). A partition, not a sort: a sort took 27 ms a token at 128k ids.
        kth = np.partition(logits, -top_k)[-top_k]
        kept = logits > kth
        kept[np.flatnonzero(logits == kth)[: top_k - kept.sum()]] = True
        logits = np.where(kept, logits, -np.inf)
    with np.errstate(over="ignore"):  # the largest at 0 first: the rest may go to -inf, never NaN
        p = np.exp((logits - logits.max()) / temperature)
    return int(rng.choice(len(p), p=p / p.sum()))


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):  # inf: its top-k sampling divides -inf by inf
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a finite positive number "
                                         "(--greedy for temperature 0)")
    return value


def main(argv: list[str]) -> int:
    p = cli.Parser(prog="python -m holmes_jax.generate",
                   description="Continue a prompt with a run's newest checkpoint.")
    p.add_argument("--workdir", required=True, type=cli.path, help="the run's TrainConfig.workdir")
    p.add_argument("--prompt", required=True,
                   help="the text to continue ('': a new document, where the run's data marks their ends)")
    p.add_argument("--max-tokens", type=cli.positive_int, default=64,
                   help="tokens to generate at most: fewer when the model ends the document (default 64)")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (no sampling)")
    p.add_argument("--temperature", type=_positive_float, default=1.0, help="sampling temperature (default 1)")
    p.add_argument("--top-k", type=cli.positive_int,
                   help="sample among the K most likely tokens only (exactly K: ties go to the lower id)")
    p.add_argument("--seed", type=cli.non_negative_int, default=0, help="sampling seed (default 0)")
    p.add_argument("--step", type=cli.non_negative_int, help="the checkpoint's step (default: the newest)")
    args = p.parse_args(argv)
    cfg, data = inference.read_configs(args.workdir)
    # The tokenizer and the prompt first: a big checkpoint takes long to read, only to end in an error.
    tokenizer, end_of_text, token_file = inference.run_tokens(args.workdir, data)
    m = Model(cfg, {}, tokenizer, 0, end_of_text, token_file)  # its parameters once the prompt is checked
    prompt = encode(m, args.prompt)
    _check(m, prompt, args.greedy, args.temperature, args.top_k)
    m.params, m.step = inference.restore_params(args.workdir, cfg, args.step)
    new = generate(m, prompt, args.max_tokens, args.greedy, args.temperature, args.top_k, args.seed)
    print(decode(m, prompt + new))
    return 0


if __name__ == "__main__":
    cli.run(main)
