"""The strategy plan (jaxpar.parallel.plan) and the mesh-axis facts (jaxpar.engine.mesh); the
import structure as a whole is tests/api/test_layers.py's."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import types

import pytest

from jaxpar.config import CommConfig, TrainConfig, TrainLoopConfig
from jaxpar.engine.mesh import (
    AXES,
    AXIS_INFO,
    BATCH_AXES,
    HOST_AXES,
    REPLICA_AXES,
    MeshSpec,
    batch_ways,
    mesh_text,
)
from jaxpar.parallel import plan

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _mesh(**sizes):
    return types.SimpleNamespace(shape={a: sizes.get(a, 1) for a in AXES})


def _cfg(microbatches=1, **comm):
    return TrainConfig(
        model=None, train=TrainLoopConfig(microbatches=microbatches), comm=CommConfig(**comm)
    )


@pytest.mark.parametrize(
    "mesh, cfg, want",
    [
        (_mesh(data=8), _cfg(), "spmd"),
        (_mesh(data=8), _cfg(4), "manual_data"),
        (_mesh(data=1, fsdp=8), _cfg(4), "spmd"),  # nothing to reduce over data
        (_mesh(data=2, fsdp=2, tensor=2), _cfg(4), "spmd"),  # manual data does not compile
        (_mesh(data=4, tensor=2), _cfg(4), "manual_data"),
        (_mesh(data=8), _cfg(compress="int8"), "compressed"),
        (_mesh(data=1, fsdp=8), _cfg(compress="int8"), "spmd"),  # data=1: nothing compressed
        (_mesh(data=4, pipeline=2), _cfg(), "pipeline"),
        (_mesh(data=4, pipeline=2), _cfg(4), "pipeline"),  # the pipeline refuses it itself
        (_mesh(data=4, fsdp=2), _cfg(diloco_inner_steps=4), "diloco"),
    ],
)
def test_plan_picks_the_strategy(mesh, cfg, want):
    chosen = plan.choose(cfg, mesh)
    assert chosen.name == want and plan.STRATEGIES[want] is chosen


@pytest.mark.parametrize(
    "mesh, cfg, match",
    [
        (_mesh(data=8), _cfg(compress="fp8"), r"comm.compress='fp8': use one of"),
        (_mesh(data=2, fsdp=2, tensor=2), _cfg(compress="int8"), r"use fsdp=1 or tensor=1"),
        (_mesh(data=4, pipeline=2), _cfg(compress="bf16"), "does not combine with pipeline"),
        (_mesh(data=1, fsdp=8), _cfg(diloco_inner_steps=2), r"data >= 2"),
        (_mesh(data=4, pipeline=2), _cfg(diloco_inner_steps=2), "DiLoCo does not combine"),
        (_mesh(data=4), _cfg(diloco_inner_steps=2, compress="int8"), "DiLoCo does not combine"),
        (_mesh(data=2, fsdp=2, tensor=2), _cfg(diloco_inner_steps=2), "fsdp=1 or tensor=1 inside"),
    ],
)
def test_plan_refuses_unsupported_combinations(mesh, cfg, match):
    with pytest.raises(ValueError, match=match):
        plan.choose(cfg, mesh)


def test_axis_facts_are_one_table():
    assert AXES == ("data", "fsdp", "tensor", "pipeline", "context", "expert")
    assert tuple(f.name for f in dataclasses.fields(MeshSpec)) == AXES
    assert AXES == tuple(a.name for a in AXIS_INFO)
    assert (BATCH_AXES, REPLICA_AXES, HOST_AXES) == (
        ("data", "fsdp", "expert"), ("data", "context"), ("data", "fsdp")
    )  # fmt: skip
    sizes = {"data": 2, "fsdp": 4, "tensor": 2, "pipeline": 1}
    assert batch_ways(sizes) == 8 and batch_ways({"tensor": 4}) == 1
    assert batch_ways({"data": 2, "expert": 4, "context": 2}) == 8
    assert MeshSpec.parse(mesh_text(sizes)) == MeshSpec(**sizes)
    assert mesh_text({"tensor": 2, "data": 4}) == "data=4,tensor=2"  # mesh order


def test_mesh_module_imports_without_jax():
    """The supervisor reads mesh specs and axis facts without starting jax."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(ROOT / 'jaxpar/engine/mesh.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['m'] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert str(m.MeshSpec.parse('data=2,tensor=4')) == 'data=2,fsdp=1,tensor=4,pipeline=1'\n"
        "assert 'jax' not in sys.modules and 'numpy' not in sys.modules, 'jax imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
