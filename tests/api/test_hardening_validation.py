"""Malformed input: one line on stderr, exit code 2, no traceback, the run directory untouched.

The fuzz tests call the command lines' `main(argv)` in this process (validation happens before
jax compiles anything), so hundreds of cases cost seconds.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from jaxpar import cli
from jaxpar.config import RANGES, resolve_recipe, validate, warnings_for
from tests.support.hardening_util import call, snapshot
from train import __main__ as train_main


@pytest.fixture
def run_dirs(tmp_path):
    """A run directory with a previous run's files, and a path that does not exist yet."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "events.jsonl").write_text('{"event": "start", "time": 1.0, "incarnation": 0}\n')
    (used / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "time": 2.0}\n')
    (used / "config.json").write_text('{"name": "gpt_tiny"}\n')
    (used / "summary.json").write_text('{"steps": 1}\n')
    (used / "incarnation").write_text("1\n")
    return used, tmp_path / "fresh"


def assert_refused(capsys, main, argv, dirs):
    used, fresh = dirs
    for run_dir in (used, fresh):
        before = snapshot(run_dir)
        full = [*argv, "--run-dir", str(run_dir)] if main is train_main.main else argv
        code = call(main, full)
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, f"{full}: exit {code}\n{err[-2000:]}"
        assert len(lines) == 1, f"{full}: expected one line, got:\n{err[-2000:]}"
        assert "Traceback" not in err and not out.strip(), (full, out, err)
        assert snapshot(run_dir) == before, f"{full} changed the run directory"
    return lines[0]


# ---- every --set key gets malformed values -----------------------------------------------------


def _bad_values(typ, key: str) -> list[str]:
    if typ is bool:
        return ["maybe", "2", ""]
    if typ is int:
        return ["abc", "1.5", "nan", "-7", ""]
    if typ is float:
        return ["abc", "nan", "inf", "-inf", "-1e9", "1e999", ""]
    if typ is str:
        if key in ("name", "data.path", "ckpt.local_dir", "run.compile_cache_dir"):
            return []  # free text (a name; folders only some settings read)
        return ["bogus-value"]
    if typing.get_origin(typ) is tuple:
        return ["[0]", "abc", "[]x"]
    return ["abc"]


def set_cases() -> list[tuple[str, str]]:
    cfg = resolve_recipe("gpt_tiny")
    cases = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            hints = typing.get_type_hints(type(section))
            for g in dataclasses.fields(section):
                key = f"{f.name}.{g.name}"
                cases += [(key, v) for v in _bad_values(hints[g.name], key)]
            cases.append((f.name, "3"))  # a section is not a value
        else:
            cases += [(f.name, v) for v in _bad_values(str, f.name)]
    return cases


def test_fuzz_every_set_key_with_malformed_values(capsys, run_dirs):
    cases = set_cases()
    assert len(cases) > 150 and any(k == "model.n_layers" for k, _ in cases)
    for key, value in cases:
        argv = ["--no-progress", "--steps", "1", "--set", f"{key}={value}"]  # 1: fail fast
        line = assert_refused(capsys, train_main.main, argv, run_dirs)
        assert key.split(".")[-1] in line or key in line, (key, value, line)


MALFORMED_SET = ["optim.lr", "=3", "nope=1", "optim.nope=1", "optim.lr.x=1", "model.nope=2"]


@pytest.mark.parametrize("item", MALFORMED_SET)
def test_malformed_set_items(capsys, run_dirs, item):
    assert_refused(capsys, train_main.main, ["--set", item], run_dirs)


# ---- every option of python -m train -----------------------------------------------------------

