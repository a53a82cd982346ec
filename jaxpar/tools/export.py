"""`jaxpar export RUN_DIR --out FILE`: a trained model's variables as one safetensors file
(`--format hf --out DIR`: a Llama-family model as a Hugging Face checkpoint folder, jaxpar.hf).

    jaxpar export runs/a --out gpt.safetensors    # writes gpt.safetensors and gpt.config.json
    model = load_model("gpt.safetensors")          # back as an nnx.Module, in evaluation mode

Every variable inference needs is written: the parameters and the non-parameter state (BatchNorm
statistics, counters); RNG streams are not, a loaded model's are seeded afresh. The file is read
back as untrusted input: its size is bounded and every tensor's name, dtype and shape checked
against the model built from the config before anything is assigned. Names, the config beside
the file, permissions and loading: docs/data.md, "Export".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from typing import Any

import jax
import numpy as np

from jaxpar.config import TrainConfig, to_dict
from jaxpar.engine.model import STATE_KEY
from jaxpar.rundir.ownership import check_file_path
from jaxpar.rundir.runlog import read_json_object
from jaxpar.tools import finished_run

FORMAT = "jaxpar-params"
_HEADER_BYTES = 8  # a safetensors file: u64 header length, JSON header, then the data
_HEADER_PER_TENSOR = 512  # bound on a tensor's header entry (its name is a path in the model)


def config_path(file: str) -> str:
    """The config JSON beside a safetensors file: NAME.safetensors -> NAME.config.json."""
    stem = file[: -len(".safetensors")] if file.endswith(".safetensors") else file
    return f"{stem}.config.json"


def param_names(params: dict) -> dict[str, Any]:
    """Flat {dotted path: leaf} of a pure dict (parameters or non-parameter state)."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    return {".".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}


def check_out(out: str, force: bool = False) -> None:
    """Refuse an --out that cannot be written, or that would overwrite an earlier export without
    `force` (ValueError naming the fix); nothing is read or written."""
    if not out.endswith(".safetensors"):
        raise ValueError(f"--out {out}: name the file NAME.safetensors")
    check_file_path(out)
    for path in (out, config_path(out)):
        if os.path.isdir(path):
            raise ValueError(f"--out {out}: {path} is a folder; choose another name")
        if os.path.lexists(path) and not force:
            raise ValueError(f"--out {out}: {path} exists; pass --force to overwrite it")


