"""What the built-in data sources share, below jaxpar/data/sources.py and the sources that live in their
own module (jaxpar/data/tokens.py): the split names, the arguments a source factory is called with,
and the example spec of `lm` sources."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class SourceArgs:
    """What a source factory is called with: a registered built-in's, or `data.source=module:callable`.

    The model's context and vocabulary, and the `data.*` settings."""

    seq_len: int = 64  # the model's context (lm sources)
    vocab_size: int = 256  # the model's vocabulary (lm sources)
    seed: int = 0  # data.seed: the source's own randomness
    path: str = ""  # data.path
    dtype: str = ""  # data.dtype


def check_seq_len(seq_len: int) -> None:
    """An `lm` source needs a context of at least one token."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")


def split_id(split: str) -> int:
    """The index of `split` in SPLITS (ValueError for an unknown split)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return SPLITS.index(split)


def lm_spec(seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The example spec of every `lm` source: int32 inputs and targets of `seq_len`."""
    one = jax.ShapeDtypeStruct((seq_len,), np.int32)
    return {"inputs": one, "targets": one}
