"""jaxpar: one model definition trained on any device mesh, and training that survives failures.

The public names below are imported lazily (PEP 562 `__getattr__`): `import jaxpar` and
`import jaxpar.supervisor` do not import jax, so the supervisor and the console script start fast
and can set XLA flags before jax's first use.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from jaxpar import _layout, _startup

_layout.install(__path__[0])  # a source checkout: serve models/, meshes/, train/ as jaxpar.*
_startup.install()  # flax's and treescope's import-time IPython probes answered without IPython

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # configuration
    "TrainConfig": "jaxpar.config",
    "DataConfig": "jaxpar.config",
    "OptimConfig": "jaxpar.config",
    "TrainLoopConfig": "jaxpar.config",
    "LogConfig": "jaxpar.config",
    "CkptConfig": "jaxpar.config",
    "RunConfig": "jaxpar.config",
    "PipelineConfig": "jaxpar.config",
    "CommConfig": "jaxpar.config",
    "PrecisionConfig": "jaxpar.config",
    "ModelConfig": "jaxpar.config",
    "apply_overrides": "jaxpar.config",
    "resolve_recipe": "jaxpar.config",
    # mesh and rules
    "AXES": "jaxpar.engine.mesh",
    "MeshSpec": "jaxpar.engine.mesh",
    "make_mesh": "jaxpar.engine.mesh",
    "ACT_RULES": "jaxpar.engine.rules",
    "PARAM_RULES": "jaxpar.engine.rules",
    "VOCAB": "jaxpar.engine.rules",
    "Preset": "jaxpar.engine.rules",
    "constrain": "jaxpar.engine.rules",
    "logical_to_spec": "jaxpar.engine.rules",
    # the library API for a user's own entrypoint (docs/api.md)
    "build": "jaxpar.api",
    "build_mesh": "jaxpar.api",
    "preset": "jaxpar.api",
    "Job": "jaxpar.api",
    "CheckpointManager": "jaxpar.api",
    "fit": "jaxpar.api",
    "entrypoint": "jaxpar.api",
    "from_hf": "jaxpar.api",
    "run_worker": "jaxpar.api",
    "resolve_run_dir": "jaxpar.api",
    "RunDir": "jaxpar.rundir.writer",
    "TensorBoardWriter": "jaxpar.rundir.writer",
    "Progress": "jaxpar.rundir.writer",
    "Preempted": "jaxpar.recovery.checkpoint",
    "CheckpointMismatch": "jaxpar.recovery.checkpoint",
    "NonFiniteLoss": "jaxpar.worker.faults",
    "heartbeat": "jaxpar.worker.bootstrap",
    "EXIT_PREEMPTED": "jaxpar.worker.bootstrap",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if _TYPE_CHECKING:  # static type checkers and IDEs see the real names
    from jaxpar.api import (  # noqa: F401
        CheckpointManager,
        Job,
        build,
        build_mesh,
        entrypoint,
        fit,
        from_hf,
        preset,
        resolve_run_dir,
        run_worker,
    )
    from jaxpar.config import (  # noqa: F401
        CkptConfig,
        CommConfig,
        DataConfig,
        LogConfig,
        ModelConfig,
        OptimConfig,
        PipelineConfig,
        PrecisionConfig,
        RunConfig,
        TrainConfig,
        TrainLoopConfig,
        apply_overrides,
        resolve_recipe,
    )
    from jaxpar.engine.mesh import AXES, MeshSpec, make_mesh  # noqa: F401
    from jaxpar.engine.rules import (  # noqa: F401
        ACT_RULES,
        PARAM_RULES,
        VOCAB,
        Preset,
        constrain,
        logical_to_spec,
    )
    from jaxpar.recovery.checkpoint import CheckpointMismatch, Preempted  # noqa: F401
    from jaxpar.rundir.writer import Progress, RunDir, TensorBoardWriter  # noqa: F401
    from jaxpar.worker.bootstrap import EXIT_PREEMPTED, heartbeat  # noqa: F401
    from jaxpar.worker.faults import NonFiniteLoss  # noqa: F401
