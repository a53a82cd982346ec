"""`jaxpar bench checkpoint`: what checkpointing costs the training loop, measured in one run.

The loop's blocking time in an async vs a sync save, throughput with a save every N steps vs
none, and the local snapshot tier's price (step time with a snapshot every step vs without).
How it measures: docs/design.md, "Benchmarks"; a measured run:
docs/benchmarks/2026-12-02-checkpoint.md.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time

import jax

from jaxpar.bench.harness import Bench, table

FULL = {"overrides": ["data.global_batch=8"], "saves": 5, "rounds": 4, "every": 5}
# quick: each measurement once (one pair of blocks, two saves of each kind): that it runs
QUICK = {"overrides": ["data.global_batch=8"], "saves": 2, "rounds": 1, "every": 3}
# The default recipe scaled up for the full benchmark (a state worth measuring).
SCALE_UP = ["model.d_model=512", "model.n_heads=8", "model.n_layers=4", "model.d_mlp=2048"]


def _session(b: Bench, overrides: list[str], steps: int, run_dir: str):
    from jaxpar.config import apply_overrides
    from jaxpar.worker import training

    cfg = apply_overrides(b.cfg, [f"train.steps={steps}", *overrides])
    return training.setup(cfg, b.preset(""), run_dir, incarnation=0)


def _checkpointer(run, use_async: bool):
    from jaxpar.recovery.checkpoint import Checkpointer

    return Checkpointer(run, every=0, keep=2, meta={"bench": True}, use_async=use_async)


def _state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def measure_blocking(s, state, saves: int) -> dict:
    """Median seconds save() blocks, async vs sync; async also till committed."""
    from jaxpar.recovery.checkpoint import warm_up
    from jaxpar.rundir.writer import RunDir

    warm_up(s.program.abstract_state)
    out: dict = {}
    for mode in ("async", "sync", "async"):  # async twice: the first pass warms orbax up
        run = RunDir(os.path.join(s.run.path, f"blocking-{mode}"), incarnation=0)
        shutil.rmtree(run.file("checkpoints"), ignore_errors=True)
        ckpt = _checkpointer(run, use_async=mode == "async")
        blocked, committed = [], []
        for i in range(saves):
            t0 = time.time()
            blocked.append(ckpt.save(i + 1, state))
            ckpt.wait()
            committed.append(time.time() - t0)
        ckpt.close()
        out[f"{mode}_blocking_s"] = statistics.median(blocked)
        out[f"{mode}_commit_s"] = statistics.median(committed)
    out["blocking_ratio"] = out["sync_blocking_s"] / max(out["async_blocking_s"], 1e-9)
    return out


def measure_throughput(s, state, rounds: int, every: int) -> tuple[dict, dict]:
    """Tokens/s without saves vs with an async save every `every` steps.

    Blocks of `every` steps, without and with one save (issued after the block's first step,
    waited for at its end, so all of its work is counted in its block), in ABBA order over
    `rounds` pairs: a machine whose speed drifts during the run hits both kinds alike.
    """
    from jaxpar.rundir.writer import RunDir
    from jaxpar.worker import training

    compiled, _ = training.compile_step(s)
    run = RunDir(os.path.join(s.run.path, "throughput"), incarnation=0)
    shutil.rmtree(run.file("checkpoints"), ignore_errors=True)
    ckpt = _checkpointer(run, use_async=True)
    state, m = compiled(state, training.device_batch(s, 0))  # first call outside timing
    jax.block_until_ready(m)
    seconds = {"none": 0.0, "saves": 0.0}
    step, saves = 1, 0
    for r in range(rounds):
        for kind in ("none", "saves") if r % 2 == 0 else ("saves", "none"):
            t0 = time.time()
            for i in range(every):
                state, m = compiled(state, training.device_batch(s, step))
                jax.device_get(m["loss"])  # the loop syncs on the loss every step
                step += 1
                if kind == "saves" and i == 0:
                    ckpt.save(step, state)
                    saves += 1
            ckpt.wait()
            seconds[kind] += time.time() - t0
    ckpt.close()
    tokens = rounds * every * s.cfg.data.global_batch * s.source.seq_len
    rate = {k: tokens / v for k, v in seconds.items()}
    result = {
        "rounds": rounds,
        "save_every": every,
        "saves": saves,
        "tokens_per_s_no_saves": rate["none"],
        "tokens_per_s_with_saves": rate["saves"],
        "throughput_cost": 1.0 - rate["saves"] / rate["none"],
    }
    return result, state


def measure_local_tier(s, state, rounds: int, every: int) -> tuple[dict, dict]:
    """Block timing as in measure_throughput: blocks of `every` steps without the
    local tier and with a snapshot offered after each step, ABBA over `rounds` pairs; each
    "with" block waits for its last snapshot's commit, so every write is counted."""
    from jaxpar.recovery import local_tier
    from jaxpar.rundir.writer import RunDir
    from jaxpar.worker import training

    compiled, _ = training.compile_step(s)
    run = RunDir(os.path.join(s.run.path, "local-tier"), incarnation=0)
    os.makedirs(run.path, exist_ok=True)
    tier = local_tier.LocalTier(run, s.program.abstract_state, every=1,
                              root=local_tier.default_root(s.cfg.ckpt.local_dir),
                              binding={"bench": "checkpoint"})  # fmt: skip
    tier.warm_up()
    seconds = {"off": 0.0, "on": 0.0}
    step = 1
    try:
        tier.offer(step, state)  # the writer thread's start and first write outside timing
        tier.wait()
        for r in range(rounds):
            for kind in ("off", "on") if r % 2 == 0 else ("on", "off"):
                t0 = time.time()
                for _ in range(every):
                    state, m = compiled(state, training.device_batch(s, step))
                    jax.device_get(m["loss"])
                    step += 1
                    if kind == "on":
                        tier.offer(step, state)
                tier.wait()
                seconds[kind] += time.time() - t0
        stats = vars(tier.stats)
    finally:
        tier.close(complete=True)  # removes this benchmark's snapshots from RAM
    steps = rounds * every
    result = {
        "local_tier_bytes_per_process": tier.nbytes,
        "local_tier_snapshots": stats["snapshots"],
        "local_tier_dir": tier.node,
        "step_s_local_tier_off": seconds["off"] / steps,
        "step_s_local_tier_on": seconds["on"] / steps,
        "local_tier_step_ratio": seconds["on"] / seconds["off"],
    }
    return result, state


