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
        """The codec of a tokenizer.json, or of the one in folder `path` (a Hugging Face model
        folder); ValueError when it is unreadable."""
        from jaxpar.data.prepare import load_tokenizer  # imports `tokenizers` only when needed

        return cls(load_tokenizer(path))

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None:
            return BYTE_VOCAB
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with the special tokens the tokenizer adds itself (its
        post-processor: Llama 3's <|begin_of_text|>), as `jaxpar data prepare` writes them."""
        return self.encode_shown(text)[0]

    def encode_shown(self, text: str) -> tuple[list[int], list[int]]:
        """(`encode(text)`, the same ids less those the tokenizer added: what to show of it)."""
        if self.tokenizer is None:
            ids = list(text.encode("utf-8"))
            return ids, ids
        enc = self.tokenizer.encode(text)
        mask = enc.special_tokens_mask
        return enc.ids, [i for i, added in zip(enc.ids, mask, strict=True) if not added]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special tokens (an end-of-text) are shown as their text."""
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def encode_prompt(codec: Any, text: str) -> tuple[list[int], list[int]]:
    """(the ids a model is given for `text`, the ids to decode for showing it) for any codec: a
    `Codec` leaves out the special tokens its tokenizer added (a BOS), another shows them all."""
    if isinstance(codec, Codec):
        return codec.encode_shown(text)
    ids = list(codec.encode(text))
    return ids, ids


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
