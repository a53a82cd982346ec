"""Hugging Face checkpoints (jaxpar.hf): the peer's reference models, made once per session.

`hf_refs` is the folder tests/support/hf_peer_script.py wrote in the peer environment (torch and
transformers, created once in the user's cache; tests/support/hf_peer.py): tiny Llama, tied
Llama (and its bfloat16 copy), Qwen3, Mixtral and Qwen3-MoE models saved with `save_pretrained`,
with their logits, greedy generations and training losses. Tests that need it are skipped, with
the reason, where the peer cannot be installed (no package index).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import hf_peer


@pytest.fixture(scope="session")
def hf_refs() -> str:
    try:
        return hf_peer.references()
    except hf_peer.PeerUnavailable as e:
        pytest.skip(f"the Hugging Face peer environment is unavailable: {e}")


@pytest.fixture(scope="session")
def hf_ref(hf_refs):
    """name -> (its checkpoint folder, its reference arrays)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            with np.load(os.path.join(hf_refs, f"{name.removesuffix('_bf16')}.npz")) as z:
                cache[name] = (os.path.join(hf_refs, name), {k: z[k] for k in z.files})
        return cache[name]

    return get


@pytest.fixture
def make_checkpoint(tmp_path):
    """(model config, name, **write_folder options) -> a checkpoint folder of random float32
    weights written by jaxpar.hf.save (no transformers needed)."""
    from jaxpar.hf import names as hf_names
    from jaxpar.hf import save as hf_save

    def make(model, name: str = "ckpt", **kw) -> str:
        rng = np.random.default_rng(0)
        params: dict = {}
        for path, spec in hf_names.specs(model).items():
            d = params
            for key in path[:-1]:
                d = d.setdefault(key, {})
            d[path[-1]] = rng.standard_normal(spec.shape).astype(np.float32)
        out = str(tmp_path / name)
        hf_save.write_folder(out, model, params, **kw)
        return out

    return make
