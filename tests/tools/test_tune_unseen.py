"""`jaxpar tune` on models it has not seen: a user's own byte-level transformer that scans its
stacked layers and has no `flops_per_token` (tests/support/scan_lm.py), and the mixture of
experts, each with pipeline layouts. Loops (the scanned stack, the pipeline's tick loop) are
counted by their trip count and a pipeline's conditional by the branch each stage runs; the
commands tune and the doctor print run as printed; noisy measurements are said to be."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

from jaxpar import cli
from jaxpar.config import apply_overrides, resolve_recipe, validate
from jaxpar.engine import collectives
from jaxpar.engine.mesh import MeshSpec
from jaxpar.engine.rules import ACT_RULES, PARAM_RULES, Preset
from jaxpar.meshes import PRESETS
from jaxpar.parallel.program import with_recipe_rules
from jaxpar.tools import doctor, hardware, tune

SCAN_LM = "tests.support.scan_lm:recipe"
# the mixture of experts without its auxiliary losses, which a pipeline cannot add to its loss
MOE_SETS = ["model.moe_aux_weight=0", "model.router_z_weight=0"]

LOOP_OF_A_SWITCH = """HloModule m

%idle (a: f32[64,64]) -> f32[64,64] {
  ROOT %a = f32[64,64]{1,0} parameter(0)
}

%work (b: f32[64,64]) -> f32[64,64] {
  %b = f32[64,64]{1,0} parameter(0)
  ROOT %d = f32[64,64]{1,0} dot(%b, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[64,64], s32[])) -> (s32[], f32[64,64], s32[]) {
  %p = (s32[], f32[64,64], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,64]{1,0} get-tuple-element(%p), index=1
  %k = s32[] get-tuple-element(%p), index=2
  %y = f32[64,64]{1,0} conditional(%k, %x, %x), branch_computations={%idle, %work}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64,64], s32[]) tuple(%n, %y, %k)
}

%cond (q: (s32[], f32[64,64], s32[])) -> pred[] {
  %q = (s32[], f32[64,64], s32[]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %c = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

ENTRY %main (a: f32[64,64], k: s32[]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %k = s32[] parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[64,64], s32[]) tuple(%z, %a, %k)
  %w = (s32[], f32[64,64], s32[]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,64]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_conditional_runs_one_branch_and_a_table_says_which():
    dot = 2 * 64**3
    # no table: each of the 4 trips runs the costlier branch once (not both branches)
    assert collectives.hlo_flops(LOOP_OF_A_SWITCH) == 4 * dot
    # two devices, their branch per trip: each trip costs the slower device's branch
    table = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    cost = collectives.hlo_cost(LOOP_OF_A_SWITCH, table)
    assert cost["flops"] == 3 * dot  # trips 0, 1, 2 work somewhere; trip 3 idles everywhere
    assert cost["wait_flops"] == 1 * dot  # each device works 2 trips of the 3 it must wait out
    # per trip: the conditional, the dot of its costlier branch, the add; and the while
    assert tune.kernel_count(LOOP_OF_A_SWITCH) == 4 * 3 + 1


# Small shapes, two layers (one per stage): the same loops and branches, quick compiles.
SMALL = ["model.n_layers=2", "model.d_model=64", "model.seq_len=32", "data.seq_len=32",
         "data.global_batch=16"]  # fmt: skip
DP8 = ({"data": 8}, {"train.microbatches": 1})
PP2 = ({"data": 4, "pipeline": 2}, {"pipeline.schedule": "gpipe", "pipeline.microbatches": 2})


@pytest.fixture(scope="module")
def cpu_profile():
    return hardware.get("cpu", 8)


def _compile(cfg, sizes, settings, tmp):
    lay = tune.Layout(sizes, settings)
    s, compiled = tune.compile_layout(cfg, lay, jax.devices()[:8], str(tmp))
    return lay, s, compiled


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "sets"), [(SCAN_LM, SMALL), ("gpt_moe", [*MOE_SETS, *SMALL])])
def test_loops_are_counted_and_the_ranking_holds_when_measured(recipe, sets, tmp_path,
                                                               cpu_profile):  # fmt: skip
    """data=8 against 4 replicas of 2 pipeline stages (gpipe, 2 microbatches), compiled and run
    here. Load-independent: the scanned stack and the tick loop are counted by trip count, so
    the pipeline's busy FLOPs per device are at least the unpipelined program's (the same model
    split 8 ways either way; the pipeline's backward recomputes a little) and its bubble is the
    schedule's idle share. Measured (one step of each in turn, their fastest): the order of the
    two predictions is the measured order (they are several times apart)."""
    cfg = validate(apply_overrides(resolve_recipe(recipe), sets))
    dp, s_dp, c_dp = _compile(cfg, *DP8, tmp_path)
    pp, s_pp, c_pp = _compile(cfg, *PP2, tmp_path)
    xla = c_dp.cost_analysis()
    xla = (xla[0] if isinstance(xla, list) else xla)["flops"]
    if recipe == SCAN_LM:  # a scan over 2 layers: XLA's own analysis counts one of them
        assert s_dp.flops_per_step is None  # no flops_per_token: nothing but the program
        assert dp.flops > 1.3 * xla, (dp.flops, xla)
    busy = pp.flops - pp.wait_flops
    assert 0.9 * dp.flops < busy < 1.6 * dp.flops, (dp.flops, pp.flops, pp.wait_flops)
    # gpipe, 2 stages, 2 microbatches: 1 of every 3 ticks idle per stage, less what the
    # unequal branches (the last stage's head and loss) change
    assert 0.15 < pp.wait_flops / pp.flops < 0.5, (pp.wait_flops, pp.flops)
    for lay in (dp, pp):
        tune.predict(lay, cpu_profile)
    assert pp.predicted_step_s > 1.3 * dp.predicted_step_s, (pp.split, dp.split)
    t_dp, t_pp = tune.measure_all([(s_dp, c_dp), (s_pp, c_pp)], steps=2, quantile=0.0)
    assert t_pp > t_dp, (t_dp, t_pp, dp.predicted_step_s, pp.predicted_step_s)


