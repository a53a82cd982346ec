"""`jaxpar bench pipeline`: step time and bubble of every pipeline schedule (gpipe, circular, 1f1b,
interleaved_1f1b, zero_bubble), measured in one run, against the idle fraction of the schedule's
table (jaxpar.parallel.schedules).

    jaxpar bench pipeline [--quick] [--recipe gpt_tiny] [--out bench-results]

How the bubble is measured: docs/design.md, "Benchmarks".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

from jaxpar.bench.harness import Bench, table
from jaxpar.config import PipelineConfig, TrainConfig
from jaxpar.engine.mesh import MeshSpec
from jaxpar.engine.rules import Preset
from jaxpar.parallel.base import merge
from jaxpar.parallel.pipeline import Schedule, balanced_split, model_parts
from jaxpar.worker.training import compile_step, device_batch, setup

LAYERS = 8
# --quick (p = 2, m ∈ {2, 4}): 4 layers, the fewest circular v = 2 takes on 2 stages (one per
# stage and repeat); tracing and compiling the ten configurations is most of a quick run and grows
# with the layers, while the ticks and the bubble do not depend on them.
QUICK_LAYERS = 4
ROWS_PER_MICROBATCH = 2
SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2),
             ("zero_bubble", 1))  # fmt: skip
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def _takes(schedule: str, p: int, m: int) -> bool:
    """Whether the schedule runs p stages with m microbatches (1F1B family: m >= p)."""
    if schedule in ("1f1b", "interleaved_1f1b", "zero_bubble") and m < p:
        return False
    return schedule != "interleaved_1f1b" or m % p == 0


def _config(base: TrainConfig, schedule: str, m: int, v: int, layers: int) -> TrainConfig:
    if not hasattr(base.model, "n_layers"):
        raise ValueError("bench pipeline needs a model config with n_layers (e.g. gpt_tiny)")
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, n_layers=layers),
        data=dataclasses.replace(base.data, global_batch=m * ROWS_PER_MICROBATCH),
        pipeline=PipelineConfig(schedule, m, v),
    )


def _time_group(cfgs: list[TrainConfig], p: int, rounds: int) -> list[list[float]]:
    """Seconds per train step of each config on a pure p-stage pipeline, timed round-robin
    (one step of each per round, after a warm-up round) so that load from other processes
    spreads over the configs rather than landing on one of them."""
    preset = Preset(MeshSpec.parse(f"data=1,pipeline={p}"))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, cfg in enumerate(cfgs):
            s = setup(cfg, preset, os.path.join(tmp, str(i)), devices=jax.devices()[:p])
            compiled, _ = compile_step(s)
            runs.append([compiled, s.program.init(), device_batch(s, 0)])
    times = [[] for _ in cfgs]
    for r in range(rounds + 1):
        for i, run in enumerate(runs):
            compiled, state, batch = run
            t0 = time.perf_counter()
            run[1], metrics = compiled(state, batch)
            jax.block_until_ready(metrics["loss"])
            if r:
                times[i].append(time.perf_counter() - t0)
    return times


def _best_of(fn, *args, rounds: int) -> float:
    """Fastest of `rounds` timed calls (after a compiling one), in seconds."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def stage_times(cfg: TrainConfig, p: int, rounds: int) -> dict:
    """Forward + backward seconds of one microbatch through one block, the embedding and the
    head with the loss, timed on one device; each stage's time for the even split and for the
    split `balanced_split` recommends from these times."""
    with tempfile.TemporaryDirectory() as tmp:
        s = setup(cfg, Preset(MeshSpec.parse("data=1")), tmp, devices=jax.devices()[:1])
        params = s.program.init()["params"]
        parts = model_parts(s.program.graphdef, s.program.param_template)
        batch = device_batch(s, 0)
    tokens, targets = (batch[k][:ROWS_PER_MICROBATCH] for k in ("inputs", "targets"))
    graphdef, template = parts.graphdef, parts.template
    layer = jax.tree.map(lambda a: a[0], functools.reduce(lambda t, k: t[k], parts.path, params))

    def embed(pr):
        return merge(graphdef, template, pr).pipeline_parts()[0](tokens, None)

    x = jax.jit(embed)(params)

    def block(w, x):
        return merge(parts.block_graphdef, parts.block_template, w)(x, None).sum()

    def head(pr, x):
        logits = merge(graphdef, template, pr).pipeline_parts()[2](x).astype(jax.numpy.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    t = {
        "block": _best_of(jax.jit(jax.grad(block, argnums=(0, 1))), layer, x, rounds=rounds),
        "embed": _best_of(jax.jit(jax.vjp(embed, params)[1]), x, rounds=rounds),
        "head": _best_of(jax.jit(jax.grad(head, argnums=(0, 1))), params, x, rounds=rounds),
    }
    n = parts.num_layers

    def per_stage(split):
        return [k * t["block"] + t["embed"] * (i == 0) + t["head"] * (i == p - 1)
                for i, k in enumerate(split)]  # fmt: skip

    even = [n // p] * p
    best = balanced_split(n, p, t["block"], t["embed"], t["head"])
    return {"p": p, "layers": n, "part_s": t, "even_split": even, "even_stage_s": per_stage(even),
            "recommended_split": best, "recommended_stage_s": per_stage(best)}  # fmt: skip


def _fit(rows: list[dict]) -> tuple[float, float, float]:
    """Least squares T = c + τ·ticks over the rows' fastest steps: (τ, c, largest relative
    residual). Where noise drives c below zero, c = 0 and τ is refitted."""
    ticks = np.array([r["ticks"] for r in rows], float)
    t = np.array([r["step_s_min"] for r in rows])
    tau, c = np.polyfit(ticks, t, 1) if len(rows) > 1 else (t[0] / ticks[0], 0.0)
    if c < 0:
        tau, c = float(ticks @ t / (ticks @ ticks)), 0.0
    return float(tau), float(c), float(np.max(np.abs(c + tau * ticks - t) / t))


def analyse(rows: list[dict]) -> list[dict]:
    """Fit each (p, schedule) and add `bubble_measured` to its rows; returns the fits."""
    fits = []
    for key in sorted({(r["p"], r["schedule"], r["v"]) for r in rows}):
        group = [r for r in rows if (r["p"], r["schedule"], r["v"]) == key]
        tau, c, resid = _fit(group)
        p, schedule, v = key
        fits.append({"p": p, "schedule": schedule, "v": v, "tick_s": tau, "fixed_s": c,
                     "max_rel_residual": resid})  # fmt: skip
        for r in group:  # busy ticks: F, B and W of each microbatch on each of v groups
            loop = r["step_s_min"] - c
            r["bubble_measured"] = (loop - 3 * r["m"] * v * tau) / loop
    return fits


def selected(names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """The (schedule, v) pairs `--schedules` names (all when empty); ValueError names the fix."""
    known = [s for s, _ in SCHEDULES]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown schedule(s) {', '.join(unknown)} for --schedules; use some of "
                         f"{', '.join(known)}")  # fmt: skip
    return tuple((s, v) for s, v in SCHEDULES if not names or s in names)


def run(b: Bench) -> dict:
    """Measure every (p, m, schedule) in one run; write pipeline.json, pipeline.png; print a table."""
    base = b.cfg
    stages = (2,) if b.quick else (2, 4)
    # Three m at least: a line through two points fits them exactly, whatever the timings. The
    # quick run (a check that every step of the benchmark runs, not a measurement) takes two,
    # the fewest a fit takes, and two timed rounds.
    micro = (2, 4) if b.quick else (1, 2, 4, 8, 12)
    rounds = 2 if b.quick else 10  # the fastest step is fitted: least disturbed by other load
    layers = QUICK_LAYERS if b.quick else LAYERS
    rows = []
    for p in stages:
        for schedule, v in selected(b.schedules):
            ms = [m for m in micro if _takes(schedule, p, m)]
            if len(ms) < 2:
                continue
            cfgs = [_config(base, schedule, m, v, layers) for m in ms]
            for m, times in zip(ms, _time_group(cfgs, p, rounds), strict=True):
                sched = Schedule(schedule, p, m, v)
                rows.append({
                    "p": p, "m": m, "schedule": schedule, "v": v, "ticks": sched.ticks,
                    "step_s_median": statistics.median(times), "step_s_min": min(times),
                    "bubble_predicted": sched.bubble, "bubble_gpipe_formula": (p - 1) / (m + p - 1),
                    "buffer_slots": sched.table.slots,
                })  # fmt: skip
    fits = analyse(rows)
    stages_s = stage_times(_config(base, "gpipe", max(stages), 1, layers), max(stages), rounds)
    result = {
        "suite": "pipeline",
        "recipe": base.name,
        "model": f"{base.name} with {layers} layers",
        "rows_per_microbatch": ROWS_PER_MICROBATCH,
        "devices": f"{jax.devices()[0].platform} x {max(stages)}",
        "host_cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],  # timings on a busy host are noisy
        "rows": rows,
        "fits": fits,
        "stage_times": stages_s,
    }
    _plot(rows, b.path("pipeline.png"))
    host = f"host: {os.cpu_count()} CPUs, load average {result['load_average_1m']:.1f}"
    return b.write("pipeline", result, f"{_table(rows, fits)}\n{_stages_text(stages_s)}\n{host}")


def _stages_text(st: dict) -> str:
    def ms(xs):
        return ", ".join(f"{1e3 * x:.2f}" for x in xs)

    part = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in st["part_s"].items())
    return (
        f"\nper stage, forward + backward of one microbatch (p={st['p']}; {part}):\n"
        f"  even split {st['even_split']}: {ms(st['even_stage_s'])} ms\n"
        f"  recommended split {st['recommended_split']}: {ms(st['recommended_stage_s'])} ms "
        f"(the embedding on stage 0 and the head on the last counted)\n"
        f"  to run it: --set pipeline.stage_layers={','.join(map(str, st['recommended_split']))}"
    )


def _table(rows: list[dict], fits: list[dict]) -> str:
    header = ["p", "m", "schedule", "ticks", "step ms (median)", "bubble measured", "predicted",
              "(p-1)/(m+p-1)"]  # fmt: skip
    cells = [
        [r["p"], r["m"], r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else ""), r["ticks"],
         f"{1e3 * r['step_s_median']:.1f}", f"{r['bubble_measured']:.1%}",
         f"{r['bubble_predicted']:.1%}", f"{r['bubble_gpipe_formula']:.1%}"]
        for r in rows
    ]  # fmt: skip
    lines = [table(header, cells, "---:|---:|---|---:|---:|---:|---:|---:"), ""]
    for f in fits:
        lines.append(
            f"fit p={f['p']} {f['schedule']}: {1e3 * f['tick_s']:.2f} ms/tick + "
            f"{1e3 * f['fixed_s']:.1f} ms fixed; largest residual {f['max_rel_residual']:.1%}"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 4), squeeze=False)
    for ax, p in zip(axes[0], stages, strict=True):
        for (schedule, v), color in zip(SCHEDULES, COLORS, strict=True):
            sel = [r for r in rows if r["p"] == p and r["schedule"] == schedule]
            if not sel:
                continue
            ms = [r["m"] for r in sel]
            label = schedule + (f" v={v}" if v > 1 else "")
            ax.plot(ms, [r["bubble_predicted"] for r in sel], "--", color=color,
                    label=f"{label} predicted")  # fmt: skip
            ax.plot(ms, [r["bubble_measured"] for r in sel], "o", color=color,
                    label=f"{label} measured")  # fmt: skip
        low = min(0.0, *(r["bubble_measured"] for r in rows)) - 0.05
        ax.set(title=f"p = {p} stages", xlabel="microbatches m", ylabel="bubble fraction",
               xscale="log", ylim=(low, 1))  # fmt: skip
        ax.minorticks_off()
        ax.set_xticks(sorted({r["m"] for r in rows}), labels=sorted({r["m"] for r in rows}))
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.legend(fontsize=8)
    fig.suptitle("pipeline bubble: measured (time) vs the schedule table's idle fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
