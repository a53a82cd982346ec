"""`jaxpar bench SUITE`: measured side by side in one run, reported as medians and ratios.

    jaxpar bench overhead [--quick] [--recipe gpt_tiny] [--out bench-results]
    jaxpar bench meshes   [--quick]
    jaxpar bench precision [--quick] [--recipe gpt_tiny]   (fp32 vs bf16, remat off vs on)

Each suite prints a markdown table and writes SUITE.json into --out. Other suites (checkpoint,
recovery, pipeline, comm, precision) register in SUITES from their own modules.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar import bench_plain, collectives
from jaxpar import data as data_lib
from jaxpar.config import TrainConfig
from jaxpar.rules import Preset
from jaxpar.step import make_optimizer
from jaxpar.trainer import compile_step, device_batch, setup


def _write(out_dir: str, suite: str, result: dict, table: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{suite}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(table)
    return result


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---- overhead ---------------------------------------------------------------------------------


def overhead(cfg: TrainConfig, quick: bool, out_dir: str, layout: Callable[[str], Preset]) -> dict:
    """jaxpar's loop step (batch from the data pipeline + compiled step + metrics) vs a plain
    jitted step of the same model and optimizer fed a ready batch; same mesh (all devices, DP)."""
    if not hasattr(cfg.model, "n_layers"):
        raise ValueError("bench overhead compares a GPT recipe against the plain JAX GPT step")
    reps = 6 if quick else 30
    with tempfile.TemporaryDirectory() as tmp:
        s = setup(cfg, layout("data=-1"), tmp)
        compiled, _ = compile_step(s)
        state = s.program.init()
        tx, _ = make_optimizer(cfg.optim, cfg.train.steps)
        mesh = Mesh(np.asarray(jax.devices()), ("batch",))
        plain_step, batch_sh = bench_plain.make_step(mesh, tx)
        params = jax.tree.map(np.asarray, jax.device_get(state["params"]))
        p_params = jax.device_put(
            params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        )
        p_opt = jax.jit(tx.init)(p_params)
        poison = jax.device_put(np.float32(1.0), s.program.state_shardings["step"])
        ours, plain, losses = [], [], []
        for i in range(reps + 2):  # 2 warm-up iterations each, then interleaved repetitions
            t0 = time.perf_counter()
            batch = device_batch(s, i)
            state, m = compiled(state, batch, poison)
            loss_ours = float(jax.device_get(m["loss"]))
            t1 = time.perf_counter()
            host = data_lib.host_batch(
                s.source, step=i, global_batch=cfg.data.global_batch, seed=cfg.data.seed
            )
            tok = jax.device_put(host["inputs"], batch_sh)
            tgt = jax.device_put(host["targets"], batch_sh)
            p_params, p_opt, loss_plain = plain_step(p_params, p_opt, tok, tgt)
            loss_plain = float(loss_plain)
            t2 = time.perf_counter()
            if i >= 2:
                ours.append(t1 - t0)
                plain.append(t2 - t1)
            losses.append((loss_ours, loss_plain))
    ratio = float(np.median(ours) / np.median(plain))
    result = {
        "suite": "overhead", "recipe": cfg.name, "devices": jax.device_count(), "reps": reps,
        "median_step_s_jaxpar": float(np.median(ours)), "median_step_s_plain": float(np.median(plain)),
        "ratio": ratio, "max_loss_diff": float(max(abs(a - b) for a, b in losses)),
    }  # fmt: skip
    table = _table(
        ["step", "median s (jaxpar)", "median s (plain jax.jit)", "ratio", "max loss diff"],
        [[cfg.name, f"{result['median_step_s_jaxpar']:.4f}", f"{result['median_step_s_plain']:.4f}",
          f"{ratio:.3f}", f"{result['max_loss_diff']:.2e}"]],
    )  # fmt: skip
    return _write(out_dir, "overhead", result, table)


# ---- meshes -----------------------------------------------------------------------------------

MESH_LAYOUTS = (
    ("data=1", 1), ("data=2", 2), ("data=4", 4), ("data=8", 8), ("fsdp=8,data=1", 8),
    ("data=2,tensor=4", 8), ("data=4,tensor=2", 8), ("data=2,fsdp=2,tensor=2", 8),
)  # fmt: skip


def meshes(cfg: TrainConfig, quick: bool, out_dir: str, layout: Callable[[str], Preset]) -> dict:
    """Throughput and collective bytes per step for each layout on 1..8 devices."""
    steps = 3 if quick else 12
    layouts = MESH_LAYOUTS[:2] + MESH_LAYOUTS[3:4] if quick else MESH_LAYOUTS
    rows, out = [], []
    for spec, n in layouts:
        if n > jax.device_count():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            s = setup(cfg, layout(spec), tmp, devices=jax.devices()[:n])
            compiled, seconds = compile_step(s)
            colls = collectives.audit(compiled, s.mesh)
            state = s.program.init()
            poison = jax.device_put(np.float32(1.0), s.program.state_shardings["step"])
            times = []
            for i in range(steps + 1):
                batch = device_batch(s, i)
                t0 = time.perf_counter()
                state, m = compiled(state, batch, poison)
                jax.block_until_ready(m)
                if i:
                    times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        unit = cfg.data.global_batch * getattr(s.source, "seq_len", 1)
        rec = {
            "mesh": spec, "devices": n, "median_step_s": step_s, "per_s": unit / step_s,
            "collective_bytes": collectives.total_bytes(colls), "compile_s": seconds,
            "collectives": collectives.tally(colls),
        }  # fmt: skip
        out.append(rec)
        rows.append(
            [spec, n, f"{step_s:.4f}", f"{rec['per_s']:,.0f}", f"{rec['collective_bytes']:,}"]
        )
    unit_name = "tokens/s" if s.source.kind == "lm" else "samples/s"
    table = _table(
        ["mesh", "devices", "median step s", unit_name, "collective bytes/step/device"], rows
    )
    return _write(out_dir, "meshes", {"suite": "meshes", "recipe": cfg.name, "layouts": out}, table)


# Suites provided by other modules: name -> "module:function" with signature (quick, out_dir).
EXTERNAL = {
    "checkpoint": "jaxpar.bench_checkpoint:run",
    "recovery": "jaxpar.bench_recovery:run",
    "pipeline": "jaxpar.bench_pipeline:run",
    "comm": "jaxpar.bench_comm:run",
    "precision": "jaxpar.bench_precision:run",
    "data": "jaxpar.bench_data:run",
}
# External suites that measure the recipe given with --recipe / --set.
TAKES_RECIPE = ("precision", "data")
SUITES = ("overhead", "meshes", *EXTERNAL)


def run_suite(name: str, cfg: TrainConfig, quick: bool, out_dir: str, layout) -> dict:
    if name == "overhead":
        return overhead(cfg, quick, out_dir, layout)
    if name == "meshes":
        return meshes(cfg, quick, out_dir, layout)
    if name not in EXTERNAL:
        raise ValueError(f"unknown bench suite {name!r}; use one of {SUITES}")
    mod_name, fn_name = EXTERNAL[name].split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError:
        raise ValueError(f"bench suite {name!r} is not available in this version") from None
    if name in TAKES_RECIPE:
        return getattr(mod, fn_name)(quick=quick, out_dir=out_dir, cfg=cfg)
    return getattr(mod, fn_name)(quick=quick, out_dir=out_dir)
