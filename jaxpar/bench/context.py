"""`jaxpar bench context`: context parallelism by sequence length and ring size: per-device
memory of the compiled step (XLA's analysis), step time, and the bytes sent over `context` per
step against the count in theory, ring attention next to all-gather.

    jaxpar bench context [--quick] [--recipe gpt_tiny] [--out bench-results]

Every layout uses all 8 (or the host's) devices as data x context, so the tokens per device are
the same at every ring size: what changes is how much of each sequence a device holds.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import jax

from jaxpar.bench.harness import Bench, table
from jaxpar.config import TrainConfig
from jaxpar.engine import collectives
from jaxpar.engine.mesh import MeshSpec
from jaxpar.engine.rules import Preset
from jaxpar.worker.training import compile_step, device_batch, setup

FULL = {"seq_lens": (2048,), "rings": (1, 2, 4, 8), "impls": ("ring", "allgather")}
QUICK = {"seq_lens": (128,), "rings": (1, 2, 4), "impls": ("ring", "allgather")}
STEPS = {True: 2, False: 3}  # timed steps after one warm-up


def _config(base: TrainConfig, seq_len: int, impl: str, batch: int) -> TrainConfig:
    for field in ("seq_len", "attention", "d_model", "n_layers"):
        if not hasattr(base.model, field):
            raise ValueError(f"bench context needs a GPT-like model config (no model.{field})")
    model = dataclasses.replace(base.model, seq_len=seq_len, attention=impl)
    data = dataclasses.replace(base.data, seq_len=seq_len, global_batch=batch)
    return dataclasses.replace(base, model=model, data=data)


def theory_bytes(impl: str, ring: int, layers: int, rows: int, seq_len: int, d_model: int) -> int:
    """Bytes per device per step that attention sends over `context` (float32), as the audit
    counts them (each collective's result size, times its executions).

    ring: K/V blocks [2, rows, T/c, D] go round forward (c-1) and backward (c-1), their float32
    gradients c times; the zigzag reorder moves half the local rows of q, k, v and of the output,
    each way (16 half-blocks of [rows, T/2c, D] per layer; 8 on a ring of 2, whose even chunks
    stay and whose one K/V shift serves both passes). allgather: K/V gathered whole forward
    ([2, rows, T, D]), their gradients reduce-scattered to one block backward. Outside attention,
    GPT's position table [T, D] is all-gathered over `context` three times per step (the
    forward's slices and the gradient), whatever the ring size."""
    if ring == 1:
        return 0
    table = 3 * seq_len * d_model * 4
    kv = 2 * rows * (seq_len // ring) * d_model * 4
    half = rows * (seq_len // (2 * ring)) * d_model * 4
    if impl == "ring":
        per_layer = 3 * kv + 8 * half if ring == 2 else (3 * ring - 2) * kv + 16 * half
    else:
        per_layer = 2 * rows * seq_len * d_model * 4 + kv
    return layers * per_layer + table


def _measure(cfg: TrainConfig, ring: int, devices: list, steps: int) -> dict:
    n = len(devices)
    preset = Preset(MeshSpec.parse(f"data={n // ring},context={ring}"))
    with tempfile.TemporaryDirectory() as tmp:
        s = setup(cfg, preset, os.path.join(tmp, "run"), devices=devices, create=False)
        compiled, compile_s = compile_step(s)
        mem = collectives.memory(compiled)
        colls = collectives.audit(compiled, s.mesh)
        state, batch = s.program.init(), device_batch(s, 0)
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics["loss"])
            if i:
                times.append(time.perf_counter() - t0)
    over = [c for c in colls if c.mesh_axes and set(c.mesh_axes) <= {"context"}]
    # Parameter gradients are all-reduced over context (a replica axis): not attention's.
    sent = sum(c.bytes * c.executions for c in over if c.kind != "all-reduce")
    m = cfg.model
    rows = cfg.data.global_batch // (n // ring)
    return {
        "seq_len": cfg.data.seq_len, "ring": ring, "impl": cfg.model.attention,
        "temps": mem["temps"], "peak": mem["peak"], "compile_s": round(compile_s, 1),
        "step_s": statistics.median(times), "loss": float(metrics["loss"]),
        "bytes_measured": sent,
        "bytes_theory": theory_bytes(m.attention, ring, m.n_layers, rows, m.seq_len, m.d_model),
    }  # fmt: skip


def run(b: Bench) -> dict:
    grid = QUICK if b.quick else FULL
    devices = jax.devices()
    n = len(devices)
    rings = [r for r in grid["rings"] if n % r == 0]
    batch = n
    rows = []
    for seq_len in grid["seq_lens"]:
        for ring in rings:
            impls = grid["impls"] if ring > 1 else grid["impls"][:1]
            for impl in impls:
                if seq_len % (2 * ring):
                    continue
                cfg = _config(b.cfg, seq_len, impl, batch)
                r = _measure(cfg, ring, devices, STEPS[b.quick])
                rows.append(r)
                print(
                    f"[context] T={seq_len} ring={ring} {impl}: temps {r['temps']:,} B, step "
                    f"{r['step_s'] * 1e3:.1f} ms, bytes {r['bytes_measured']:,} (theory "
                    f"{r['bytes_theory']:,})",
                    flush=True,
                )
    base = {r["seq_len"]: r["temps"] for r in rows if r["ring"] == 1}
    text = table(
        ["seq_len", "ring", "attention", "temps/device", "vs ring 1", "peak/device", "step ms",
         "bytes over context/step", "theory", "loss"],
        [[r["seq_len"], r["ring"], r["impl"] if r["ring"] > 1 else "plain", f"{r['temps']:,}",
          f"{r['temps'] / base[r['seq_len']]:.3f}", f"{r['peak']:,}",
          f"{r['step_s'] * 1e3:.1f}", f"{r['bytes_measured']:,}", f"{r['bytes_theory']:,}",
          f"{r['loss']:.5f}"] for r in rows],
    )  # fmt: skip
    text += (
        f"\n\n{b.cfg.name} ({b.cfg.model.n_layers} layers, d_model {b.cfg.model.d_model}), "
        f"global batch {batch}, {n} devices as data x context; float32. temps and peak: XLA's "
        f"memory analysis of the compiled train step, per device. bytes: the collectives over "
        f"`context` other than the parameter gradients' all-reduce, from the compiled HLO."
    )
    return b.write("context", {"rows": rows, "devices": n, "batch": batch}, text)
