"""`jaxpar inspect --doctor`: XLA's involuntary rematerializations captured while compiling,
mapped to the array, the model's source line, the logical axes and the conflicting rules; a
proposed rule change verified by compiling again; the built-in presets compile without any."""

from __future__ import annotations

import dataclasses
import os

import jax
import pytest

import jaxpar
from jaxpar.config import apply_overrides, resolve_recipe, validate
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.rules import PARAM_RULES
from jaxpar.meshes import PRESETS
from jaxpar.tools import doctor
from jaxpar.worker.training import setup
from tests.support import helpers

WARNING = (
    "W1204 13:24:44.667834   31548 spmd_partitioner.cc:656] [SPMD] Involuntary full "
    "rematerialization. The compiler cannot go from sharding {devices=[1,1,2,4]<=[2,2,2]T(1,0,2) "
    "last_tile_dim_replicate} to {devices=[4,1,1,2]<=[8] last_tile_dim_replicate} efficiently for "
    "HLO operation %gather = f32[32,64,64]{2,1,0} gather(%all-gather, %all-gather), "
    "offset_dims={2}, sharding={devices=[1,1,2,4]<=[2,2,2]T(1,0,2) last_tile_dim_replicate}. As "
    "the last resort, SPMD will replicate the tensor and then partition it."
)
# The default table on dp2_fsdp2_tp2 (the preset puts ("vocab", ("tensor", "fsdp")) first): the
# token table's `embed` columns on fsdp while the lookup's output wants fsdp on its batch rows.
PLANTED = PARAM_RULES
# The preset test_the_mixed_preset_compiles_without_rematerializations compiles (in the quick
# tier; the slow test over every preset leaves it out)
MIXED = "dp2_fsdp2_tp2"


def small_gpt(**extra):
    """gpt_tiny with one layer: the same arrays and rules, a quicker compile."""
    sets = ["model.n_layers=1", *(f"{k}={v}" for k, v in extra.items())]
    return validate(apply_overrides(resolve_recipe("gpt_tiny"), sets))


def test_stderr_of_the_c_side_is_captured():
    with doctor.captured_stderr() as err:
        os.write(2, b"from C: Involuntary full rematerialization\n")
    assert err == ["from C: Involuntary full rematerialization\n"]


def test_warning_and_shardings_are_read():
    (w,) = doctor.parse_warnings("other line\n" + WARNING + "\n")
    assert (w["name"], w["opcode"], w["shape"]) == ("gather", "gather", "f32[32,64,64]{2,1,0}")
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    src, dst = doctor.sharding_axes(w["src"], mesh), doctor.sharding_axes(w["dst"], mesh)
    assert src == ((), (), ("fsdp",))
    assert dst == (("data", "fsdp"), (), ())
    assert doctor._moved(src, dst) == ("fsdp",)


def test_a_planted_rule_from_a_warm_cache_is_mapped_and_its_fix_verified(request, tmp_path):
    """One process of its own (it needs XLA's warnings, and XLA may log a kind of warning only
    so many times per process: earlier compilations of a worker's session use them up), three
    properties of one doctor run on the planted rule:

    - a program another process already put in jax's persistent cache would load without being
      partitioned again, and so without a warning: the doctor bypasses the cache even after the
      process has compiled with it (jax decides once per process whether the cache is in use);
    - each warning is mapped to the array, the model's source line, the logical axes and the
      conflicting rules, and the largest collectives to their model lines;
    - the proposed rule change is verified by compiling again: no warning left (the doctor's
      own verification, `remats_after`, counts the warnings of that compilation)."""
    if not helpers.in_child(request, "JAXPAR_DOCTOR_CHILD", "the doctor on a planted rule"):
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    preset = dataclasses.replace(jaxpar.preset("dp2_fsdp2_tp2"), params=PLANTED)
    run = str(tmp_path / "run")
    s = setup(small_gpt(), preset, run, create=False)
    doctor.lower_step(s).compile()  # cached, as an earlier test or run would have left it
    assert os.listdir(tmp_path / "jax-cache"), "the program must be in the persistent cache"
    result = doctor.doctor(small_gpt(), preset, run)
    remats = result["remats"]
    # none: a program from the cache was reported without its warnings (or none was logged)
    assert remats, "the planted rule must make XLA rematerialize"
    tok = [r for r in remats if any(p == "['params']['tok_emb']" for p, _ in r.arrays)]
    assert tok, [r.lines() for r in remats]
    r = tok[0]
    assert r.source.startswith(os.path.join("models", "gpt.py")) or "models/gpt.py" in r.source
    assert "GPT.embed" in r.source
    assert dict(r.arrays)["['params']['tok_emb']"] == ("vocab", "embed")
    assert r.moved == ("fsdp",)
    assert any("parameter rule ('embed', 'fsdp')" in x for x in r.rules)
    assert any(x.startswith("activation rule ('batch'") for x in r.rules)
    text = "\n".join(doctor.doctor_lines(result))
    assert "GPT.embed" in text and "largest collectives" in text
    # the largest collectives carry the model lines they come from
    assert any("models/gpt.py" in c["source"] for c in result["collectives"])
    assert result["proposals"], text
    best = result["proposals"][0]
    assert best.remats_before > 0 and best.remats_after == 0
    # the winner keeps the parameters sharded: no more argument bytes than the planted table
    assert best.args_after <= best.args_before


