"""`jaxpar export RUN_DIR --out FILE`: the trained parameters as one safetensors file.

    jaxpar export runs/a --out gpt.safetensors    # writes gpt.safetensors and gpt.config.json
    model = load_model("gpt.safetensors")          # back as an nnx.Module (load(): the arrays)

The tensors' names, the config beside them and loading: docs/data.md, "Export".
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from jaxpar.config import TrainConfig, to_dict
from jaxpar.rundir.runlog import read_json_object
from jaxpar.tools import finished_run

FORMAT = "jaxpar-params"


def config_path(file: str) -> str:
    """The config JSON beside a safetensors file: NAME.safetensors -> NAME.config.json."""
    stem = file[: -len(".safetensors")] if file.endswith(".safetensors") else file
    return f"{stem}.config.json"


def param_names(params: dict) -> dict[str, Any]:
    """Flat {dotted path: leaf} of a pure parameter dict."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    return {".".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}


def export(run_dir: str, out: str) -> dict:
    """Write `out` (safetensors) and its config JSON; returns the config dict written."""
    from safetensors.numpy import save_file

    if not out.endswith(".safetensors"):
        raise ValueError(f"--out {out}: name the file NAME.safetensors")
    cfg, params, step = finished_run.load_run(run_dir)
    tensors = {
        k: np.ascontiguousarray(v) for k, v in param_names(finished_run.to_numpy(params)).items()
    }
    model = to_dict(cfg)["model"]
    meta = {
        "format": FORMAT, "model": model, "step": step,
        "parameters": int(sum(v.size for v in tensors.values())), "run_dir": os.path.abspath(run_dir),
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file(tensors, out, metadata={"format": FORMAT, "step": str(step)})
    with open(config_path(out), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def load(file: str) -> tuple[TrainConfig, dict]:
    """(a TrainConfig holding the model config, pure parameter dict of numpy arrays) of an
    exported file; every parameter the model needs must be there with its shape and dtype."""
    from safetensors.numpy import load_file

    cpath = config_path(file)
    meta = read_json_object(cpath, "jaxpar export config", f"; export writes it beside {file}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{cpath}: not a jaxpar export config")
    cfg = TrainConfig(model=finished_run.model_config(meta.get("model"), f"{cpath} model"))
    tensors = load_file(file)
    abstract = finished_run.abstract_params(cfg)
    want = param_names(abstract)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{file}: tensors do not match the model (missing {missing[:5]}, extra "
                         f"{extra[:5]})")  # fmt: skip
    for name, spec in want.items():
        got = tensors[name]
        if got.shape != spec.shape or got.dtype != spec.dtype:
            raise ValueError(
                f"{file}: {name} is {got.dtype}{list(got.shape)}, the model needs "
                f"{spec.dtype}{list(spec.shape)}"
            )
    leaves = [tensors[name] for name in want]
    return cfg, jax.tree.unflatten(jax.tree.structure(abstract), leaves)


def load_model(file: str):
    """An nnx model holding an exported file's parameters (see the module docstring)."""
    cfg, params = load(file)
    return finished_run.build_model(cfg, params)
