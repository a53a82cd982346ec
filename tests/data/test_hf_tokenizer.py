"""`jaxpar data prepare --tokenizer HF_DIR`: a model's own tokenizer used as it is (ids exactly
its `Tokenizer.encode`, documents ended by the eos_token of its tokenizer_config.json, the file
copied to --out), `jaxpar sample`'s codec from it, and bad tokenizer folders refused in one line
with nothing written."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from jaxpar import cli
from jaxpar.data import prepare as prep
from jaxpar.data.codec import Codec, codec_of, encode_prompt
from jaxpar.data.tokens import open_tokens

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = ["the", "model", "tokenizer", "naïve", "café", "日本語", "emoji 🙂", "x = 1;", "def f():",
         "\n", "  indented", "Zürich", "ids", "1234567"]  # fmt: skip


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(20, 120))) for _ in range(n)]


def _llama_like(folder, eos=EOS, config: bool = True):
    """A byte-level BPE like Llama 3's (GPT-2 byte alphabet, a BOS added by its post-processor,
    <|end_of_text|> named eos in tokenizer_config.json), trained on a few KB; saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(_docs(40, seed=1), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": BOS, "eos_token": eos})
        )
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "model"
    _llama_like(folder, eos={"content": EOS, "special": True})  # the dict form of eos_token
    return folder


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(_docs(12, seed=2)):
        (folder / f"{i:02d}.txt").write_text(doc)
    return folder


def _stream(out, split: str, dtype: str) -> list[int]:
    meta = json.loads((out / "meta.json").read_text())
    return [
        int(t)
        for s in meta["shards"][split]
        for t in np.fromfile(out / s["file"], dtype=np.dtype(dtype).newbyteorder("<"))
    ]


