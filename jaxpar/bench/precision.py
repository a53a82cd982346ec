"""`jaxpar bench precision`: float32 vs bf16 compute, rematerialisation off vs on, on one device.

    jaxpar bench precision [--quick] [--recipe gpt_tiny] [--set key=value ...]

Step time, throughput, MFU, memory (read two ways) and the loss of each variant: docs/design.md,
"Benchmarks".
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import jax
import numpy as np

from jaxpar import contract
from jaxpar.bench.harness import Bench, table
from jaxpar.config import PrecisionConfig, TrainConfig, resolve_recipe
from jaxpar.data import sources as data_lib
from jaxpar.engine.mesh import MeshSpec
from jaxpar.engine.rules import Preset
from jaxpar.parallel.program import saved_for_backward_bytes
from jaxpar.rundir.writer import mfu
from jaxpar.worker.training import compile_step, device_batch, setup

GPU_RECIPE = "gpt_350m"


def variants(cfg: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """(label, config) for compute float32/bfloat16 x remat none/on."""
    remat_on = getattr(cfg.model, "remat", None)
    remats = [None] if remat_on is None else ["none", "block" if remat_on == "none" else remat_on]
    out = []
    for compute in ("float32", "bfloat16"):
        for remat in remats:
            model = cfg.model if remat is None else dataclasses.replace(cfg.model, remat=remat)
            prec = dataclasses.replace(PrecisionConfig(), compute=compute)
            label = compute + ("" if remat is None else f", remat={remat}")
            out.append((label, dataclasses.replace(cfg, model=model, precision=prec)))
    return out


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    return {
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
    }


def _measure(cfgs: list[TrainConfig], reps: int, tmp: str) -> list[dict]:
    """Compile every variant, then time them interleaved: rep r runs one step of each."""
    layout = Preset(MeshSpec.parse("data=1"))
    runs = []
    for i, cfg in enumerate(cfgs):
        s = setup(cfg, layout, os.path.join(tmp, str(i)), devices=jax.devices()[:1])
        compiled, compile_s = compile_step(s)
        spec = data_lib.batch_spec(s.source, cfg.data.global_batch)
        saved = saved_for_backward_bytes(cfg, s.program, spec)
        runs.append({"s": s, "step": compiled, "state": s.program.init(),
                     "times": [], "compile_s": compile_s, "saved_bytes": saved,
                     **_memory(compiled)})  # fmt: skip
    for r in range(reps + 2):  # two warm-up rounds
        for run in runs:
            s = run["s"]
            batch = device_batch(s, r)
            t0 = time.perf_counter()
            run["state"], m = run["step"](run["state"], batch)
            run["loss"] = float(jax.device_get(m["loss"]))
            if r >= 2:
                run["times"].append(time.perf_counter() - t0)
    return runs


def run(b: Bench) -> dict:
    cfg = b.cfg
    if jax.default_backend() != "cpu" and b.default_recipe:
        cfg = resolve_recipe(GPU_RECIPE)
    reps = 3 if b.quick else 10
    labels, cfgs = zip(*variants(cfg), strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = _measure(list(cfgs), reps, tmp)
    s0 = runs[0]["s"]
    unit = cfg.data.global_batch * getattr(s0.source, "seq_len", 1)
    unit_name = "tokens_per_s" if s0.source.kind == "lm" else "samples_per_s"
    rows = []
    for label, c, r in zip(labels, cfgs, runs, strict=True):
        step_s = float(np.median(r["times"]))
        rows.append({
            "variant": label, "compute": c.precision.compute,
            "remat": getattr(c.model, "remat", None), "median_step_s": step_s,
            unit_name: unit / step_s, "mfu": mfu(r["s"].flops_per_step, step_s, 1, r["s"].peak),
            "saved_bytes": r["saved_bytes"], "temp_bytes": r["temp_bytes"], "argument_bytes": r["argument_bytes"],
            "output_bytes": r["output_bytes"], "compile_s": r["compile_s"], "loss": r["loss"],
        })  # fmt: skip
    base = rows[0]
    for row in rows:
        row["saved_ratio"] = row["saved_bytes"] / max(base["saved_bytes"], 1)
        row["temp_ratio"] = row["temp_bytes"] / max(base["temp_bytes"], 1)
        row["step_ratio"] = row["median_step_s"] / base["median_step_s"]
    device = jax.devices()[0].device_kind
    result = {
        "suite": "precision", "recipe": cfg.name, "device": device, "devices": 1, "reps": reps,
        "params": contract.num_params(cfg.model),
        "global_batch": cfg.data.global_batch, "rows": rows,
    }  # fmt: skip
    header = ["variant", "median step s", "vs fp32", unit_name.replace("_per_s", "/s"), "MFU",
              "saved for backward", "vs fp32", "compiled temp", "vs fp32", "loss"]  # fmt: skip
    cells = [
        [row["variant"], f"{row['median_step_s']:.4f}", f"{row['step_ratio']:.2f}",
         f"{row[unit_name]:,.0f}", "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}",
         f"{row['saved_bytes'] / 2**20:,.1f} MiB", f"{row['saved_ratio']:.2f}",
         f"{row['temp_bytes'] / 2**20:,.1f} MiB", f"{row['temp_ratio']:.2f}", f"{row['loss']:.4f}"]
        for row in rows
    ]  # fmt: skip
    title = (f"{cfg.name} on one {device}, batch {cfg.data.global_batch}, median of {reps} "
             f"interleaved steps\n\n")  # fmt: skip
    return b.write("precision", result, title + table(header, cells, "---" + "|---:" * 9))
