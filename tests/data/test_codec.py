"""How `jaxpar sample` finds a run's tokenizer: the data source says (its codec, its tokenizer
file, or the meta.json of its data folder), whatever the source's name; --tokenizer overrides."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from jaxpar.config import DataConfig, resolve_recipe
from jaxpar.data import sources as data_lib
from jaxpar.data import tokens
from jaxpar.data.codec import Codec, codec_of
from jaxpar.tools.sample import run_codec

TEXT = "def dumps(obj):"


class Counting:
    """A user's source (MODULE:CALLABLE) that says nothing about its ids itself."""

    name, kind = "counting", "lm"

    def __init__(self, args):
        self.seq_len, self.vocab_size = args.seq_len, args.vocab_size

    def size(self, split):
        return None

    def example(self, index, split):
        w = (index + np.arange(self.seq_len + 1)) % self.vocab_size
        return {"inputs": w[:-1].astype(np.int32), "targets": w[1:].astype(np.int32)}


class Spelled(Counting):
    """A user's source that says its ids are bytes."""

    def codec(self):
        return Codec()


class Unbuildable:
    """Recorded by a run as MODULE:CLASS from a recipe's source object: not a factory."""

    def __init__(self, corpus, seq_len):
        self.corpus, self.seq_len = corpus, seq_len


def run_cfg(source, path=""):
    cfg = resolve_recipe("gpt_tiny")
    return dataclasses.replace(cfg, data=DataConfig(source=source, path=path))


def is_corpus_tokenizer(codec, corpus):
    ids = codec.encode(TEXT)
    expected = Codec.from_file(os.path.join(corpus, "tokenizer.json")).encode(TEXT)
    return codec.vocab_size == 512 and ids == expected and codec.decode(ids) == TEXT


@pytest.fixture
def alias():
    """The tokens source registered under another name."""
    data_lib.register_source("my_corpus_test", tokens.open_source)
    yield "my_corpus_test"
    del data_lib.SOURCE_REGISTRY["my_corpus_test"]


def test_tokens_under_another_name_decode_with_the_tokenizer_of_its_meta_json(tokens_corpus, alias):
    codec = run_codec(run_cfg(alias, tokens_corpus))
    assert is_corpus_tokenizer(codec, tokens_corpus)
    assert is_corpus_tokenizer(run_codec(run_cfg("tokens", tokens_corpus)), tokens_corpus)


def test_a_user_source_decodes_with_the_tokenizer_its_data_folder_names(tokens_corpus):
    for name in (f"{__name__}:Counting", f"{__name__}:Unbuildable"):
        assert is_corpus_tokenizer(run_codec(run_cfg(name, tokens_corpus)), tokens_corpus)
    # the source's own word comes first
    assert run_codec(run_cfg(f"{__name__}:Spelled", tokens_corpus)).tokenizer is None
    with pytest.raises(ValueError, match="'.*:Counting' does not say how its ids decode.*--tok"):
        run_codec(run_cfg(f"{__name__}:Counting"))
    with pytest.raises(ValueError, match="could not be opened: .*missing 1 required"):
        run_codec(run_cfg(f"{__name__}:Unbuildable"))


def test_byte_level_built_ins_are_bytes_and_tokenizer_overrides(tokens_corpus):
    for name in ("stdlib_text", "synthetic_text"):
        codec = run_codec(run_cfg(name))
        assert codec.tokenizer is None and codec.decode(codec.encode(TEXT)) == TEXT
    tok = os.path.join(tokens_corpus, "tokenizer.json")
    assert is_corpus_tokenizer(run_codec(run_cfg("stdlib_text"), tok), tokens_corpus)
    with pytest.raises(ValueError, match="'digits' does not say how its ids decode"):
        run_codec(run_cfg("digits"))


def test_meta_json_is_untrusted(tokens_corpus, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    meta = json.load(open(os.path.join(tokens_corpus, "meta.json")))
    shutil.copy(os.path.join(tokens_corpus, "tokenizer.json"), tmp_path / "tokenizer.json")
    for named in ("../tokenizer.json", str(tmp_path / "tokenizer.json"), "missing.json", 7):
        (folder / "meta.json").write_text(json.dumps({**meta, "tokenizer": named}))
        assert codec_of(None, str(folder)) is None, named
    (folder / "meta.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a meta file .*; pass --tokenizer FILE"):
        codec_of(None, str(folder))


def test_nanogpt_folder_uses_a_tokenizer_beside_its_shards(tokens_corpus, tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 512, 2000).astype(np.uint16).tofile(tmp_path / f"{split}.bin")
    cfg = run_cfg("tokens", str(tmp_path))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=512))
    with pytest.raises(ValueError, match="'tokens' does not say how its ids decode"):
        run_codec(cfg)
    shutil.copy(os.path.join(tokens_corpus, "tokenizer.json"), tmp_path / "tokenizer.json")
    assert is_corpus_tokenizer(run_codec(cfg), tokens_corpus)
