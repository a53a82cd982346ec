"""`jaxpar data prepare`: text files -> a byte-level BPE tokenizer -> token shards + meta.json.

    jaxpar data prepare INPUT... --out DIR [--vocab-size N] [--val-fraction F]
                        [--tokenizer HF_DIR_OR_TOKENIZER_JSON] [--shard-tokens N]

What it reads and writes: docs/data.md, "Preparing a corpus", "Preparing data with a model's own
tokenizer" and "The token-file format".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from jaxpar.data.tokens import FORMAT, META, VERSION
from jaxpar.rundir.ownership import check_path
from jaxpar.rundir.runlog import read_json_object

EOT = "<|endoftext|>"
DEFAULT_VOCAB = 4096
MIN_VOCAB = 257  # 256 byte symbols + the end-of-text token
MAX_VOCAB = 1 << 20  # past any BPE vocabulary in use; the trainer aborts the process near 1e9
TOKENIZER_FILE = "tokenizer.json"  # in a Hugging Face model folder, and in --out
TOKENIZER_CONFIG = "tokenizer_config.json"  # beside it in a Hugging Face model folder: eos_token
MAX_TOKENIZER_BYTES = 64 << 20  # Llama 3's tokenizer.json is 9 MB; larger is refused
_DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard
_SKIP_DIRS = ("__pycache__",)
_ENCODE_CHUNK = 256  # documents per encode_batch call (tokenizers runs them in parallel)
# The BPE trainer's and encoder's work grows with the square of a pre-token's length (one 1 MB
# word took minutes), so runs of non-space (or space) characters are cut every _MAX_RUN characters
# before the tokenizer sees them: a word that long is no word, and ordinary text is never cut.
_MAX_RUN = 256
_LONG_RUN = re.compile(rf"\S{{{_MAX_RUN + 1},}}|\s{{{_MAX_RUN + 1},}}")


@dataclass(frozen=True)
class Doc:
    path: str  # as found (the input name joined with the path below it)
    text: str
    nbytes: int
    sha256: str


def input_files(inputs: list[str]) -> tuple[list[str], list[str]]:
    """(files to read, skipped paths) named by `inputs`; ValueError if there are none.

    A folder is walked recursively in sorted order. An INPUT that is a symlink is followed; a
    symlink met inside a folder (to a file or a folder) is not, and is listed as skipped, as is
    anything that is not a regular file. Each file is read once, however many names reach it."""
    if not inputs:
        raise ValueError("no INPUT given: jaxpar data prepare FILE_OR_FOLDER... --out DIR")
    files, skipped, seen = [], [], set()

    def add(path: str, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            skipped.append(path)
        elif (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            files.append(path)

    for item in inputs:
        try:
            st = os.stat(item)
        except OSError as e:
            why = "a symlink that does not resolve" if os.path.islink(item) else e.strerror
            raise ValueError(f"input {item}: {why}; give text files or folders") from None
        if not stat.S_ISDIR(st.st_mode):
            add(item, st)
            continue
        found = []
        for directory, subdirs, names in os.walk(item):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in _SKIP_DIRS)
            found += [os.path.join(directory, n) for n in subdirs + names if not n.startswith(".")]
        before = len(files) + len(skipped)
        for path in sorted(found):
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                entry = os.lstat(path)
                if stat.S_ISLNK(entry.st_mode):
                    skipped.append(path)  # symlinks inside a folder are never followed
                elif not stat.S_ISDIR(entry.st_mode):
                    add(path, entry)
        if len(files) + len(skipped) == before:
            raise ValueError(f"input folder {item} holds no files; give a folder of text files")
    if not files:
        raise ValueError(
            f"no regular files among the inputs (skipped {skipped[:3]}); give text files"
        )
    return files, skipped


def read_docs(files: list[str]) -> tuple[list[Doc], list[str]]:
    """(UTF-8 text documents, skipped paths). ValueError when nothing readable remains."""
    docs, skipped = [], []
    for path in files:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"input {path}: unreadable ({e.strerror}); leave it out") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(path)
            continue
        if text:
            docs.append(Doc(path, text, len(raw), hashlib.sha256(raw).hexdigest()))
    if not docs:
        raise ValueError(
            f"none of the {len(files)} input files is non-empty UTF-8 text "
            f"(e.g. {files[0] if files else '-'}); give text files"
        )
    return docs, skipped


def split_docs(docs: list[Doc], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train texts, val texts): the last `val_fraction` of the bytes, cut inside a document."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction} must be in (0, 1), e.g. 0.05")
    total = sum(d.nbytes for d in docs)
    cut = total - max(1, int(total * val_fraction))  # byte offset where val starts
    train, val, pos = [], [], 0
    for d in docs:
        if pos + d.nbytes <= cut:
            train.append(d.text)
        elif pos >= cut:
            val.append(d.text)
        else:  # the boundary falls inside this document: cut at the same fraction of characters
            at = int(len(d.text) * (cut - pos) / d.nbytes)
            train.append(d.text[:at])
            val.append(d.text[at:])
        pos += d.nbytes
    return [t for t in train if t], [t for t in val if t]


def train_tokenizer(texts: list[str], vocab_size: int, progress: bool):
    """A byte-level BPE tokenizer with `vocab_size` entries (EOT included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(
            f"--vocab-size {vocab_size} is outside {MIN_VOCAB}..{MAX_VOCAB} (at least 256 bytes + "
            f"end-of-text); use e.g. 4096"
        )


def pieces(text: str) -> list[str]:
    """`text` cut inside runs longer than _MAX_RUN characters (every _MAX_RUN characters), so
    that no pre-token is longer; text without such runs is one piece."""
    cuts = [
        at
        for m in _LONG_RUN.finditer(text)
        for at in range(m.start() + _MAX_RUN, m.end(), _MAX_RUN)
    ]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def tokenizer_path(path: str) -> str:
    """The tokenizer.json that --tokenizer `path` names: the file itself, or the one inside the
    folder `path` (a Hugging Face model folder); ValueError naming the fix when there is none."""
    fix = "give a Hugging Face model folder holding tokenizer.json, or a tokenizer.json file"
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.exists(path):
            folder = os.path.dirname(path)
            spm = os.path.exists(os.path.join(folder, "tokenizer.model"))
            note = " (its tokenizer.model, a SentencePiece file, is not read)" if spm else ""
            raise ValueError(
                f"--tokenizer {folder}: the folder has no {TOKENIZER_FILE}{note}; {fix}"
            )
    if not os.path.isfile(path):
        why = "no such file or folder" if not os.path.exists(path) else "not a regular file"
        raise ValueError(f"--tokenizer {path}: {why}; {fix}")
    return path


def read_tokenizer(path: str):
    """(tokenizer, the bytes of its file) for --tokenizer `path` (`tokenizer_path`).

    The file is untrusted input: it is read once, up to MAX_TOKENIZER_BYTES, and parsed by
    Hugging Face `tokenizers`; anything else is a ValueError of one line naming the file."""
    from tokenizers import Tokenizer

    path = tokenizer_path(path)
    bad = f"--tokenizer {path}: not a readable {TOKENIZER_FILE}"
    fix = "give the tokenizer.json a Hugging Face model ships (or one jaxpar data prepare wrote)"
    try:
        with open(path, "rb") as f:
            blob = f.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{bad} ({e.strerror}); {fix}") from None
    if len(blob) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{bad} (larger than {MAX_TOKENIZER_BYTES >> 20} MiB); {fix}")
    try:
        return Tokenizer.from_str(blob.decode("utf-8")), blob
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions for bad files
        why = " ".join(str(e).split())[:200]  # one line, bounded
        raise ValueError(f"{bad} ({why}); {fix}") from None


def load_tokenizer(path: str):
    """A tokenizer.json (Hugging Face tokenizers), or the one in folder `path`; ValueError when
    unreadable (`read_tokenizer`)."""
    return read_tokenizer(path)[0]


def eos_token(path: str) -> str | None:
    """The end-of-text token that the tokenizer_config.json beside tokenizer.json `path` names
    (`eos_token`: a string, or an object with `content`), or None when there is no such file or
    it names none. The file is untrusted: read bounded, and anything but those shapes is refused."""
    config = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG)
    if not os.path.exists(config):
        return None
    hint = f"; fix or remove it (then {EOT} separates the documents)"
    eos = read_json_object(config, TOKENIZER_CONFIG, hint).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        return None
    if not isinstance(eos, str) or not eos:
        raise ValueError(f"{config}: eos_token {str(eos)[:80]!r} is not a token{hint}")
    return eos


