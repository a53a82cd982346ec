"""Hugging Face checkpoint folders in: checked whole, then streamed onto a mesh.

    folder = open_folder("Llama-3.2-1B")            # config.json + every header, all checked
    params = load_params(folder, shardings)          # pure dict of jax.Arrays, each sharded
    state = initial_state(program, folder)           # a train state starting from them

`open_folder` reads config.json and the safetensors headers (`model.safetensors`, or the shards
`model.safetensors.index.json` names) and checks every file and tensor — present, regular, its
size matching its header, F32/BF16/F16, every tensor config.json implies there with its shape,
nothing else but `rotary_emb.inv_freq` buffers and a tied `lm_head` equal to the token table —
before any array is built. A refused folder builds nothing.

`load_params` builds each parameter with `jax.make_array_from_callback` on its sharding, from the
distinct blocks this process's devices hold: names.blocks reads each Hugging Face tensor those
blocks need once (only the layers and experts inside them; in each tensor, the rows they need)
and cuts every block's part out of it. A process therefore holds its own shards plus, at most,
the one tensor being read; the whole model is never in one process's memory.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.hf import config as hf_config
from jaxpar.hf import names as hf_names
from jaxpar.hf import tensors
from jaxpar.rundir.runlog import read_json_object

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors$")
IGNORED_SUFFIX = ".rotary_emb.inv_freq"  # older checkpoints store the rotary frequencies
PREFIX = "hf:"


def source_folder(text: str) -> str:
    """The folder of an `--init-from` value (`hf:DIR`)."""
    if not isinstance(text, str) or not text.startswith(PREFIX) or not text[len(PREFIX) :]:
        raise ValueError(
            f"--init-from {text!r}: give hf:DIR, a Hugging Face checkpoint folder (config.json "
            "and *.safetensors)"
        )
    return text[len(PREFIX) :]


@dataclass
class Folder:
    """A checkpoint folder whose config and tensors passed every check."""

    path: str
    hf: dict  # config.json
    model: Any  # the model config its tensors are read for (LlamaConfig / LlamaMoEConfig)
    reader: tensors.Reader
    narrow: list[str] = field(default_factory=list)  # stored dtypes other than float32
    files: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_folder(path: str, expect: Any = None, seq_len: int | None = None) -> Folder:
    """The checked folder. `expect`: the model config the tensors must fit (a recipe's); its
    differences from config.json in any field that decides the tensors are refused, listed in one
    line. Without it, config.json's model (`seq_len`: see config.model_config)."""
    where = os.path.join(path, hf_config.CONFIG)
    hf = hf_config.read_config(path)
    if expect is not None:
        found = hf_config.model_config(hf, where)
        diff = hf_config.differences(expect, found)
        if diff:
            more = f"; and {len(diff) - 8} more" if len(diff) > 8 else ""
            raise ValueError(
                f"{where} differs from the recipe's model ({'; '.join(diff[:8])}{more}): the "
                f"weights cannot start that model; use --recipe hf:{path} or set those fields"
            )
        model = expect
    else:
        model = hf_config.model_config(hf, where, seq_len)
    want = hf_names.hf_tensors(model)
    files, mapped = _files(path, len(want))
    limit = 64 * 1024 + 2048 * len(want)
    entries: dict[str, tensors.Entry] = {}
    for name in files:
        for t, e in tensors.read_header(os.path.join(path, name), limit).items():
            if t in entries:
                raise ValueError(f"{e.file}: tensor {t[:200]!r} is also in {entries[t].file}; "
                                 f"download the checkpoint again")  # fmt: skip
            entries[t] = e
    for t, f in mapped.items():
        if t not in entries or os.path.basename(entries[t].file) != f:
            raise ValueError(
                f"{os.path.join(path, INDEX)} places {t[:200]!r} in {f}, which does not hold it; "
                f"download the checkpoint again"
            )
    _check_names(path, hf, model, want, entries)
    reader = tensors.Reader(entries)
    folder = Folder(path, hf, model, reader, files=files)
    folder.narrow = sorted({tensors.NAMES[e.dtype] for e in entries.values()} - {"float32"})
    try:
        if model.tie_embeddings and "lm_head.weight" in entries:
            _check_tied(folder)
    except BaseException:
        folder.close()
        raise
    return folder


def _files(path: str, tensors_wanted: int) -> tuple[list[str], dict[str, str]]:
    """(the safetensors files, {tensor: file} from the index or {} for a single file)."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        raw = read_json_object(index, "safetensors index", "; download it again")
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict) or len(weight_map) > 4 * tensors_wanted + 1024:
            raise ValueError(f"{index}: no usable 'weight_map' of tensor names to files; "
                             f"download it again")  # fmt: skip
        for t, f in weight_map.items():
            if not isinstance(f, str) or not SHARD_NAME.match(f) or len(t) > 1024:
                raise ValueError(
                    f"{index}: {str(t)[:100]!r} maps to {str(f)[:100]!r}, not a file name "
                    f"NAME.safetensors in the folder; download it again"
                )
        files = sorted(set(weight_map.values()))
        for f in files:
            if not os.path.exists(os.path.join(path, f)):
                first = next(t for t, g in weight_map.items() if g == f)
                raise ValueError(
                    f"{os.path.join(path, f)}: missing ({INDEX} places {first[:200]!r} and "
                    f"{sum(g == f for g in weight_map.values()) - 1} more tensors in it); "
                    f"download that shard again"
                )
        return files, dict(weight_map)
    if os.path.exists(os.path.join(path, SINGLE)):
        return [SINGLE], {}
    bins = [n for n in os.listdir(path) if n.endswith((".bin", ".pth", ".pt"))][:3]
    hint = (
        f" (it holds {', '.join(bins)}: convert them with save_pretrained(dir, "
        f"safe_serialization=True))"
        if bins
        else ""
    )
    raise ValueError(f"{path}: no {SINGLE} or {INDEX}{hint}; jaxpar reads safetensors")


def _check_names(path: str, hf: dict, model: Any, want: dict, entries: dict) -> None:
    arch = hf_config.architecture(hf, os.path.join(path, hf_config.CONFIG))
    missing = [t for t in want if t not in entries]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(
            f"{path}: tensors {', '.join(missing[:3])}{more} are missing; config.json "
            f"describes another model than the weights, or a shard is missing"
        )
    for t, shape in want.items():
        e = entries[t]
        if e.shape != shape:
            raise ValueError(
                f"{e.file}: {t} is {list(e.shape)} but config.json makes it {list(shape)}; "
                f"config.json and the weights are of different models"
            )
    extra = [
        t for t in entries if t not in want and not t.endswith(IGNORED_SUFFIX)
        and not (t == "lm_head.weight" and model.tie_embeddings)
    ]  # fmt: skip
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise ValueError(
            f"{entries[extra[0]].file}: tensors {', '.join(x[:120] for x in extra[:3])}{more} "
            f"are not part of a {arch} of this config.json (jaxpar's Llama has no biases)"
        )
    if model.tie_embeddings and "lm_head.weight" in entries:
        e = entries["lm_head.weight"]
        if e.shape != want["model.embed_tokens.weight"]:
            raise ValueError(f"{e.file}: lm_head.weight is {list(e.shape)}, unlike the tied token "
                             f"table {list(want['model.embed_tokens.weight'])}")  # fmt: skip


def _check_tied(folder: Folder, rows: int = 4096) -> None:
    """A stored lm_head of a tied model must be the token table (compared in row blocks)."""
    v, d = folder.reader.entries["model.embed_tokens.weight"].shape
    for r0 in range(0, v, rows):
        block = [range(r0, min(v, r0 + rows)), range(d)]
        a = folder.reader.read("model.embed_tokens.weight", block)
        b = folder.reader.read("lm_head.weight", block)
        if not np.array_equal(a, b):
            raise ValueError(
                f"{folder.path}: lm_head.weight differs from model.embed_tokens.weight but "
                f"config.json says tie_word_embeddings: true; fix config.json"
            )


def _paths(tree: dict) -> list[tuple[tuple[str, ...], Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(str(getattr(k, "key", k)) for k in p), leaf) for p, leaf in flat]


def notice(folder: Folder) -> None:
    """One line (process 0) when the stored dtype is not the parameters'."""
    if folder.narrow and jax.process_index() == 0:
        print(
            f"jaxpar: {folder.path} holds {' and '.join(folder.narrow)} tensors; loading them as "
            f"float32 (the parameters' dtype)",
            file=sys.stderr,
            flush=True,
        )


# The bytes of one parameter's blocks a process assembles on the host at once. A stacked [L, ...]
# parameter whose blocks here are larger is placed layer by layer instead (each layer's part
# copied into its devices' buffers), so that the host holds one layer of it at a time.
HOST_BLOCK_BYTES = 1 << 30


def load_params(folder: Folder, shardings: dict, *, host_bytes: int | None = None) -> dict:
    """The model's parameters (a pure dict like the model's parameter state) as jax.Arrays on
    `shardings` (a pure dict of NamedShardings of the same structure), each block read from the
    files for the devices of this process that hold it. `host_bytes`: see HOST_BLOCK_BYTES."""
    specs = hf_names.specs(folder.model)
    flat = _paths(shardings)
    known = {path for path, _ in flat}
    unknown = sorted(".".join(p) for p in known - set(specs))
    if unknown or len(known) != len(specs):
        raise ValueError(
            f"the model's parameters {unknown[:3] or sorted('.'.join(p) for p in set(specs) - known)[:3]} "
            f"have no Hugging Face tensor mapping (jaxpar/hf/names.py)"
        )
    budget = HOST_BLOCK_BYTES if host_bytes is None else host_bytes
    notice(folder)
    leaves = []
    for path, sharding in flat:
        spec = specs[path]
        # the distinct blocks this process's devices hold, read together (each tensor once)
        per_device = sharding.addressable_devices_indices_map(spec.shape)
        distinct = {_key(index): index for index in per_device.values()}
        share = sum(4 * math.prod(len(r) for r in hf_names.index_ranges(i, spec.shape))
                    for i in distinct.values())  # fmt: skip
        if spec.layers and share > budget:
            leaves.append(_by_layers(folder, spec, sharding, per_device))
            continue
        made = dict(zip(distinct, _blocks(folder, spec, list(distinct.values())), strict=True))
        leaves.append(jax.make_array_from_callback(
            spec.shape, sharding, lambda index, made=made: made[_key(index)]))  # fmt: skip
        made.clear()
    treedef = jax.tree.structure(shardings)
    return jax.tree.unflatten(treedef, leaves)


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(buffer: jax.Array, part: jax.Array, at: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buffer, part, at, axis=0)


def _by_layers(folder: Folder, spec: hf_names.Spec, sharding: Any, per_device: dict) -> jax.Array:
    """A stacked parameter placed one layer at a time: each device's block starts as zeros on
    the device, and every layer's part (its tensors read once for all blocks) is copied in."""
    buffers = {}
    for d, index in per_device.items():
        shape = tuple(len(r) for r in hf_names.index_ranges(index, spec.shape))
        buffers[d] = jnp.zeros(shape, jnp.float32, device=d)
    layers = {d: hf_names.index_ranges(index, spec.shape)[0] for d, index in per_device.items()}
    for layer in range(spec.shape[0]):
        holders = [d for d in per_device if layer in layers[d]]
        distinct: dict[tuple, tuple] = {}
        for d in holders:
            sub = (slice(layer, layer + 1), *tuple(per_device[d])[1:])
            distinct.setdefault(_key(sub), sub)
        parts = dict(zip(distinct, _blocks(folder, spec, list(distinct.values())), strict=True))
        for d in holders:
            sub = (slice(layer, layer + 1), *tuple(per_device[d])[1:])
            part = jax.device_put(parts[_key(sub)], d)
            buffers[d] = _put_layer(buffers[d], part, layer - layers[d].start)
        parts.clear()
    return jax.make_array_from_single_device_arrays(spec.shape, sharding, list(buffers.values()))


def _blocks(folder: Folder, spec: hf_names.Spec, indices: list) -> list[np.ndarray]:
    r = folder.reader
    return hf_names.blocks(spec, indices, r.read_raw, r.widen)


def _key(index: tuple) -> tuple:
    return tuple((s.start, s.stop) for s in index)


def initial_state(program: Any, folder: Folder) -> dict:
    """A fresh train state of `program` (jaxpar.parallel.program.Program) whose parameters are
    the folder's, streamed onto the program's parameter shardings; the rest (the optimizer
    state, the step, the rng) initialised as `program.init()` would."""
    check_abstract(folder, program.abstract_state["params"])
    params = load_params(folder, program.state_shardings["params"])
    return program.init_from(params)


def check_abstract(folder: Folder, abstract_params: dict) -> None:
    """The model's own parameter shapes are the mapping's (a model config the names do not
    describe is refused before anything is read)."""
    specs = hf_names.specs(folder.model)
    for path, leaf in _paths(abstract_params):
        spec = specs.get(path)
        if spec is None or tuple(leaf.shape) != spec.shape:
            got = None if spec is None else list(spec.shape)
            raise ValueError(
                f"parameter {'.'.join(path)} is {list(leaf.shape)} but the Hugging Face mapping "
                f"gives {got}"
            )
