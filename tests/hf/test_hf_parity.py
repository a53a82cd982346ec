"""Hugging Face checkpoints against transformers itself: tiny models built and saved by
transformers (tests/support/hf_peer_script.py) load into jaxpar and give transformers' logits
(max abs difference <= 1e-4 in float32) on every layout, its greedy generation token for token
with the KV cache, and its training losses (two AdamW steps, torch.optim.AdamW against
optax.adamw) on one device and on a pipeline; HF -> jaxpar -> HF is bitwise, and transformers
reads the exported folders back to the same logits.

    python -m pytest tests/hf/test_hf_parity.py -n 0 -s   # -s prints the differences
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import jaxpar
from jaxpar.config import DataConfig, PipelineConfig, TrainConfig, TrainLoopConfig
from jaxpar.data import sources as data_lib
from jaxpar.engine import model as model_lib
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.rules import activation_rules, logical_to_spec
from jaxpar.hf import config as hf_config
from jaxpar.hf import load as hf_load
from jaxpar.hf import save as hf_save
from jaxpar.hf import tensors
from jaxpar.parallel.program import param_shardings
from jaxpar.tools.sample import generate
from tests.support import hf_peer, programs

pytestmark = pytest.mark.slow

LOGITS_ATOL = 1e-4
LOSS_RTOL = 1e-5


def forward(folder: str, tokens: np.ndarray, layout: str, **model_changes) -> np.ndarray:
    """The logits of `tokens` by the folder's model loaded onto `layout`, computed under the
    layout's activation rules (a `context` axis splits the sequence, `expert` the experts)."""
    cfg = hf_config.recipe(folder)
    model_cfg = dataclasses.replace(cfg.model, **model_changes)
    p = programs.preset(layout)
    mesh = make_mesh(p.mesh, jax.devices()[: p.mesh.size])
    mdef = model_lib.abstract(model_cfg, 0)
    with hf_load.open_folder(folder, expect=model_cfg) as f:
        params = hf_load.load_params(f, param_shardings(mdef.params, p.params, mesh))
    x = jax.device_put(
        tokens.astype(np.int32),
        NamedSharding(mesh, logical_to_spec(("batch", "seq"), p.acts, mesh)),
    )

    def logits(params, x):
        with activation_rules(mesh, p.acts):
            model = model_lib.rebuild(mdef, params, None, None)
            model.eval()
            return model(x)

    return np.asarray(jax.jit(logits)(params, x))


CASES = [
    ("llama", "dp8", {}),
    ("llama", "fsdp8", {}),
    ("llama", "dp2_tp4", {}),
    ("llama", "data=2,context=4", {"attention": "ring"}),
    ("llama", "data=2,context=4", {"attention": "allgather"}),
    ("llama", "data=2,context=4", {"attention": "alltoall"}),
    ("llama_tied", "fsdp8", {}),
    ("qwen3", "dp2_tp4", {}),
    ("mixtral", "dp8", {}),
    ("mixtral", "data=2,expert=4", {}),
    ("qwen3_moe", "data=2,expert=4", {}),
]


@pytest.mark.parametrize(
    "name, layout, changes",
    CASES,
    ids=[f"{n}-{lay}-{c.get('attention', '')}" for n, lay, c in CASES],
)
def test_logits_match_transformers(hf_ref, name, layout, changes):
    folder, ref = hf_ref(name)
    got = forward(folder, ref["tokens"][:, :256], layout, **changes)
    diff = float(np.abs(got - ref["logits"]).max())
    print(f"\n[hf] {name} {layout} {changes}: logits max abs diff {diff:.2e}")
    assert diff <= LOGITS_ATOL


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_decoding_with_the_kv_cache_matches_generate(hf_ref, name):
    folder, ref = hf_ref(name)
    cfg, model = jaxpar.from_hf(folder)
    assert isinstance(cfg, TrainConfig) and cfg.model == hf_config.recipe(folder).model
    prompt = [int(t) for t in ref["prompt"][0]]
    got = generate(model, prompt, len(ref["generated"][0]), temperature=0)
    assert got == [int(t) for t in ref["generated"][0]], f"margin {float(ref['margin']):.2e}"


def train_config(folder: str, layout: str, manifest: dict) -> TrainConfig:
    t = manifest["train_t"]
    a = manifest["adamw"]
    model = dataclasses.replace(hf_config.recipe(folder).model, seq_len=t)
    return TrainConfig(
        name="hf-train", model=model, mesh=layout,
        data=DataConfig(source="stdlib_text", global_batch=8, seq_len=t),
        train=TrainLoopConfig(steps=2),
        optimizer=optax.adamw(a["lr"], b1=a["betas"][0], b2=a["betas"][1], eps=a["eps"],
                              weight_decay=a["weight_decay"]),
        pipeline=PipelineConfig(schedule="1f1b", microbatches=4),
    )  # fmt: skip


