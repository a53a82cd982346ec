"""`jaxpar bench data`: is the input pipeline fast enough, and how fast is `jaxpar data prepare`?

    jaxpar bench data [--quick] [--recipe gpt_tiny] [--out bench-results]

What it measures: docs/design.md, "Benchmarks"; a measured run: docs/benchmarks/2026-12-01-data.md.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import tempfile
import time

import jax
import numpy as np

from jaxpar.bench.harness import Bench, table
from jaxpar.config import TrainConfig
from jaxpar.data import sources as data_lib
from jaxpar.worker import training

QUICK_PACKAGES = ("json", "email")
FULL_PACKAGES = (*QUICK_PACKAGES, "asyncio", "concurrent", "importlib", "logging", "multiprocessing",
                 "unittest", "xml", "http", "urllib", "tomllib", "sqlite3", "zoneinfo")  # fmt: skip
PROCESSES = (1, 2, 4, 8)


def _prepare(out: str, quick: bool) -> dict:
    from jaxpar.data.prepare import prepare

    root = sysconfig.get_paths()["stdlib"]
    packages = QUICK_PACKAGES if quick else FULL_PACKAGES
    inputs = [os.path.join(root, p) for p in packages if os.path.isdir(os.path.join(root, p))]
    meta = prepare(inputs, out, vocab_size=512, progress=False)
    mb = meta["input_bytes"] / 1e6
    return {
        "input_mb": mb, "files": len(meta["sources"]), "tokens": sum(meta["tokens"].values()),
        "seconds": meta["seconds"], "mb_per_s": mb / meta["seconds"],
        "encode_seconds": meta["encode_seconds"], "encode_mb_per_s": mb / meta["encode_seconds"],
    }  # fmt: skip


def _source_rate(cfg: TrainConfig, processes: int, steps: int) -> dict:
    """Process 0 of `processes`: examples/s the source builds and bytes it reads per step."""
    source = training.make_source(cfg)
    b = cfg.data.global_batch
    t0 = time.perf_counter()
    for step in range(steps):
        data_lib.host_batch(source, step=step, global_batch=b, seed=cfg.data.seed,
                            process_index=0, process_count=processes)  # fmt: skip
    seconds = time.perf_counter() - t0
    rows = b // processes
    return {
        "processes": processes, "rows_per_step": rows,
        "bytes_per_step": source.bytes_read / steps, "examples_per_s": rows * steps / seconds,
    }  # fmt: skip


def _step_time(cfg: TrainConfig, layout, steps: int) -> float:
    """Median seconds of the recipe's compiled train step (data-parallel, all devices)."""
    with tempfile.TemporaryDirectory() as tmp:
        s = training.setup(cfg, layout("data=-1"), tmp)
        compiled, _ = training.compile_step(s)
        state = s.program.init()
        times = []
        for i in range(steps + 1):
            batch = training.device_batch(s, i)
            t0 = time.perf_counter()
            state, m = compiled(state, batch)
            jax.block_until_ready(m)
            if i:  # the first call pays one-time costs
                times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(bench: Bench) -> dict:
    cfg, quick, layout = bench.cfg, bench.quick, bench.preset
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus")
        prep = _prepare(corpus, quick)
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, source="tokens", path=corpus, dtype="")
        )
        cfg = training.vocab_from_data(cfg)
        step_s = _step_time(cfg, layout, 3 if quick else 10)
        rates = [_source_rate(cfg, p, 10 if quick else 50) for p in PROCESSES]
        seq_len = training.make_source(cfg).seq_len
    b = cfg.data.global_batch
    for r in rates:
        r["step_needs_examples_per_s"] = r["rows_per_step"] / step_s
        r["ratio"] = r["examples_per_s"] / r["step_needs_examples_per_s"]
    result = {
        "suite": "data", "recipe": cfg.name, "devices": jax.device_count(), "global_batch": b,
        "seq_len": seq_len, "median_step_s": step_s, "prepare": prep,
        "source": rates,
    }  # fmt: skip
    text = table(
        ["processes", "rows/process/step", "bytes read/process/step", "source examples/s",
         "step consumes examples/s", "ratio"],
        [[r["processes"], r["rows_per_step"], f"{r['bytes_per_step']:,.0f}",
          f"{r['examples_per_s']:,.0f}", f"{r['step_needs_examples_per_s']:,.1f}",
          f"{r['ratio']:,.0f}"] for r in rates],
        "|".join(["---:"] * 6),
    )  # fmt: skip
    text += (
        f"\n\nprepare: {prep['input_mb']:.2f} MB ({prep['files']} files, {prep['tokens']:,} "
        f"tokens) in {prep['seconds']:.2f} s = {prep['mb_per_s']:.2f} MB/s; encoding alone "
        f"{prep['encode_mb_per_s']:.2f} MB/s. Step: median {step_s:.4f} s for {b} rows."
    )
    return bench.write("data", result, text)
