"""jaxpar: one model definition trained on any device mesh, and training that survives failures.

The public names below are imported on first use (module `__getattr__`), so tools that need no
jax (`jaxpar launch`, the supervisor, `jaxpar report`) start without importing it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "DataConfig": "jaxpar.config",
    "LogConfig": "jaxpar.config",
    "OptimConfig": "jaxpar.config",
    "TrainConfig": "jaxpar.config",
    "TrainLoopConfig": "jaxpar.config",
    "apply_overrides": "jaxpar.config",
    "AXES": "jaxpar.mesh",
    "MeshSpec": "jaxpar.mesh",
    "make_mesh": "jaxpar.mesh",
    "ACT_RULES": "jaxpar.rules",
    "PARAM_RULES": "jaxpar.rules",
    "VOCAB": "jaxpar.rules",
    "Preset": "jaxpar.rules",
    "constrain": "jaxpar.rules",
    "logical_to_spec": "jaxpar.rules",
}

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
