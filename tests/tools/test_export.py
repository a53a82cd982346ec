"""`jaxpar export` and `load_model` round-trip models that keep non-parameter state and RNG
streams (tests/support/export_models.py): trained a few steps in-process, exported through the
command line, loaded back, evaluated to the run's own eval loss. The command's output checks, the
files' modes, and `load` on tampered files."""

from __future__ import annotations

import json
import os
import stat

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar import cli
from jaxpar.data import sources as data_lib
from jaxpar.engine.losses import classification
from jaxpar.rundir.runlog import read_jsonl
from jaxpar.tools.export import config_path, load, load_model
from tests.support import export_models as em


def train(model_cfg, name: str, mesh: str, tmp_path_factory):
    cfg = em.digits_config(model_cfg, name)
    run_dir = tmp_path_factory.mktemp(name) / "run"
    jaxpar.fit(cfg, mesh=mesh, run_dir=str(run_dir), progress=False)
    return cfg, run_dir


def export_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def load_tensors(data: bytes) -> dict:
    from safetensors.numpy import load

    return load(data)


def refused(capsys, *argv: str) -> str:
    code, out, err = export_cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and not out, (code, out, err)
    return lines[0]


def eval_loss(model, cfg) -> float:
    """The run's evaluation: the built-in loss over train.eval_batches batches of the eval split."""
    source = data_lib.make_source(cfg.data.source)
    losses = []
    for i in range(cfg.train.eval_batches):
        batch = data_lib.global_batch(
            source, step=i, global_batch=cfg.data.global_batch, seed=cfg.data.seed, split="eval"
        )
        losses.append(float(classification(model, batch, None)[0]))
    return float(np.mean(losses))


