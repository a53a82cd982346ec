"""A jaxpar Llama-family model out as a Hugging Face checkpoint folder.

    write_folder(out, model_cfg, params, shard_bytes=2 << 30, tokenizer_dir="data/tok")

writes, into a temporary folder beside `out` that is renamed into place once complete (nothing
half-written is ever at `out`): config.json (jaxpar.hf.config.hf_config), the float32 tensors in
`model.safetensors` or, past `shard_bytes`, in `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`, generation_config.json, and the tokenizer (tokenizer.json, with
tokenizer_config.json and special_tokens_map.json when present, else a tokenizer_config.json
naming PreTrainedTokenizerFast) when `tokenizer_dir` holds a tokenizer.json. Files are written one
tensor at a time (each converted from its parameter as it is written).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import tempfile
from typing import Any

import numpy as np

from jaxpar.hf import config as hf_config
from jaxpar.hf import load as hf_load
from jaxpar.hf import names as hf_names
from jaxpar.hf import tensors
from jaxpar.rundir.ownership import check_creatable, under_system_dir

DEFAULT_SHARD_BYTES = 2 << 30
MAX_TOKENIZER_BYTES = 256 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes of `2GiB`, `500MB`, `1000000` (ValueError naming the forms)."""
    t = str(text).strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not math.isfinite(value) or value * _UNITS[unit] < 1:
        raise ValueError(
            f"--shard-size {text!r}: give a positive size, e.g. 2GiB, 500MB or a number of bytes"
        )
    return int(value * _UNITS[unit])


def check_out(out: str, force: bool = False) -> None:
    """Refuse an output folder that cannot be written or would replace an earlier export without
    `force` (ValueError naming the fix); nothing is written."""
    system = under_system_dir(out)
    if system is not None:
        raise ValueError(f"--out {out} is under {system}, a kernel filesystem; write to a "
                         f"normal disk, e.g. --out exports/NAME")  # fmt: skip
    if os.path.lexists(out) and not force:
        raise ValueError(
            f"--out {out} exists; pass --force to replace it, or choose another folder"
        )
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; choose a folder name")
    check_creatable(out)


def plan_shards(layout: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list]:
    """The tensors (name, shape), in order, split into files of at most `shard_bytes` (a tensor
    larger than that gets a file of its own)."""
    shards: list[list] = [[]]
    size = 0
    for name, shape in layout:
        nbytes = math.prod(shape) * 4
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def hf_layout(model: Any) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, tuple]]:
    """([(tensor name, shape)] in the order written, {tensor name: (spec, (layer, expert, slot))})."""
    layout, where = [], {}
    for spec in hf_names.specs(model).values():
        for idx, name in spec.hf_names():
            layout.append((name, spec.hf_shape))
            where[name] = (spec, idx)
    order = sorted(range(len(layout)), key=lambda k: _natural(layout[k][0]))
    return [layout[k] for k in order], where


def _natural(name: str) -> tuple:
    """model.layers.2 before model.layers.10."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def _tensor(params: dict, spec: hf_names.Spec, idx: tuple[int, int, int]) -> np.ndarray:
    value = params
    for key in spec.path:
        value = value[key]
    return hf_names.hf_tensor(spec, value, idx)


def write_folder(
    out: str,
    model: Any,
    params: dict,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer_dir: str | None = None,
    force: bool = False,
    extra_config: dict | None = None,
) -> dict:
    """Write the checkpoint folder `out` (see the module docstring); returns a summary:
    {"files", "tensors", "bytes", "parameters", "tokenizer", "config"}."""
    check_out(out, force)
    config = {**hf_config.hf_config(model), **(extra_config or {})}
    layout, where = hf_layout(model)
    shards = plan_shards(layout, shard_bytes)
    tok = _tokenizer_files(tokenizer_dir)
    umask = os.umask(0)
    os.umask(umask)
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-", dir=parent)
    try:
        files, weight_map, total = [], {}, 0
        for k, shard in enumerate(shards):
            name = hf_load.SINGLE if len(shards) == 1 else (
                f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")  # fmt: skip
            arrays = (_tensor(params, *where[t]) for t, _ in shard)
            tensors.write(os.path.join(tmp, name), shard, arrays, {"format": "pt"}, 0o666 & ~umask)
            files.append(name)
            for t, shape in shard:
                weight_map[t] = name
                total += math.prod(shape) * 4
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_json(os.path.join(tmp, hf_load.INDEX), index, umask)
        _write_json(os.path.join(tmp, hf_config.CONFIG), config, umask)
        gen = {"_from_model_config": True, "do_sample": False}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if config.get(key) is not None:
                gen[key] = config[key]
        _write_json(os.path.join(tmp, "generation_config.json"), gen, umask)
        for name, src in tok.items():
            dst = os.path.join(tmp, name)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o666 & ~umask)
        if tok and "tokenizer_config.json" not in tok:
            _write_json(os.path.join(tmp, "tokenizer_config.json"),
                        {"tokenizer_class": "PreTrainedTokenizerFast"}, umask)  # fmt: skip
        os.chmod(tmp, 0o777 & ~umask)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"files": files, "tensors": len(layout), "bytes": total,
            "parameters": total // 4, "tokenizer": sorted(tok), "config": config}  # fmt: skip


def _write_json(path: str, obj: dict, umask: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~umask)
    with open(fd, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _replace(tmp: str, out: str) -> None:
    """`tmp` becomes `out`; an earlier `out` (replaced with --force) is removed only after."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    old = f"{tmp}.old"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(old)


def _tokenizer_files(folder: str | None) -> dict[str, str]:
    """{name: path} of the tokenizer files to copy from a data folder holding tokenizer.json."""
    if not folder or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return {}
    out = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_TOKENIZER_BYTES:
            raise ValueError(
                f"{path}: not a regular file of at most {MAX_TOKENIZER_BYTES >> 20} MiB; the "
                f"tokenizer cannot be exported"
            )
        out[name] = path
    return out