def report(r: dict) -> str:
    mb = r["local_tier_bytes_per_process"] / 2**20
    rows = [
        ("state", f"{r['state_mb']:.1f} MB on {r['devices']} devices ({r['mesh']})"),
        ("save() blocking, async (median)", f"{r['async_blocking_s'] * 1e3:.1f} ms"),
        ("save() blocking, sync (median)", f"{r['sync_blocking_s'] * 1e3:.1f} ms"),
        ("sync / async blocking", f"{r['blocking_ratio']:.1f}x"),
        ("async save until committed (median)", f"{r['async_commit_s'] * 1e3:.1f} ms"),
        ("tokens/s, no saves", f"{r['tokens_per_s_no_saves']:,.0f}"),
        (
            f"tokens/s, async save every {r['save_every']} steps",
            f"{r['tokens_per_s_with_saves']:,.0f}",
        ),
        ("throughput cost of saving", f"{r['throughput_cost'] * 100:.1f}%"),
        ("step time, no local snapshots", f"{r['step_s_local_tier_off'] * 1e3:.1f} ms"),
        (
            f"step time, a local snapshot every step ({mb:.1f} MB)",
            f"{r['step_s_local_tier_on'] * 1e3:.1f} ms",
        ),
        ("local tier on / off", f"{r['local_tier_step_ratio']:.3f}x"),
    ]
    return table(["checkpoint", "value"], [list(r) for r in rows])


def run(b: Bench) -> dict:
    """Run the checkpoint benchmark; print a markdown table, write OUT_DIR/checkpoint.json."""
    plan = QUICK if b.quick else FULL
    overrides = plan["overrides"] + (SCALE_UP if b.default_recipe and not b.quick else [])
    work = b.path("checkpoint-bench")
    s = _session(b, overrides, 4 * plan["rounds"] * plan["every"] + 2, work)
    state = s.program.init()
    jax.block_until_ready(state)
    result = {
        "suite": "checkpoint",
        "recipe": b.cfg.name,
        "quick": b.quick,
        "overrides": overrides,
        "state_mb": _state_bytes(state) / 2**20,
        "params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "mesh": ",".join(f"{k}={v}" for k, v in s.mesh.shape.items() if v > 1) or "1 device",
    }
    result.update(measure_blocking(s, state, plan["saves"]))
    throughput, state = measure_throughput(s, state, plan["rounds"], plan["every"])
    result.update(throughput)
    local, state = measure_local_tier(s, state, plan["rounds"], plan["every"])
    result.update(local)
    shutil.rmtree(work, ignore_errors=True)  # checkpoints of a benchmark are not kept
    if jax.process_index() == 0:
        b.write("checkpoint", result, report(result))
    return result
