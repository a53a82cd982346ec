"""The `overhead` and `meshes` suites of `jaxpar bench` (registered in jaxpar/bench/harness.py).

jaxpar bench overhead [--quick] [--recipe gpt_tiny]   (jaxpar's step vs plain jax.jit)
jaxpar bench meshes   [--quick] [--recipe gpt_tiny]   (each layout on 1..8 devices)
"""

from __future__ import annotations

import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar.bench import plain_jax
from jaxpar.bench.harness import Bench, table
from jaxpar.data import sources as data_lib
from jaxpar.engine import collectives
from jaxpar.engine.mesh import AXES, BATCH_AXES, DATA
from jaxpar.parallel.program import make_optimizer
from jaxpar.worker.training import compile_step, device_batch, setup

# ---- overhead ---------------------------------------------------------------------------------


def overhead(b: Bench) -> dict:
    """jaxpar's loop step (batch from the data pipeline + compiled step + metrics) vs a plain
    jitted step of the same model and optimizer fed a ready batch; same mesh (all devices, DP)."""
    cfg = b.cfg
    if not hasattr(cfg.model, "n_layers"):
        raise ValueError("bench overhead compares a GPT recipe against the plain JAX GPT step")
    reps = 6 if b.quick else 30
    with tempfile.TemporaryDirectory() as tmp:
        s = setup(cfg, b.preset("data=-1"), tmp)
        compiled, _ = compile_step(s)
        state = s.program.init()
        tx, _ = make_optimizer(cfg.optim, cfg.train.steps)
        mesh = Mesh(np.asarray(jax.devices()), ("batch",))
        plain_step, batch_sh = plain_jax.make_step(mesh, tx)
        params = jax.tree.map(np.asarray, jax.device_get(state["params"]))
        p_params = jax.device_put(
            params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        )
        p_opt = jax.jit(tx.init)(p_params)
        ours, plain, losses = [], [], []
        for i in range(reps + 2):  # 2 warm-up iterations each, then interleaved repetitions
            t0 = time.perf_counter()
            batch = device_batch(s, i)
            state, m = compiled(state, batch)
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
    text = table(
        ["step", "median s (jaxpar)", "median s (plain jax.jit)", "ratio", "max loss diff"],
        [[cfg.name, f"{result['median_step_s_jaxpar']:.4f}", f"{result['median_step_s_plain']:.4f}",
          f"{ratio:.3f}", f"{result['max_loss_diff']:.2e}"]],
    )  # fmt: skip
    return b.write("overhead", result, text)


# ---- meshes -----------------------------------------------------------------------------------

MAX_DEVICES = 8
# The axes the sweep lays out (all of jaxpar.engine.mesh.AXES but pipeline: `jaxpar bench pipeline`
# measures it, and a pipeline layout needs a recipe with stacked layers).
SWEPT_AXES = tuple(a for a in AXES if a != "pipeline")


def mesh_layouts(max_devices: int = MAX_DEVICES) -> tuple[tuple[str, int], ...]:
    """(mesh spec, devices) of each measured layout, derived from the axis table
    (jaxpar.engine.mesh.AXIS_INFO): `data` alone on 1, 2, 4, ... devices; then, on `max_devices`,
    all of them on each other batch axis (fsdp), `data` with each axis that does not split the
    batch (tensor) both ways round, and every swept axis at 2 when that fits."""
    out = [(f"{DATA}={n}", n) for n in _powers_of_two(max_devices)]
    for a in SWEPT_AXES:
        if a == DATA:
            continue
        if a in BATCH_AXES:
            out.append((f"{a}={max_devices},{DATA}=1", max_devices))
        else:
            splits = [d for d in _powers_of_two(max_devices) if 1 < d < max_devices]
            out += [(f"{DATA}={d},{a}={max_devices // d}", max_devices) for d in splits]
    if 2 ** len(SWEPT_AXES) <= max_devices:
        out.append((",".join(f"{a}=2" for a in SWEPT_AXES), 2 ** len(SWEPT_AXES)))
    return tuple(out)


def _powers_of_two(n: int) -> list[int]:
    return [2**k for k in range(n.bit_length()) if 2**k <= n]


def quick_layouts(layouts: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """`--quick`: `data` alone on 1, 2 and the most devices."""
    pure = [(spec, n) for spec, n in layouts if spec == f"{DATA}={n}"]
    return tuple(pure[:2] + pure[-1:]) if len(pure) > 2 else tuple(pure)


MESH_LAYOUTS = mesh_layouts()


def meshes(b: Bench) -> dict:
    """Throughput and collective bytes per step for each layout on 1..8 devices."""
    cfg = b.cfg
    steps = 3 if b.quick else 12
    layouts = quick_layouts(MESH_LAYOUTS) if b.quick else MESH_LAYOUTS
    rows, out = [], []
    for spec, n in layouts:
        if n > jax.device_count():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            s = setup(cfg, b.preset(spec), tmp, devices=jax.devices()[:n])
            compiled, seconds = compile_step(s)
            colls = collectives.audit(compiled, s.mesh)
            state = s.program.init()
            times = []
            for i in range(steps + 1):
                batch = device_batch(s, i)
                t0 = time.perf_counter()
                state, m = compiled(state, batch)
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
    text = table(
        ["mesh", "devices", "median step s", unit_name, "collective bytes/step/device"], rows
    )
    return b.write("meshes", {"suite": "meshes", "recipe": cfg.name, "layouts": out}, text)
