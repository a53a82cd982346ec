"""Which strategy trains a config on a mesh: the compatibility matrix, in one place.

    pipeline > 1                  -> pipeline     (not with comm.compress or DiLoCo)
    comm.diloco_inner_steps > 0   -> diloco       (needs data >= 2)
    comm.compress != none, data>1 -> compressed   (int8 / bf16 with error feedback)
    microbatches > 1, data > 1    -> manual_data  (gradients reduced once per step)
    otherwise                     -> spmd

The data-manual strategies (diloco, compressed, manual_data) run a shard_map manual over `data`;
XLA CPU aborts compiling one whose fsdp and tensor axes are both automatic and > 1, so such a
mesh refuses diloco and compression and falls back to spmd for accumulation. The pipeline's
shard_map (manual over data and pipeline) avoids the gathers that abort, and allows both.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jaxpar.config import TrainConfig, stage_split
from jaxpar.engine.mesh import DATA
from jaxpar.parallel.base import Strategy
from jaxpar.parallel.compressed import COMPRESS, Compressed
from jaxpar.parallel.diloco import DiLoCo
from jaxpar.parallel.manual_data import ManualData
from jaxpar.parallel.pipeline import Pipeline
from jaxpar.parallel.spmd import SPMD

STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (SPMD, ManualData, Compressed, Pipeline, DiLoCo)
}


def manual_data_compiles(mesh: Mesh) -> bool:
    """Whether a shard_map manual over `data` compiles on this mesh (not fsdp > 1 and tensor > 1)."""
    return not (mesh.shape["fsdp"] > 1 and mesh.shape["tensor"] > 1)


def uses_manual_data(mesh: Mesh, microbatches: int) -> bool:
    """Accumulate inside a shard_map manual over `data`, reducing gradients once per step.

    A plain scan all-reduces every microbatch; the manual axis is used whenever it compiles.
    """
    return microbatches > 1 and mesh.shape[DATA] > 1 and manual_data_compiles(mesh)


def choose(cfg: TrainConfig, mesh: Mesh) -> type[Strategy]:
    """The strategy for `cfg` on `mesh`; ValueError names the fix for a combination that is not
    supported."""
    comm, compress = cfg.comm, cfg.comm.compress
    if compress not in COMPRESS:
        raise ValueError(f"comm.compress={compress!r}: use one of {COMPRESS}")
    split = stage_split(cfg.pipeline)
    if mesh.shape["pipeline"] == 1 and len(split) > 1:
        raise ValueError(
            f"pipeline.stage_layers={','.join(map(str, split))} names {len(split)} stages but "
            f"the mesh has pipeline=1: use a mesh with pipeline={len(split)} or drop "
            f"pipeline.stage_layers"
        )
    if comm.diloco_inner_steps > 0:
        if mesh.shape[DATA] < 2:
            raise ValueError(
                "comm.diloco_inner_steps needs replicas: a mesh with data >= 2 (e.g. --mesh "
                "data=4,fsdp=2)"
            )
        if mesh.shape["pipeline"] > 1 or compress != "none":
            raise ValueError("DiLoCo does not combine with pipeline parallelism or comm.compress")
        if not manual_data_compiles(mesh):
            raise ValueError(
                "DiLoCo runs each replica in a shard_map manual over `data`, which XLA cannot "
                "compile with both fsdp and tensor automatic; use fsdp=1 or tensor=1 inside each "
                "replica"
            )
        return DiLoCo
    if compress != "none" and mesh.shape[DATA] > 1:
        if not manual_data_compiles(mesh):
            raise ValueError(
                f"comm.compress={compress} runs in a shard_map manual over `data`, which XLA "
                f"cannot compile with both fsdp and tensor automatic; use fsdp=1 or tensor=1"
            )
        if mesh.shape["pipeline"] > 1:
            raise ValueError(
                f"comm.compress={compress} does not combine with pipeline parallelism yet"
            )
        return Compressed
    if mesh.shape["pipeline"] > 1:
        return Pipeline
    if uses_manual_data(mesh, cfg.train.microbatches):
        return ManualData
    return SPMD
