"""`jaxpar inspect`: shardings of every parameter and of the non-parameter state (BatchNorm
statistics), and the compiled step's per-device memory and collectives; nothing is allocated.

jaxpar inspect --recipe gpt_tiny --mesh dp2_tp4
jaxpar inspect --recipe gpt_tiny --mesh data=2,context=4 --json   # machine-readable figures
jaxpar inspect --recipe gpt_350m --mesh fsdp8 --target v5e-8      # XLA's TPU compiler, here
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
from jaxpar.tools import doctor, targets
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


def _comm_lines(s, step_colls, target: targets.Target | None = None) -> list[str]:
    """Bytes over `data` per optimizer step for the communication options (comm.*)."""
    data = ("data",)
    per_step = collectives.total_wire_bytes(step_colls, data)
    lines = ["", f"## gradient communication over `data` (comm.compress={s.cfg.comm.compress})"]
    if s.program.sync_step is not None:
        h = s.program.sync_every
        lowered = s.program.sync_step.lower(s.program.abstract_state)
        if target is None:
            sync_colls = collectives.audit(lowered.compile(), s.mesh)
        else:
            sync_colls = targets.compile_lowered(target, lowered, s.mesh).colls
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
        platform = target.family if target else jax.devices()[0].platform
        lines.append(
            f"note: this backend ({platform}) widened the bf16 collectives to "
            f"{', '.join(dtypes)}: no bytes are saved here"
        )
    return lines


def _memory_line(mem: dict) -> str:
    if mem["peak"] is None:
        return "per-device memory: not reported by this backend"
    parts = ", ".join(f"{k} {_human(mem[k])}" for k in ("arguments", "outputs", "temps", "peak"))
    return f"per-device memory of the compiled step (XLA): {parts}"


def _session(cfg: TrainConfig, preset: Preset, run_dir: str, target: targets.Target | None):
    if target is None:
        return setup(cfg, preset, run_dir)
    targets.check_mesh(target, preset.mesh)
    return setup(cfg, preset, run_dir, devices=targets.devices(target), create=False)


def _target_compile(s, target: targets.Target, with_doctor: bool):
    """(targets.Result, the doctor's findings or None): the step compiled once by the target's
    compiler (with the partitioner's input kept when the doctor reads it)."""
    from jaxpar.tools.tune import pipeline_table  # noqa: PLC0415 - tune imports the tools

    switch = pipeline_table(s)  # a pipeline's tick loop: the branch each stage runs
    if not with_doctor:
        return targets.compile_lowered(target, doctor.lower_step(s), s.mesh, switch), None
    import time  # noqa: PLC0415

    t0 = time.perf_counter()
    c = doctor.compile_captured(doctor.lower_step(s), target)
    res = targets.result(target, c.compiled, c.after, time.perf_counter() - t0, c.warnings, s.mesh,
                         switch)  # fmt: skip
    return res, c


def _fit_or_raise(res: targets.Result) -> None:
    """A CUDA program over the card's memory (its compiler does not check): one line, exit 2."""
    t, mem = res.target, res.memory
    if not res.fits:
        raise targets.DoesNotFit(
            f"does not fit on {t.name} ({t.device}): peak {_human(mem['peak'])} per device "
            f"(arguments {_human(mem['arguments'])}, temporaries {_human(mem['temps'])}) > "
            f"{_human(t.memory_bytes)} of device memory (jaxpar's comparison: the CUDA compiler "
            f"does not check memory)"
        )


def inspect_json(cfg: TrainConfig, preset: Preset, run_dir: str, target: str | None = None) -> dict:
    """`jaxpar inspect --json`: the mesh, the parameter and state bytes, and the compiled train
    step's per-device memory (`collectives.memory`) and collectives (one row per kind, mesh
    axes and dtype; bytes per device per step, loop ops times their trip count). `target`: the
    step compiled by that target's compiler (jaxpar.tools.targets), with its FLOPs, whether it
    fits and the partitioner's involuntary rematerializations."""
    t = targets.get(target) if target else None
    s = _session(cfg, preset, run_dir, t)
    rows, params_dev, state_dev = param_table(s)
    if t is None:
        compiled, seconds = compile_step(s)
        colls, mem = collectives.audit(compiled, s.mesh), collectives.memory(compiled)
    else:
        res, _ = _target_compile(s, t, False)
        _fit_or_raise(res)
        colls, mem, seconds = res.colls, res.memory, res.seconds
    out = {
        "recipe": cfg.name,
        "mesh": {a: int(n) for a, n in s.mesh.shape.items()},
        "devices": t.devices if t else jax.device_count(),
        "platform": t.family if t else jax.devices()[0].platform,
        "precision_compute": cfg.precision.compute,
        "parameters": {
            "bytes_global": sum(r["bytes_global"] for r in rows),
            "bytes_per_device": params_dev,
        },
        "state_bytes_per_device": state_dev,
        "memory": mem,
        "collectives": [dict(r, mesh_axes=list(r["mesh_axes"])) for r in collectives.tally(colls)],
        "compile_s": round(seconds, 3),
    }
    if s.mesh.shape["pipeline"] > 1:
        out["pipeline"] = pipeline.inspect_dict(cfg, s.program)
    if s.program.attention:  # the sequence split over `context`: the kernels and the ring
        out["context"] = {"attention": sorted({impl for impl, _ in s.program.attention}),
                          "ring": s.program.attention[0][1],
                          "calls_per_forward": len(s.program.attention)}  # fmt: skip
    if t is not None:
        out["target"] = targets.as_dict(t)
        out["fits"] = res.fits
        out["flops_per_device"] = res.flops
        out["flops_source"] = res.flops_source
        out["overlapped_collective_bytes"] = _overlapped(colls)
        out["involuntary_remats"] = len(res.remats)
    return out


def _overlapped(colls) -> int:
    return sum(c.bytes * c.executions for c in colls if c.overlapped)


def _target_lines(cfg: TrainConfig, res: targets.Result) -> list[str]:
    t, mem = res.target, res.memory
    total = collectives.total_bytes(res.colls)
    share = _overlapped(res.colls) / total if total else 0.0
    check = "the TPU compiler checked it" if t.family == "tpu" else "jaxpar's comparison"
    out = [
        "",
        f"target {targets.describe(t)}; precision.compute={cfg.precision.compute}",
        f"per-device memory of the {t.name} program: " + ", ".join(
            f"{k} {_human(mem[k])}" for k in ("arguments", "outputs", "temps", "peak")
        ) + f"; fits in {_human(t.memory_bytes)}: {'yes' if res.fits else 'no'} ({check})",
        f"FLOPs per device per step: {res.flops:,.0f} ({res.flops_source})",
        f"collectives scheduled to overlap with computation: {share:.0%} of the bytes",
        f"involuntary rematerializations (the {t.name} partitioner): {len(res.remats)}"
        + (f" (jaxpar inspect ... --target {t.name} --doctor)" if res.remats else ""),
    ]  # fmt: skip
    if cfg.precision.compute != "bfloat16":
        out.append(
            f"note: compiled with precision.compute={cfg.precision.compute}; accelerators "
            "usually train in bfloat16 (--set precision.compute=bfloat16)"
        )
    if t.family == "cuda":
        out.append(
            "note: CUDA compiled without the card: kernel autotuning skipped (XLA's default "
            "kernel configurations); memory compared with the card's by jaxpar"
        )
    return out


def inspect(cfg: TrainConfig, preset: Preset, run_dir: str, audit: bool = True,
            target: str | None = None, with_doctor: bool = False,
            command: str | None = None, presets=None) -> str:  # fmt: skip
    """The inspection report as markdown text. `target`: compiled by that target's compiler for
    its devices (jaxpar.tools.targets); `with_doctor` (with a target): the doctor's section from
    the same compilation; `command`: the inspect command as given (doctor.inspect_command);
    `presets`: the named presets the doctor's fix may point to."""
    t = targets.get(target) if target else None
    s = _session(cfg, preset, run_dir, t)
    rows, params_dev, state_dev = param_table(s)
    total = sum(r["bytes_global"] for r in rows)
    where = (
        f"{t.devices} devices, target {t.name}" if t else
        f"{jax.device_count()} devices, {jax.devices()[0].platform}"
    )  # fmt: skip
    out = [
        f"# {cfg.name} on mesh {dict(s.mesh.shape)} ({where})",
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
    found = None
    if audit and t is not None:
        res, c = _target_compile(s, t, with_doctor)
        _fit_or_raise(res)
        colls, seconds = res.colls, res.seconds
        out += _target_lines(cfg, res)
        if c is not None:
            remats = doctor.diagnose_remats(c, s, preset)
            props = (doctor.propose(cfg, preset, run_dir, remats, s, c, target=t)
                     if remats else [])  # fmt: skip
            found = {"remats": remats, "proposals": props,
                     "collectives": doctor.largest_collectives(c, s, preset)}  # fmt: skip
    elif audit:
        compiled, seconds = compile_step(s)
        colls = collectives.audit(compiled, s.mesh)
        out += ["", _memory_line(collectives.memory(compiled))]
    if audit:
        out += ["", f"## collectives of the compiled train step (compiled in {seconds:.1f}s)", ""]
        out.append(collectives.format_audit(colls))
        out += _comm_lines(s, colls, t)
    if s.mesh.shape["pipeline"] > 1:
        out += pipeline.inspect_lines(cfg, s.program, colls if audit else None)
    out += attention.inspect_lines(s.program.attention, colls if audit else None)
    if found is not None:
        out += doctor.doctor_lines(found, command, cfg, presets)
    return "\n".join(out)
