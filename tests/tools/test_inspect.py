"""`jaxpar inspect` lists the non-parameter state (BatchNorm statistics, counters) beside the
parameters, with its type, sharding and size."""

from __future__ import annotations

import json

import pytest

import jaxpar
from jaxpar.tools.inspect import inspect
from tests.support import export_models as em


def test_inspect_lists_the_non_parameter_state(tmp_path):
    cfg = em.digits_config(em.BNNetConfig(), "bn")
    text = inspect(cfg, jaxpar.preset("data=8"), str(tmp_path), audit=False)
    assert "| ['norm']['scale'] | None | () | (4,) | 16 B |" in text  # a parameter
    assert "| ['norm']['mean'] | BatchStat | () | (4,) | 16 B |" in text
    assert "| ['norm']['var'] | BatchStat | () | (4,) | 16 B |" in text
    assert "| ['calls'] | Variable | () | () | 4 B |" in text
    assert "non-parameter state: 36 bytes global, 3 arrays" in text


def test_inspect_of_a_model_without_state_has_no_state_table(tmp_path):
    cfg = em.digits_config(em.ViTConfig(), "vit")
    text = inspect(cfg, jaxpar.preset("data=4,tensor=2"), str(tmp_path), audit=False)
    assert "['mlp1']['kernel'] | (None, 'mlp') | (None, 'tensor')" in text
    assert "non-parameter state" not in text


def test_inspect_json_reports_the_compiled_steps_memory_and_collectives(tmp_path, capsys):
    """`jaxpar inspect --json`: per-device memory from XLA's analysis of the compiled step (an
    FSDP layout holds an eighth of dp8's parameter bytes per device) and its collectives. One
    block of gpt_tiny (every block is the same arrays and collectives): a quicker compile."""
    from jaxpar import cli

    got = {}
    for mesh in ("dp8", "fsdp8"):
        argv = ["inspect", "--recipe", "gpt_tiny", "--mesh", mesh, "--json",
                "--set", "model.n_layers=1"]  # fmt: skip
        rc = cli.main(argv)
        assert rc == 0
        got[mesh] = json.loads(capsys.readouterr().out)
    dp, fs = got["dp8"], got["fsdp8"]
    assert dp["mesh"]["data"] == 8 and fs["mesh"]["fsdp"] == 8 and dp["devices"] == 8
    for r in (dp, fs):
        mem = r["memory"]
        assert set(mem) >= {"arguments", "outputs", "temps", "peak"}
        assert mem["arguments"] > 0 and r["state_bytes_per_device"] > 0
        assert mem["peak"] >= mem["temps"] > 0
    assert fs["parameters"]["bytes_per_device"] * 8 <= dp["parameters"]["bytes_per_device"] * 1.1
    assert fs["memory"]["arguments"] < dp["memory"]["arguments"] / 4
    kinds = {(c["kind"], tuple(c["mesh_axes"])) for c in dp["collectives"]}
    assert ("all-reduce", ("data",)) in kinds
    assert any(c["kind"] == "all-gather" and c["mesh_axes"] == ["fsdp"] for c in fs["collectives"])


@pytest.mark.parametrize("flag", ["--json", "--doctor"])
def test_inspect_refuses_no_audit_with_what_compiles(capsys, flag):
    """--json and --doctor both read the compiled step: with --no-audit, one line, nothing built."""
    from jaxpar import cli

    assert cli.main(["inspect", flag, "--no-audit"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} " in err and "drop --no-audit" in err and err.count("\n") == 1


@pytest.mark.slow
def test_inspect_json_of_pipeline_and_context_layouts_says_how_they_run(capsys):
    """A pipeline layout's JSON has its schedule (kind, stages, microbatches, ticks, bubble), a
    context layout's its attention kernel and ring; a collective whose groups are single devices
    (mesh_axes []: the context layout's transposed psums) carries the note that explains it.
    gpt_tiny with two blocks, one per stage: quicker compiles, the same schedule and kernels."""
    from jaxpar import cli
    from jaxpar.engine.collectives import TRIVIAL_NOTE

    got = {}
    for mesh in ("data=4,pipeline=2", "data=2,context=4"):
        argv = ["inspect", "--recipe", "gpt_tiny", "--mesh", mesh, "--json",
                "--set", "pipeline.schedule=1f1b", "--set", "pipeline.microbatches=4",
                "--set", "model.n_layers=2"]  # fmt: skip
        assert cli.main(argv) == 0
        got[mesh] = json.loads(capsys.readouterr().out)
    pp = got["data=4,pipeline=2"]["pipeline"]
    assert (pp["schedule"], pp["stages"], pp["microbatches"]) == ("1f1b", 2, 4)
    assert pp["ticks"] > pp["microbatches"] and 0 < pp["bubble"] < 1
    assert pp["stage_layers"] == [1, 1] and len(pp["stage_train_flops"]) == 2
    ctx = got["data=2,context=4"]
    assert ctx["context"]["ring"] == 4 and ctx["context"]["attention"] and "pipeline" not in ctx
    assert any(row["mesh_axes"] == [] for row in ctx["collectives"])
    for r in got.values():
        for row in r["collectives"]:
            assert (row.get("note") == TRIVIAL_NOTE) == (row["mesh_axes"] == [])
