"""`jaxpar bench moe`: a mixture of experts against the dense model of the same active parameters.

    jaxpar bench moe [--quick] [--recipe gpt_moe] [--set key=value ...]

The MoE recipe (gpt_moe unless --recipe names another MoE recipe) on `data=D,expert=E` (E: the
experts' and devices' common divisor, leaving data >= 2) and the dense GPT whose MLP has top_k x
d_mlp units (the same parameters per token) on `data=-1`: tokens/s of each (steps interleaved)
and their ratio; the all-to-all bytes each device sends per step, read from the compiled program,
against theory; the share of routed assignments dropped for several capacity factors (the forward
pass of the trained MoE model at each factor, on the same batches).

Theory of the all-to-all: each MoE layer sends its dispatched slots [rows, E, C, D] to the
experts and the results back, forward and again backward: 4 all-to-alls per layer and step, each
sending (ep-1)/ep of rows x E x C x D elements. With C = ceil(cf x T x top_k / E) that is
cf x top_k x tokens x D x (ep-1)/ep per direction, which at top_k = 2 and cf = 1 is the
2 x tokens x d_model x (E-1)/E of the tokens alone.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time

import jax
import numpy as np

from jaxpar.bench.harness import Bench, table
from jaxpar.config import TrainConfig, apply_overrides, resolve_recipe
from jaxpar.engine import collectives
from jaxpar.engine import model as model_lib
from jaxpar.engine.experts import capacity
from jaxpar.worker.training import compile_step, device_batch, setup

MOE_RECIPE = "gpt_moe"
CAPACITY_FACTORS = (0.5, 1.0, 1.25, 2.0)


def moe_config(b: Bench) -> TrainConfig:
    """The MoE recipe: the bench's own when its model config names its dense equivalent (a
    mixture of experts), else gpt_moe with the --set values."""
    cfg = b.cfg
    if not hasattr(cfg.model, "dense_equivalent"):
        cfg = apply_overrides(resolve_recipe(MOE_RECIPE), list(b.overrides))
    return cfg


def dense_config(cfg: TrainConfig) -> TrainConfig:
    """The dense model a token of `cfg`'s MoE model costs as much as (its dense_equivalent)."""
    return dataclasses.replace(cfg, name=f"{cfg.name}-dense", model=cfg.model.dense_equivalent())


def expert_ways(n_experts: int, devices: int) -> int:
    """The expert axis: the largest common divisor of the experts and devices leaving data >= 2."""
    ep = math.gcd(n_experts, devices)
    return ep // 2 if ep == devices and ep > 1 else ep


def theory_bytes(cfg: TrainConfig, ep: int, rows_per_device: int, itemsize: int) -> dict:
    """All-to-all bytes each device sends per step (module docstring)."""
    m = cfg.model
    c = capacity(m.seq_len, m.n_experts, m.top_k, m.capacity_factor)
    share = (ep - 1) / ep
    slots = rows_per_device * m.n_experts * c * m.d_model * itemsize * share
    tokens = m.top_k * rows_per_device * m.seq_len * m.d_model * itemsize * share
    calls = 4 * m.n_moe_layers  # dispatch and return, forward and backward
    return {"slots": slots * calls, "tokens": tokens * calls, "per_call": slots, "calls": calls}


def _timed(sessions: list, steps: int) -> list[float]:
    """Median step seconds of each (compiled, session, state), steps interleaved."""
    times: list[list[float]] = [[] for _ in sessions]
    for i in range(steps + 1):
        for j, run in enumerate(sessions):
            compiled, s, state = run
            batch = device_batch(s, i)
            t0 = time.perf_counter()
            state, m = compiled(state, batch)
            jax.block_until_ready(m["loss"])
            if i:  # the first step of each is a warm-up
                times[j].append(time.perf_counter() - t0)
            sessions[j] = (compiled, s, state)
    return [float(np.median(t)) for t in times]


def dropped_by_capacity(cfg: TrainConfig, s, state, factors, batches: int) -> dict[float, float]:
    """Share of assignments dropped by the trained model's forward pass at each capacity factor
    (routing is per sequence, so any layout gives the same)."""
    out = {}
    for cf in factors:
        model_cfg = dataclasses.replace(cfg.model, capacity_factor=cf)
        mdef = model_lib.abstract(model_cfg, cfg.train.seed)

        @jax.jit
        def dropped(params, tokens, mdef=mdef):
            model = model_lib.rebuild(mdef, params, {}, None)
            return model.aux_forward(tokens)[1]["metrics"]["moe_dropped_frac"]

        vals = [dropped(state["params"], device_batch(s, i)["inputs"]) for i in range(batches)]
        out[cf] = float(np.mean(jax.device_get(vals)))
    return out


