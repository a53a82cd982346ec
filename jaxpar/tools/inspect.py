"""`jaxpar inspect`: shardings of every parameter and of the non-parameter state (BatchNorm
statistics), and the compiled step's per-device memory and collectives; nothing is allocated.

jaxpar inspect --recipe gpt_tiny --mesh dp2_tp4
jaxpar inspect --recipe gpt_tiny --mesh data=2,context=4 --json   # machine-readable figures
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxpar import contract
from jaxpar.config import TrainConfig
from jaxpar.engine import attention, collectives
from jaxpar.engine.model import STATE_KEY
from jaxpar.engine.rules import Preset
from jaxpar.parallel import pipeline
from jaxpar.worker.training import compile_step, setup


def _bytes_per_device(shape, dtype, sharding) -> int:
    shard = sharding.shard_shape(tuple(shape))
    return math.prod(shard) * dtype.itemsize


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _row(path, leaf, **extra) -> dict:
    return {
        "path": jax.tree_util.keystr(path), **extra,
        "spec": leaf.sharding.spec,
        "shape": tuple(leaf.shape),
        "bytes_global": math.prod(leaf.shape) * leaf.dtype.itemsize,
        "bytes_per_device": _bytes_per_device(leaf.shape, leaf.dtype, leaf.sharding),
    }  # fmt: skip


def param_table(session) -> tuple[list[dict], int, int]:
    """Rows of (path, logical, spec, shape, bytes per device); totals for params and state."""
    prog = session.program
    flat_abs = jax.tree_util.tree_leaves_with_path(prog.abstract_state["params"])
    logical = dict(jax.tree_util.tree_leaves_with_path(prog.param_logical, is_leaf=_is_names))
    rows = [_row(path, leaf, logical=logical.get(path)) for path, leaf in flat_abs]
    state_dev = sum(
        _bytes_per_device(x.shape, x.dtype, x.sharding)
        for x in jax.tree.leaves(prog.abstract_state)
    )
    return rows, sum(r["bytes_per_device"] for r in rows), state_dev


def state_table(session) -> list[dict]:
    """Rows of (path, variable type, spec, shape, bytes per device) of the model's non-parameter
    state (BatchNorm statistics, counters: the train state's `model_state`)."""
    prog = session.program
    abstract = prog.abstract_state.get(STATE_KEY, {})
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    kinds = dict(jax.tree_util.tree_leaves_with_path(prog.model.state, is_leaf=is_var))
    return [
        _row(path, leaf, kind=type(kinds.get(path)).__name__)
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)
    ]


def _table_line(r: dict, second: object) -> str:
    return (
        f"| {r['path']} | {second} | {tuple(r['spec'])} | {r['shape']} | "
        f"{_human(r['bytes_per_device'])} |"
    )


def _is_names(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(isinstance(n, str | None) for n in x))


def _comm_lines(s, step_colls) -> list[str]:
    """Bytes over `data` per optimizer step for the communication options (comm.*)."""
    data = ("data",)
    per_step = collectives.total_wire_bytes(step_colls, data)
    lines = ["", f"## gradient communication over `data` (comm.compress={s.cfg.comm.compress})"]
    if s.program.sync_step is not None:
        h = s.program.sync_every
        sync = s.program.sync_step.lower(s.program.abstract_state).compile()
        sync_colls = collectives.audit(sync, s.mesh)
        sync_bytes = collectives.total_wire_bytes(sync_colls, data)
        lines += [
            f"DiLoCo sync step (every {h} steps):", "", collectives.format_audit(sync_colls), "",
            f"bytes sent over `data` per step: {per_step:,} (inner) + {sync_bytes:,} / {h} (sync) "
            f"= {per_step + sync_bytes / h:,.0f}",
        ]  # fmt: skip
        return lines
    dtypes = sorted({c.dtype for c in step_colls if c.mesh_axes == data})
    lines.append(f"bytes sent over `data` per step: {per_step:,} (collective dtypes: {dtypes})")
    if s.cfg.comm.compress == "bf16" and "bf16" not in dtypes:
        lines.append(
            f"note: this backend ({jax.devices()[0].platform}) widened the bf16 collectives to "
            f"{', '.join(dtypes)}: no bytes are saved here"
        )
    return lines


def _memory_line(mem: dict) -> str:
    if mem["peak"] is None:
        return "per-device memory: not reported by this backend"
    parts = ", ".join(f"{k} {_human(mem[k])}" for k in ("arguments", "outputs", "temps", "peak"))
    return f"per-device memory of the compiled step (XLA): {parts}"


def inspect_json(cfg: TrainConfig, preset: Preset, run_dir: str) -> dict:
    """`jaxpar inspect --json`: the mesh, the parameter and state bytes, and the compiled train
    step's per-device memory (`collectives.memory`) and collectives (one row per kind, mesh
    axes and dtype; bytes per device per step, loop ops times their trip count)."""
    s = setup(cfg, preset, run_dir)
    rows, params_dev, state_dev = param_table(s)
    compiled, seconds = compile_step(s)
    colls = collectives.audit(compiled, s.mesh)
    return {
        "recipe": cfg.name,
        "mesh": {a: int(n) for a, n in s.mesh.shape.items()},
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "parameters": {
            "bytes_global": sum(r["bytes_global"] for r in rows),
            "bytes_per_device": params_dev,
        },
        "state_bytes_per_device": state_dev,
        "memory": collectives.memory(compiled),
        "collectives": [dict(r, mesh_axes=list(r["mesh_axes"])) for r in collectives.tally(colls)],
        "compile_s": round(seconds, 3),
    }


def inspect(cfg: TrainConfig, preset: Preset, run_dir: str, audit: bool = True) -> str:
    """The inspection report as markdown text."""
    s = setup(cfg, preset, run_dir)
    rows, params_dev, state_dev = param_table(s)
    total = sum(r["bytes_global"] for r in rows)
    out = [
        f"# {cfg.name} on mesh {dict(s.mesh.shape)} ({jax.device_count()} devices, "
        f"{jax.devices()[0].platform})",
        "",
        *([w, ""] if (w := contract.unsharded_warning(s.program.param_logical)) else []),
        "| parameter | logical axes | PartitionSpec | global shape | bytes/device |",
        "|---|---|---|---|---|",
    ]
    out += [_table_line(r, r["logical"]) for r in rows]
    state_rows = state_table(s)
    if state_rows:
        out += ["", "| non-parameter state | variable | PartitionSpec | global shape | bytes/device |",
                "|---|---|---|---|---|", *(_table_line(r, r["kind"]) for r in state_rows)]  # fmt: skip
    out += [
        "",
        f"parameters: {total:,} bytes global ({_human(total)}); per device {_human(params_dev)} "
        f"({params_dev / total:.1%} of all)",
        *(
            [
                f"non-parameter state: {sum(r['bytes_global'] for r in state_rows):,} bytes global, "
                f"{len(state_rows)} arrays"
            ]
            if state_rows
            else []
        ),
        f"training state (params + optimizer + model state) per device: {_human(state_dev)}",
    ]
    if audit:
        compiled, seconds = compile_step(s)
        colls = collectives.audit(compiled, s.mesh)
        out += ["", _memory_line(collectives.memory(compiled))]
        out += ["", f"## collectives of the compiled train step (compiled in {seconds:.1f}s)", ""]
        out.append(collectives.format_audit(colls))
        out += _comm_lines(s, colls)
    if s.mesh.shape["pipeline"] > 1:
        out += pipeline.inspect_lines(cfg, s.program, colls if audit else None)
    out += attention.inspect_lines(s.program.attention, colls if audit else None)
    return "\n".join(out)
