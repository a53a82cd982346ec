"""Mesh specs, the logical-axis rules resolver, and the ValueErrors a user's mistakes raise.

Every error must say what to change: the assertions match the part of the message that names
the fix (parameter path, shape, logical axis, mesh axis, the value to use).
"""

import dataclasses

import pytest
from jax.sharding import AxisType, PartitionSpec

from jaxpar import meshes
from jaxpar.config import apply_overrides, resolve_recipe
from jaxpar.data.sources import batch_spec
from jaxpar.engine.mesh import AXES, MeshSpec, batch_parallel_size, make_mesh
from jaxpar.engine.rules import (
    ACT_RULES,
    PARAM_RULES,
    check_spec,
    logical_to_spec,
    named_sharding,
    validate_rules,
)
from jaxpar.parallel.program import build_program, check_batch
from jaxpar.worker import training

P = PartitionSpec

# ---- MeshSpec ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, sizes",
    [
        ("data=2,fsdp=2,tensor=2", (2, 2, 2, 1, 1, 1)),
        ("", (-1, 1, 1, 1, 1, 1)),  # all devices on data
        ("tensor=4", (1, 1, 4, 1, 1, 1)),  # unnamed axes are 1
        (" data = -1 , tensor=2 ", (-1, 1, 2, 1, 1, 1)),
        ("pipeline=2,data=4", (4, 1, 1, 2, 1, 1)),
        ("data=2,context=4", (2, 1, 1, 1, 4, 1)),
        ("fsdp=2,expert=2,tensor=2", (1, 2, 2, 1, 1, 2)),
    ],
)
def test_parse(text, sizes):
    assert MeshSpec.parse(text).shape == sizes


@pytest.mark.parametrize(
    "text, devices, sizes",
    [
        ("data=-1,tensor=4", 8, (2, 1, 4, 1, 1, 1)),
        ("fsdp=-1", 8, (1, 8, 1, 1, 1, 1)),
        ("", 4, (4, 1, 1, 1, 1, 1)),
        ("data=2,fsdp=2,tensor=2", 8, (2, 2, 2, 1, 1, 1)),
    ],
)
def test_resolve_fills_in_the_rest(text, devices, sizes):
    spec = MeshSpec.parse(text).resolve(devices)
    assert spec.shape == sizes and spec.size == devices
    # context and expert are written only when > 1: the texts of the other layouts are unchanged
    assert str(spec) == ",".join(f"{a}={n}" for a, n in zip(AXES[:4], sizes[:4], strict=True))


@pytest.mark.parametrize(
    "text, match",
    [
        ("data=2,model=4", r"'model=4' is not AXIS=SIZE .*'data', 'fsdp', 'tensor', 'pipeline'"),
        ("data", r"'data' is not AXIS=SIZE"),
        ("data=two", r"size of 'data' must be an int"),
        ("data=-1,fsdp=-1", r"only one axis may be -1"),
        ("data=0", r"axis 'data' has size 0; use >= 1 or -1"),
        ("tensor=-2", r"axis 'tensor' has size -2; use >= 1 or -1"),
    ],
)
def test_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        MeshSpec.parse(text)


@pytest.mark.parametrize(
    "text, match",
    [
        ("data=3", r"3 positions but there are 8 devices; make the axis sizes multiply to 8"),
        ("data=2,tensor=2", r"4 positions but there are 8 devices.*or set one axis to -1"),
        ("data=-1,tensor=3", r"fixed axes multiply to 3, which does not divide 8; change"),
    ],
)
def test_mesh_product_must_match_device_count(text, match, devices8):
    with pytest.raises(ValueError, match=match):
        make_mesh(text)


# ---- make_mesh ---------------------------------------------------------------------------------


def test_make_mesh_has_every_axis_auto_in_device_order(devices8):
    mesh = make_mesh("data=2,tensor=4")
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {
        "data": 2, "fsdp": 1, "tensor": 4, "pipeline": 1, "context": 1, "expert": 1
    }  # fmt: skip
    assert mesh.axis_types == (AxisType.Auto,) * 6
    assert list(mesh.devices.flat) == devices8
    assert batch_parallel_size(mesh) == 2
    assert batch_parallel_size(make_mesh("data=2,fsdp=2,tensor=2")) == 4


def test_make_mesh_on_a_subset_of_devices(devices8):
    mesh = make_mesh(MeshSpec.parse("data=-1"), devices8[2:6])
    assert mesh.shape["data"] == 4 and list(mesh.devices.flat) == devices8[2:6]
    one = make_mesh(meshes.PRESETS["cpu1"].mesh, devices8[:1])  # one device = the 1x...x1 mesh
    assert one.devices.shape == (1,) * len(AXES)