@pytest.mark.parametrize("layout", ["cpu1", "pp2"])
def test_two_training_steps_match_torch_adamw(hf_ref, hf_refs, layout):
    """From the checkpoint's weights, two steps on one batch: the losses of transformers with
    torch.optim.AdamW (float32) and of jaxpar's train step with optax.adamw, on one device and
    on two pipeline stages (1F1B)."""
    import json

    with open(os.path.join(hf_refs, "manifest.json")) as f:
        manifest = json.load(f)
    folder, ref = hf_ref("llama")
    cfg = train_config(folder, layout, manifest)
    b = programs.build(cfg, layout)
    if layout == "pp2":
        assert b.program.strategy == "pipeline"
    with hf_load.open_folder(folder, expect=cfg.model) as f:
        state = hf_load.initial_state(b.program, f)
    t = manifest["train_t"]
    rows = {"inputs": ref["tokens"][:, :t].astype(np.int32),
            "targets": ref["tokens"][:, 1 : t + 1].astype(np.int32)}  # fmt: skip
    losses = []
    for _ in range(2):
        batch = data_lib.to_device(rows, b.program.batch_shardings, 8)
        state, m = b.program.train_step(state, batch)
        losses.append(float(m["loss"]))
    rel = programs.max_rel(losses, ref["train_losses"])
    print(f"\n[hf] train {layout}: {losses} vs torch {list(ref['train_losses'])}: rel {rel:.2e}")
    assert rel <= LOSS_RTOL


def read_all(folder: str) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (stored dtype, raw values)} of every tensor of a checkpoint folder."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            header = tensors.read_header(os.path.join(folder, name))
            with tensors.Reader(header) as r:
                for t, e in header.items():
                    out[t] = (e.dtype, r.read_raw(t, [range(d) for d in e.shape]).copy())
    return out


def test_hf_to_jaxpar_to_hf_is_bitwise_and_transformers_reads_the_export(hf_ref, tmp_path):
    """Each model loaded onto fsdp8 and written back: the same tensors bit for bit (the
    sharded llama into several files again), a config.json giving the same model; then
    transformers loads the exported folders (one peer process) to the reference logits."""
    venv, _ = hf_peer.ensure()
    checks, expected = [], {}
    for name in ("llama", "llama_tied", "qwen3", "mixtral", "qwen3_moe"):
        folder, ref = hf_ref(name)
        cfg, model = jaxpar.from_hf(folder, "fsdp8")
        params = jax.tree.map(np.asarray, model_lib.split_values(model)[0])
        out = str(tmp_path / name)
        hf_save.write_folder(out, cfg.model, params, shard_bytes=400_000)
        got, want = read_all(out), read_all(folder)
        assert sorted(got) == sorted(want), name
        for t, (dtype, value) in want.items():
            assert got[t][0] == dtype and np.array_equal(got[t][1].view(np.uint8),
                                                         value.view(np.uint8)), (name, t)  # fmt: skip
        assert hf_config.recipe(out).model == cfg.model
        assert os.path.exists(os.path.join(out, hf_load.INDEX)) == (len(os.listdir(out)) > 3)
        np.save(tmp_path / f"{name}.tokens.npy", ref["tokens"][:2, :256])
        checks += [out, str(tmp_path / f"{name}.tokens.npy"), str(tmp_path / f"{name}.npy")]
        expected[name] = ref["logits"][:2]
    hf_peer.run_script(venv, hf_peer.SCRIPT, "check", *checks)
    for name, want in expected.items():
        got = np.load(tmp_path / f"{name}.npy")
        diff = float(np.abs(got - want).max())
        print(f"\n[hf] transformers on the export of {name}: max abs diff {diff:.2e}")
        assert diff <= 1e-5, name


def test_a_bfloat16_checkpoint_loads_as_float32(hf_ref, capfd):
    folder, _ = hf_ref("llama_tied_bf16")
    f32_folder, ref = hf_ref("llama_tied")
    _, model = jaxpar.from_hf(folder)
    _, model32 = jaxpar.from_hf(f32_folder)
    import ml_dtypes

    a = model_lib.split_values(model)[0]
    b = model_lib.split_values(model32)[0]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == np.float32
        assert np.array_equal(
            np.asarray(x), np.asarray(y).astype(ml_dtypes.bfloat16).astype(np.float32)
        )
    err = capfd.readouterr().err
    assert err.count("holds bfloat16 tensors; loading them as float32") == 1
