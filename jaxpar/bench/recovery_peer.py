"""torchrun + DDP + DCP, the peer of `jaxpar bench recovery`: the same kills, its restart time.

The job (`recovery_torchrun.py`) runs in the peer environment `jaxpar bench survivors` installs
(survivors_peer.ensure: torch for the CPU, never in jaxpar's own environment), as one `torchrun`
of `nproc` processes that restarts them all when one dies. Its figures: per kill, the time to the
restarted group's first step and its phases (to start: torchrun notices, stops the others and
starts new interpreters; init: imports, process group, model and optimizer; restore: the DCP
read; first step), the steps lost, and the steady step time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess

from jaxpar.bench import survivors_peer as peer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recovery_torchrun.py")
PHASES = ("to_start_s", "init_s", "restore_s", "first_step_s")


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(venv: str, out: str, p: dict, batch: int) -> dict:
    """One torchrun job with the kills of `p` (steps p["kills"], one per restart, process
    1 + i % (nproc - 1) as jaxpar's), checkpoints every p["every"] steps; its figures."""
    os.makedirs(out, exist_ok=True)
    n = p["nproc"]
    kills = ",".join(f"{i}:{s}:{1 + i % (n - 1)}" for i, s in enumerate(p["kills"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXPAR_", "XLA_"))}
    env.update({"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    cmd = [peer._bin(venv, "python"), "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(n), "--max-restarts", str(len(p["kills"]) + 1),
           "--monitor-interval", "0.1", WORKER, "--out", out, "--steps", str(p["steps"]),
           "--every", str(p["every"]), "--kills", kills, "--batch", str(batch // n)]  # fmt: skip
    with open(os.path.join(out, "torchrun.log"), "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=3600)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the torchrun job did not finish in an hour (see {out})") from None
        finally:
            peer._kill_tree(proc)
    return figures(out, code, p["every"])


def figures(out: str, code: int, every: int) -> dict:
    kills = _read(os.path.join(out, "kills.jsonl"))
    steps = _read(os.path.join(out, "steps.jsonl"))
    starts = {s["restart"]: s for s in _read(os.path.join(out, "starts.jsonl"))}
    each = []
    for k in kills:
        r = k["restart"]
        start = starts.get(r + 1)
        first = min((s["time"] for s in steps if s["restart"] == r + 1), default=None)
        if start is None or first is None:
            continue
        newest = max((s["step"] for s in steps if s["restart"] == r), default=0)
        each.append({
            "recovery_s": first - k["time"],
            "to_start_s": start["begin"] - k["time"],
            "init_s": start["built"] - start["begin"],
            "restore_s": start["restored"] - start["built"],
            "first_step_s": first - start["restored"],
            "lost_steps": newest - start["step"],
        })  # fmt: skip
    gaps = [
        b["time"] - a["time"]
        for a, b in zip(steps, steps[1:], strict=False)
        if a["restart"] == b["restart"]
        and b["step"] == a["step"] + 1
        and (b["step"] - 1) % every != 0
    ]  # fmt: skip  (not the step after a save)
    out_ = {"exit_code": code, "kills": len(kills), "recoveries": each,
            "steady_step_s": statistics.median(gaps) if gaps else None}  # fmt: skip
    for key in ("recovery_s", *PHASES, "lost_steps"):
        vals = [e[key] for e in each]
        out_[key] = statistics.median(vals) if vals else None
    return out_


def ensure() -> tuple[str, dict]:
    """The peer environment (survivors_peer.ensure) with numpy, which DCP's gathers need."""
    venv, info = peer.ensure()
    check = [peer._bin(venv, "python"), "-c", "import numpy"]
    if subprocess.run(check, capture_output=True).returncode != 0:
        r = peer._pip(venv, ["install", "--quiet", "numpy"])
        if r.returncode != 0:
            raise peer.PeerUnavailable(f"pip cannot install numpy: {peer._last_line(r.stderr)}")
    return venv, info


def torchrun_side(p: dict, root: str, batch: int) -> dict:
    """{"status": "ok", figures, versions} or {"status": "unavailable"/"failed", "reason"};
    never raises: the jaxpar side stands without it."""
    try:
        venv, info = ensure()
    except (peer.PeerUnavailable, OSError) as e:
        return {"status": "unavailable", "reason": str(e)}
    try:
        got = run(venv, os.path.join(root, "torchrun"), p, batch)
    except (RuntimeError, OSError) as e:
        return {"status": "failed", "reason": str(e), **info}
    if not got["recoveries"]:
        return {"status": "failed", "reason": "no restart measured (see its torchrun.log)",
                **info, **got}  # fmt: skip
    return {"status": "ok", **info, **got}
