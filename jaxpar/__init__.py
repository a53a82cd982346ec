"""jaxpar: one model definition trained on any device mesh, and training that survives failures."""

from jaxpar.config import (
    DataConfig,
    LogConfig,
    OptimConfig,
    TrainConfig,
    TrainLoopConfig,
    apply_overrides,
)
from jaxpar.mesh import AXES, MeshSpec, make_mesh
from jaxpar.rules import ACT_RULES, PARAM_RULES, VOCAB, Preset, constrain, logical_to_spec

__version__ = "0.1.0"

__all__ = [
    "ACT_RULES",
    "AXES",
    "PARAM_RULES",
    "VOCAB",
    "DataConfig",
    "LogConfig",
    "MeshSpec",
    "OptimConfig",
    "Preset",
    "TrainConfig",
    "TrainLoopConfig",
    "apply_overrides",
    "constrain",
    "logical_to_spec",
    "make_mesh",
]