@pytest.mark.slow
def test_default_mesh_uses_every_device_on_data(devices8):
    """Every device of the process when none are given (the test process's 8), and as many as
    are given (4: the count is not the process's, nor a fixed 8): no process of its own."""
    assert dict(make_mesh("").shape) == dict.fromkeys(AXES, 1) | {"data": 8}
    assert dict(make_mesh("", devices8[:4]).shape) == dict.fromkeys(AXES, 1) | {"data": 4}


# ---- logical_to_spec ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh222(devices8):
    return make_mesh("data=2,fsdp=2,tensor=2")


def test_first_rule_whose_axes_are_unused_wins(mesh222):
    rules = (("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tensor"))
    assert logical_to_spec(("embed", "mlp"), rules, mesh222) == P("fsdp", "tensor")
    assert logical_to_spec(("mlp", "embed"), rules, mesh222) == P("fsdp", None)
    assert logical_to_spec(("mlp",), rules, mesh222) == P("fsdp")
    # Within one array no mesh axis is used twice, however the rules are ordered.
    assert logical_to_spec(("embed", "embed"), rules, mesh222) == P("fsdp", None)


def test_size_one_axes_are_dropped(devices8):
    dp8 = make_mesh("data=8")
    assert logical_to_spec(("embed", "mlp"), PARAM_RULES, dp8) == P(None, None)
    assert logical_to_spec(("batch", "seq"), ACT_RULES, dp8) == P("data", None)  # not a tuple
    fsdp8 = make_mesh("data=1,fsdp=8")
    # ("mlp", "tensor") has only a size-1 axis, so the later ("mlp", "fsdp") applies.
    assert logical_to_spec(("mlp", "embed"), PARAM_RULES, fsdp8) == P("fsdp", None)
    assert logical_to_spec(("batch",), ACT_RULES, make_mesh("data=2,fsdp=4")) == P(("data", "fsdp"))


def test_none_names_and_excluded_axes(mesh222):
    assert logical_to_spec((None, "mlp"), PARAM_RULES, mesh222) == P(None, "tensor")
    assert logical_to_spec(("batch", None), ACT_RULES, mesh222) == P(("data", "fsdp"), None)
    # Manual axes (inside a shard_map) are excluded: a rule needing them does not apply.
    assert logical_to_spec(("batch",), ACT_RULES, mesh222, exclude=("data",)) == P(None)


def test_default_tables_are_valid():
    validate_rules(PARAM_RULES)
    validate_rules(ACT_RULES)
    for name, preset in meshes.PRESETS.items():
        validate_rules(preset.params)
        validate_rules(preset.acts)
        assert preset.description, name


# ---- user mistakes raise a ValueError naming the fix -------------------------------------------


def test_unknown_logical_name(mesh222):
    with pytest.raises(ValueError, match=r"unknown logical axis 'hidden'; the vocabulary is .*mlp"):
        logical_to_spec(("hidden",), PARAM_RULES, mesh222)


def test_unknown_names_in_rules():
    with pytest.raises(ValueError, match=r"rule \('hidden', 'fsdp'\): unknown logical .*'mlp'"):
        validate_rules((("hidden", "fsdp"),))
    with pytest.raises(ValueError, match=r"unknown mesh axis 'model'; use \('data', 'fsdp'"):
        validate_rules((("mlp", "model"),))
    with pytest.raises(ValueError, match=r"unknown mesh axis 'model'"):
        validate_rules((("batch", ("data", "model")),))


def test_check_spec_rejects_an_axis_used_twice():
    check_spec(P(("data", "fsdp"), "tensor", None))
    with pytest.raises(ValueError, match=r"uses mesh axis 'fsdp' twice; give it once"):
        check_spec(P("fsdp", ("data", "fsdp")))


def test_named_sharding_checks_rank(mesh222):
    with pytest.raises(ValueError, match=r"w: 3 logical names \('mlp', None, None\) for shape"):
        named_sharding("w", (4, 4), ("mlp", None, None), PARAM_RULES, mesh222)
    # fewer names than dimensions: the rest unnamed, as in a PartitionSpec
    assert named_sharding("w", (4, 4), ("mlp",), PARAM_RULES, mesh222).spec == P("tensor", None)
    assert named_sharding("b", (4,), None, PARAM_RULES, mesh222).spec == P()


def _gpt(**model):
    cfg = resolve_recipe("gpt_tiny")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def _program(cfg, layout):
    p = meshes.resolve(layout)
    spec = batch_spec(training.make_source(cfg), cfg.data.global_batch)
    return build_program(cfg, make_mesh(p.mesh), p.params, p.acts, spec, "lm")


def test_dimension_not_divisible_names_param_shape_and_axes(devices8):
    # d_model=36 divides into 4 heads but not over fsdp=8.
    with pytest.raises(ValueError) as err:
        _program(_gpt(d_model=36), "fsdp8")
    msg = str(err.value)
    assert "parameter ['blocks']" in msg and "of shape (4, 36" in msg, msg
    assert "(logical 'embed', size 36)" in msg
    assert "not divisible by mesh axes ('fsdp',) of size 8" in msg
    assert "change the model size, the mesh, or the rule for 'embed'" in msg
    # vocab over tensor=4: the first parameter that does not divide is named.
    with pytest.raises(ValueError, match=r"\['head'\] of shape \(128, 258\).*'vocab'.*tensor"):
        _program(_gpt(vocab_size=258), "dp2_tp4")


