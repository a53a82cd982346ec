"""Run-directory writers (config, metrics, events, summary), progress display, MFU and goodput.

The run-directory contract (file names, event names, the JSONL writer and readers) is
jaxpar/rundir/runlog.py's and docs/design.md's: metrics.jsonl has one line per optimizer step (process
0), events.jsonl one JSON object per line written with a single append, and readers take the last
metrics line per step (steps after a restored checkpoint appear again).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import numpy as np

from jaxpar.rundir import ownership, runlog
from jaxpar.rundir.runlog import append_line, last_per_step, read_jsonl

# Peak dense bf16 FLOP/s per device, by jax `device_kind` prefix (vendor data sheets).
PEAK_FLOPS: dict[str, float] = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10G": 125e12,
    "NVIDIA GB200": 2250e12,
    "NVIDIA B200": 2250e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device, or None where unknown (e.g. CPU)."""
    for prefix in sorted(PEAK_FLOPS, key=len, reverse=True):
        if device_kind.startswith(prefix):
            return PEAK_FLOPS[prefix]
    return None


def mfu(flops_per_step: float | None, step_time_s: float, devices: int, peak: float | None):
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak (None if unknown)."""
    if not flops_per_step or not peak or step_time_s <= 0:
        return None
    return flops_per_step / step_time_s / (devices * peak)


class RunDir:
    """Paths and writers of one run directory, shared by the supervisor and every process."""

    def __init__(
        self,
        path: str,
        process_index: int = 0,
        incarnation: int | None = None,
        create: bool = True,
    ):
        """create=False: nothing is written until `create()` (a run validates first)."""
        self.path = os.path.abspath(path)
        self.process_index = process_index
        self._incarnation = incarnation
        if create:
            self.create()
        self.incarnation = self.count_starts() if incarnation is None else incarnation

    def create(self) -> None:
        """Make the directory; the incarnation is counted again (under the run's lock). Never
        waits: a standby worker waits for its "go" before it creates one."""
        ownership.make_run_dir(self.path)
        if self._incarnation is None:
            self.incarnation = self.count_starts()

    def unreadable_lines(self) -> dict[str, int]:
        """File name -> lines skipped as unreadable, for metrics.jsonl and events.jsonl."""
        out = {}
        for name in (runlog.EVENTS, runlog.METRICS):
            bad = runlog.read_jsonl_counted(self.file(name))[1]
            if bad:
                out[name] = bad
        return out

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def is_writer(self) -> bool:
        return self.process_index == 0

    def count_starts(self) -> int:
        return sum(
            1
            for e in read_jsonl(self.file(runlog.EVENTS))
            if e.get("event") == runlog.WorkerEvent.START
        )

    def event(self, event: str, *, all_processes: bool = False, **fields: Any) -> None:
        """Append an event (process 0 only, unless `all_processes`)."""
        if not (self.is_writer or all_processes):
            return
        line = {"event": event, "time": time.time(), "incarnation": self.incarnation, **fields}
        if all_processes:
            line.setdefault("process", self.process_index)
        append_line(self.file(runlog.EVENTS), line)

    def metrics(self, line: dict) -> None:
        if self.is_writer:
            append_line(self.file(runlog.METRICS), {**line, "incarnation": self.incarnation})

    def write_incarnation(self) -> None:
        if self.is_writer:
            with open(self.file(runlog.INCARNATION), "w") as f:
                f.write(f"{self.incarnation}\n")

    def events(self) -> list[dict]:
        return read_jsonl(self.file(runlog.EVENTS))


def summarize(run: RunDir, wall_s: float, restarts: int = 0) -> dict:
    """summary.json contents from metrics.jsonl and events.jsonl (docs/design.md, "Run directory")."""
    lines = runlog.well_formed(read_jsonl(run.file(runlog.METRICS)))
    per_step = last_per_step(lines)
    all_steps = [line for line in lines if "loss" in line]
    productive = sum(line.get("step_time_s", 0.0) for line in per_step.values())
    rate_key = (
        "tokens_per_s" if any("tokens_per_s" in v for v in per_step.values()) else "samples_per_s"
    )
    rates = [v[rate_key] for v in per_step.values() if v.get(rate_key)]
    final = per_step[max(per_step)] if per_step else {}
    return {
        "steps": max(per_step) if per_step else 0,
        "final_loss": final.get("loss"),
        "wall_s": wall_s,
        "restarts": restarts,
        "goodput": min(1.0, productive / wall_s) if wall_s > 0 else None,
        "lost_steps": len(all_steps) - len(per_step),
        "mttr_s": None,
        f"median_{rate_key}": float(np.median(rates)) if rates else None,
    }


class Progress:
    """Progress on process 0: a live line on a terminal, plain periodic lines otherwise."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, stream=None):
        self.total, self.start = total, start
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.time()
        self.last_print = 0.0
        self.every_s = 0.2 if self.tty else 10.0

    def update(
        self, step: int, loss: float, rate: float | None, unit: str, extra: dict | None = None
    ) -> None:
        """`extra`: further metrics shown after the loss (e.g. {"accuracy": 0.93})."""
        if not self.enabled:
            return
        now = time.time()
        final = step >= self.total
        if not final and now - self.last_print < self.every_s and step != self.start + 1:
            return
        self.last_print = now
        done = step - self.start
        eta = (now - self.t0) / done * (self.total - step) if done else math.nan
        frac = step / self.total if self.total else 1.0
        bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
        rate_s = f"{rate:,.0f} {unit}/s" if rate else "-"
        more = "".join(f" {k} {v:.4f}" for k, v in (extra or {}).items())
        text = f"[{bar}] step {step}/{self.total} loss {loss:.4f}{more} {rate_s} eta {_fmt_s(eta)}"
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class TensorBoardWriter:
    """TensorBoard event files (tensorboardX) in RUN_DIR/tensorboard/, written by process 0.

    Each incarnation opens its own event file; after a restart TensorBoard shows the re-run steps
    a second time, as metrics.jsonl does. The file is flushed after every line, so a SIGKILL loses
    at most the newest line (tensorboardX otherwise buffers up to `flush_secs`).
    """

    TAGS = {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "accuracy": "train/accuracy",
        "step_time_s": "perf/step_time_s",
        "tokens_per_s": "perf/tokens_per_s",
        "samples_per_s": "perf/samples_per_s",
        "mfu": "perf/mfu",
        "mem_gb": "perf/mem_gb",
        "eval_loss": "eval/loss",
    }

    def __init__(self, run: RunDir, flush_secs: int = 30):
        self.writer = None
        if run.is_writer:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(
                logdir=run.file(runlog.TENSORBOARD),
                flush_secs=flush_secs,
                filename_suffix=f".inc{run.incarnation}",
            )

    def write(self, line: dict) -> None:
        """One metrics line (train or eval) as scalars at its step; None/non-finite values skipped."""
        if self.writer is None or "step" not in line:
            return
        for key, tag in self.TAGS.items():
            value = line.get(key)
            if isinstance(value, int | float | np.generic) and math.isfinite(value):
                self.writer.add_scalar(tag, float(value), int(line["step"]), line.get("time"))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_tensorboard(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file in `logdir`: tag -> [(step, value)] in file order.

    Parses the TFRecord framing (length, masked CRC-32C of length and of data) and tensorboardX's
    Event protobuf directly, so no TensorBoard install is needed. A torn last record is ignored.
    """
    import struct

    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    out: dict[str, list[tuple[int, float]]] = {}
    names = sorted(n for n in os.listdir(logdir) if "tfevents" in n)
    for name in names:
        with open(os.path.join(logdir, name), "rb") as f:
            blob = f.read()
        pos = 0
        while pos + 12 <= len(blob):
            header = blob[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            end = pos + 12 + length + 4
            if end > len(blob):
                break  # torn record (writer still running)
            (crc_len,) = struct.unpack("<I", blob[pos + 8 : pos + 12])
            data = blob[pos + 12 : pos + 12 + length]
            (crc_data,) = struct.unpack("<I", blob[end - 4 : end])
            if crc_len != masked(header) or crc_data != masked(data):
                raise ValueError(f"{name}: corrupt TFRecord at byte {pos}")
            event = Event.FromString(data)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((int(event.step), float(v.simple_value)))
            pos = end
    return out