def end_of_text(tok, path: str | None) -> int:
    """The id that ends each document: the eos_token of tokenizer.json `path` (`eos_token`), else
    <|endoftext|> (what a trained tokenizer has); ValueError naming the fix when it has none."""
    eos = eos_token(path) if path else None
    eot = tok.token_to_id(eos or EOT)
    if eot is not None:
        return eot
    if eos:
        raise ValueError(
            f"--tokenizer {path}: {TOKENIZER_CONFIG} names eos_token {eos[:80]!r}, which is not "
            f"in its {TOKENIZER_FILE}; give the folder the model shipped"
        )
    raise ValueError(
        f"--tokenizer {path}: no end-of-text token (no eos_token in a {TOKENIZER_CONFIG} beside "
        f"it, and no {EOT}); add eos_token to {TOKENIZER_CONFIG} or {EOT} to the tokenizer"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype of the token files: uint16 while every id fits (vocab <= 65536), else uint32."""
    if not 2 <= vocab_size <= 1 << 32:
        raise ValueError(f"a vocabulary of {vocab_size} tokens: jaxpar token files hold 2..2**32")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _Bar:
    """Bytes encoded so far, on stderr: a live line on a terminal, a few plain lines otherwise."""

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.done, self.t0 = total, 0, time.time()
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.last = 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.time()
        final = self.done >= self.total
        if not self.enabled or (not final and now - self.last < (0.2 if self.tty else 5.0)):
            return
        self.last = now
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
        rate = self.done / 1e6 / max(now - self.t0, 1e-9)
        text = f"[{bar}] encoded {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB {rate:.1f} MB/s"
        self.stream.write(("\r" + text + ("\n" if final else "")) if self.tty else text + "\n")
        self.stream.flush()


class _ShardWriter:
    """Appends token ids to `PREFIX-NNNNN.bin` files of at most `shard_tokens` tokens each."""

    def __init__(self, out: str, prefix: str, dtype: np.dtype, shard_tokens: int):
        self.out, self.prefix, self.dtype, self.cap = out, prefix, dtype, shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype.newbyteorder("<"), copy=False)
        while len(ids):
            if self._f is None or self.shards[-1]["tokens"] >= self.cap:
                self._open()
            room = self.cap - self.shards[-1]["tokens"]
            self._f.write(ids[:room].tobytes())
            self.shards[-1]["tokens"] += len(ids[:room])
            ids = ids[room:]

    def _open(self) -> None:
        if self._f is not None:
            self._f.close()
        name = f"{self.prefix}-{len(self.shards):05d}.bin"
        self._f = open(os.path.join(self.out, name), "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> list[dict]:
        if self._f is not None:
            self._f.close()
        return self.shards


def _encode(tok, texts: list[str], writer: _ShardWriter, eot: int, bar: _Bar) -> int:
    """Each text's ids, then `eot`: the ids `tok.encode(text)` gives, with the special tokens
    the tokenizer adds itself (its post-processor: Llama 3's <|begin_of_text|>); `eot` is not
    repeated when the post-processor already ended the text with it."""
    from tokenizers import Encoding

    count = 0
    post = tok.post_processor is not None
    for i in range(0, len(texts), _ENCODE_CHUNK):
        chunk = texts[i : i + _ENCODE_CHUNK]
        cut = [pieces(t) for t in chunk]
        whole = iter(tok.encode_batch([ps[0] for ps in cut if len(ps) == 1]))
        parts = iter(
            tok.encode_batch([p for ps in cut if len(ps) > 1 for p in ps], add_special_tokens=False)
        )
        for ps in cut:
            if len(ps) == 1:
                doc = next(whole)
            else:  # the pieces joined, then post-processed as one text
                doc = Encoding.merge([next(parts) for _ in ps], growing_offsets=True)
                doc = tok.post_process(doc) if post else doc
            ids = doc.ids
            ended = post and bool(ids) and ids[-1] == eot and doc.special_tokens_mask[-1] == 1
            ids = np.asarray(ids if ended else [*ids, eot], np.int64)
            writer.write(ids)
            count += len(ids)
        bar.add(sum(len(t.encode("utf-8")) for t in chunk))
    return count


def _chunks(texts: list[str], size: int = 1 << 20) -> Iterator[str]:
    """Long documents in pieces of about `size` characters (BPE training memory stays flat),
    cut inside over-long runs too (`pieces`)."""
    for t in texts:
        for i in range(0, len(t), size):
            yield from pieces(t[i : i + size])


def prepare(
    inputs: list[str],
    out: str,
    *,
    vocab_size: int | None = None,
    val_fraction: float = 0.05,
    tokenizer: str | None = None,
    shard_tokens: int = _DEFAULT_SHARD_TOKENS,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` into `out` (see the module docstring); returns the meta.json dict."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens} must be >= 1")
    if tokenizer and vocab_size is not None:
        raise ValueError(
            f"--vocab-size {vocab_size} with --tokenizer {tokenizer}: the tokenizer fixes the "
            "vocabulary; drop --vocab-size"
        )
    if vocab_size is not None:
        check_vocab_size(vocab_size)
    check_path(out, option="--out")
    if os.path.exists(os.path.join(out, META)):
        raise ValueError(f"--out {out} already holds a prepared corpus ({META}); use a new folder")
    t0 = time.time()
    tok = tok_blob = None
    if tokenizer:  # used as it is, checked before any input is read
        tok_file = tokenizer_path(tokenizer)
        tok, tok_blob = read_tokenizer(tok_file)
        eot = end_of_text(tok, tok_file)
    files, not_files = input_files(inputs)
    docs, skipped = read_docs(files)
    skipped = not_files + skipped
    train, val = split_docs(docs, val_fraction)
    if not train or not val:
        raise ValueError(
            f"the input ({sum(d.nbytes for d in docs)} bytes) is too small to split with "
            f"--val-fraction {val_fraction}; give more text"
        )
    if tok is None:
        tok = train_tokenizer(
            list(_chunks(train)), DEFAULT_VOCAB if vocab_size is None else vocab_size, progress
        )
        eot = end_of_text(tok, None)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)
    os.makedirs(out, exist_ok=True)
    bar = _Bar(sum(len(t.encode("utf-8")) for t in train + val), progress)
    shards, counts = {}, {}
    t_encode = time.time()
    for name, texts in (("train", train), ("val", val)):
        writer = _ShardWriter(out, name, dtype, shard_tokens)
        try:
            counts[name] = _encode(tok, texts, writer, eot, bar)
        finally:
            shards[name] = writer.close()
    encode_seconds = time.time() - t_encode
    if tok_blob is None:
        tok.save(os.path.join(out, TOKENIZER_FILE))
    else:  # the given file, byte for byte
        with open(os.path.join(out, TOKENIZER_FILE), "wb") as f:
            f.write(tok_blob)
    meta = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name, "byte_order": "little",
        "vocab_size": vocab, "eot_id": eot, "tokens": counts, "shards": shards,
        "tokenizer": TOKENIZER_FILE, "val_fraction": val_fraction,
        "sources": [{"path": d.path, "bytes": d.nbytes, "sha256": d.sha256} for d in docs],
        "skipped": skipped, "input_bytes": sum(d.nbytes for d in docs),
        "seconds": time.time() - t0, "encode_seconds": encode_seconds,
    }  # fmt: skip
    tmp = os.path.join(out, f"{META}.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out, META))  # meta.json last: its presence means complete
    return meta
