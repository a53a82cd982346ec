"""The `tokens` source: pre-tokenized shards of flat token ids, read through `np.memmap`.

    python -m train --set data.source=tokens --set data.path=DIR

DIR is what `jaxpar data prepare` writes, or nanoGPT's train.bin/val.bin. The format, the
examples (windows of seq_len + 1 tokens) and the checks: docs/data.md, "The token-file format".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxpar.data.spec import SPLITS, SourceArgs, check_seq_len, lm_spec, split_id
from jaxpar.rundir.runlog import read_json_object

FORMAT = "jaxpar-tokens"
VERSION = 1
DTYPES = ("uint16", "uint32")
META = "meta.json"
NANOGPT_TOKENIZER = "tokenizer.json"  # read beside nanoGPT's train.bin/val.bin, which have no meta
# jaxpar's split -> the shard name prefix on disk (nanoGPT's names)
SPLIT_FILES = {"train": "train", "eval": "val"}


@dataclass(frozen=True)
class Shard:
    path: str
    tokens: int


@dataclass(eq=False)
class TokenSource:
    """Windows of `seq_len + 1` tokens over the shards of each split (see the module docstring)."""

    path: str
    seq_len: int
    dtype: str
    vocab_size: int
    vocab_fixed: bool  # meta.json fixes the vocabulary (the model must match it)
    shards: dict[str, tuple[Shard, ...]] = field(repr=False)
    tokenizer_file: str | None = None  # the tokenizer.json that decodes its ids (codec.py)
    name: str = "tokens"
    kind: str = "lm"
    bytes_read: int = 0  # token bytes this process has sliced out of the shards (benchmarks)

    def __post_init__(self):
        self._maps: dict[str, np.memmap] = {}
        # starts[split][k] = first token of shard k within the split's token stream
        self._starts = {
            s: np.cumsum([0] + [sh.tokens for sh in shards]) for s, shards in self.shards.items()
        }

    def tokens(self, split: str) -> int:
        return int(self._starts[_split(split)][-1])

    def size(self, split: str) -> int | None:
        return max(0, (self.tokens(split) - 1) // self.seq_len)

    def spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        return lm_spec(self.seq_len)

    def _map(self, shard: Shard) -> np.memmap:
        mm = self._maps.get(shard.path)
        if mm is None:
            mm = np.memmap(shard.path, dtype=np.dtype(self.dtype).newbyteorder("<"), mode="r")
            self._maps[shard.path] = mm
        return mm

    def window(self, index: int, split: str) -> np.ndarray:
        """Tokens [index * seq_len, index * seq_len + seq_len + 1) of `split`, as int32."""
        split = _split(split)
        n = self.size(split)
        if not 0 <= index < n:
            raise IndexError(f"tokens {split} window {index} out of range [0, {n})")
        starts, shards = self._starts[split], self.shards[split]
        lo, hi = index * self.seq_len, index * self.seq_len + self.seq_len + 1
        k = int(np.searchsorted(starts, lo, side="right")) - 1
        parts = []
        while lo < hi:  # a window may run across the end of a shard into the next
            take = min(hi, int(starts[k + 1])) - lo
            off = lo - int(starts[k])
            parts.append(np.asarray(self._map(shards[k])[off : off + take]))
            lo += take
            k += 1
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self.bytes_read += out.nbytes
        top = int(out.max())
        if top >= self.vocab_size:
            raise ValueError(
                f"{self.path}: token id {top} in {split} window {index} is >= vocab_size "
                f"{self.vocab_size}; the shards were written with another dtype or tokenizer "
                f"(check data.dtype and meta.json)"
            )
        return out.astype(np.int32)

    def example(self, index: int, split: str) -> dict[str, np.ndarray]:
        w = self.window(index, split)
        return {"inputs": w[:-1], "targets": w[1:]}

    def describe(self) -> str:
        sizes = ", ".join(f"{s} {self.tokens(s):,} tokens" for s in SPLITS)
        return (
            f"tokens: {self.path} ({self.dtype}, vocab {self.vocab_size}), lm seq_len="
            f"{self.seq_len}; {sizes}"
        )


def _split(split: str) -> str:
    return SPLITS[split_id(split)]


def _check_dtype(dtype: str, where: str) -> np.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"{where}: token dtype {dtype!r} is not supported; use one of {DTYPES}")
    return np.dtype(dtype)


def _shard(directory: str, name: object, tokens: object, itemsize: int) -> Shard:
    """A shard named in meta.json, checked against the file on disk (meta.json is untrusted)."""
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        raise ValueError(f"{directory}/{META}: shard name {name!r} must be a plain file name")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"{directory}/{META}: shard {name} token count {tokens!r} is invalid")
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: shard listed in {META} is missing; rerun jaxpar data prepare")
    size = os.path.getsize(path)
    if size != tokens * itemsize:
        raise ValueError(
            f"{path}: {size} bytes, but {META} says {tokens} tokens of {itemsize} bytes "
            f"({tokens * itemsize}); the file was written with another dtype or is truncated"
        )
    return Shard(path, tokens)


def _read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    meta = read_json_object(path, f"{FORMAT} meta file", "; rerun jaxpar data prepare")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} meta file (format={meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: version {meta.get('version')!r}; this jaxpar reads {VERSION}")
    return meta


def _from_meta(directory: str, seq_len: int, dtype: str) -> TokenSource:
    meta = _read_meta(directory)
    where = os.path.join(directory, META)
    have = meta.get("dtype")
    np_dtype = _check_dtype(have, where)
    if dtype and dtype != have:
        raise ValueError(
            f"data.dtype={dtype} but {where} says the shards are {have}; drop --set data.dtype"
        )
    vocab = meta.get("vocab_size")
    if (
        isinstance(vocab, bool)
        or not isinstance(vocab, int)
        or not 2 <= vocab <= 2 ** (8 * np_dtype.itemsize)
    ):
        raise ValueError(f"{where}: vocab_size {vocab!r} does not fit {have} token ids")
    listed = meta.get("shards")
    if not isinstance(listed, dict):
        raise ValueError(f"{where}: no 'shards' table; rerun jaxpar data prepare")
    shards = {}
    for split, prefix in SPLIT_FILES.items():
        entries = listed.get(prefix, [])
        if not isinstance(entries, list):
            raise ValueError(f"{where}: shards.{prefix} must be a list")
        shards[split] = tuple(
            _shard(directory, e.get("file"), e.get("tokens"), np_dtype.itemsize)
            for e in entries
            if isinstance(e, dict)
        )
    return TokenSource(
        directory, seq_len, have, vocab, True, shards, meta_tokenizer(directory, meta)
    )


def meta_tokenizer(directory: str, meta: dict | None = None, hint: str = "") -> str | None:
    """The tokenizer file that `directory`'s meta.json names, or None when it names none.

    meta.json is untrusted: it is read (unless `meta` is given) through the bounded reader, and
    its `tokenizer` entry counts only as a plain file name of a file present in `directory`.
    `hint` ends the error of an unreadable meta.json."""
    if meta is None:
        meta = read_json_object(os.path.join(directory, META), "meta file", hint)
    name = meta.get("tokenizer")
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        return None
    path = os.path.join(directory, name)
    return path if os.path.isfile(path) else None


def _nanogpt(directory: str, seq_len: int, vocab_size: int, dtype: str) -> TokenSource:
    np_dtype = _check_dtype(dtype or "uint16", f"data.dtype for {directory}")
    shards = {}
    for split, prefix in SPLIT_FILES.items():
        path = os.path.join(directory, f"{prefix}.bin")
        size = os.path.getsize(path)
        if size % np_dtype.itemsize:
            raise ValueError(
                f"{path}: {size} bytes is not a whole number of {np_dtype.name} tokens; "
                f"set data.dtype to the dtype it was written with"
            )
        shards[split] = (Shard(path, size // np_dtype.itemsize),)
    # no meta.json to name a tokenizer: one saved beside the shards under the usual name decodes
    tok_path = os.path.join(directory, NANOGPT_TOKENIZER)
    tok_path = tok_path if os.path.isfile(tok_path) else None
    return TokenSource(directory, seq_len, np_dtype.name, vocab_size, False, shards, tok_path)


def open_source(args: SourceArgs) -> TokenSource:
    """The `tokens` source's factory (registered in jaxpar/data/sources.py)."""
    check_seq_len(args.seq_len)
    return open_tokens(
        args.path, seq_len=args.seq_len, vocab_size=args.vocab_size, dtype=args.dtype
    )


