"""What the built-in data sources share, below jaxpar/data/sources.py and the sources that live in their
own module (jaxpar/data/tokens.py): the split names and the example spec of `lm` sources."""

from __future__ import annotations

import jax
import numpy as np

SPLITS = ("train", "eval")


def split_id(split: str) -> int:
    """The index of `split` in SPLITS (ValueError for an unknown split)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return SPLITS.index(split)


def lm_spec(seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The example spec of every `lm` source: int32 inputs and targets of `seq_len`."""
    one = jax.ShapeDtypeStruct((seq_len,), np.int32)
    return {"inputs": one, "targets": one}
