"""`jaxpar sample RUN_DIR --prompt TEXT`: text from a trained model, with a key/value cache.

    jaxpar sample runs/a --prompt "def main(" --max-new-tokens 40 --temperature 0
    jaxpar sample runs/a --prompt "import " --temperature 0.8 --top-k 20 --seed 1

The restore, the cache, the tokenizer and sampling: docs/data.md, "Sampling".
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.data.codec import Codec, codec_of, encode_prompt  # Codec: importable from here too
from jaxpar.data.sources import source_label
from jaxpar.tools import finished_run


def run_codec(cfg, tokenizer: str | None = None) -> Any:
    """The codec a run trained with: `tokenizer` (a tokenizer.json) if given, else the one its
    data source says (see the module docstring); ValueError naming --tokenizer when none does."""
    if tokenizer:
        return Codec.from_file(tokenizer)
    from jaxpar.worker.training import make_source  # the source exactly as the run built it

    label, path = source_label(cfg.data.source), cfg.data.path
    why = ""
    try:
        source = make_source(cfg)
    except Exception as e:  # noqa: BLE001 - any source (a user's too): meta.json may still say
        source, why = None, f" (the source could not be opened: {e})"
    codec = codec_of(source, path)
    if codec is None:
        where = f" or in data.path={path}/meta.json" if path else ""
        raise ValueError(
            f"the run's data source {label!r} does not say how its ids decode (no codec() or "
            f"tokenizer_file{where}){why}; pass --tokenizer FILE"
        )
    return codec


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


def check_sampling(temperature: float, top_k: int, prompt: str = "") -> None:
    """Refuse sampling settings that cannot work (ValueError naming the option)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature {temperature} must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise ValueError(f"--top-k {top_k} must be >= 0 (0: all tokens)")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("--prompt is not valid UTF-8 text; give the prompt in UTF-8") from None


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
    check_sampling(temperature, top_k)
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
    check_sampling(temperature, top_k, prompt)  # before the run is loaded
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
    ids, shown = encode_prompt(codec, prompt)  # shown: less a BOS the tokenizer added
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
    return codec.decode(shown + new)