def _texts(folder, val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """The (train, val) texts prepare cuts from `folder`."""
    files = sorted(str(p) for p in folder.iterdir())
    return prep.split_docs(prep.read_docs(files)[0], val_fraction)


def _expected(texts, tok, eos: int, val_fraction: float = 0.05) -> dict[str, list[int]]:
    train, val = _texts(texts, val_fraction)
    return {
        name: [t for text in part for t in [*tok.encode(text).ids, eos]]
        for name, part in (("train", train), ("val", val))
    }


def _prepare(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(["data", "prepare", "--no-progress", *argv])
    return code, capsys.readouterr().err


def test_prepare_uses_the_model_tokenizer_as_it_is(model_dir, texts, tmp_path, capsys):
    from tokenizers import Tokenizer

    out = tmp_path / "out"
    code, err = _prepare([str(texts), "--out", str(out), "--tokenizer", str(model_dir)], capsys)
    assert code == 0, err
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert meta["dtype"] == "uint16" and meta["eot_id"] == eos
    # the tokenizer is the given file, byte for byte, where training and sample look for it
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert Codec.from_file(str(out / "tokenizer.json")).tokenizer.to_str() == tok.to_str()
    want = _expected(texts, tok, eos)
    for split in ("train", "val"):
        got = _stream(out, split, "uint16")
        assert got == want[split]  # each document: Tokenizer.encode's ids (BOS first), then eos
        # and the documents decode back to the text, one per eos
        docs = _split(got, eos)
        assert all(d[0] == bos for d in docs)
        assert [tok.decode(d, skip_special_tokens=True) for d in docs] == _texts(texts)[
            split == "val"
        ]
    src = open_tokens(str(out), seq_len=16, vocab_size=0)
    assert src.vocab_size == meta["vocab_size"] and src.tokenizer_file == str(
        out / "tokenizer.json"
    )


def _split(ids: list[int], sep: int) -> list[list[int]]:
    docs, cur = [], []
    for t in ids:
        if t == sep:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    assert not cur  # the stream ends with a separator
    return docs


def test_an_over_long_run_is_encoded_in_pieces_under_one_bos(model_dir, tmp_path):
    """A document with a 600-character word: its pieces are encoded one by one (as with a
    trained tokenizer), and the tokenizer's own special tokens are added once, to the whole."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "the model " + "x" * 600 + " ids café"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(text + " the model" * 40)
    out = tmp_path / "out"
    meta = prep.prepare([str(tmp_path / "in")], str(out), tokenizer=str(model_dir),
                        val_fraction=0.3, progress=False)  # fmt: skip
    train = _texts(tmp_path / "in", 0.3)[0]
    assert len(train) == 1 and train[0].startswith(text)
    cut = prep.pieces(train[0])
    assert len(cut) == 3
    body = [t for p in cut for t in tok.encode(p, add_special_tokens=False).ids]
    got = _stream(out, "train", meta["dtype"])
    assert got == [tok.token_to_id(BOS), *body, tok.token_to_id(EOS)]
    assert tok.decode(got, skip_special_tokens=True) == train[0]


def test_a_tokenizer_json_file_and_the_endoftext_fallback(texts, tmp_path):
    """--tokenizer may name the file itself; without a tokenizer_config.json the documents end
    with <|endoftext|>, as with a trained tokenizer, and there is no BOS without a post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[prep.EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(_docs(20, seed=3), trainer)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    meta = prep.prepare([str(texts)], str(tmp_path / "out"), tokenizer=str(path), progress=False)
    eot = tok.token_to_id(prep.EOT)
    assert meta["eot_id"] == eot
    assert _stream(tmp_path / "out", "train", "uint16") == _expected(texts, tok, eot)["train"]


def test_a_vocabulary_past_uint16_is_written_as_uint32(tmp_path):
    """A word-level tokenizer of 70,002 entries (cheap to build): ids above 65535 come back."""
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model = tmp_path / "big"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    texts = tmp_path / "texts"
    texts.mkdir()
    rng = random.Random(0)
    for i in range(4):
        (texts / f"{i}.txt").write_text(" ".join(f"w{rng.randrange(70_000)}" for _ in range(300)))
    out = tmp_path / "out"
    meta = prep.prepare([str(texts)], str(out), tokenizer=str(model), progress=False)
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_002, 70_001)
    got = _stream(out, "train", "uint32")
    assert got == _expected(texts, tok, 70_001)["train"] and max(got) > 65535
    assert (out / "train-00000.bin").stat().st_size == 4 * meta["tokens"]["train"]


def test_the_token_dtype_is_uint16_while_every_id_fits():
    assert prep.token_dtype(4096) == np.uint16
    assert prep.token_dtype(65536) == np.uint16  # ids 0..65535
    assert prep.token_dtype(65537) == np.uint32
    assert prep.token_dtype(128_256) == np.uint32  # Llama 3
    assert prep.token_dtype(151_669) == np.uint32  # Qwen3


def test_sample_encodes_with_the_bos_and_shows_the_text(model_dir, texts, tmp_path):
    """The codec `jaxpar sample` finds in the prepared folder is the model's tokenizer: the
    prompt's ids are those prepare wrote (BOS first), and the shown text leaves the BOS out."""
    out = tmp_path / "out"
    prep.prepare([str(texts)], str(out), tokenizer=str(model_dir), progress=False)
    codec = codec_of(open_tokens(str(out), seq_len=16, vocab_size=0), str(out))
    tok = Codec.from_file(str(model_dir)).tokenizer  # a folder works here too
    prompt = "the naïve café 🙂"
    ids, shown = encode_prompt(codec, prompt)
    assert ids == tok.encode(prompt).ids and ids[0] == tok.token_to_id(BOS)
    assert shown == ids[1:] and codec.encode(prompt) == ids
    eos = tok.token_to_id(EOS)
    assert codec.decode(shown + tok.encode(" ids", add_special_tokens=False).ids + [eos]) == (
        f"{prompt} ids{EOS}"
    )
    assert codec.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    assert encode_prompt(Codec(), "é") == ([0xC3, 0xA9], [0xC3, 0xA9])  # bytes: nothing added


def _refused(argv, tmp_path, capsys, match: str) -> None:
    out = tmp_path / "out"
    code, err = _prepare([*argv, "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert match in err, err
    assert not out.exists()


def test_tokenizer_with_vocab_size_is_refused(model_dir, texts, tmp_path, capsys):
    argv = [str(texts), "--tokenizer", str(model_dir), "--vocab-size", "600"]
    _refused(argv, tmp_path, capsys, "drop --vocab-size")


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "no such file or folder; give a Hugging Face model folder"),
        ("empty_folder", "the folder has no tokenizer.json"),
        ("sentencepiece_only", "tokenizer.model, a SentencePiece file, is not read"),
        ("truncated", "not a readable tokenizer.json"),
        ("garbage", "not a readable tokenizer.json"),
        ("not_utf8", "not a readable tokenizer.json"),
        ("too_large", "larger than 0 MiB"),
        ("config_corrupt", "tokenizer_config.json: unreadable"),
        ("config_eos_unknown", "names eos_token '<|eot_id|>', which is not in its tokenizer.json"),
        ("config_eos_bad", "eos_token '7' is not a token"),
        ("no_end_of_text", "no end-of-text token"),
    ],
)
def test_bad_tokenizer_folders_are_one_line(
    model_dir, texts, tmp_path, capsys, monkeypatch, case, match
):
    folder = tmp_path / "hf"
    folder.mkdir()
    good = (model_dir / "tokenizer.json").read_bytes()
    config = {"eos_token": EOS}
    if case == "missing":
        folder = tmp_path / "nowhere"
    elif case == "sentencepiece_only":
        (folder / "tokenizer.model").write_bytes(b"\x0a\x0b")
    elif case != "empty_folder":
        (folder / "tokenizer.json").write_bytes(
            {"truncated": good[: len(good) // 2], "garbage": b"\x00 not json {",
             "not_utf8": b"\xff\xfe{}"}.get(case, good)
        )  # fmt: skip
        if case == "too_large":
            monkeypatch.setattr(prep, "MAX_TOKENIZER_BYTES", 1000)
        if case == "config_corrupt":
            (folder / "tokenizer_config.json").write_text('{"eos_token": ')
        elif case == "no_end_of_text":
            pass  # no tokenizer_config.json, and the tokenizer has no <|endoftext|>
        else:
            config = {"config_eos_unknown": {"eos_token": "<|eot_id|>"},
                      "config_eos_bad": {"eos_token": 7}}.get(case, config)  # fmt: skip
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _refused([str(texts), "--tokenizer", str(folder)], tmp_path, capsys, match)


def test_jaxpar_sample_reads_and_writes_text_through_the_model_tokenizer(
    model_dir, texts, tmp_path, monkeypatch
):
    """`sample` on a run over the prepared folder (its checkpoint stood in by a fresh gpt_tiny of
    the tokenizer's vocabulary): the prompt goes in with its BOS, the text comes back without it."""
    import dataclasses

    from jaxpar.config import DataConfig, resolve_recipe
    from jaxpar.engine import model as model_lib
    from jaxpar.tools import finished_run, sample

    out = tmp_path / "out"
    meta = prep.prepare([str(texts)], str(out), tokenizer=str(model_dir), progress=False)
    cfg = resolve_recipe("gpt_tiny")
    cfg = dataclasses.replace(
        cfg, data=DataConfig(source="tokens", path=str(out)),
        model=dataclasses.replace(cfg.model, vocab_size=meta["vocab_size"]),
    )  # fmt: skip
    seen = []
    generate = sample.generate

    def spy(model, prompt_ids, *args, **kwargs):
        seen.append(list(prompt_ids))
        return generate(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(finished_run, "load_run", lambda run_dir: (cfg, None, 0))
    monkeypatch.setattr(finished_run, "build_model", lambda c, p: model_lib.build(c.model, 0))
    monkeypatch.setattr(sample, "generate", spy)
    prompt = "the naïve café"
    text = sample.sample("unused", prompt, max_new_tokens=6, temperature=0)
    tok = Codec.from_file(str(model_dir)).tokenizer
    assert seen == [tok.encode(prompt).ids] and seen[0][0] == tok.token_to_id(BOS)
    assert text.startswith(prompt) and BOS not in text, text
