"""The bench registry: every suite has one signature, the help lists them with a rough duration,
the shared writer prints the table and where the JSON and the dated record went. Fast: no suite
is run."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import platform
import re

import pytest

from jaxpar import cli
from jaxpar.bench import harness


def test_every_suite_resolves_to_a_function_of_one_bench():
    assert {"overhead", "meshes", "checkpoint", "recovery", "pipeline", "comm", "precision"} <= set(
        harness.SUITES
    )
    for name, suite in harness.SUITES.items():
        mod, fn = suite.target.split(":")
        params = list(inspect.signature(getattr(importlib.import_module(mod), fn)).parameters)
        assert len(params) == 1, f"{name}: {suite.target} takes {params}, not one Bench"
        assert suite.help and suite.duration.startswith("~")


def test_help_lists_every_suite_with_its_duration(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for name, suite in harness.SUITES.items():
        assert f"  {name} " in out and suite.duration in out


def test_unknown_suite_and_duplicate_registration_are_errors(tmp_path):
    b = harness.Bench(cfg=None, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown bench suite 'nope'; use one of checkpoint"):
        harness.run_suite("nope", b)
    with pytest.raises(ValueError, match="registered twice"):
        harness.register("comm", "jaxpar.bench.comm:run", "again", "~1 min")


def test_write_prints_table_and_path(tmp_path, capsys):
    b = harness.Bench(cfg=None, out_dir=str(tmp_path / "out"))
    result = b.write(
        "demo", {"suite": "demo", "x": 1}, harness.table(["a", "b"], [[1, 2]], "---|---:")
    )
    out = capsys.readouterr().out
    path = tmp_path / "out" / "demo.json"
    (record,) = (tmp_path / "out").glob("*-demo.md")
    assert out == f"| a | b |\n|---|---:|\n| 1 | 2 |\n\nwrote {path}\nwrote {record}\n"
    assert json.loads(path.read_text()) == result


def test_write_keeps_a_dated_record_of_command_machine_and_table(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = ["/venv/bin/jaxpar", "bench", "demo", "--quick", "--set", "train.steps=3", "--out"]
    monkeypatch.setattr("sys.argv", [*argv, str(out)])
    b = harness.Bench(cfg=None, quick=True, out_dir=str(out), overrides=("train.steps=3",))
    b.write("demo", {"suite": "demo"}, harness.table(["a", "b"], [[1, 2]], "---|---:"))
    (record,) = out.glob("*-demo.md")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-demo\.md", record.name)
    assert f"wrote {record}" in capsys.readouterr().out
    text = record.read_text()
    lines = text.splitlines()
    assert lines[0] == f"# jaxpar bench demo, {record.name[:10]}"
    command = f"- command: `jaxpar bench demo --quick --set train.steps=3 --out {out}`"
    assert command in lines
    (machine,) = [line for line in lines if line.startswith("- machine: ")]
    assert platform.machine() in machine and f"{os.cpu_count()} CPUs" in machine
    (versions,) = [line for line in lines if line.startswith("- versions: ")]
    assert "jax " in versions and "flax " in versions
    assert "```text\n| a | b |\n|---|---:|\n| 1 | 2 |\n```\n" in text
    assert (out / "demo.json").exists()  # SUITE.json stays where other code reads it
    # called as a library (not from `jaxpar bench`), the command is rebuilt from the Bench
    monkeypatch.setattr("sys.argv", ["pytest"])
    b = harness.Bench(cfg=None, out_dir=str(out), recipe="digits_mlp", paths=("cold", "local"))
    assert b.command("recovery") == (
        f"jaxpar bench recovery --recipe digits_mlp --paths cold,local --out {out}"
    )


def test_bench_takes_the_recipe_and_overrides():
    b = harness.Bench.create("digits_mlp", ["train.steps=3"], quick=True)
    assert b.cfg.train.steps == 3 and b.recipe == "digits_mlp" and not b.default_recipe
    assert harness.Bench.create().default_recipe
    assert not harness.Bench.create(overrides=["train.steps=3"]).default_recipe


def test_recovery_paths_are_checked_before_anything_runs(tmp_path, capsys):
    from jaxpar.bench import recovery

    assert recovery.selected(()) == list(recovery.MODES)
    assert recovery.selected(("standby-hang", "cold")) == ["cold", "standby-hang"]
    b = harness.Bench.create(out_dir=str(tmp_path / "out"), paths=("standby", "warm"))
    with pytest.raises(ValueError, match="unknown restart path.*warm.*use some of cold"):
        harness.run_suite("recovery", b)
    # another suite refuses the option with one line naming the fix, and writes nothing
    assert cli.main(["bench", "meshes", "--paths", "standby", "--out", str(tmp_path / "o")]) == 2
    assert "--paths applies to `jaxpar bench recovery` only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_pipeline_schedules_are_checked_before_anything_runs(tmp_path, capsys):
    from jaxpar.bench import pipeline

    assert [s for s, _ in pipeline.selected(())] == [s for s, _ in pipeline.SCHEDULES]
    assert pipeline.selected(("zero_bubble", "gpipe")) == (("gpipe", 1), ("zero_bubble", 1))
    out = tmp_path / "o"
    assert cli.main(["bench", "pipeline", "--schedules", "1f1b,pipedream", "--out", str(out)]) == 2
    assert (
        "unknown schedule(s) pipedream for --schedules; use some of gpipe"
        in capsys.readouterr().err
    )
    assert cli.main(["bench", "meshes", "--schedules", "1f1b", "--out", str(out)]) == 2
    assert "--schedules applies to `jaxpar bench pipeline` only" in capsys.readouterr().err
    assert not out.exists()
    b = harness.Bench.create(quick=True, schedules=("1f1b",))
    assert "--schedules 1f1b" in b.command("pipeline")