def run(b: Bench) -> dict:
    cfg = moe_config(b)
    dense = dense_config(cfg)
    n = jax.device_count()
    ep = expert_ways(cfg.model.n_experts, n)
    steps = 3 if b.quick else 20
    layouts = {"moe": f"data=-1,expert={ep}", "dense": "data=-1"}
    with tempfile.TemporaryDirectory() as tmp:
        runs, audits = [], {}
        for name, c in (("moe", cfg), ("dense", dense)):
            c = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=steps + 1))
            s = setup(c, b.preset(layouts[name]), os.path.join(tmp, name), create=False)
            compiled, _ = compile_step(s)
            audits[name] = collectives.audit(compiled, s.mesh)
            runs.append((compiled, s, s.program.init()))
        step_s = dict(zip(("moe", "dense"), _timed(runs, steps), strict=True))
        moe_s, moe_state = runs[0][1], runs[0][2]
        factors = CAPACITY_FACTORS[1::2] if b.quick else CAPACITY_FACTORS
        drops = dropped_by_capacity(cfg, moe_s, moe_state, factors, 1 if b.quick else 4)
    a2a = [c for c in audits["moe"] if c.kind == "all-to-all" and c.mesh_axes == ("expert",)]
    measured = collectives.total_wire_bytes(a2a)
    rows = cfg.data.global_batch // n  # the batch splits over data x expert: every device
    itemsize = jax.numpy.dtype(cfg.precision.compute).itemsize
    theory = theory_bytes(cfg, ep, rows, itemsize)
    tokens = cfg.data.global_batch * cfg.model.seq_len
    rate = {k: tokens / v for k, v in step_s.items()}
    result = {
        "suite": "moe", "recipe": cfg.name, "devices": n, "steps": steps, "layouts": layouts,
        "active_params": cfg.model.active_params(), "dense_params": dense.model.num_params(),
        "moe_params": cfg.model.num_params(), "step_s": step_s, "tokens_per_s": rate,
        "tokens_per_s_ratio": rate["moe"] / rate["dense"],
        "all_to_all": {"measured_bytes": measured, "theory_slots_bytes": theory["slots"],
                       "theory_tokens_bytes": theory["tokens"], "ops": len(a2a),
                       "theory_ops": theory["calls"]},
        "dropped_by_capacity": {str(k): v for k, v in drops.items()},
    }  # fmt: skip
    m = cfg.model
    text = (
        f"{cfg.name}: {m.n_experts} experts, top-{m.top_k}, capacity factor "
        f"{m.capacity_factor}, {m.n_moe_layers} MoE layers, on {layouts['moe']} ({n} devices); "
        f"dense: d_mlp {dense.model.d_mlp} on {layouts['dense']}; {steps} timed steps each\n\n"
    )
    text += table(
        ["model", "parameters", "per token", "step s", "tokens/s"],
        [["MoE", f"{cfg.model.num_params():,}", f"{cfg.model.active_params():,}",
          f"{step_s['moe']:.4f}", f"{rate['moe']:,.0f}"],
         ["dense", f"{dense.model.num_params():,}", f"{dense.model.num_params():,}",
          f"{step_s['dense']:.4f}", f"{rate['dense']:,.0f}"]],
        "---|---:|---:|---:|---:",
    )  # fmt: skip
    text += f"\n\nMoE / dense tokens/s: {rate['moe'] / rate['dense']:.3f}\n\n"
    text += table(
        ["all-to-all over expert, per device per step", "bytes", "ops"],
        [["measured (compiled program)", f"{measured:,.0f}", len(a2a)],
         ["theory: dispatched slots (capacity included)", f"{theory['slots']:,.0f}",
          theory["calls"]],
         ["theory: top_k x tokens x d_model x (ep-1)/ep", f"{theory['tokens']:,.0f}",
          theory["calls"]]],
        "---|---:|---:",
    )  # fmt: skip
    text += "\n\n" + table(
        ["capacity factor", "assignments dropped"],
        [[f"{k:g}", f"{v:.2%}"] for k, v in drops.items()],
        "---:|---:",
    )
    return b.write("moe", result, text)