def export(run_dir: str, out: str, force: bool = False) -> dict:
    """Write `out` (safetensors) and its config JSON; returns the config dict written. Both files
    are created like any output file (mode 0666 less the umask) and appear together."""
    check_out(out, force)
    cfg, variables, step = finished_run.load_variables(run_dir)
    params = _flat(variables["params"])
    state = _flat(variables.get(STATE_KEY, {}))
    if not force:
        refuse_nonfinite(run_dir, step, {**params, **state})
    meta = {
        "format": FORMAT, "model": to_dict(cfg)["model"], "step": step,
        "parameters": int(sum(v.size for v in params.values())), "state": sorted(state),
        "run_dir": os.path.abspath(run_dir),
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    _write(out, {**params, **state}, meta)
    return meta


def export_hf(run_dir: str, out: str, *, shard_bytes: int, force: bool = False) -> dict:
    """`jaxpar export RUN_DIR --format hf --out DIR`: the newest good checkpoint of a
    Llama-family run as a Hugging Face checkpoint folder (jaxpar.hf.save.write_folder, with the
    data folder's tokenizer when it has one); returns its summary and `step`."""
    from jaxpar.hf import config as hf_config
    from jaxpar.hf import save as hf_save

    hf_save.check_out(out, force)
    try:
        hf_config.hf_config(finished_run.load_config(run_dir).model)  # refused before reading
    except ValueError as e:
        raise ValueError(f"jaxpar export --format hf {run_dir}: {e}") from None
    cfg, variables, step = finished_run.load_variables(run_dir)
    params = finished_run.to_numpy(variables["params"])
    if not force:
        refuse_nonfinite(run_dir, step, param_names(params))
    tokenizer = cfg.data.path or None
    summary = hf_save.write_folder(out, cfg.model, params, shard_bytes=shard_bytes,
                                   tokenizer_dir=tokenizer, force=force)  # fmt: skip
    return {**summary, "step": step}


def refuse_nonfinite(run_dir: str, step: int, tensors: dict[str, np.ndarray]) -> None:
    """ValueError (one line) when the checkpoint's tensors hold a NaN or an infinity."""
    floats = {k: v for k, v in tensors.items() if v.dtype.kind not in "biu"}  # bfloat16 too
    bad = {k: int(v.size - np.isfinite(v).sum()) for k, v in floats.items()}
    bad = {k: n for k, n in bad.items() if n}
    if bad:
        raise ValueError(
            f"{run_dir}: the checkpoint of step {step} holds non-finite values ({sum(bad.values())} "
            f"in {len(bad)} of {len(tensors)} tensors, e.g. {next(iter(bad))}); pass --force to "
            f"export it anyway"
        )


def _flat(tree: dict) -> dict[str, np.ndarray]:
    return {
        k: np.asarray(v, order="C") for k, v in param_names(finished_run.to_numpy(tree)).items()
    }


def _write(out: str, tensors: dict[str, np.ndarray], meta: dict) -> None:
    """Both files under temporary names, then renamed into place; the tensors take the mode the
    config was created with (safetensors itself would create its file 0600)."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    cpath = config_path(out)
    tmp_t, tmp_c = f"{out}.tmp.{os.getpid()}", f"{cpath}.tmp.{os.getpid()}"

    def remove_temporaries() -> None:
        for tmp in (tmp_t, tmp_c):
            with contextlib.suppress(OSError):
                os.remove(tmp)

    remove_temporaries()  # a crashed export's; O_EXCL below never follows a planted link
    try:
        with open(os.open(tmp_c, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
        save_file(tensors, tmp_t, metadata={"format": FORMAT, "step": str(meta["step"])})
        os.chmod(tmp_t, stat.S_IMODE(os.stat(tmp_c).st_mode))
        os.replace(tmp_t, out)
        os.replace(tmp_c, cpath)
    except (OSError, SafetensorError) as e:
        remove_temporaries()
        raise ValueError(
            f"--out {out}: cannot write it ({e}); free space or choose another path"
        ) from None
    except BaseException:
        remove_temporaries()
        raise


def load(file: str) -> tuple[TrainConfig, dict, dict]:
    """(a TrainConfig holding the model config, pure dict of the parameters, pure dict of the
    non-parameter state ({} if the model has none)) of an exported file, as numpy arrays. Every
    variable the model needs must be there with its shape and dtype, and nothing else."""
    cpath = config_path(file)
    meta = read_json_object(cpath, "jaxpar export config", f"; export writes it beside {file}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{cpath}: not a jaxpar export config")
    cfg = TrainConfig(model=finished_run.model_config(meta.get("model"), f"{cpath} model"))
    abstract = finished_run.abstract_variables(cfg)
    want = {k: v for tree in abstract.values() for k, v in param_names(tree).items()}
    tensors = _read_checked(file, want)
    out = {
        key: jax.tree.unflatten(jax.tree.structure(tree), [tensors[k] for k in param_names(tree)])
        for key, tree in abstract.items()
    }
    return cfg, out["params"], out.get(STATE_KEY, {})


def _read_checked(file: str, want: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tensors of `file`, after checking its size, names, dtypes and shapes against `want`
    ({name: ShapeDtypeStruct}) and before reading any data."""
    from safetensors import SafetensorError, safe_open

    data = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in want.values())
    limit = data + _HEADER_BYTES + 4096 + _HEADER_PER_TENSOR * len(want)
    try:
        st = os.stat(file)
    except OSError as e:
        raise ValueError(f"{file}: {e.strerror}; give an exported NAME.safetensors") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{file}: not a regular file; give an exported NAME.safetensors")
    size = st.st_size
    if size > limit:
        raise ValueError(
            f"{file}: {size:,} bytes, more than the model's {data:,} bytes of tensors can take; "
            "was it exported from this config?"
        )
    try:
        with safe_open(file, framework="numpy") as f:
            names = set(f.keys())
            missing, extra = sorted(set(want) - names), sorted(names - set(want))
            if missing or extra:
                raise ValueError(
                    f"{file}: tensors do not match the model (missing {missing[:5]}, extra "
                    f"{extra[:5]}); export the run again"
                )
            for name, spec in want.items():
                sl = f.get_slice(name)
                got = (_DTYPES.get(sl.get_dtype(), sl.get_dtype()), list(sl.get_shape()))
                need = (str(np.dtype(spec.dtype)), list(spec.shape))
                if got != need:
                    raise ValueError(
                        f"{file}: {name} is {got[0]}{got[1]}, the model needs {need[0]}{need[1]}"
                    )
            return {name: f.get_tensor(name) for name in want}
    except SafetensorError as e:
        raise ValueError(
            f"{file}: not a readable safetensors file ({e}); export it again"
        ) from None


# safetensors' dtype names -> numpy's
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
    "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def load_model(file: str):
    """The nnx model of an exported file, holding its parameters and non-parameter state, in
    evaluation mode (`model.eval()`: dropout off, BatchNorm on its running statistics). Its RNG
    streams, if any, are keyed from a fixed key; `model.train()` to train it further."""
    import jax.numpy as jnp

    cfg, params, state = load(file)
    params, state = jax.tree.map(jnp.asarray, (params, state))
    model = finished_run.build_model(cfg, params, state or None)
    model.eval()
    return model