def test_the_mixed_preset_compiles_without_rematerializations(tmp_path):
    """dp2_fsdp2_tp2 used to rematerialize the token-embedding lookup twice. gpt_tiny with two
    layers, as test_every_preset_compiles_gpt_tiny_without_rematerializations compiles every
    other preset (it leaves this one to this test, in the quick tier)."""
    c, _ = doctor.verify(_fewer_layers("gpt_tiny"), jaxpar.preset(MIXED), str(tmp_path))
    assert c.warnings == []


# Layouts whose compilation XLA's SPMD partitioner aborts (a crash, not a rematerialization,
# and one that would take the test session down with it): none today.
ABORTS: set[str] = set()


def _eight_device_presets():
    """One preset per distinct program on 8 devices: presets of the same axis sizes and rules
    (cpu1 and h200x1; fsdp8, h100x8 and v5e-8) compile the same program, the first is kept."""
    out, seen = [], set()
    for name, p in PRESETS.items():
        if name in ABORTS:
            continue
        try:
            mesh = p.mesh.resolve(8)
        except ValueError:
            mesh = p.mesh
        n = mesh.size
        same = (tuple(sorted(mesh.sizes().items())), repr(p.params), repr(p.acts), repr(p.extra))
        if name == MIXED:  # test_the_mixed_preset_compiles_without_rematerializations compiles it
            seen.add(same)
        if 0 < n <= 8 and p.num_processes == 1 and same not in seen:
            seen.add(same)
            # a layout with experts needs a model with experts
            out.append((name, n, "gpt_moe" if p.mesh.sizes().get("expert", 1) > 1 else "gpt_tiny"))
    return out


def _fewer_layers(recipe: str, stages: int = 1):
    """The recipe with two layers (one per pipeline stage where it has more stages): every block
    is the same arrays, rules and collectives, and two of them show the hand-over from one block
    to the next (the blocks are unrolled: each one more is compiled again)."""
    return validate(apply_overrides(resolve_recipe(recipe), [f"model.n_layers={max(2, stages)}"]))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "n", "recipe"), _eight_device_presets())
def test_every_preset_compiles_gpt_tiny_without_rematerializations(tmp_path, name, n, recipe):
    cfg = _fewer_layers(recipe, PRESETS[name].mesh.sizes()["pipeline"])
    c, _ = doctor.verify(cfg, PRESETS[name], str(tmp_path), devices=jax.devices()[:n])
    assert c.warnings == [], (name, c.warnings)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gpt_small", "digits_mlp", "digits_cnn", "gpt_moe"])
def test_the_other_models_compile_on_the_mixed_preset_without_rematerializations(tmp_path, recipe):
    cfg = _fewer_layers(recipe) if recipe.startswith("gpt") else validate(resolve_recipe(recipe))
    for mesh in ("dp2_fsdp2_tp2", "fsdp4_tp2"):
        try:
            c, _ = doctor.verify(cfg, PRESETS[mesh], str(tmp_path))
        except ValueError:  # the model does not divide over this layout
            continue
        assert c.warnings == [], (recipe, mesh, c.warnings)