def test_the_printed_train_command_parses_to_the_config_tune_compiled():
    """The recipe as given (module:function), the --set of the search, then the layout's own
    settings (a circular schedule's two layer groups per stage included)."""
    sets = ["model.d_model=64", "data.global_batch=16"]
    cfg = validate(apply_overrides(resolve_recipe(SCAN_LM), sets))
    lay = tune.Layout({"data": 2, "pipeline": 2},
                      {"train.microbatches": 1, "pipeline.schedule": "circular",
                       "pipeline.microbatches": 4})  # fmt: skip
    command = lay.command(SCAN_LM, sets)
    argv = command.split()
    assert argv[:2] == ["jaxpar", "train"]
    args = cli.build_parser(argv[1:]).parse_args(argv[1:])
    assert args.recipe == SCAN_LM and args.mesh == "data=2,pipeline=2"
    assert cli._layout(args.mesh, "cpu1").mesh.sizes() == MeshSpec(data=2, pipeline=2).sizes()
    again = validate(apply_overrides(resolve_recipe(args.recipe), args.overrides))
    compiled = tune.apply(cfg, lay.settings)  # the recipe's optimizer: a new object per call
    assert replace(again, optimizer=None) == replace(compiled, optimizer=None)
    assert again.pipeline.repeats == 2 and again.model.d_model == 64


def test_the_doctors_rule_first_runs_from_a_recipe_or_names_the_preset():
    """The doctor's "put parameter rule R first" is `param_rules_first` (in the recipe, or --set
    on the inspect command as given): the rule tables the command builds are the ones the doctor
    verified; a built-in preset of the same mesh that already puts R first is named."""
    rule = ("vocab", ("tensor", "fsdp"))
    mesh = MeshSpec.parse("data=2,fsdp=2,tensor=2")
    verified = Preset(mesh, (rule, *PARAM_RULES), ACT_RULES)
    best = doctor.Proposal(f"put parameter rule {rule} first", verified, 2, 0, 1, 0, 1, 0,
                           first=rule)  # fmt: skip
    given = doctor.inspect_command(SCAN_LM, "data=2,fsdp=2,tensor=2", ["model.d_model=64"])
    lines = doctor.apply_lines(best, given, validate(resolve_recipe(SCAN_LM)), PRESETS)
    assert "TrainConfig(param_rules_first=(('vocab', ('tensor', 'fsdp')),))" in lines[0]
    run = next(x for x in lines if "or run: " in x).split("or run: ", 1)[1]
    import shlex

    argv = shlex.split(run)
    args = cli.build_parser(argv[1:]).parse_args(argv[1:])
    assert args.doctor and args.mesh == "data=2,fsdp=2,tensor=2"
    cfg = validate(apply_overrides(resolve_recipe(args.recipe), args.overrides))
    assert with_recipe_rules(cfg, PARAM_RULES, ACT_RULES) == (verified.params, ACT_RULES)
    assert "--mesh dp2_fsdp2_tp2" in lines[-1]  # the built-in preset that holds the rule
    assert doctor.presets_with_first(rule, MeshSpec.parse("data=8"), PRESETS) == []


def test_noisy_measurements_are_said_to_be():
    """The profile's peak measured again after the layouts ran, and each layout's step spread."""
    prof = hardware.Profile("cpu", 1e15, 1.0, 1e9, 1e9, 1e9, 1e-4, 8, 0.0)  # far above this host
    out = tune.noise(prof, 2, [1.1])
    assert out["peak_after"] < prof.peak_flops and "peak moved" in out["warning"]
    assert "measure again on an idle machine" in out["warning"]
    steady = hardware.Profile("h100x8", 1e12, 1.0, 1e9, 1e9, 1e9, 1e-4, 8, 0.0)
    assert tune.noise(steady, 2, [1.1])["warning"] is None  # a named profile: nothing to redo
    assert "slowest step took 3.0x" in tune.noise(steady, 2, [3.0])["warning"]
