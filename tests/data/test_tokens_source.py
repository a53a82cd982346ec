"""The data-source protocol and the `tokens` source: windows, per-process rows, formats, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from jaxpar.config import DataConfig, resolve_recipe
from jaxpar.data import sources as data_lib
from jaxpar.data.tokens import TokenSource
from jaxpar.worker import training

SEQ = 64


def tokens(path: str, **kw) -> TokenSource:
    return data_lib.make_source("tokens", seq_len=SEQ, path=path, **kw)


class Recording:
    """A user-style source wrapping another, recording which indices were read."""

    def __init__(self, inner):
        self.inner, self.read = inner, []
        self.name, self.kind = "recording", inner.kind
        self.seq_len, self.vocab_size = inner.seq_len, inner.vocab_size

    def size(self, split):
        return self.inner.size(split)

    def example(self, index, split):
        self.read.append(index)
        return self.inner.example(index, split)


def synthetic(args: data_lib.SourceArgs):
    """A factory named as MODULE:CALLABLE."""
    return data_lib.SyntheticTextSource(args.seq_len, args.vocab_size, args.seed)


def test_windows_are_slices_of_the_shards(tokens_corpus):
    src = tokens(tokens_corpus)
    meta = json.load(open(os.path.join(tokens_corpus, "meta.json")))
    assert src.vocab_size == meta["vocab_size"] == 512 and src.vocab_fixed
    flat = np.fromfile(os.path.join(tokens_corpus, "train-00000.bin"), np.uint16)
    assert src.size("train") == (len(flat) - 1) // SEQ
    for i in (0, 7, src.size("train") - 1):
        ex = src.example(i, "train")
        np.testing.assert_array_equal(ex["inputs"], flat[i * SEQ : i * SEQ + SEQ])
        np.testing.assert_array_equal(ex["targets"], flat[i * SEQ + 1 : i * SEQ + SEQ + 1])
        assert ex["inputs"].dtype == np.int32
    assert data_lib.batch_spec(src, 8)["inputs"].shape == (8, SEQ)
    with pytest.raises(IndexError):
        src.example(src.size("eval"), "eval")


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_read_disjoint_rows_whose_union_is_the_global_batch(tokens_corpus, processes):
    batch, step = 16, 5
    whole = Recording(tokens(tokens_corpus))
    ref = data_lib.host_batch(whole, step=step, global_batch=batch, seed=3)
    parts, reads, nbytes = [], [], []
    for p in range(processes):  # one fresh source per process, as each process opens its own
        src = Recording(tokens(tokens_corpus))
        parts.append(
            data_lib.host_batch(
                src,
                step=step,
                global_batch=batch,
                seed=3,
                process_index=p,
                process_count=processes,
            )  # fmt: skip
        )
        reads.append(set(src.read))
        nbytes.append(src.inner.bytes_read)
    for a in range(processes):
        for b in range(a + 1, processes):
            assert not reads[a] & reads[b], "two processes read the same window"
    assert set().union(*reads) == set(whole.read)
    for key in ref:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), ref[key])
    # each process reads only its rows: 1/processes of the global batch's token bytes
    assert nbytes == [batch // processes * (SEQ + 1) * 2] * processes
    assert whole.inner.bytes_read == batch * (SEQ + 1) * 2


def test_a_window_may_cross_shards(tokens_corpus, tmp_path):
    from jaxpar.data.prepare import prepare
    from tests.support.corpus import inputs

    out = tmp_path / "small-shards"
    tok = os.path.join(tokens_corpus, "tokenizer.json")
    meta = prepare(inputs(), str(out), tokenizer=tok, shard_tokens=1000, progress=False)
    assert len(meta["shards"]["train"]) > 100
    one, many = tokens(tokens_corpus), tokens(str(out))
    assert one.size("train") == many.size("train")
    for i in (0, 15, 16, 500, one.size("train") - 1):  # 1000 / 64: window 15 crosses a boundary
        np.testing.assert_array_equal(one.example(i, "train")["inputs"],
                                      many.example(i, "train")["inputs"])  # fmt: skip


def test_nanogpt_layout(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 300, 5000).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    rng.integers(0, 300, 700).astype(np.uint16).tofile(tmp_path / "val.bin")
    src = tokens(str(tmp_path), vocab_size=300)
    assert not src.vocab_fixed and src.vocab_size == 300 and src.dtype == "uint16"
    np.testing.assert_array_equal(src.example(3, "train")["targets"], train[193:257])
    with pytest.raises(ValueError, match="token id .* >= vocab_size 256"):
        tokens(str(tmp_path), vocab_size=256).example(3, "train")
    (tmp_path / "val.bin").write_bytes(b"\x01\x00\x02")  # 3 bytes: not whole uint16 tokens
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        tokens(str(tmp_path))


def test_bad_directories_get_clear_errors(tokens_corpus, tmp_path):
    with pytest.raises(ValueError, match="needs data.path=DIR"):
        tokens("")
    with pytest.raises(ValueError, match="no such directory; run `jaxpar data prepare"):
        tokens(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no meta.json .* and no train.bin/val.bin"):
        tokens(str(tmp_path))
    with pytest.raises(ValueError, match="data.dtype=uint32 but .* says the shards are uint16"):
        tokens(tokens_corpus, dtype="uint32")
    bad = tmp_path / "bad"
    shutil.copytree(tokens_corpus, bad)
    meta = json.load(open(bad / "meta.json"))
    json.dump({**meta, "dtype": "float32"}, open(bad / "meta.json", "w"))
    with pytest.raises(ValueError, match="token dtype 'float32' is not supported"):
        tokens(str(bad))
    json.dump({**meta, "dtype": "uint32"}, open(bad / "meta.json", "w"))
    with pytest.raises(ValueError, match="written with another dtype or is truncated"):
        tokens(str(bad))
    escape = {**meta, "shards": {"train": [{"file": "../x.bin", "tokens": 1}], "val": []}}
    json.dump(escape, open(bad / "meta.json", "w"))
    with pytest.raises(ValueError, match="must be a plain file name"):
        tokens(str(bad))


def test_vocab_comes_from_meta_and_a_mismatch_is_an_error(tokens_corpus):
    cfg = resolve_recipe("gpt_tiny")
    cfg = dataclasses.replace(cfg, data=DataConfig(source="tokens", path=tokens_corpus))
    assert cfg.model.vocab_size == 256
    assert training.vocab_from_data(cfg).model.vocab_size == 512
    with pytest.raises(ValueError, match="model.vocab_size=256 but the data .* vocabulary of 512"):
        training.vocab_from_data(cfg, explicit=True)
    with pytest.raises(ValueError, match="set --set model.vocab_size=512"):
        training.check_vocab(cfg, training.make_source(cfg))


def test_user_sources_by_object_factory_and_name(tokens_corpus):
    inner = tokens(tokens_corpus)
    obj = Recording(inner)
    assert data_lib.make_source(obj) is obj
    made = data_lib.make_source(lambda args: Recording(tokens(args.path)), path=tokens_corpus)
    assert made.vocab_size == 512
    named = data_lib.make_source(f"{__name__}:synthetic", seq_len=8, vocab_size=5)
    assert named.kind == "lm" and named.example(0, "train")["inputs"].shape == (8,)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        data_lib.make_source("no_such_module:make")
    with pytest.raises(ValueError, match="lacks \\['kind', 'example', 'size'\\]"):
        data_lib.make_source(lambda args: type("Bare", (), {"name": "bare"})())
    with pytest.raises(ValueError, match="unknown data source 'my_data'.*MODULE:CALLABLE"):
        data_lib.make_source("my_data")