def open_tokens(path: str, *, seq_len: int, vocab_size: int, dtype: str = "") -> TokenSource:
    """The tokens source over directory `path` (meta.json, else nanoGPT's train.bin/val.bin)."""
    if not path:
        raise ValueError(
            "data.source=tokens needs data.path=DIR: a folder written by `jaxpar data prepare "
            "INPUT --out DIR` (or nanoGPT's train.bin/val.bin)"
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"data.path={path}: no such directory; run `jaxpar data prepare INPUT... --out {path}` "
            "first"
        )
    if os.path.isfile(os.path.join(path, META)):
        source = _from_meta(path, seq_len, dtype)
    elif all(os.path.isfile(os.path.join(path, f"{p}.bin")) for p in SPLIT_FILES.values()):
        source = _nanogpt(path, seq_len, vocab_size, dtype)
    else:
        raise ValueError(
            f"data.path={path}: no {META} (from `jaxpar data prepare`) and no train.bin/val.bin "
            "(nanoGPT's layout); prepare the corpus into it first"
        )
    for split in SPLITS:
        if source.size(split) < 1:
            raise ValueError(
                f"{path}: the {split} split has {source.tokens(split)} tokens, fewer than one "
                f"window of seq_len+1={seq_len + 1}; use more text, a larger --val-fraction or a "
                "shorter seq_len"
            )
    return source
