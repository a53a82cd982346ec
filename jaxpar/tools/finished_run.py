"""A trained model read back from a run directory (`jaxpar sample`, `jaxpar export`): its config
and the newest good checkpoint's parameters on one device, whatever mesh saved them; all of it
untrusted input (docs/design.md, "Run directory").

    cfg, params, step = load_run("runs/a")       # TrainConfig, pure dict of arrays, step
    model = build_model(cfg, params)              # an nnx.Module holding them
    cfg, variables, step = load_variables("runs/a")  # {"params", "model_state"}: all of a model
    model = build_model(cfg, variables["params"], variables.get("model_state"))
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import typing
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpar import config as config_lib
from jaxpar.engine import model as model_lib
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.model import STATE_KEY
from jaxpar.recovery.checkpoint import CHECKSUMS_FILE, checksums
from jaxpar.rundir.runlog import read_json_object
from jaxpar.usercode import search_current_directory


def _section(cls: type, values: object, where: str) -> Any:
    """Dataclass `cls` from a dict of its fields (unknown keys ignored; lists -> tuples)."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected an object, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    kwargs = {}
    for k, v in values.items():
        if k in names:
            is_tuple = typing.get_origin(hints.get(k)) is tuple
            kwargs[k] = tuple(v) if is_tuple and isinstance(v, list) else v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def model_config(values: object, where: str) -> Any:
    """The model config named by `_class` ("module:QualName") in a saved config dict."""
    if not isinstance(values, dict) or not isinstance(values.get("_class"), str):
        raise ValueError(f"{where}: no model '_class'; was this written by jaxpar?")
    mod_name, _, qual = values["_class"].partition(":")
    search_current_directory()  # a user's model package, after the installed ones (like recipes)
    try:
        cls = importlib.import_module(mod_name)
        for part in qual.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{where}: cannot import the model config {values['_class']!r} ({e}); run from the "
            "checkout (or the project) that trained it"
        ) from None
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type) and hasattr(cls, "build")):
        raise ValueError(f"{where}: {values['_class']!r} is not a model config dataclass")
    return _section(cls, values, where)


def load_config(run_dir: str) -> config_lib.TrainConfig:
    """The TrainConfig a run directory's config.json records."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir}: no such run directory")
    raw = read_json_object(path, "jaxpar config", f"; is {run_dir} a jaxpar run directory?")
    kwargs = {"model": model_config(raw.get("model"), f"{path} model")}
    for f in dataclasses.fields(config_lib.TrainConfig):
        if f.name == "model" or f.name not in raw:
            continue
        value = raw[f.name]
        cls = f.default_factory if callable(f.default_factory) else None
        if dataclasses.is_dataclass(cls):
            kwargs[f.name] = _section(cls, value, f"{path} {f.name}")
        elif isinstance(value, str):
            kwargs[f.name] = value
    return config_lib.TrainConfig(**kwargs)


def abstract_params(cfg: config_lib.TrainConfig) -> dict:
    """Pure dict of ShapeDtypeStructs of the model's parameters (nothing allocated)."""
    return abstract_variables(cfg)["params"]


def abstract_variables(cfg: config_lib.TrainConfig) -> dict:
    """Pure dicts of ShapeDtypeStructs of every variable a trained model holds: `params`, and
    `model_state` (BatchNorm statistics, counters) when it has non-parameter state. RNG streams
    are not among them: a rebuilt model's streams are seeded afresh (build_model)."""
    mdef = model_lib.abstract(cfg.model, cfg.train.seed)
    out = {"params": nnx.to_pure_dict(mdef.params)}
    if mdef.has_state:
        out[STATE_KEY] = nnx.to_pure_dict(mdef.state)
    return out


def build_model(cfg: config_lib.TrainConfig, params: dict, state: dict | None = None) -> nnx.Module:
    """The model of `cfg` holding `params` and its non-parameter `state` (pure dicts shaped like
    abstract_variables); its RNG streams, if any, keyed from a fixed key."""
    mdef = model_lib.abstract(cfg.model, cfg.train.seed)
    if mdef.has_state and state is None:
        raise ValueError(
            f"the model holds non-parameter state ({', '.join(mdef.state_paths()[:3])}); "
            "load it with the parameters (load_variables)"
        )
    return model_lib.rebuild(mdef, params, state if mdef.has_state else None, None)


def committed_steps(run_dir: str) -> list[int]:
    """Committed checkpoint steps (named by their step; tmp and quarantined folders are not)."""
    directory = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def _restore_step(run_dir: str, step: int, item: dict) -> dict:
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.join(run_dir, "checkpoints", str(step)))
    args = ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as ckptr:
        state = ckptr.restore(os.path.join(path, "state"), args=args)
    saved = read_json_object(os.path.join(path, CHECKSUMS_FILE), "checksums file")
    sums = checksums(state)
    bad = sorted(k for k, v in sums.items() if saved.get(k) != v)
    if bad:
        raise ValueError(f"checksum mismatch in {bad[:5]}")
    return state


def load_run(run_dir: str, device: jax.Device | None = None) -> tuple[Any, dict, int]:
    """(TrainConfig, parameters on `device` (default the first), step) of the newest good
    checkpoint in `run_dir`. The run directory is only read."""
    cfg = load_config(run_dir)
    variables, step = _load_newest(run_dir, {"params": abstract_params(cfg)}, device)
    return cfg, variables["params"], step


def load_variables(run_dir: str, device: jax.Device | None = None) -> tuple[Any, dict, int]:
    """Like load_run, with every variable of the model (abstract_variables: the parameters and
    the non-parameter state), never the optimizer state."""
    cfg = load_config(run_dir)
    variables, step = _load_newest(run_dir, abstract_variables(cfg), device)
    return cfg, variables, step


def _load_newest(run_dir: str, abstract: dict, device: jax.Device | None) -> tuple[dict, int]:
    steps = committed_steps(run_dir)
    if not steps:
        raise ValueError(f"{run_dir}: no committed checkpoint; train it first (ckpt.every > 0)")
    mesh = make_mesh("data=1", [device or jax.devices()[0]])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract
    )
    errors = []
    for step in reversed(steps):
        try:
            return _restore_step(run_dir, step, target), step
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint: fall back to an older one
            errors.append(f"step {step}: {e!r}"[:300])
            print(f"jaxpar: checkpoint {step} unusable, trying an older one", file=sys.stderr)
    raise ValueError(f"{run_dir}: no readable checkpoint ({'; '.join(errors)})")


def to_numpy(params: dict) -> dict:
    return jax.tree.map(np.asarray, jax.device_get(params))
