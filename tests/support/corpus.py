"""The small corpus the data tests share: two packages of the Python standard library's source
(`json`, `email`; ~0.4 MB), prepared with a 512-token byte-level BPE vocabulary."""

from __future__ import annotations

import os
import sysconfig

from jaxpar.data.prepare import prepare

VOCAB = 512
PACKAGES = ("json", "email")


def inputs() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return [os.path.join(root, p) for p in PACKAGES]


def prepare_corpus(out) -> str:
    prepare(inputs(), str(out), vocab_size=VOCAB, val_fraction=0.05, progress=False)
    return str(out)