def test_global_batch_must_divide_data_times_fsdp(devices8):
    mesh = make_mesh("data=2,fsdp=4")
    check_batch(32, 1, mesh)
    with pytest.raises(
        ValueError, match=r"global batch 12 is not divisible by the data-parallel size 8 .*"
        r"set --set data.global_batch to a multiple of 8",
    ):  # fmt: skip
        check_batch(12, 1, mesh)
    cfg = resolve_recipe("gpt_tiny")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, global_batch=12))
    with pytest.raises(ValueError, match="data.global_batch to a multiple of 8"):
        _program(cfg, "fsdp8")


def test_microbatches_must_divide_the_per_replica_batch(devices8):
    mesh = make_mesh("data=8")
    check_batch(32, 4, mesh)
    with pytest.raises(ValueError, match=r"microbatches=3 must divide the per-replica batch 4"):
        check_batch(32, 3, mesh)
    with pytest.raises(ValueError, match=r"microbatches=0"):
        check_batch(32, 0, mesh)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown mesh preset 'dp9'; use one of \[.*'dp8'.*"):
        meshes.resolve("dp9")
    assert meshes.resolve("data=2,tensor=4").mesh.shape == (2, 1, 4, 1, 1, 1)


def test_unknown_recipe():
    with pytest.raises(ValueError, match=r"unknown recipe 'gpt_huge'; known: \[.*'gpt_tiny'"):
        resolve_recipe("gpt_huge")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module'.*MODULE:FUNCTION"):
        resolve_recipe("no_such_module:recipe")
    assert resolve_recipe("train.recipes:digits_mlp").name == "digits_mlp"


def test_unknown_set_key():
    cfg = resolve_recipe("gpt_tiny")
    with pytest.raises(ValueError, match=r"optim.lrr: unknown key 'lrr'; known here: \[.*'lr'"):
        apply_overrides(cfg, ["optim.lrr=1e-3"])
    with pytest.raises(ValueError, match=r"unknown key 'optimiser'; known here: \[.*'optim'"):
        apply_overrides(cfg, ["optimiser.lr=1e-3"])
    with pytest.raises(ValueError, match=r"unknown key 'channels'; known here: \[.*'d_model'"):
        apply_overrides(cfg, ["model.channels=[8]"])  # a CNN field on the GPT config
    with pytest.raises(ValueError, match=r"use KEY=VALUE, e.g. --set optim.lr=3e-4"):
        apply_overrides(cfg, ["optim.lr"])


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.lr=fast", r"--set optim.lr=fast: expected float"),
        ("train.steps=1.5", r"--set train.steps=1.5: expected int"),
        ("train.steps=1e3", r"--set train.steps=1e3: expected int"),
        ("log.progress=maybe", r"--set log.progress=maybe: expected a boolean \(true/false\)"),
        ("model.d_model=wide", r"--set model.d_model=wide: expected int"),
    ],
)
def test_bad_set_value_type(override, match):
    with pytest.raises(ValueError, match=match):
        apply_overrides(resolve_recipe("gpt_tiny"), [override])


@pytest.mark.parametrize("value", ["16,32", "5", '[16.5, "a"]'])
def test_bad_set_tuple_value_names_the_key(value):
    with pytest.raises(ValueError, match=r"--set model.channels="):
        apply_overrides(resolve_recipe("digits_cnn"), [f"model.channels={value}"])


def test_context_and_expert_axes(devices8):
    """context and expert are mesh axes like the others: parsed, in the mesh (innermost, so a
    ring or an all-to-all spans neighbouring devices), written in texts only when > 1; expert
    splits the batch (outside the MoE layers it is one more data-parallel way)."""
    spec = MeshSpec.parse("data=2,context=4")
    assert str(spec) == "data=2,fsdp=1,tensor=1,pipeline=1,context=4"
    mesh = make_mesh(spec, devices8)
    assert mesh.shape["context"] == 4 and batch_parallel_size(mesh) == 2
    assert mesh.devices[1, 0, 0, 0, :, 0].tolist() == devices8[4:8]  # one ring: 4 neighbours
    ep = make_mesh("data=2,expert=4", devices8)
    assert batch_parallel_size(ep) == 8  # data x expert
    assert str(MeshSpec.parse("fsdp=2,expert=2,tensor=2")) == (
        "data=1,fsdp=2,tensor=2,pipeline=1,expert=2"
    )
    assert {"dp2_cp4", "fsdp2_cp2_tp2", "dp2_ep4", "fsdp2_ep2_tp2"} <= set(meshes.PRESETS)
