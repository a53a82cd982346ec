"""torchft, the peer of `jaxpar bench survivors`: its own virtual environment and its jobs.

The environment holds torch (CPU) and torchft, installed by the benchmark from the package index
with pip into `~/.cache/jaxpar/bench-peers/torchft-VERSION` ($XDG_CACHE_HOME honoured,
$JAXPAR_BENCH_PEERS overrides the folder) and never into jaxpar's own environment. Where the
index's torch for this platform brings GPU packages (nvidia-*, cuda-*), a CPU wheel of torch is
taken from pip's --find-links folders or from $JAXPAR_BENCH_TORCH (a requirement or a wheel's
path); without one the peer is unavailable and the benchmark says why (`PeerUnavailable`).

A job: torchft's Lighthouse, and one `torchrun` per replica group (its processes restarted
together when one dies) running `survivors_torchft.py`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import time

import psutil

from jaxpar.bench.survivors_measure import Kill, Step, kill_random, schedule

TORCHFT = "0.2.0"  # the torchft release whose API survivors_torchft.py uses
TORCH_GPU_PACKAGES = ("nvidia-", "cuda-")
INSTALL_TIMEOUT_S = 1800
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "survivors_torchft.py")


class PeerUnavailable(RuntimeError):
    """The peer cannot be installed or started here; the message says why and what to do."""


def cache_dir() -> str:
    if os.environ.get("JAXPAR_BENCH_PEERS"):
        return os.environ["JAXPAR_BENCH_PEERS"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpar", "bench-peers")


def _bin(venv: str, name: str) -> str:
    return os.path.join(venv, "bin", name)


def _pip(venv: str, args: list[str], timeout: float = INSTALL_TIMEOUT_S, python: str = ""):
    cmd = [python or _bin(venv, "python"), "-m", "pip", "--disable-pip-version-check", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"pip {args[0]} took over {timeout:.0f} s") from None


def _last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("WARNING")]
    return lines[-1].strip() if lines else "no output"


def gpu_packages(report: dict) -> list[str]:
    """The GPU packages in a `pip install --dry-run --report` result."""
    names = [i.get("metadata", {}).get("name", "") for i in report.get("install", [])]
    return sorted(n for n in names if n.lower().startswith(TORCH_GPU_PACKAGES))


def find_links(pip_config: str) -> list[str]:
    """pip's --find-links folders: $PIP_FIND_LINKS and `pip config list`'s find-links."""
    out = os.environ.get("PIP_FIND_LINKS", "").split()
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            out += value.strip().strip("'\"").split()
    return [p.removeprefix("file://") for p in dict.fromkeys(out) if "://" not in p or
            p.startswith("file://")]  # fmt: skip


def cpu_wheel(folders: list[str]) -> str | None:
    """The newest CPU wheel of torch (local version +cpu) for this interpreter in `folders`."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = []
    for folder in folders:
        found += glob.glob(os.path.join(folder, f"torch-*+cpu-{tag}-{tag}-*.whl"))
    machine = os.uname().machine
    found = [w for w in found if machine in os.path.basename(w)]
    return max(found, default=None)


def torch_requirement(venv: str, python: str = "") -> str:
    """What to install torch from: $JAXPAR_BENCH_TORCH, else the index's torch if it brings no
    GPU packages, else a CPU wheel in pip's find-links folders; PeerUnavailable if none.
    `python`: the interpreter whose pip resolves it (the venv's by default; `venv` is then only
    the folder its report is written to)."""
    if os.environ.get("JAXPAR_BENCH_TORCH"):
        return os.environ["JAXPAR_BENCH_TORCH"]
    report_path = os.path.join(venv, "torch-report.json")
    r = _pip(
        venv, ["install", "--dry-run", "--quiet", "--report", report_path, "torch"], python=python
    )
    if r.returncode != 0:
        raise PeerUnavailable(f"pip cannot resolve torch: {_last_line(r.stderr)}")
    with open(report_path) as f:
        gpu = gpu_packages(json.load(f))
    if not gpu:
        return "torch"
    config = _pip(venv, ["config", "list"], timeout=60, python=python).stdout
    wheel = cpu_wheel(find_links(config))
    if wheel is None:
        raise PeerUnavailable(
            f"the package index's torch for this platform brings {len(gpu)} GPU packages "
            f"({', '.join(gpu[:3])}, ...) and no CPU wheel of torch is in pip's find-links; "
            "set JAXPAR_BENCH_TORCH to a CPU wheel of torch (a path or a requirement)"
        )
    return wheel


