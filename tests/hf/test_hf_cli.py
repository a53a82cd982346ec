"""`--recipe hf:DIR`, `--init-from hf:DIR` and `jaxpar export --format hf` on the command line:
a run started from a transformers checkpoint exports it back bit for bit, a checkpoint in the run
directory wins over --init-from (one line), and each bad input is one line, exit 2, nothing
written. Every command runs `jaxpar.cli.main` in this process."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar import cli
from jaxpar.config import resolve_recipe, to_dict
from jaxpar.hf import config as hf_config
from jaxpar.hf import tensors
from jaxpar.models.llama import LlamaConfig
from jaxpar.tools import sample
from tests.support.hardening_util import call, snapshot

SMALL = LlamaConfig(vocab_size=256, seq_len=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    d_mlp=48)  # fmt: skip


def one_line_refusal(capsys, argv: list[str]) -> str:
    code = call(cli.main, argv)
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{argv}: exit {code}\n{err[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in err, f"{argv}:\n{err[-2000:]}"
    return lines[0]


def train(run_dir, *argv: str) -> list[str]:
    return ["train", "--run-dir", str(run_dir), "--no-progress", "--set", "ckpt.local_every=0",
            *argv]  # fmt: skip


def test_an_unsupported_architecture_is_one_line(capsys, tmp_path, make_checkpoint):
    folder = make_checkpoint(SMALL)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump(cfg | {"architectures": ["Qwen2ForCausalLM"]}, f)
    line = one_line_refusal(capsys, train(tmp_path / "run", "--recipe", f"hf:{folder}"))
    assert "Qwen2ForCausalLM is not supported (its q/k/v projections have biases" in line
    assert "jaxpar loads LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM" in line
    assert not (tmp_path / "run").exists()


def test_a_recipe_that_differs_from_the_folder_is_refused_with_the_fields(
    capsys, tmp_path, make_checkpoint
):
    folder = make_checkpoint(SMALL)
    run = tmp_path / "run"
    for argv in (["--recipe", "llama3_tiny", "--init-from", f"hf:{folder}"],
                 ["--recipe", f"hf:{folder}", "--init-from", f"hf:{folder}", "--set",
                  "model.n_kv_heads=4"]):  # fmt: skip
        line = one_line_refusal(capsys, train(run, *argv))
        assert f"{folder}/config.json differs from the recipe's model (" in line
        assert "the weights cannot start that model; use --recipe hf:" in line
        assert not run.exists()
    assert "d_model: 256 → 32; n_layers: 4 → 2" in one_line_refusal(
        capsys, train(run, "--recipe", "llama3_tiny", "--init-from", f"hf:{folder}")
    )


def test_a_damaged_folder_is_refused_before_anything_is_written(capsys, tmp_path, make_checkpoint):
    folder = make_checkpoint(SMALL, shard_bytes=20_000)
    shard = os.path.join(folder, sorted(n for n in os.listdir(folder) if n.startswith("model-"))[1])
    os.truncate(shard, os.path.getsize(shard) - 8)
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(run)
    line = one_line_refusal(capsys, train(run, "--recipe", f"hf:{folder}", "--init-from",
                                          f"hf:{folder}"))  # fmt: skip
    assert f"{shard}: " in line and "(truncated); download it again" in line
    os.remove(shard)
    line = one_line_refusal(capsys, train(run, "--recipe", f"hf:{folder}", "--init-from",
                                          f"hf:{folder}"))  # fmt: skip
    assert f"{shard}: missing (model.safetensors.index.json places" in line
    line = one_line_refusal(capsys, train(run, "--recipe", f"hf:{folder}", "--init-from", folder))
    assert "give hf:DIR" in line
    assert snapshot(run) == before


def test_export_refuses_a_model_without_a_hugging_face_form(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "config.json", "w") as f:
        json.dump(to_dict(resolve_recipe("gpt_tiny")), f)
    out = tmp_path / "out"
    line = one_line_refusal(capsys, ["export", str(run), "--format", "hf", "--out", str(out)])
    assert f"jaxpar export --format hf {run}: a GPTConfig model has no Hugging Face form" in line
    assert not out.exists()
    line = one_line_refusal(capsys, ["export", str(run), "--out", "x.safetensors",
                                     "--shard-size", "1GB"])  # fmt: skip
    assert "--shard-size applies to --format hf only" in line


def read_all(folder: str) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            header = tensors.read_header(os.path.join(folder, name))
            with tensors.Reader(header) as r:
                for t, e in header.items():
                    out[t] = (e.dtype, r.read_raw(t, [range(d) for d in e.shape]).copy())
    return out


@pytest.mark.slow
def test_init_from_then_export_is_bitwise_and_a_checkpoint_wins(capsys, tmp_path, hf_ref):
    """One step at learning rate 0 (the warm-up's first) from transformers' llama leaves its
    weights as they were: the export of step 1 is the checkpoint bit for bit. A second run in the
    same directory resumes from its checkpoint and does not read --init-from (one line)."""
    folder, _ = hf_ref("llama")
    run, out = tmp_path / "run", tmp_path / "export"
    argv = ["--recipe", f"hf:{folder}", "--set", "data.global_batch=8"]
    assert call(cli.main, train(run, *argv, "--init-from", f"hf:{folder}", "--steps", "1")) == 0
    capsys.readouterr()
    code = call(cli.main, ["export", str(run), "--format", "hf", "--out", str(out),
                           "--shard-size", "400KB"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "as LlamaForCausalLM in 5 safetensors file(s)" in printed, printed
    got, want = read_all(str(out)), read_all(folder)
    assert sorted(got) == sorted(want)
    for t, (dtype, value) in want.items():
        assert got[t][0] == dtype and np.array_equal(got[t][1], value), t
    assert hf_config.recipe(str(out)).model == hf_config.recipe(folder).model
    missing = tmp_path / "gone"
    assert call(cli.main, train(run, *argv, "--init-from", f"hf:{missing}", "--steps", "2")) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if "--init-from" in x]
    assert err == [
        f"jaxpar: --init-from hf:{missing} not read: resuming from the checkpoint at step 1 in "
        f"{run}/checkpoints (a run directory's checkpoint wins)"
    ]
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f if '"loss"' in x] == [1, 2]
    # `jaxpar sample` of the run (KV-cached, grouped-query attention, rotary positions from the
    # cache's offset): greedy, the tokens of an uncached argmax loop over the full forward pass.
    # The forward pass is causal: the logits at position i of a zero-padded row are those of the
    # row cut after i, so one compiled program of the final length serves every step.
    cfg, model = jaxpar.from_hf(str(out))
    ids = list(b"def main(")
    forward = nnx.jit(lambda m, x: m(x))
    row = np.zeros((1, len(ids) + 12), np.int32)
    for _ in range(12):
        row[0, : len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(forward(model, row))[0, len(ids) - 1, :256])))
    assert sample.sample(str(run), "def main(", max_new_tokens=12, temperature=0) == (
        sample.run_codec(cfg, None).decode(ids)
    )


@pytest.mark.slow
def test_checkpoint_manager_restore_or_init_from_a_folder(tmp_path, make_checkpoint):
    """A loop of one's own: restore_or_init(init_from="hf:DIR") starts from the folder's
    weights on the job's shardings, with a fresh optimizer state."""
    import dataclasses

    import jax

    import jaxpar
    from jaxpar.hf import load as hf_load

    folder = make_checkpoint(SMALL)
    cfg = hf_config.recipe(folder)
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, global_batch=8),
        ckpt=dataclasses.replace(cfg.ckpt, local_every=0),
    )  # fmt: skip
    job = jaxpar.build(cfg, "fsdp8")
    with jaxpar.CheckpointManager(str(tmp_path / "run"), job=job) as ckpt:
        state = ckpt.restore_or_init(init_from=f"hf:{folder}")
        assert int(state["step"]) == 0 and "opt" in state
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        with hf_load.open_folder(folder) as f:
            want = hf_load.load_params(
                f, jax.tree.map(lambda _: one, job.state_shardings["params"])
            )
        for (path, got), (_, value) in zip(hf_load._paths(state["params"]),
                                           hf_load._paths(want), strict=True):  # fmt: skip
            assert got.sharding == dict(hf_load._paths(job.state_shardings["params"]))[path]
            assert np.array_equal(np.asarray(got), np.asarray(value)), path
