"""Fault injection: real failures at chosen steps, for tests, benchmarks and drills.

Specs (`--fault SPEC`, repeatable; `JAXPAR_FAULTS` carries the same specs `;`-separated):
KIND@S[:process=P][:permanent][:repeat][:seconds=X][:node=N]. The kinds, their grammar, where
each fires and whether it ends the incarnation are one table, jaxpar/rundir/fault_kinds.py; their
implementations are `IMPLEMENTATIONS` below, keyed by kind.

`@S` fires when the process is about to start step S (steps < S are complete and logged). A spec
fires once per run directory (its `fault_injected` event is the record); `:repeat` fires in
every incarnation. `process=P` (default 0) is the process index in the incarnation that fires.
`nan` poisons the parameters on every process (the process P logs it); `killsave` fires in
orbax's commit hook, which runs on process 0; `corrupt` first waits for an in-flight save to
commit. `losthost` fires in the lowest-numbered process of node N (nodes as the local tier counts
them: jaxpar/recovery/peer_tier.py); its workers die with their agent.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.rundir import fault_kinds, runlog
from jaxpar.rundir.runlog import WorkerEvent
from jaxpar.rundir.writer import RunDir
from jaxpar.worker import bootstrap
from jaxpar.worker.bootstrap import EXIT_NAN as EXIT_NAN  # the exit after a non-finite loss

KINDS = fault_kinds.KINDS
# Kinds every process holds: `nan` acts on every process, `losthost` picks its process by node.
EVERY_PROCESS = frozenset({"nan", "losthost"})


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
    node: int | None = None
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse one spec; ValueError (one line, naming the fix) for anything malformed."""
        usage = f"use KIND@STEP[:process=P][:permanent][:repeat][:seconds=X], KIND one of {KINDS}"
        head, *opts = text.strip().split(":")
        kind, at, step = head.partition("@")
        if kind not in KINDS or not at or not step.isdigit():
            raise ValueError(f"bad fault spec {text!r}: {usage}")
        if int(step) < 1:
            raise ValueError(f"bad fault spec {text!r}: @STEP counts steps from 1 (got {step})")
        fields: dict = {"kind": kind, "step": int(step), "text": text.strip()}
        for opt in opts:
            key, eq, val = opt.partition("=")
            if key in ("permanent", "repeat") and not eq:
                fields[key] = True
            elif key == "process" and val.isdigit():
                fields["process"] = int(val)
            elif key == "seconds" and eq and kind == "slow":
                fields["seconds"] = _seconds(text, val)
            elif key == "node" and val.isdigit():
                fields["node"] = int(val)
            else:
                raise ValueError(f"bad fault spec {text!r}: unknown option {opt!r}; {usage}")
        if fields.get("permanent") and kind != "kill":
            raise ValueError(f"bad fault spec {text!r}: only kill takes :permanent")
        if kind == "slow" and fields.get("seconds", 0) <= 0:
            raise ValueError(f"bad fault spec {text!r}: slow needs :seconds=X (X > 0)")
        if (kind == "losthost") != ("node" in fields):
            raise ValueError(f"bad fault spec {text!r}: node=N goes with losthost (and only it)")
        return cls(**fields)


def _seconds(text: str, val: str) -> float:
    try:
        seconds = float(val)
    except ValueError:
        seconds = float("nan")
    if not (0 < seconds <= 86400):  # also false for NaN
        raise ValueError(
            f"bad fault spec {text!r}: seconds={val} must be a number of seconds in (0, 86400]"
        )
    return seconds