def ensure() -> tuple[str, dict]:
    """The peer's virtual environment (created and installed on first use): (its folder,
    {"torch": version, "torchft": version, "installed_s": seconds spent installing now})."""
    venv = os.path.join(cache_dir(), f"torchft-{TORCHFT}")
    ready = os.path.join(venv, "ready.json")
    if os.path.exists(ready):
        with contextlib.suppress(OSError, ValueError):
            with open(ready) as f:
                info = json.load(f)
            if os.path.exists(_bin(venv, "torchft_lighthouse")):
                return venv, {**info, "installed_s": 0.0}
    t0 = time.time()
    shutil.rmtree(venv, ignore_errors=True)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if r.returncode != 0:
        raise PeerUnavailable(f"cannot create a virtual environment: {_last_line(r.stderr)}")
    torch = torch_requirement(venv)
    r = _pip(venv, ["install", "--quiet", torch, f"torchft=={TORCHFT}"])
    if r.returncode != 0:
        raise PeerUnavailable(f"pip cannot install torch + torchft: {_last_line(r.stderr)}")
    code = "import torch, torchft, importlib.metadata as m, json; " \
           "print(json.dumps({'torch': torch.__version__, 'torchft': m.version('torchft')}))"  # fmt: skip
    r = subprocess.run([_bin(venv, "python"), "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise PeerUnavailable(f"torchft does not import: {_last_line(r.stderr)}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    with open(ready, "w") as f:
        json.dump(info, f)
    return venv, {**info, "installed_s": time.time() - t0}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process this benchmark started and every process below it (torchrun starts its
    workers in sessions of their own, so a process group would miss them)."""
    with contextlib.suppress(psutil.Error):
        tree = psutil.Process(proc.pid).children(recursive=True)
        for p in [*tree, psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


class Job:
    """torchft's Lighthouse and `groups` torchruns of `per_group` processes each."""

    def __init__(self, venv: str, out: str, groups: int, per_group: int, batch: int,
                 min_groups: int):  # fmt: skip
        self.out, self.groups, self.per_group, self.batch = out, groups, per_group, batch
        os.makedirs(out, exist_ok=True)
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXPAR_", "XLA_"))}
        env.update({"RUST_LOG": "warn", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
                    "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"})  # fmt: skip
        self.logs = []
        self.procs: list[subprocess.Popen] = []
        self.procs.append(self._start(
            [_bin(venv, "torchft_lighthouse"), "--min_replicas", str(min_groups),
             "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
             "--bind", f"127.0.0.1:{port}"], env, "lighthouse.log"))  # fmt: skip
        for g in range(groups):
            cmd = [_bin(venv, "python"), "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(per_group), "--max-restarts", "1000",
                   "--monitor-interval", "0.1", WORKER, "--group", str(g), "--groups",
                   str(groups), "--out", out, "--batch", str(batch // per_group),
                   "--min-groups", str(min_groups)]  # fmt: skip
            genv = {**env, "SURVIVORS_ERRORS": os.path.join(out, f"errors-g{g}.log")}
            self.procs.append(self._start(cmd, genv, f"group{g}.log"))

    def _start(self, cmd: list[str], env: dict, log: str) -> subprocess.Popen:
        f = open(os.path.join(self.out, log), "wb")
        self.logs.append(f)
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def close(self) -> None:
        for p in self.procs:
            _kill_tree(p)
        for f in self.logs:
            f.close()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def pids(self) -> dict[int, int]:
        """{slot: pid} of the workers now (slot = group x per_group + rank), from their files."""
        out = {}
        for g in range(self.groups):
            for r in range(self.per_group):
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(self.out, f"pid-g{g}-r{r}")) as f:
                        out[g * self.per_group + r] = int(f.read().strip())
        return out

    def steps(self) -> list[Step]:
        """Every group's logged steps; examples count where the step committed with the group
        taking part (a recovering group's first step trains nothing)."""
        out = []
        for g in range(self.groups):
            for rec in _read_lines(os.path.join(self.out, f"steps-g{g}.jsonl")):
                trained = rec.get("committed") and rec.get("participating")
                out.append(Step(float(rec["t"]), int(rec["step"]), (g,),
                                self.batch if trained else 0.0, {g: int(rec["pid"])}))  # fmt: skip
        return out

    def errors(self) -> str:
        text = []
        for g in range(self.groups):
            with contextlib.suppress(OSError):
                with open(os.path.join(self.out, f"errors-g{g}.log")) as f:
                    text.append(f.read())
        return "".join(text)


def _read_lines(path: str) -> list[dict]:
    out = []
    with contextlib.suppress(OSError):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if isinstance(rec, dict) and {"t", "step", "pid"} <= rec.keys():
                        out.append(rec)
    return out


def run(venv: str, out: str, period: float | None, seconds: float, groups: int, per_group: int,
        batch: int, min_groups: int, seed: int = 0, startup_timeout: float = 600,
        warmup_s: float = 0.0) -> dict:  # fmt: skip
    """One torchft job: SIGKILL a random worker every `period` s (none if None) over `seconds`
    s from `warmup_s` after the first step every group trained; returns the trace for
    survivors_measure."""
    job = Job(venv, out, groups, per_group, batch, min_groups)
    rng = random.Random(seed)
    kills: list[Kill] = []
    samples: list[tuple[float, dict[int, int]]] = []
    try:
        deadline = time.time() + startup_timeout
        while len({s.groups[0] for s in job.steps()}) < groups:
            if not job.alive() or time.time() > deadline:
                raise RuntimeError(f"torchft job did not start (see {out}): {job.errors()[-400:]}")
            time.sleep(0.2)
        start = time.time() + warmup_s
        while time.time() < start:
            if not job.alive():
                raise RuntimeError(f"torchft job ended while warming up (see {out})")
            time.sleep(0.2)
        due = schedule(start, period, seconds)
        while time.time() < start + seconds:
            samples.append((time.time(), job.pids()))
            if due and time.time() >= due[0]:
                due.pop(0)
                kills.append(kill_random(rng, groups * per_group, per_group, job.pids,
                                         lambda: [p.pid for p in job.procs]))  # fmt: skip
            time.sleep(0.2)
        samples.append((time.time(), job.pids()))
    finally:
        job.close()
    return {"steps": job.steps(), "kills": kills, "samples": samples, "start": start}
