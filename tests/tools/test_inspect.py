"""`jaxpar inspect` lists the non-parameter state (BatchNorm statistics, counters) beside the
parameters, with its type, sharding and size."""

from __future__ import annotations

import json

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
    FSDP layout holds an eighth of dp8's parameter bytes per device) and its collectives."""
    from jaxpar import cli

    got = {}
    for mesh in ("dp8", "fsdp8"):
        rc = cli.main(["inspect", "--recipe", "gpt_tiny", "--mesh", mesh, "--json"])
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


def test_inspect_json_refuses_no_audit(capsys):
    from jaxpar import cli

    assert cli.main(["inspect", "--json", "--no-audit"]) == 2
    assert "drop --no-audit" in capsys.readouterr().err