def check_processes(specs: list[FaultSpec], nproc: int) -> None:
    """Refuse specs naming a process this job does not have (ValueError naming the range)."""
    for s in specs:
        if s.process >= nproc:
            raise ValueError(
                f"bad fault spec {s.text!r}: process={s.process} but the job has {nproc} "
                f"process(es) (0..{nproc - 1})"
            )


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
    """The faults of this process in this incarnation; the loop calls the injection points below
    (fault_kinds.POINTS), each of which runs the implementations of its kinds in table order.

    `nan` poisons the parameters on every process (each process runs its part of the same
    jitted program); the process named by `process=P` records the event. Every other kind acts
    only in process P. `killsave` fires in orbax's commit hook, which runs on process 0.
    """

    def __init__(self, specs: list[FaultSpec], run: RunDir, process_index: int):
        self.run = run
        fired = {
            e.get("spec") for e in run.events() if e.get("event") == WorkerEvent.FAULT_INJECTED
        }
        self.specs = [
            s
            for s in specs
            if (s.process == process_index or s.kind in EVERY_PROCESS)
            and (s.repeat or s.text not in fired)
        ]
        self.process = process_index
        self.fired: list[str] = []  # specs this process injected in this incarnation
        self._slow: float = 0.0
        # Set by the loop once the local tier has met the other processes: (this process's
        # node, the processes of each node, this node's local tier directory).
        self.node: tuple[int, list[list[int]], str] | None = None
        # Set by the loop's checkpointer: waits for an in-flight save (so `corrupt` sees it).
        self.wait_for_saves: Callable[[], None] | None = None
        self.wait_for_snapshot: Callable[[], None] | None = None  # this process's local tier

    def _take(self, kind: str, step: int, *, since: bool = False) -> FaultSpec | None:
        for s in self.specs:  # `since`: a spec for an earlier step fires too (a lasting state)
            if s.kind == kind and (s.step == step or (since and s.step < step)):
                self.specs.remove(s)
                self.fired.append(s.text)
                if s.process == self.process:
                    self.run.event(
                        WorkerEvent.FAULT_INJECTED, all_processes=True, kind=s.kind, spec=s.text,
                        process=self.process, step=step, permanent=s.permanent,
                    )  # fmt: skip
                return s
        return None

    def before_step(self, step: int) -> None:
        """Process-level faults at the start of `step` (0-based index of the step about to run)."""
        at = step + 1  # @S: about to start step S (1-based, as metrics.jsonl counts)
        for kind in fault_kinds.at("before_step"):
            IMPLEMENTATIONS[kind](self, at)

    def on_state(self, step: int, state: dict) -> dict:
        """The state step `step` (0-based) will run on, after the faults that change it."""
        for kind in fault_kinds.at("on_state"):
            state = IMPLEMENTATIONS[kind](self, step + 1, state)
        return state

    def before_snapshot(self, step: int) -> None:
        """The local tier's hook: snapshot `step` written, its commit marker not yet."""
        for kind in fault_kinds.at("before_snapshot"):
            IMPLEMENTATIONS[kind](self, step)

    def before_commit(self, step: int) -> None:
        """Orbax's commit hook for the save of `step`: arrays written, not yet committed."""
        for kind in fault_kinds.at("before_commit"):
            IMPLEMENTATIONS[kind](self, step)

    def before_give(self, step: int) -> None:
        """A replica group's process asked for its state at `step` (0-based), before sending."""
        for kind in fault_kinds.at("before_give"):
            IMPLEMENTATIONS[kind](self, step + 1)

    def before_average(self, step: int, tree):
        """A replica group's process computed `step`'s (0-based) gradients (`tree`), before
        sending them to the hub; the tree it sends."""
        for kind in fault_kinds.at("before_average"):
            tree = IMPLEMENTATIONS[kind](self, step + 1, tree)
        return tree

    def inside_average(self, step: int) -> None:
        """A replica group's process sent its shards of `step`'s (0-based) gradients to the hub
        and waits for the average."""
        for kind in fault_kinds.at("inside_average"):
            IMPLEMENTATIONS[kind](self, step + 1)

    def name_in(self, error: BaseException) -> None:
        """Name the injected fault(s) of this process that caused `error` in its message
        (NonFiniteLoss after nan@S, ...: fault_kinds' `raises`)."""
        kinds = fault_kinds.raised_as(type(error).__name__)
        own = [t for t in self.fired if t.partition("@")[0] in kinds]
        if own and error.args and not getattr(error, "interrupted", False):
            error.args = (f"{error.args[0]} (injected fault {', '.join(own)})", *error.args[1:])


# ---- the implementations, keyed by kind -------------------------------------------------------
# Called at the kind's injection point (fault_kinds.TABLE) with `at`, the step as the spec counts
# it: before_step, before_commit and before_snapshot as (faults, at); on_state as (faults, at,
# state) -> the state the step runs on.


def _kill(f: Faults, at: int) -> None:
    if f._take("kill", at):
        os.kill(os.getpid(), signal.SIGKILL)


def _hang(f: Faults, at: int) -> None:
    if f._take("hang", at):
        # as a real hang inside a step: this process arrived at the step (its progress
        # heartbeat says so), then makes no progress; jax's own heartbeats continue
        bootstrap.heartbeat(f.run.path, at - 1)
        while True:
            time.sleep(3600)


def _sigterm(f: Faults, at: int) -> None:
    if f._take("sigterm", at):
        os.kill(os.getpid(), signal.SIGTERM)
        _await_preemption_notice()


