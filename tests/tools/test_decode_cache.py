"""The GPT's cached decode path and generation: same logits as the full forward, deterministic
greedy decoding, clear errors for the CLI's bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models.gpt import GPTConfig
from jaxpar.tools.sample import Codec, generate

CFG = GPTConfig(vocab_size=300, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_mlp=64)


@pytest.fixture(scope="module")
def model():
    with nnx.use_eager_sharding(False):  # an annotated model built with no mesh
        return CFG.build(nnx.Rngs(params=0))


@nnx.jit
def forward(model, tokens_BT):
    return model(tokens_BT)


@nnx.jit
def decode(model, tokens_BT, cache, pos):
    return model.decode(tokens_BT, cache, pos)


def test_cached_decode_matches_the_full_forward(model):
    tokens_BT = jax.random.randint(jax.random.key(1), (2, 11), 0, CFG.vocab_size)
    full_BTV = forward(model, tokens_BT)
    cache = model.init_cache(2)
    assert cache["k"].shape == (2, 2, 16, 4, 8)
    parts = []
    for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 11)):  # a prefill, single steps, a chunk
        logits, cache = decode(model, tokens_BT[:, lo:hi], cache, jnp.int32(lo))
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate(parts, 1), full_BTV, atol=2e-5, rtol=2e-5)
    # positions beyond those decoded stay empty: nothing was computed for them
    assert not np.any(np.asarray(cache["k"])[:, :, 11:])


def test_greedy_generation_is_deterministic_and_follows_the_model(model):
    prompt = [5, 17, 42]
    a = generate(model, prompt, 8, temperature=0)
    assert a == generate(model, prompt, 8, temperature=0)
    # greedy = argmax of the full forward at every position
    seq = prompt + a
    logits = np.asarray(forward(model, jnp.asarray([seq[:-1]])))[0]
    assert a == [int(i) for i in logits[len(prompt) - 1 :].argmax(-1)]
    drawn = generate(model, prompt, 8, temperature=1.0, top_k=5, seed=3)
    assert drawn == generate(model, prompt, 8, temperature=1.0, top_k=5, seed=3)
    assert all(0 <= t < CFG.vocab_size for t in drawn)
    with pytest.raises(ValueError, match="--temperature -1"):
        generate(model, prompt, 2, temperature=-1)


def test_byte_codec_round_trips():
    codec = Codec()
    ids = codec.encode("héllo")
    assert codec.vocab_size == 256 and len(ids) == 6 and codec.decode(ids) == "héllo"


def test_cli_errors_name_the_fix(tokens_corpus, tmp_path, capsys):
    from jaxpar.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["data", "prepare", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "holds no files; give a folder of text files" in capsys.readouterr().err
    assert main(["data", "prepare", tokens_corpus, "--out", tokens_corpus]) == 2
    assert "already holds a prepared corpus" in capsys.readouterr().err
    assert main(["sample", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "m.bin")]) == 2
    assert "name the file NAME.safetensors" in capsys.readouterr().err


def test_train_cli_data_errors(tokens_corpus, tmp_path, capsys):
    from train.__main__ import main

    base = ["--run-dir", str(tmp_path / "run"), "--no-progress", "--set", "data.source=tokens"]
    assert main([*base, "--set", f"data.path={tmp_path / 'missing'}"]) == 2
    assert "no such directory; run `jaxpar data prepare" in capsys.readouterr().err
    args = [*base, "--set", f"data.path={tokens_corpus}", "--set", "model.vocab_size=256"]
    assert main(args) == 2
    assert "model.vocab_size=256 but the data" in capsys.readouterr().err
    assert main([*base, "--set", f"data.path={tokens_corpus}", "--set", "data.dtype=uint32"]) == 2
    assert "says the shards are uint16" in capsys.readouterr().err
