"""`jaxpar bench comm`: bytes over `data` per step and loss after N steps, per gradient option.

    jaxpar bench comm [--quick]

gpt_tiny on all devices as data parallel: fp32 all-reduce, bf16 and int8 compressed means (with
error feedback), and DiLoCo with H in {1, 4, 16} inner steps. Bytes are the ring / pairwise
bytes each device sends over `data`, read from the compiled programs (HLO audit).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import collectives
from jaxpar.config import CommConfig, resolve_recipe
from jaxpar.mesh import MeshSpec
from jaxpar.rules import Preset
from jaxpar.trainer import compile_step, device_batch, setup

OPTIONS = (
    ("fp32", {}),
    ("bf16", {"compress": "bf16"}),
    ("int8", {"compress": "int8"}),
    ("DiLoCo H=1", {"diloco_inner_steps": 1}),
    ("DiLoCo H=4", {"diloco_inner_steps": 4}),
    ("DiLoCo H=16", {"diloco_inner_steps": 16}),
)


def _measure(cfg, steps: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        s = setup(cfg, Preset(MeshSpec.parse("data=-1")), tmp)
        compiled, _ = compile_step(s)
        data = ("data",)
        per_step = collectives.total_wire_bytes(collectives.audit(compiled, s.mesh), data)
        if s.program.sync_step is not None:
            sync = s.program.sync_step.lower(s.program.abstract_state).compile()
            sync_bytes = collectives.total_wire_bytes(collectives.audit(sync, s.mesh), data)
            per_step += sync_bytes / s.program.sync_every
        state = s.program.init()
        one = jax.device_put(np.float32(1.0), NamedSharding(s.mesh, PartitionSpec()))
        loss = float("nan")
        for i in range(steps):
            state, m = compiled(state, device_batch(s, i), one)
            if s.program.sync_every and (i + 1) % s.program.sync_every == 0:
                state = s.program.sync_step(state)
            loss = float(np.mean(jax.device_get(m["loss"])))
        eval_loss = float(s.program.eval_step(state, device_batch(s, 0, "eval"))["loss"])
    return per_step, loss, eval_loss


def run(quick: bool = False, out_dir: str = "bench-results") -> dict:
    steps = 8 if quick else 96  # a multiple of every H, so DiLoCo ends on a sync
    base = resolve_recipe("gpt_tiny")
    options = OPTIONS[:3] + OPTIONS[4:5] if quick else OPTIONS
    rows = []
    for name, comm in options:
        cfg = dataclasses.replace(
            base,
            comm=dataclasses.replace(CommConfig(), **comm),
            train=dataclasses.replace(base.train, steps=steps),
        )
        per_step, loss, eval_loss = _measure(cfg, steps)
        rows.append({"option": name, "bytes_per_step": per_step, "train_loss": loss,
                     "eval_loss": eval_loss})  # fmt: skip
    ref = rows[0]["bytes_per_step"]
    lines = [
        f"gpt_tiny, {jax.device_count()} devices data parallel, {steps} steps",
        "",
        "| option | bytes sent over data per step | vs fp32 | train loss | eval loss (anchor) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['option']} | {r['bytes_per_step']:,.0f} | {r['bytes_per_step'] / ref:.3f} | "
            f"{r['train_loss']:.4f} | {r['eval_loss']:.4f} |"
        )
    result = {"suite": "comm", "steps": steps, "devices": jax.device_count(), "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "comm.json"), "w") as f:
        json.dump(result, f, indent=2)
    print("\n".join(lines))
    return result