TRAIN_OPTIONS = [
    ["--steps", "0"], ["--steps", "-5"], ["--steps", "abc"], ["--steps", "1.5"],
    ["--fault", "kill@0"], ["--fault", "kill@5:process=99"], ["--fault", "slow@1:seconds=inf"],
    ["--fault", "slow@1:seconds=abc"], ["--fault", "slow@1:seconds=nan"],
    ["--fault", "slow@1:seconds=-1"], ["--fault", "slow@1"], ["--fault", "boom@3"],
    ["--fault", "kill@x"], ["--fault", "kill"], ["--fault", "hang@3:permanent"],
    ["--fault", "kill@3:when=now"], ["--fault", "nan@2:seconds=1"],
    ["--mesh", "data=2,data=4"], ["--mesh", "data=x"], ["--mesh", "bogus"], ["--mesh", "data=0"],
    ["--mesh", "data=3"], ["--recipe", "nope"], ["--recipe", "no_such_module_xyz:f"],
    ["--recipe", "train.recipes:nope"], ["--bogus-option"],
]  # fmt: skip


@pytest.mark.parametrize("argv", TRAIN_OPTIONS, ids=lambda a: " ".join(a))
def test_fuzz_train_options(capsys, run_dirs, argv):
    assert_refused(capsys, train_main.main, [*argv, "--set", "model.n_layers=1"], run_dirs)