def _slow(f: Faults, at: int) -> None:
    # A failure at S happens as soon as step S-1 is done (before any `slow` sleep): a hang's
    # time without progress starts at its `fault_injected` event. Every step from S sleeps, also
    # in an incarnation that restored past S (with :repeat; without it the spec has fired in the
    # incarnation that reached S).
    slow = f._take("slow", at, since=True)
    if slow is not None:
        f._slow = slow.seconds
    if f._slow:
        time.sleep(f._slow)


def _losthost(f: Faults, at: int) -> None:
    node, nodes, tier_dir = f.node or (0, [[f.process]], None)
    spec = next((s for s in f.specs if s.kind == "losthost" and s.step == at), None)
    if spec is None or spec.node != node or f.process != min(nodes[node]):
        return
    f.specs.remove(spec)
    f.run.event(WorkerEvent.FAULT_INJECTED, all_processes=True, kind=spec.kind, spec=spec.text,
                process=f.process, step=at, node=node)  # fmt: skip
    if f.wait_for_snapshot is not None:
        # this process's snapshot writer could otherwise write the tier again after it is
        # deleted; bounded, in case the writer itself is stuck
        waiter = threading.Thread(target=f.wait_for_snapshot, daemon=True)
        waiter.start()
        waiter.join(timeout=60)
    lose_host(tier_dir)


def _corrupt(f: Faults, at: int) -> None:
    if any(s.kind == "corrupt" and s.step == at for s in f.specs):
        if f.wait_for_saves is not None:
            f.wait_for_saves()  # the newest checkpoint is the committed one
        f._take("corrupt", at)
        corrupt_newest(f.run.file(runlog.CHECKPOINTS))


def _diverge(f: Faults, at: int, state: dict) -> dict:
    if not f._take("diverge", at):
        return state
    state["params"] = perturb_local_replicas(state["params"])
    return state


def _nan(f: Faults, at: int, state: dict) -> dict:
    if not f._take("nan", at):
        return state
    key = "replicas" if "replicas" in state else "params"  # DiLoCo steps on per-replica copies
    state[key] = times_nan(state[key])
    return state


def _killsave(f: Faults, step: int) -> None:
    if f._take("killsave", step):
        os.kill(os.getpid(), signal.SIGKILL)


def _killsnap(f: Faults, step: int) -> None:
    if f._take("killsnap", step):
        os.kill(os.getpid(), signal.SIGKILL)


def _killgive(f: Faults, at: int) -> None:
    if f._take("killgive", at, since=True):  # the first time asked at or after S
        os.kill(os.getpid(), signal.SIGKILL)


def _nangrad(f: Faults, at: int, grads):
    if not f._take("nangrad", at, since=True):  # S or the first step after it computed here
        return grads
    return times_nan(grads)  # the loss, computed before, stays finite


def _killavg(f: Faults, at: int) -> None:
    if f._take("killavg", at):
        time.sleep(0.2)  # the hub has read the shards: the average waits with them
        os.kill(os.getpid(), signal.SIGKILL)


IMPLEMENTATIONS: dict[str, Callable] = {
    "kill": _kill, "hang": _hang, "sigterm": _sigterm, "slow": _slow, "losthost": _losthost,
    "corrupt": _corrupt, "diverge": _diverge, "nan": _nan, "killsave": _killsave,
    "killsnap": _killsnap, "killgive": _killgive, "nangrad": _nangrad, "killavg": _killavg,
}  # fmt: skip


def lose_host(tier_dir: str | None) -> None:
    """What losing this host does to a job: its RAM (the local tier) is gone, and so are its
    agent and every worker on it (they die with the agent: PR_SET_PDEATHSIG)."""
    if tier_dir:
        shutil.rmtree(tier_dir, ignore_errors=True)
    agent = os.environ.get("JAXPAR_SUPERVISOR_PID")
    if agent and agent.isdigit() and int(agent) != os.getpid():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(agent), signal.SIGKILL)
        time.sleep(0.5)  # the siblings' writers may still have been mid-write
        if tier_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGKILL)


