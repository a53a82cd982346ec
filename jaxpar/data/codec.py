"""Text <-> token ids: how the ids of a data source decode (`jaxpar sample` asks here).

    codec = codec_of(source, path=cfg.data.path) or Codec()   # None: nothing says

The order a source is asked in (its `codec()`, its `tokenizer_file`, its data folder's meta.json):
docs/data.md, "How `jaxpar sample` finds the tokenizer".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from jaxpar.data import tokens

BYTE_VOCAB = 256


@dataclass
class Codec:
    """Text <-> token ids: a Hugging Face tokenizer, or UTF-8 bytes (tokenizer None)."""

    tokenizer: Any = None

    @classmethod
    def from_file(cls, path: str) -> Codec:
        """The codec of a tokenizer.json; ValueError when it is unreadable."""
        from jaxpar.data.prepare import load_tokenizer  # imports `tokenizers` only when needed

        return cls(load_tokenizer(path))

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB if self.tokenizer is None else self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def codec_of(source: Any, path: str = "") -> Any | None:
    """How the ids of `source` decode (see the module docstring), or None when nothing says.

    `source` may be None (it could not be built): only the data folder `path` is asked then."""
    own = getattr(source, "codec", None)
    if callable(own):
        codec = own()
        if codec is not None:
            return codec
    tokenizer_file = getattr(source, "tokenizer_file", None)
    if tokenizer_file:
        return Codec.from_file(tokenizer_file)
    if path and os.path.isfile(os.path.join(path, tokens.META)):
        named = tokens.meta_tokenizer(path, hint="; pass --tokenizer FILE")
        if named is not None:
            return Codec.from_file(named)
    return None
