"""Fault injection: real failures at chosen steps, for tests, benchmarks and drills.

Specs (`--fault SPEC`, repeatable; `JAXPAR_FAULTS` carries the same specs `;`-separated):

    kill@S[:process=P][:permanent]   SIGKILL to itself (permanent: the slot is lost for good)
    hang@S[:process=P]               stays alive, makes no progress
    sigterm@S[:process=P]            preemption notice
    nan@S                            poisons the loss inside the compiled step
    diverge@S[:process=P]            perturbs that process's replica of the parameters
    killsave@S                       SIGKILL after the step-S checkpoint wrote its arrays, before commit
    corrupt@S                        flips bytes inside an array file of the newest committed checkpoint
    slow@S:process=P:seconds=X       every step from S sleeps X seconds

`@S` fires when the process is about to start step S (steps < S are complete and logged). A spec
fires once per run directory (its `fault_injected` event is the record); `:repeat` fires in
every incarnation. `process=P` (default 0) is the process index in the incarnation that fires.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.metrics import RunDir

KINDS = ("kill", "hang", "sigterm", "nan", "diverge", "killsave", "corrupt", "slow")
EXIT_NAN = 44  # non-finite loss: the supervisor rolls back to the last good checkpoint


class NonFiniteLoss(RuntimeError):
    """The loss of a step was NaN or infinite; the state after it is not saved."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"non-finite loss {loss} at step {step}; the state is not saved")
        self.step, self.loss = step, loss


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    step: int
    process: int = 0
    permanent: bool = False
    repeat: bool = False
    seconds: float = 0.0
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        head, *opts = text.strip().split(":")
        kind, at, step = head.partition("@")
        if kind not in KINDS or not at or not step.isdigit():
            raise ValueError(f"bad fault spec {text!r}: use KIND@STEP[:opt...] with KIND in {KINDS}")
        fields: dict = {"kind": kind, "step": int(step), "text": text.strip()}
        for opt in opts:
            key, eq, val = opt.partition("=")
            if key in ("permanent", "repeat") and not eq:
                fields[key] = True
            elif key == "process" and val.isdigit():
                fields["process"] = int(val)
            elif key == "seconds" and eq:
                fields["seconds"] = float(val)
            else:
                raise ValueError(f"bad fault spec {text!r}: unknown option {opt!r}")
        if kind == "slow" and fields.get("seconds", 0) <= 0:
            raise ValueError(f"bad fault spec {text!r}: slow needs :seconds=X")
        return cls(**fields)


def parse_all(specs: list[str]) -> list[FaultSpec]:
    env = os.environ.get("JAXPAR_FAULTS", "")
    texts = [s for s in specs if s.strip()] + [s for s in env.split(";") if s.strip()]
    out: list[FaultSpec] = []
    for t in texts:
        spec = FaultSpec.parse(t)
        if spec not in out:
            out.append(spec)
    return out


class Faults:
    """The faults of this process in this incarnation; the loop calls the hooks below."""

    def __init__(self, specs: list[FaultSpec], run: RunDir, process_index: int):
        self.run = run
        fired = {e.get("spec") for e in run.events() if e.get("event") == "fault_injected"}
        self.specs = [
            s for s in specs if s.process == process_index and (s.repeat or s.text not in fired)
        ]
        self.process = process_index
        self._slow: float = 0.0

    def _take(self, kind: str, step: int) -> FaultSpec | None:
        for s in self.specs:
            if s.kind == kind and s.step == step:
                self.specs.remove(s)
                self.run.event(
                    "fault_injected", all_processes=True, kind=s.kind, spec=s.text,
                    process=self.process, step=step, permanent=s.permanent,
                )  # fmt: skip
                return s
        return None

    def before_step(self, step: int) -> None:
        """Process-level faults at the start of `step` (0-based index of the step about to run)."""
        at = step + 1  # @S: about to start step S (1-based, as metrics.jsonl counts)
        slow = self._take("slow", at)
        if slow is not None:
            self._slow = slow.seconds
        if self._slow:
            time.sleep(self._slow)
        if self._take("kill", at):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._take("hang", at):
            while True:  # alive, heartbeats from jax continue, no step progress
                time.sleep(3600)
        if self._take("sigterm", at):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._take("corrupt", at):
            corrupt_newest(self.run.file("checkpoints"))

    def poison(self, step: int) -> float:
        """Factor multiplied into the loss inside the compiled step (NaN poisons it)."""
        return float("nan") if self._take("nan", step + 1) else 1.0

    def maybe_diverge(self, step: int, params: dict) -> dict:
        if not self._take("diverge", step + 1):
            return params
        return perturb_local_replicas(params)

    def before_commit(self, step: int) -> None:
        if self._take("killsave", step):
            os.kill(os.getpid(), signal.SIGKILL)


def perturb_local_replicas(params: dict) -> dict:
    """Add noise to this process's copies of each parameter, on devices off data index 0.

    Multi-process: every local device of this process (its replica); one process: the devices
    with data coordinate > 0. The global array then has replicas that disagree.
    """

    def one(x: jax.Array) -> jax.Array:
        mesh = x.sharding.mesh
        data_pos = {d: c for c, d in np.ndenumerate(mesh.devices)}
        shards = []
        for shard in x.addressable_shards:
            val = shard.data
            coord = data_pos[shard.device][0]
            if jax.process_count() > 1 or coord > 0:
                val = val + jnp.asarray(1e-3, val.dtype)
            shards.append(jax.device_put(val, shard.device))
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

    return jax.tree.map(one, params)


def corrupt_newest(ckpt_dir: str) -> str | None:
    """Flip bytes in the middle of the largest array file of the newest committed checkpoint."""
    steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if os.path.isdir(ckpt_dir) else []
    if not steps:
        return None
    root = os.path.join(ckpt_dir, str(steps[-1]), "state")
    files = [f for f in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(f)]
    data_files = [f for f in files if "/d/" in f or os.path.basename(f).isalnum()] or files
    target = max(data_files, key=os.path.getsize)
    size = os.path.getsize(target)
    with open(target, "r+b") as f:
        f.seek(size // 2)
        chunk = bytearray(f.read(16))
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return target