def logged_eval_loss(run_dir) -> float:
    (logged,) = [m["eval_loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in m]
    return logged


@pytest.fixture(scope="module")
def bn_run(tmp_path_factory):
    """The BatchNorm + Dropout CNN, 3 steps on data=8."""
    return train(em.BNNetConfig(), "bn", "data=8", tmp_path_factory)


@pytest.fixture(scope="module")
def bn_export(bn_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "bn.safetensors"
    code = cli.main(["export", str(bn_run[1]), "--out", str(out)])
    assert code == 0
    return out


def test_batchnorm_dropout_cnn_round_trips_to_the_runs_eval_loss(bn_run, bn_export):
    from safetensors.numpy import load_file

    cfg, run_dir = bn_run
    tensors = load_file(bn_export)
    assert {"norm.mean", "norm.var", "calls", "norm.scale", "conv.kernel"} <= set(tensors)
    assert not any("rng" in name or "dropout" in name for name in tensors)  # streams left out
    assert tensors["calls"].dtype == np.int32 and int(tensors["calls"]) > 0
    assert not np.allclose(tensors["norm.var"], 1.0)  # trained statistics, not the initial ones
    meta = json.loads(open(config_path(str(bn_export))).read())
    assert meta["state"] == ["calls", "norm.mean", "norm.var"] and meta["step"] == 3
    model = load_model(str(bn_export))
    assert model.dropout.deterministic and model.norm.use_running_average  # evaluation mode
    np.testing.assert_allclose(eval_loss(model, cfg), logged_eval_loss(run_dir), rtol=1e-5)
    _, params, state = load(str(bn_export))
    np.testing.assert_array_equal(state["norm"]["mean"], tensors["norm.mean"])
    assert set(params) == {"conv", "norm", "fc1", "fc2"}


def test_vit_with_multi_head_attention_round_trips_to_the_runs_eval_loss(
    tmp_path_factory, tmp_path
):
    cfg, run_dir = train(em.ViTConfig(), "vit", "data=4,tensor=2", tmp_path_factory)
    out = tmp_path / "vit.safetensors"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    model = load_model(str(out))
    np.testing.assert_allclose(eval_loss(model, cfg), logged_eval_loss(run_dir), rtol=1e-5)


def test_both_files_follow_the_umask(bn_run, tmp_path):
    out = tmp_path / "m.safetensors"
    old = os.umask(0o027)
    try:
        assert cli.main(["export", str(bn_run[1]), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(os.stat(p).st_mode) for p in (out, config_path(str(out)))}
    assert modes == {0o640}
    assert sorted(os.listdir(tmp_path)) == ["m.config.json", "m.safetensors"]  # no temporaries


def test_an_existing_export_is_overwritten_only_with_force(capsys, bn_run, tmp_path):
    run_dir = bn_run[1]
    out = tmp_path / "m.safetensors"
    assert export_cli(capsys, run_dir, "--out", out)[0] == 0
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "m.config.json").write_text("{}")  # either file existing is refused
    line = refused(capsys, run_dir, "--out", out)
    assert "exists" in line and "--force" in line
    assert out.read_bytes() == before[out]
    code, stdout, _ = export_cli(capsys, run_dir, "--out", out, "--force")
    assert code == 0 and "parameters and 3 state tensors of step 3" in stdout
    assert (tmp_path / "m.config.json").read_bytes() == before[tmp_path / "m.config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.config.json", "m.safetensors"]
    # the same tensors (safetensors orders its metadata differently from one write to the next)
    old, new = load_tensors(before[out]), load_tensors(out.read_bytes())
    assert old.keys() == new.keys() and all(np.array_equal(old[k], new[k]) for k in old)


def test_a_checkpoint_holding_a_nan_is_exported_only_with_force(capsys, bn_run, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    """A checkpoint whose variables hold a NaN (written before jaxpar refused such saves, or by
    other tools) is refused in one line naming the tensor; --force exports it as it is."""
    from jaxpar.tools import finished_run

    load = finished_run.load_variables

    def poisoned(run_dir, device=None):
        cfg, variables, step = load(run_dir, device)
        variables = jax.tree.map(np.array, jax.device_get(variables))  # writable copies
        first = jax.tree.leaves(variables["params"])[0]
        first.reshape(-1)[0] = np.nan
        return cfg, variables, step

    monkeypatch.setattr(finished_run, "load_variables", poisoned)
    out = tmp_path / "m.safetensors"
    line = refused(capsys, bn_run[1], "--out", out)
    assert "checkpoint of step 3 holds non-finite values (1 in 1 of" in line, line
    assert "pass --force to export it anyway" in line and not out.exists()
    assert export_cli(capsys, bn_run[1], "--out", out, "--force")[0] == 0
    assert sum(np.isnan(v).sum() for v in load_tensors(out.read_bytes()).values()) == 1


def test_an_out_that_cannot_be_written_is_refused_before_anything(capsys, bn_run, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "dir.safetensors").mkdir()
    cases = {
        "/proc/jaxpar-export.safetensors": "/proc",
        a_file / "m.safetensors": "is a file",
        a_file / "deeper" / "m.safetensors": "is a file",
        tmp_path / "dir.safetensors": "folder",
        tmp_path / "m.npz": "NAME.safetensors",
    }
    for out, words in cases.items():
        assert words in refused(capsys, bn_run[1], "--out", out)
    assert "no such run directory" in refused(
        capsys, tmp_path / "nope", "--out", tmp_path / "x.safetensors"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.safetensors", "file"]
    assert a_file.read_text() == "x"


def test_a_failed_write_is_one_line_and_leaves_nothing(capsys, bn_run, tmp_path):
    out = tmp_path / "m.safetensors"
    (tmp_path / f"m.safetensors.tmp.{os.getpid()}").mkdir()  # where the tensors would go
    assert "cannot write it" in refused(capsys, bn_run[1], "--out", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"m.safetensors.tmp.{os.getpid()}"]


def _tampered(bn_export, tmp_path, tensors=None, raw: bytes | None = None) -> str:
    from safetensors.numpy import save_file

    out = tmp_path / "t.safetensors"
    (tmp_path / "t.config.json").write_text(open(config_path(str(bn_export))).read())
    if raw is not None:
        out.write_bytes(raw)
    else:
        save_file(tensors, str(out))
    return str(out)


def test_load_checks_an_untrusted_file_against_the_model(bn_export, tmp_path):
    from safetensors.numpy import load_file

    good = load_file(bn_export)

    def error(**kw) -> str:
        with pytest.raises(ValueError) as e:
            load(_tampered(bn_export, tmp_path, **kw))
        return str(e.value)

    assert "norm.mean is float32[5], the model needs float32[4]" in error(
        tensors={**good, "norm.mean": np.zeros(5, np.float32)}
    )
    assert "calls is float32[], the model needs int32[]" in error(
        tensors={**good, "calls": np.zeros((), np.float32)}
    )
    assert "missing ['norm.var']" in error(
        tensors={k: v for k, v in good.items() if k != "norm.var"}
    )
    assert "extra ['opt.mu']" in error(tensors={**good, "opt.mu": np.zeros(1, np.float32)})
    big = {**good, "norm.mean": np.zeros(1 << 16, np.float32)}
    assert "more than the model's" in error(tensors=big)
    raw = bn_export.read_bytes()
    assert "not a readable safetensors file" in error(raw=raw[: len(raw) // 2])
    assert "not a readable safetensors file" in error(raw=b"\xff" * 64)
    (tmp_path / "t.safetensors").unlink()
    os.mkfifo(tmp_path / "t.safetensors")  # never opened: reading it would block
    with pytest.raises(ValueError, match="not a regular file"):
        load(str(tmp_path / "t.safetensors"))
    (tmp_path / "t.config.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a jaxpar export config"):
        load(str(tmp_path / "t.safetensors"))