def times_nan(tree: dict) -> dict:
    """Every floating leaf of `tree` multiplied by NaN, by a separately jitted program (donated;
    each leaf keeps its sharding), so that the step after it has a non-finite loss and gradients
    on every process. Compiled only when a `nan` fault fires; no collective."""
    shardings = jax.tree.map(lambda x: x.sharding, tree)

    def poison(t):
        nan = lambda x: x * jnp.asarray(jnp.nan, x.dtype)  # noqa: E731
        return jax.tree.map(lambda x: nan(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)

    return jax.jit(poison, out_shardings=shardings, donate_argnums=0)(tree)


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
                # On the host: jax's eager ops would compile each op for each device and shape.
                host = np.asarray(val)
                bumped = host * host.dtype.type(1 + 1e-3)  # a relative nudge...
                val = np.where(bumped == host, np.nextafter(host, host.dtype.type(np.inf)),
                               bumped)  # ...or 1 ulp  # fmt: skip
            shards.append(jax.device_put(val, shard.device))
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

    return jax.tree.map(one, params)


def newest_committed(ckpt_dir: str) -> str | None:
    """Path of the newest committed step folder under `ckpt_dir`, or None."""
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    return os.path.join(ckpt_dir, str(steps[-1])) if steps else None


def array_data_files(step_dir: str) -> list[str]:
    """The files holding array chunks of a step's `state` item (orbax OCDBT layout:
    state/ocdbt.process_<i>/d/<hash>, one per writing process and flush), largest first."""
    pattern = os.path.join(glob.escape(step_dir), "state", "ocdbt.process_*", "d", "*")
    files = [f for f in glob.glob(pattern) if os.path.isfile(f)]
    if not files:  # another layout: any file under state/d
        files = glob.glob(
            os.path.join(glob.escape(step_dir), "state", "**", "d", "*"), recursive=True
        )
    return sorted(files, key=os.path.getsize, reverse=True)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def zstd_raw_blocks(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of the stored-verbatim ("raw") blocks of the zstd frames in `data`.

    Orbax compresses each array chunk into one zstd frame; chunks of float weights do not
    compress, so zstd stores them raw. A byte changed inside a raw block decodes without error
    (the frames carry no content checksum) to a different value: damage only jaxpar's checksums
    can see.
    """
    out = []
    pos = data.find(_ZSTD_MAGIC)
    while pos != -1:
        end = _parse_frame(data, pos, out)
        pos = data.find(_ZSTD_MAGIC, end if end else pos + 4)
    return out


def _parse_frame(data: bytes, pos: int, out: list) -> int | None:
    p = pos + 4
    if p >= len(data):
        return None
    fhd = data[p]
    fcs_flag, single, has_sum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    p += 1 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    p += (1 if single else 0, 2, 4, 8)[fcs_flag]
    blocks = []
    while p + 3 <= len(data):
        header = int.from_bytes(data[p : p + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        p += 3
        if kind == 3:
            return None  # reserved: not a frame after all
        if kind == 0:
            blocks.append((p, size))
        p += 1 if kind == 1 else size
        if last:
            if p + 4 * has_sum > len(data):
                return None
            if not has_sum:  # with a content checksum zstd itself would notice: skip those
                out.extend(blocks)
            return p + 4 * has_sum
    return None


def corrupt_newest(ckpt_dir: str, mode: str = "flip") -> str | None:
    """Damage an array file of the newest committed checkpoint; returns the file.

    mode "flip": invert one byte inside the largest raw zstd block of the largest array file
    (size unchanged; no decoder notices), or in the file's middle if it has no raw block.
    mode "truncate": cut the largest array file to half its size.
    """
    step_dir = newest_committed(ckpt_dir)
    files = array_data_files(step_dir) if step_dir else []
    if not files:
        return None
    if mode == "truncate":
        target = files[0]
        os.truncate(target, os.path.getsize(target) // 2)
        return target
    best = None  # (size, file, offset)
    for f in files:
        with open(f, "rb") as fh:
            for off, size in zstd_raw_blocks(fh.read()):
                if best is None or size > best[0]:
                    best = (size, f, off)
    target, where = (
        (best[1], best[2] + best[0] // 2) if best else (files[0], os.path.getsize(files[0]) // 2)
    )
    with open(target, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return target


def _await_preemption_notice(timeout_ms: int = 30_000) -> None:
    """Block until jax's coordination service holds this process's preemption notice.

    jax's SIGTERM listener looks for the signal once a second, so without this the notice may
    reach the other processes only after the last step, and the run ends without the coordinated
    save the fault is meant to cause. A no-op outside a multi-process job."""
    from jaxpar._compat import jax_distributed as distributed  # jax.distributed.initialize made

    client = distributed.global_state.client
    if client is None:
        return
    try:
        client.blocking_key_value_get("RECEIVED_PREEMPTION_NOTICE", timeout_ms)
    except jax.errors.JaxRuntimeError:  # not there in time: the loop goes on as it would have
        pass
