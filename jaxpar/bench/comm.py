"""`jaxpar bench comm`: bytes over `data` per step and loss after N steps, per gradient option.

    jaxpar bench comm [--quick] [--recipe gpt_tiny]

The recipe on all devices as data parallel: fp32 all-reduce, bf16 and int8 compressed means (with
error feedback), and DiLoCo with H in {1, 4, 16} inner steps. Bytes are the ring / pairwise
bytes each device sends over `data`, read from the compiled programs (HLO audit).
"""

from __future__ import annotations

import dataclasses
import tempfile

import jax
import numpy as np

from jaxpar.bench.harness import Bench, table
from jaxpar.config import CommConfig
from jaxpar.engine import collectives
from jaxpar.worker.training import compile_step, device_batch, setup

OPTIONS = (
    ("fp32", {}),
    ("bf16", {"compress": "bf16"}),
    ("int8", {"compress": "int8"}),
    ("DiLoCo H=1", {"diloco_inner_steps": 1}),
    ("DiLoCo H=4", {"diloco_inner_steps": 4}),
    ("DiLoCo H=16", {"diloco_inner_steps": 16}),
)


def _measure(b: Bench, cfg, steps: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        s = setup(cfg, b.preset("data=-1"), tmp)
        compiled, _ = compile_step(s)
        data = ("data",)
        per_step = collectives.total_wire_bytes(collectives.audit(compiled, s.mesh), data)
        if s.program.sync_step is not None:
            sync = s.program.sync_step.lower(s.program.abstract_state).compile()
            sync_bytes = collectives.total_wire_bytes(collectives.audit(sync, s.mesh), data)
            per_step += sync_bytes / s.program.sync_every
        state = s.program.init()
        loss = float("nan")
        for i in range(steps):
            state, m = compiled(state, device_batch(s, i))
            if s.program.sync_every and (i + 1) % s.program.sync_every == 0:
                state = s.program.sync_step(state)
            loss = float(np.mean(jax.device_get(m["loss"])))
        eval_loss = float(s.program.eval_step(state, device_batch(s, 0, "eval"))["loss"])
    return per_step, loss, eval_loss


def run(b: Bench) -> dict:
    steps = 8 if b.quick else 96  # a multiple of every H, so DiLoCo ends on a sync
    base = b.cfg
    options = OPTIONS[:3] + OPTIONS[4:5] if b.quick else OPTIONS
    rows = []
    for name, comm in options:
        cfg = dataclasses.replace(
            base,
            comm=dataclasses.replace(CommConfig(), **comm),
            train=dataclasses.replace(base.train, steps=steps),
        )
        per_step, loss, eval_loss = _measure(b, cfg, steps)
        rows.append({"option": name, "bytes_per_step": per_step, "train_loss": loss,
                     "eval_loss": eval_loss})  # fmt: skip
    ref = rows[0]["bytes_per_step"]
    header = ["option", "bytes sent over data per step", "vs fp32", "train loss",
              "eval loss (anchor)"]  # fmt: skip
    cells = [[r["option"], f"{r['bytes_per_step']:,.0f}", f"{r['bytes_per_step'] / ref:.3f}",
              f"{r['train_loss']:.4f}", f"{r['eval_loss']:.4f}"] for r in rows]  # fmt: skip
    text = f"{base.name}, {jax.device_count()} devices data parallel, {steps} steps\n\n"
    text += table(header, cells, "---|---:|---:|---:|---:")
    result = {"suite": "comm", "recipe": base.name, "steps": steps,
              "devices": jax.device_count(), "rows": rows}  # fmt: skip
    return b.write("comm", result, text)
