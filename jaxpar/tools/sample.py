"""`jaxpar sample RUN_DIR --prompt TEXT`: text from a trained model, with a key/value cache.

    jaxpar sample runs/a --prompt "def main(" --max-new-tokens 40 --temperature 0
    jaxpar sample runs/a --prompt "import " --temperature 0.8 --top-k 20 --seed 1

The newest good checkpoint is restored onto one device (whatever mesh saved it). The prompt is
run through the model once (prefill), then each new token costs one `decode` call on that token
alone: the model's `init_cache`/`decode` keep every earlier position's keys and values, so
nothing is recomputed. Text goes through the run's tokenizer: the `tokens` source's
tokenizer.json, or bytes for the byte-level sources (`stdlib_text`, `synthetic_text`);
`--tokenizer FILE` names another. `--temperature 0` is greedy and deterministic; otherwise
sampling is reproducible for a given `--seed`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.data.sources import source_label
from jaxpar.tools import finished_run

BYTE_SOURCES = ("stdlib_text", "synthetic_text")


@dataclass
class Codec:
    """Text <-> token ids: a Hugging Face tokenizer, or UTF-8 bytes (tokenizer None)."""

    tokenizer: Any = None

    @property
    def vocab_size(self) -> int:
        return 256 if self.tokenizer is None else self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def run_codec(cfg, tokenizer: str | None = None) -> Codec:
    """The codec a run trained with (see the module docstring)."""
    from jaxpar.data.prepare import load_tokenizer

    if tokenizer:
        return Codec(load_tokenizer(tokenizer))
    source = source_label(cfg.data.source)
    if source == "tokens":
        path = os.path.join(cfg.data.path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"the run trained on data.path={cfg.data.path}, which has no tokenizer.json; "
                "pass --tokenizer FILE"
            )
        return Codec(load_tokenizer(path))
    if source in BYTE_SOURCES:
        return Codec()
    raise ValueError(
        f"the run's data source {source!r} has no known tokenizer; pass --tokenizer FILE"
    )


def _pick(logits_BV, key, temperature: float, top_k: int, vocab: int):
    """The next token: argmax at temperature 0, else a draw from the top-k softmax."""
    logits_BV = logits_BV[:, :vocab].astype(jnp.float32)  # ids the tokenizer can decode
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1)
    logits_BV = logits_BV / temperature
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1)


@partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "vocab"))
def _prefill(state, tokens_BT, key, *, graphdef, temperature, top_k, vocab):
    m = nnx.merge(graphdef, state)
    logits_BTV, cache = m.decode(tokens_BT, m.init_cache(tokens_BT.shape[0]), 0)
    return _pick(logits_BTV[:, -1], key, temperature, top_k, vocab), cache


@partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "vocab"))
def _step(state, token_B, cache, pos, key, *, graphdef, temperature, top_k, vocab):
    logits_BTV, cache = nnx.merge(graphdef, state).decode(token_B[:, None], cache, pos)
    return _pick(logits_BTV[:, -1], key, temperature, top_k, vocab), cache


def generate(
    model: nnx.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    vocab: int | None = None,
) -> list[int]:
    """`max_new_tokens` ids continuing `prompt_ids` (prefill once, then one cached step each)."""
    if not (hasattr(model, "init_cache") and hasattr(model, "decode")):
        raise ValueError(
            f"{type(model).__name__} has no cached decode path (init_cache and decode methods)"
        )
    if temperature < 0:
        raise ValueError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
    graphdef, state = nnx.split(model)
    static = dict(graphdef=graphdef, temperature=float(temperature), top_k=int(top_k),
                  vocab=int(vocab or model.cfg.vocab_size))  # fmt: skip
    root = jax.random.key(seed)
    prompt_BT = jnp.asarray([prompt_ids], jnp.int32)
    token, cache = _prefill(state, prompt_BT, jax.random.fold_in(root, 0), **static)
    out = [int(token[0])]
    for i in range(1, max_new_tokens):
        pos = jnp.int32(len(prompt_ids) + i - 1)  # where the last picked token goes
        token, cache = _step(state, token, cache, pos, jax.random.fold_in(root, i), **static)
        out.append(int(token[0]))
    return out


def sample(
    run_dir: str,
    prompt: str,
    *,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    tokenizer: str | None = None,
) -> str:
    """The prompt and its continuation by the newest checkpoint of `run_dir`, as text."""
    cfg, params, _ = finished_run.load_run(run_dir)
    codec = run_codec(cfg, tokenizer)
    model = finished_run.build_model(cfg, params)
    context, vocab = getattr(cfg.model, "seq_len", None), getattr(cfg.model, "vocab_size", None)
    if context is None or vocab is None:
        raise ValueError(
            f"{type(cfg.model).__name__} is not a language model (seq_len, vocab_size)"
        )
    if codec.vocab_size > vocab:
        raise ValueError(
            f"the tokenizer has {codec.vocab_size} tokens but the model only {vocab}; use the "
            "tokenizer the run trained with"
        )
    ids = codec.encode(prompt)
    if not ids:
        raise ValueError("--prompt is empty; give some text to continue")
    room = context - len(ids)
    if room < 1:
        raise ValueError(
            f"the prompt is {len(ids)} tokens but the model's context is {context}; "
            "use a shorter prompt"
        )
    n = room if max_new_tokens is None else max_new_tokens
    if not 1 <= n <= room:
        raise ValueError(
            f"--max-new-tokens {n}: the prompt ({len(ids)} tokens) leaves room for 1..{room} "
            f"new tokens in the model's context of {context}"
        )
    new = generate(
        model, ids, n, temperature=temperature, top_k=top_k, seed=seed, vocab=codec.vocab_size
    )
    return codec.decode(ids + new)