def test_run_dir_under_proc_or_a_file_is_refused(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for run_dir in ("/proc/jaxpar-run", str(a_file), str(a_file / "below")):
        code = call(train_main.main, ["--run-dir", run_dir, "--steps", "1"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and run_dir in err, err
    assert a_file.read_text() == "x"


def test_config_ranges_name_the_key_and_the_range():
    cfg = resolve_recipe("gpt_tiny")
    cases = {
        "optim.lr=-1": "optim.lr=-1.0 is out of range: allowed > 0",
        "model.dropout=2": "model.dropout=2.0 is out of range: allowed 0 <= x < 1",
        "optim.warmup_steps=-3": "allowed >= 0",
        "optim.min_lr_ratio=1.5": "allowed 0 <= x <= 1",
        "comm.diloco_inner_steps=-1": "comm.diloco_inner_steps=-1",
        "log.every=0": "log.every=0 is out of range: allowed >= 1",
        "log.every=-1": "log.every=-1",
        "train.eval_batches=0": "train.eval_batches=0",
        "ckpt.keep=0": "ckpt.keep=0 is out of range: allowed >= 1",
        "ckpt.keep=-1": "ckpt.keep=-1",
        "ckpt.every=-5": "ckpt.every=-5 is out of range: allowed >= 0",
        "data.global_batch=-8": "data.global_batch=-8",
        "model.n_layers=0": "model.n_layers=0",
    }
    from jaxpar.config import apply_overrides

    for item, message in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
            validate(apply_overrides(cfg, [item]))
    assert set(RANGES) >= {"optim.lr", "ckpt.keep", "log.every", "train.steps"}
    assert validate(cfg) is cfg


@dataclasses.dataclass(frozen=True)
class UserMoEConfig:
    """A user's own model config whose field names happen to be jaxpar's (moe_every, dropout)."""

    moe_every: int = 0  # 0: no MoE layer, in this user's meaning
    moe_period: int = 0
    dropout: float = 1.5
    scale: float = 1.0

    def build(self, rngs):  # never called here
        raise AssertionError


@dataclasses.dataclass(frozen=True)
class UserRangedConfig(UserMoEConfig):
    RANGES: typing.ClassVar[dict] = {"moe_every": RANGES["data.seed"]}  # >= 0


def test_jaxpar_ranges_apply_to_its_own_model_configs_only():
    """jaxpar's default ranges (sizes >= 1, rates in [0, 1)) are for jaxpar.models' configs; a
    user's config is checked by its own RANGES, and every float must be finite."""
    from jaxpar.config import apply_overrides

    cfg = dataclasses.replace(resolve_recipe("gpt_tiny"), model=UserMoEConfig())
    assert validate(cfg) is cfg  # moe_every=0, moe_period=0, dropout=1.5: the user's meaning
    with pytest.raises(ValueError, match=r"model\.scale=nan is out of range: allowed a finite"):
        validate(dataclasses.replace(cfg, model=UserMoEConfig(scale=float("nan"))))
    ranged = dataclasses.replace(cfg, model=UserRangedConfig(moe_every=-1))
    with pytest.raises(ValueError, match=r"model\.moe_every=-1 is out of range: allowed >= 0"):
        validate(ranged)
    for item, message in (("model.n_layers=0", "allowed >= 1"),  # jaxpar's GPT: the defaults
                          ("model.dropout=1.5", "allowed 0 <= x < 1")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            validate(apply_overrides(resolve_recipe("gpt_tiny"), [item]))
    llama = resolve_recipe("llama3_tiny")  # its own RANGES beside the defaults
    with pytest.raises(ValueError, match=r"model\.rope_factor=0\.5 is out of range: allowed >= 1"):
        validate(apply_overrides(llama, ["model.rope_factor=0.5"]))
    with pytest.raises(ValueError, match=r"model\.n_layers=0 is out of range: allowed >= 1"):
        validate(apply_overrides(llama, ["model.n_layers=0"]))


def test_settings_that_lose_work_warn():
    from jaxpar.config import apply_overrides

    cfg = resolve_recipe("gpt_tiny")
    assert warnings_for(cfg) == []
    (warning,) = warnings_for(apply_overrides(cfg, ["ckpt.every=0"]))
    assert "ckpt.every=0" in warning and "loses" in warning


# ---- the jaxpar console script ------------------------------------------------------------------


def test_report_and_bench_out_checked_first(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "time": 2.0}\n')
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        ["report", str(run_dir), "--out", "/proc/jaxpar-report"],
        ["report", str(run_dir), "--out", str(a_file)],
        ["report", str(a_file)],
        ["bench", "overhead", "--quick", "--out", str(a_file / "sub")],  # before it runs
        ["bench", "overhead", "--out", "/proc/x"],
        ["bench", "nope"],
        ["bench", "overhead", "--set", "optim.lr=-1", "--out", str(tmp_path / "b")],
        ["inspect", "--set", "model.n_layers=0"],
        ["inspect", "--mesh", "data=2,data=2"],
        ["nope"],
    ]
    for argv in cases:
        assert_refused(capsys, cli.main, argv, (tmp_path / "unused", tmp_path / "unused2"))
    assert not (tmp_path / "b").exists() and a_file.read_text() == "x"


def test_report_skips_non_numeric_metrics(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [
        '{"step": 1, "loss": 5.0, "step_time_s": 0.5, "time": 2.0, "incarnation": 0}',
        '{"step": "two", "loss": "abc", "time": "late", "incarnation": 0}',
        '{"step": 3, "loss": [1], "time": 4.0, "incarnation": 0}',
        '{"step": 2, "loss": 4.5, "step_time_s": 0.5, "time": 3.0, "incarnation": 0}',
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "events.jsonl").write_text(
        '{"event": "start", "time": 1.0, "incarnation": 0}\n{"event": "start", "time": "x"}\n'
    )
    assert cli.main(["report", str(run_dir)]) == 0
    assert (run_dir / "report" / "report.md").exists()
    assert "Traceback" not in capsys.readouterr().err


# ---- help ---------------------------------------------------------------------------------------


def test_help_lists_defaults_recipes_presets_and_fault_kinds(capsys):
    assert call(train_main.main, ["--help"]) == 0
    text = capsys.readouterr().out
    for word in ("gpt_tiny", "digits_cnn", "dp2_tp4", "fsdp8", "killsave", "slow", "default:"):
        assert word in text, word
    for sub in ("inspect", "bench", "report"):
        assert call(cli.main, [sub, "--help"]) == 0
        text = capsys.readouterr().out
        assert "default" in text, sub
        if sub != "report":
            assert "gpt_tiny" in text and "dp2_tp4" in text, sub
