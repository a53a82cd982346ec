"""`jaxpar data prepare` on bad input: one line naming the fix (exit 2), symlinks read once,
over-long words cut before the tokenizer sees them."""

from __future__ import annotations

import json
import os
import random
import string

import pytest

from jaxpar import cli
from jaxpar.data import prepare as prep

WORDS = [w * 3 for w in string.ascii_lowercase]


def _text(n_words: int = 6000, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choices(WORDS, k=12)) for _ in range(n_words // 12)) + "\n"


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "in" / "a.txt"
    path.parent.mkdir()
    path.write_text(_text())
    return path


def _prepare(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(["data", "prepare", "--no-progress", *argv])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "vocab", ["0", "256", "1000000000"], ids=["zero", "below_bytes", "billion"]
)
def test_vocab_size_out_of_range_is_one_line(corpus, tmp_path, capsys, vocab):
    code, err = _prepare([str(corpus), "--out", str(tmp_path / "out"), "--vocab-size", vocab],
                         capsys)  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert f"--vocab-size {vocab} is outside 257..1048576" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_out_that_cannot_be_a_folder_is_one_line(corpus, tmp_path, capsys, where):
    out = str(corpus) if where == "file" else "/proc/jaxpar-test"
    code, err = _prepare([str(corpus), "--out", out], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert ("is a file" if where == "file" else "under /proc") in err


def test_shard_tokens_below_one_is_a_usage_error(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["data", "prepare", str(corpus), "--out", str(tmp_path / "o"),
                  "--shard-tokens", "0"])  # fmt: skip
    assert e.value.code == 2
    assert "--shard-tokens: must be >= 1" in capsys.readouterr().err


def test_a_symlink_loop_named_as_input_is_one_line(tmp_path, capsys):
    loop = tmp_path / "loop"
    os.symlink("loop", loop)
    code, err = _prepare([str(loop), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "a symlink that does not resolve" in err


def test_symlinks_inside_a_folder_are_skipped_and_each_file_is_read_once(corpus, tmp_path):
    folder = corpus.parent
    os.symlink("a.txt", folder / "b.txt")  # a second name for the same file
    os.symlink("loop", folder / "loop")  # a loop
    (folder / "sub").mkdir()
    os.symlink("..", folder / "sub" / "up")  # a folder loop
    os.mkfifo(folder / "fifo")  # not a regular file: opening it would block
    os.link(corpus, folder / "hard.txt")  # the same file under a real second name
    out = tmp_path / "out"
    meta = prep.prepare([str(folder), str(corpus)], str(out), vocab_size=300, progress=False)
    assert [s["path"] for s in meta["sources"]] == [str(corpus)]
    assert meta["skipped"] == [str(folder / n) for n in ("b.txt", "fifo", "loop", "sub/up")]
    assert meta["input_bytes"] == corpus.stat().st_size
    assert json.loads((out / "meta.json").read_text())["sources"] == meta["sources"]


def test_the_console_says_what_was_not_read(corpus, tmp_path, capsys):
    os.symlink("a.txt", corpus.parent / "b.txt")
    (corpus.parent / "c.bin").write_bytes(b"\xff\xfe")
    code, err = _prepare([str(corpus.parent), "--out", str(tmp_path / "out")], capsys)
    assert code == 0 and err.count("\n") == 1, err
    assert f"not read: {corpus.parent / 'b.txt'}, {corpus.parent / 'c.bin'} (" in err, err
    assert "symlinks inside folders are not followed" in err, err


def test_an_unreadable_input_is_one_line(corpus, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    corpus.chmod(0)
    code, err = _prepare([str(corpus), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "unreadable" in err


def test_pieces_cut_only_over_long_runs():
    ordinary = _text(300)
    assert prep.pieces(ordinary) == [ordinary]
    text = "ab " + "x" * 600 + " " * 300 + "cd"
    parts = prep.pieces(text)
    assert "".join(parts) == text
    assert [len(p) for p in parts] == [3 + 256, 256, 88 + 256, 44 + 2]
    assert max(len(w) for p in parts for w in p.split()) <= 256


@pytest.mark.timeout(120)  # minutes before the cut
@pytest.mark.parametrize("alphabet", ["a", string.ascii_letters])
def test_a_one_megabyte_word_is_tokenized_in_pieces(tmp_path, alphabet):
    """One 1 MB line without spaces: the BPE trainer's work on one pre-token grows with the
    square of its length (minutes at 1 MB); cut into pieces it is a corpus like any other."""
    rng = random.Random(0)
    path = tmp_path / "long.txt"
    path.write_text("".join(rng.choices(alphabet, k=1 << 20)))
    meta = prep.prepare([str(path)], str(tmp_path / "out"), vocab_size=512, progress=False)
    assert meta["tokens"]["train"] > 0 and meta["tokens"]["val"] > 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tok.get_vocab_size() <= 512
