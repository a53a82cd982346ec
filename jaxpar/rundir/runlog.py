"""The run-log schema: a run directory's files, every event name, its writers, readers and timeline.

Everything a run leaves behind is defined here, and this module imports no jax: the supervisor,
`jaxpar report`, the goodput ledger and the benches read run directories with it. Design:
docs/design.md, "Run directory", "Events" and "The timeline".
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from jaxpar.rundir import fault_kinds

# ---- files ----------------------------------------------------------------------------------

EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
CONFIG = "config.json"
SUMMARY = "summary.json"
INCARNATION = "incarnation"
CHECKPOINTS = "checkpoints"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # in the name of a checkpoint save that never committed
COMPILED = "compiled"  # the compiled-program cache
TENSORBOARD = "tensorboard"
REPORT = "report"
HEARTBEATS = "heartbeats"
STACKS = "stacks"
LOGS = "logs"
LOCK = "lock"  # the run's owner (jaxpar/rundir/ownership.py)
LOCAL_TIER_ID = "local_tier_id"  # the run directory's identity for its local snapshots


# ---- event names ----------------------------------------------------------------------------


class WorkerEvent:
    """Written by the training processes (jaxpar.worker.training, checkpoint, faults)."""

    START = "start"  # jax.distributed up, mesh and program built; begins an incarnation
    RESTORE = "restore"  # a checkpoint was restored (step, from/to mesh)
    RESTORE_FORCED = "restore_forced"
    COMPILED = "compiled"  # the step and the tiers' programs ready everywhere (seconds, stats)
    DONE = "done"  # the loop ended (step, complete)
    PREEMPTED = "preempted"  # SIGTERM: saved at `step` and stopping (every process)
    WALL_TIME_LIMIT = "wall_time_limit"
    NONFINITE = "nonfinite"
    REPLICA_MISMATCH = "replica_mismatch"
    COMM_STATE_RESET = "comm_state_reset"
    SAVE_BEGIN = "save_begin"
    SAVE_END = "save_end"  # blocking_s: time the loop waited
    CHECKPOINT_REPLACED = "checkpoint_replaced"
    UNCOMMITTED_IGNORED = "uncommitted_ignored"
    NO_GOOD_CHECKPOINT = "no_good_checkpoint"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    FAULT_INJECTED = "fault_injected"  # kind, spec, process, step
    # the local snapshot tier (jaxpar/recovery/local_tier.py); `restore` says its `tier`
    LOCAL_TIER = "local_tier"  # every, bytes_per_process, dir, peer
    LOCAL_TIER_STATS = "local_tier_stats"  # snapshots, wait_s, write_s, max_held (per process)
    SNAPSHOT_REJECTED = "snapshot_rejected"  # a snapshot not used (step, reason or processes)
    SNAPSHOT_TORN = "snapshot_torn"  # a slot with data and no commit marker (killed mid-write)
    SNAPSHOT_ERROR = "snapshot_error"  # the writer failed: the tier is off for this incarnation
    PEER_REPLICATION_FAILED = "peer_replication_failed"
    LOCAL_FALLBACK = "local_fallback"  # snapshots existed, none usable: to, step, skipped, ...
    LOCAL_TIER_CLEANED = "local_tier_cleaned"  # stale snapshot folders removed at start

    ALL = frozenset(
        {START, RESTORE, RESTORE_FORCED, COMPILED, DONE, PREEMPTED, WALL_TIME_LIMIT, NONFINITE,
         REPLICA_MISMATCH, COMM_STATE_RESET, SAVE_BEGIN, SAVE_END, CHECKPOINT_REPLACED,
         UNCOMMITTED_IGNORED, NO_GOOD_CHECKPOINT, CHECKPOINT_CORRUPT, FAULT_INJECTED, LOCAL_TIER,
         LOCAL_TIER_STATS, SNAPSHOT_REJECTED, SNAPSHOT_TORN, SNAPSHOT_ERROR,
         PEER_REPLICATION_FAILED, LOCAL_FALLBACK, LOCAL_TIER_CLEANED}
    )  # fmt: skip


class SupervisorEvent:
    """Written by `jaxpar launch` (never by workers: they do not extend an incarnation's span)."""

    LAUNCH = "launch"
    GROUP_STARTED = "group_started"  # processes spawned for an incarnation
    FAILURE = "failure"  # a process failed (cause, process, code, step; stale_s for a hang)
    PREEMPTION = "preemption"  # a process exited after a coordinated save on SIGTERM
    SURVIVORS_STOPPED = "survivors_stopped"
    RESTART = "restart"
    SHRINK = "shrink"
    GAVE_UP = "gave_up"
    STACKS_DUMPED = "stacks_dumped"
    STRAGGLER = "straggler"
    CONTROL_REJECTED = "control_rejected"  # a multi-host control connection was refused
    ENDED = "ended"  # the job's end (status): written with summary.json
    # replica groups (`jaxpar launch --groups`): one group failed, restarted, admitted to the
    # quorum (from a peer's state or not), stopped; a step's quorum differs from the last one's
    GROUP_FAILURE = "group_failure"
    GROUP_RESTART = "group_restart"
    GROUP_JOINED = "group_joined"
    GROUP_STOPPED = "group_stopped"
    QUORUM_CHANGED = "quorum_changed"
    GROUP_STANDBY_READY = "group_standby_ready"  # a group's standby group is built and waiting

    ALL = frozenset(
        {LAUNCH, GROUP_STARTED, FAILURE, PREEMPTION, SURVIVORS_STOPPED, RESTART, SHRINK, GAVE_UP,
         STACKS_DUMPED, STRAGGLER, CONTROL_REJECTED, ENDED, GROUP_FAILURE, GROUP_RESTART,
         GROUP_JOINED, GROUP_STOPPED, QUORUM_CHANGED, GROUP_STANDBY_READY}
    )  # fmt: skip
    DETECTIONS = (FAILURE, PREEMPTION)  # the supervisor noticed an incarnation ending


# Injected faults that end an incarnation (slow, diverge and corrupt do not, by themselves):
# the `ends` column of jaxpar/rundir/fault_kinds.py.
ENDING_FAULTS = fault_kinds.ENDING

# ---- writers and readers --------------------------------------------------------------------


def _json_default(x: Any):
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-Infinity) replaced by None: strict JSON."""
    if hasattr(obj, "dtype") and hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()  # a numpy scalar
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON (no NaN/Infinity tokens: non-finite floats become null)."""
    return json.dumps(finite(obj), default=_json_default, allow_nan=False)


def append_line(path: str, obj: dict) -> None:
    """Append one JSON line with a single write (lines from several processes never interleave).

    If the file ends in a torn line (a crash or a full disk mid-write), the record starts on a
    fresh line, so the torn one is skipped by readers instead of swallowing this one."""
    data = (dumps(obj) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        written = os.write(fd, data)
        if written != len(data):  # a short write (full disk): never leave a torn record
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)", path)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    """Write JSON atomically (temp file + rename): readers never see a half-written file. On an
    error (a full disk) the temporary file is removed."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(finite(obj), indent=2, default=_json_default, allow_nan=False))
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


MAX_JSON_BYTES = 64 << 20  # a JSON file read back (a config, a meta file): larger is refused


def read_json_object(path: str, what: str = "JSON object", hint: str = "") -> dict:
    """The JSON object in `path`, a file read from a run or data directory (untrusted input).

    The file is read up to MAX_JSON_BYTES, parsed, and must hold an object (a dict). Anything
    else raises ValueError naming the file and what it should be, followed by `hint` (e.g.
    "; rerun jaxpar data prepare")."""
    try:
        with open(path, "rb") as f:
            blob = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{path}: unreadable ({e}){hint}") from None
    if len(blob) > MAX_JSON_BYTES:
        raise ValueError(f"{path}: larger than {MAX_JSON_BYTES} bytes, not a {what}{hint}")
    try:
        obj = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: unreadable ({e}){hint}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a {what} (a {type(obj).__name__}, not an object){hint}")
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: jaxpar writes strict JSON, so the line is damaged
        raise ValueError(f"non-finite number {text}")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str | bytes) -> Any:
    """json.loads, refusing what jaxpar never writes: NaN, Infinity and numbers that overflow a
    float (ValueError)."""
    return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)


def read_jsonl_counted(path: str) -> tuple[list[dict], int]:
    """(records, unreadable line count) of a JSONL file; ([], 0) if absent.

    A line that is not a JSON object (torn by a crash, binary garbage, bad UTF-8, a non-finite
    number) is skipped and counted, never fatal: the file is an append-only log shared by many
    writers."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return [], 0
    out, bad = [], 0
    for raw in blob.split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = loads_strict(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, 1e999
            bad += 1
            continue
        if isinstance(record, dict):
            out.append(record)
        else:
            bad += 1
    return out, bad


def read_jsonl(path: str) -> list[dict]:
    """All readable JSON-object lines of a JSONL file ([] if absent); see read_jsonl_counted."""
    return read_jsonl_counted(path)[0]


# Keys whose values readers do arithmetic on: a number (or null) wherever they appear.
NUMERIC_KEYS = (
    "step", "time", "incarnation", "loss", "eval_loss", "step_time_s", "tokens_per_s",
    "samples_per_s", "seconds", "blocking_s", "nproc",
)  # fmt: skip
_INT_KEYS = ("step", "incarnation", "nproc")


def well_formed(records: list[dict], required: tuple[str, ...] = ()) -> list[dict]:
    """The records whose NUMERIC_KEYS hold numbers (ints for step/incarnation/nproc) and which
    have every `required` key: a run directory is untrusted input, so a reader of a hand-edited
    or damaged file skips the lines it cannot use instead of failing on them."""

    def ok(r: dict) -> bool:
        for key in NUMERIC_KEYS:
            v = r.get(key)
            if v is None:
                if key in required:
                    return False
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not _finite(v):
                return False
            if key in _INT_KEYS and not float(v).is_integer():
                return False
        return all(k in r for k in required)

    return [r for r in records if ok(r)]


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an int past any float: 1 followed by 400 zeros
        return False


def skipped_lines(run_dir: str) -> dict[str, int]:
    """File name -> lines a reader of `read_run` skips (unreadable, or not well formed), for
    events.jsonl and metrics.jsonl; files with none are left out."""
    out = {}
    for name, required in ((EVENTS, ("event", "time")), (METRICS, ())):
        records, bad = read_jsonl_counted(os.path.join(run_dir, name))
        bad += len(records) - len(well_formed(records, required))
        if bad:
            out[name] = bad
    return out


def read_run(run_dir: str) -> tuple[list[dict], list[dict]]:
    """(events, metrics lines) of a run directory."""
    path = os.path.abspath(run_dir)
    events = well_formed(read_jsonl(os.path.join(path, EVENTS)), required=("event", "time"))
    return events, well_formed(read_jsonl(os.path.join(path, METRICS)))


def uncommitted_saves(ckpt_dir: str) -> list[str]:
    """Names in a checkpoint directory of saves that never committed (orbax's tmp folders)."""
    try:
        return sorted(n for n in os.listdir(ckpt_dir) if TMP_SUFFIX in n)
    except OSError:
        return []


def discard_uncommitted(ckpt_dir: str) -> list[str]:
    """Remove the saves that never committed (after a failed save, once nobody can still write
    them); returns the names removed. A link is removed, never followed."""
    removed = []
    for name in uncommitted_saves(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


def last_per_step(lines: list[dict], key: str = "loss") -> dict[int, dict]:
    """The last metrics line for each step (restarts re-log steps after the restored one)."""
    out: dict[int, dict] = {}
    for line in lines:
        if key in line and "step" in line:
            out[int(line["step"])] = line
    return dict(sorted(out.items()))


# ---- the timeline ---------------------------------------------------------------------------

# Where the wall-clock went: cause -> label; the order is the report's legend.
CAUSES: dict[str, str] = {
    "productive": "productive steps",
    "startup": "start-up (spawn, imports, build)",
    "restore": "restore",
    "compile": "compile",
    "checkpoint": "checkpoint (blocking)",
    "recomputed": "recomputed steps",
    "detection": "failure detection",
    "restart": "restart (teardown, relaunch, worker init)",
    "other": "other (data, eval, host)",
}
# An incident's recovery phases, in order (seconds; None where not reached).
PHASES = ("detect_s", "stop_s", "restart_s", "init_s", "restore_s", "compile_s", "first_step_s")


@dataclass
class Incarnation:
    """One start of the run: its worker events and metrics lines."""

    index: int
    start: float
    end: float = 0.0  # newest worker record
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    def first(self, name: str) -> dict | None:
        return next((e for e in self.events if e["event"] == name), None)

    def last(self, name: str) -> dict | None:
        return next((e for e in reversed(self.events) if e["event"] == name), None)

    def ending_fault(self) -> dict | None:
        kinds = [e for e in self.events if e["event"] == WorkerEvent.FAULT_INJECTED]
        return next((e for e in reversed(kinds) if e.get("kind") in ENDING_FAULTS), None)

    def phases(self) -> list[tuple[float, float, str]]:
        """start -> restore (`restore`), then -> `compiled` (`compile`): the step compiles while
        the checkpoint is read, so compile counts only what the restore did not hide. Without a
        `compiled` event the compile ends where the first step begins (else at the newest
        record): it never overlaps the steps, which are counted on their own."""
        out, t = [], self.start
        restore, compiled = self.first(WorkerEvent.RESTORE), self.first(WorkerEvent.COMPILED)
        if restore is not None:
            out.append((t, restore["time"], "restore"))
            t = restore["time"]
        if compiled is not None:
            end = compiled["time"]
        else:
            begun = [x["time"] - x.get("step_time_s", 0.0) for x in self.train]
            end = min(begun) if begun else self.end
        out.append((t, max(t, end), "compile"))
        return out


@dataclass
class Incident:
    """What ended an incarnation (or the job) and how the run resumed, with recovery phases."""

    cause: str  # short: the supervisor's classification (signal, hang, preempted, ...) or a record
    description: str  # human: "injected kill@8 (process 1, step 8)", "failure: hang of process 1"
    ended: int | None  # the incarnation that ended (None: it never wrote `start`)
    resumed: int | None  # the incarnation that resumed (None: gave up or still restarting)
    process: int | None = None
    code: int | None = None
    step: int | None = None  # as the supervisor reported it
    failed_at_step: int | None = None  # the step that did not complete
    resumed_from: int = 0  # the restored checkpoint's step (0: started over)
    restored: bool = False
    shrink: dict | None = None
    detected: bool = False  # a supervisor `failure`/`preemption` event marks it
    phases: dict[str, float | None] = field(default_factory=dict)
    recovery_s: float | None = None  # first step of the resumed incarnation - the cause
    lost_steps: int = 0
    lost_step_time_s: float = 0.0

    @property
    def extension(self) -> bool:
        """A finished run continued to more steps (`--steps` raised): no failure, no restart."""
        return self.cause == "extension"

    def ledger(self) -> dict[str, Any]:
        """The summary.json form (jaxpar launch's incidents)."""
        return {
            "cause": self.cause, "process": self.process, "code": self.code, "step": self.step,
            "incarnation": self.ended, "cause_from": self.description, **self.phases,
            "recovery_s": self.recovery_s, "lost_steps": self.lost_steps,
            "lost_step_time_s": self.lost_step_time_s,
        }  # fmt: skip


@dataclass
class Timeline:
    incarnations: list[Incarnation]
    incidents: list[Incident]
    intervals: list[tuple[int, float, float, str]]  # (row, t0, t1, cause); t relative to t0
    totals: dict[str, float]  # seconds per CAUSES key; they add up to wall_s
    wall_s: float  # launch (or the first start) -> newest record, idle gaps excluded
    t0: float
    status: str  # completed | gave_up | preempted | failed | ... | in progress
    status_detail: str  # the give-up reason, or how long ago the newest record was written
    per_step: dict[int, dict]

    @property
    def goodput(self) -> float | None:
        return self.totals["productive"] / self.wall_s if self.wall_s > 0 else None

    @property
    def mttr_s(self) -> float | None:
        rec = [i.recovery_s for i in self.incidents if i.recovery_s is not None]
        return statistics.fmean(rec) if rec else None

    def ledger(self) -> list[dict]:
        """The supervisor-detected incidents in summary.json's form."""
        return [i.ledger() for i in self.incidents if i.detected]


def _incarnations(events: list[dict], lines: list[dict]) -> list[Incarnation]:
    incs: dict[int, Incarnation] = {}
    for e in events:
        if e.get("event") == WorkerEvent.START and e.get("incarnation", 0) not in incs:
            incs[e.get("incarnation", 0)] = Incarnation(e.get("incarnation", 0), e["time"])
    for line in lines:  # lines of an incarnation whose start event is missing (older writers)
        k = line.get("incarnation", 0)
        if k not in incs and "time" in line:
            incs[k] = Incarnation(k, line["time"] - line.get("step_time_s", 0.0))
    for e in events:
        inc = incs.get(e.get("incarnation", 0))
        if inc is not None and e.get("event") not in SupervisorEvent.ALL:
            inc.events.append(e)
            inc.end = max(inc.end, e["time"])
    for line in lines:
        inc = incs.get(line.get("incarnation", 0))
        if inc is None:
            continue
        if "loss" in line:
            inc.train.append(line)
        elif "eval_loss" in line:
            inc.evals.append(line)
        inc.end = max(inc.end, line.get("time", inc.start))
    for inc in incs.values():
        inc.end = max(inc.end, inc.start)
    return [incs[k] for k in sorted(incs)]


def _first(events: list[dict], name: str, t: float | None, until: float | None) -> dict | None:
    if t is None:
        return None
    return next(
        (e for e in events
         if e.get("event") == name and e["time"] >= t and (until is None or e["time"] < until)),
        None,
    )  # fmt: skip


def _gap(later: dict | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later["time"] - earlier


def _owner(incs: list[Incarnation], t: float) -> Incarnation | None:
    """The newest incarnation started at or before `t`."""
    return next((i for i in reversed(incs) if i.start <= t), None)


def _cause(prev: Incarnation | None, det: dict | None, since: float) -> tuple[float | None, str]:
    """When an incarnation's end began, and a description: the injected fault that ended it,
    else the supervisor's detection (minus a hang's stale time), else a worker's own record."""
    fault = prev.ending_fault() if prev is not None else None
    if fault is not None and (det is None or since <= fault["time"] <= det["time"]):
        where = f"process {fault.get('process', 0)}, step {fault.get('step')}"
        return fault["time"], f"injected {fault.get('spec', fault.get('kind'))} ({where})"
    if det is not None:
        what = f"{det.get('cause', det['event'])} of process {det.get('process', '?')}"
        if det.get("code") is not None:
            what += f" (code {det['code']})"
        return det["time"] - det.get("stale_s", 0.0), f"{det['event']}: {what}"
    for name in (
        WorkerEvent.PREEMPTED,
        WorkerEvent.NONFINITE,
        WorkerEvent.REPLICA_MISMATCH,
        WorkerEvent.WALL_TIME_LIMIT,
    ):
        e = prev.last(name) if prev is not None else None
        if e:
            return e["time"], f"{name} at step {e.get('step')}"
    if prev is not None and prev.last(WorkerEvent.DONE):
        return None, "rerun after a finished run"
    return None, "rerun (no failure recorded)"


def _superseded(lines: list[dict], per_step: dict[int, dict]) -> set[int]:
    winners = {id(v) for v in per_step.values()}
    return {id(m) for m in lines if "loss" in m and id(m) not in winners}


def _incidents(
    incs: list[Incarnation], events: list[dict], lines: list[dict], per_step: dict
) -> list[Incident]:
    """One incident per supervisor detection, plus one per restart no detection explains."""
    dets = [e for e in events if e.get("event") in SupervisorEvent.DETECTIONS]
    shrinks = [e for e in events if e.get("event") == SupervisorEvent.SHRINK]
    lost_ids = _superseded(lines, per_step)
    steps = [m for m in lines if "loss" in m and "time" in m]
    out: list[Incident] = []
    explained: set[int] = set()
    prev_t = events[0]["time"] if events else 0.0
    for k, det in enumerate(dets):
        until = dets[k + 1]["time"] if k + 1 < len(dets) else None
        prev = _owner(incs, det["time"])
        group = _first(events, SupervisorEvent.GROUP_STARTED, det["time"], until)
        nxt = next((i for i in incs if i.start >= det["time"]
                    and (until is None or i.start < until)), None)  # fmt: skip
        inc = _incident(prev, nxt, det, prev_t, shrinks, steps)
        stopped = _first(events, SupervisorEvent.SURVIVORS_STOPPED, det["time"], until)
        t_cause = det["time"] - inc.phases.get("detect_s", 0.0)
        start = {"time": nxt.start} if nxt else None
        restore = nxt.first(WorkerEvent.RESTORE) if nxt else None
        compiled = nxt.first(WorkerEvent.COMPILED) if nxt else None
        first = _first_step(steps, nxt)
        inc.phases = {
            "detect_s": det["time"] - t_cause,
            "stop_s": _gap(stopped, det["time"]),
            "restart_s": _gap(group, stopped["time"] if stopped else det["time"]),
            "init_s": _gap(start, group["time"] if group else None),
            "restore_s": _gap(restore, nxt.start if nxt else None),
            "compile_s": _gap(compiled, (restore or start or {}).get("time")),
            "first_step_s": _gap(first, compiled["time"] if compiled else None),
        }
        lost = [m for m in lines if id(m) in lost_ids and prev_t <= m["time"] <= det["time"]]
        inc.lost_steps = len(lost)
        inc.lost_step_time_s = float(sum(m.get("step_time_s", 0.0) for m in lost))
        out.append(inc)
        if nxt is not None:
            explained.add(nxt.index)
        prev_t = det["time"]
    for prev, nxt in zip(incs, incs[1:], strict=False):  # restarts without a supervisor
        if nxt.index not in explained:
            out.append(_incident(prev, nxt, None, prev.start, shrinks, steps))
    return sorted(out, key=lambda i: (i.resumed is None, i.resumed or 0, i.ended or 0))


def _first_step(steps: list[dict], nxt: Incarnation | None) -> dict | None:
    """The first step line logged after `nxt` started (its incarnation's first step)."""
    if nxt is None:
        return None
    return next(
        (m for m in steps
         if m["time"] >= nxt.start and m.get("incarnation", nxt.index) == nxt.index),
        None,
    )  # fmt: skip


def _incident(
    prev: Incarnation | None,
    nxt: Incarnation | None,
    det: dict | None,
    since: float,
    shrinks: list[dict],
    steps: list[dict],
) -> Incident:
    t_cause, description = _cause(prev, det, since)
    fault = prev.ending_fault() if prev is not None else None
    done = [int(x["step"]) for x in prev.train] if prev is not None else []
    if det is not None:
        cause = (
            det.get("cause", "preempted")
            if det["event"] == SupervisorEvent.FAILURE
            else "preempted"
        )
    else:
        cause = description.split(" ")[0].removesuffix(":")
    finished = prev.last(WorkerEvent.DONE) if prev is not None and det is None else None
    if finished is not None and finished.get("complete", True) and not fault and nxt is not None:
        at = finished.get("step")
        beyond = [int(x["step"]) for x in nxt.train if type(at) is int and x["step"] > at]
        if beyond:  # it trained past the step the run had finished at: a longer run, no restart
            cause = "extension"
            description = f"extension of the run finished at step {at} (to step {max(beyond)})"
    inc = Incident(
        cause=cause,
        description=description,
        ended=prev.index if prev is not None else None,
        resumed=nxt.index if nxt is not None else None,
        process=det.get("process") if det else None,
        code=det.get("code") if det else None,
        step=det.get("step") if det else None,
        failed_at_step=(
            fault.get("step") if fault else max(done) + 1 if done and cause != "extension" else None
        ),
        detected=det is not None,
    )
    if det is not None and t_cause is not None:
        inc.phases["detect_s"] = det["time"] - t_cause
    if nxt is not None:
        restore = nxt.first(WorkerEvent.RESTORE)
        inc.restored = restore is not None
        inc.resumed_from = int(restore["step"]) if restore else 0
        lo = prev.start if prev is not None else since
        inc.shrink = next((s for s in shrinks if lo <= s["time"] <= nxt.start), None)
        first = _first_step(steps, nxt)
        if first is not None and t_cause is not None:
            inc.recovery_s = first["time"] - t_cause
    return inc


def _accounting(incs: list[Incarnation], per_step: dict, events: list[dict]):
    """Intervals and seconds per cause; they add up to the wall-clock.

    A launched run begins with start-up from the supervisor's `launch` to the first `start`.
    Each incarnation runs from its `start` to its newest worker record; within it:
      restore     `start` -> `restore` (when it restored a checkpoint)
      compile     -> `compiled` (the step compiles while the checkpoint is read: the part of the
                  compile the restore did not hide; without a restore, mesh and init overlap it)
      productive  step_time_s of the metrics line that is last for its step
      recomputed  step_time_s of lines a later incarnation logged again (work lost)
      checkpoint  blocking_s of each `save_end`
      other       the rest: input pipeline, evaluation, host work between steps
    Between incarnations: `detection` (newest record of the failed incarnation -> the
    supervisor's `failure` or `preemption`) and `restart` (-> the next `start`: teardown,
    relaunch, imports, jax.distributed). After a clean `done` the gap is idle and counts nowhere
    (a new `launch` in it starts a new start-up). After the last record, the supervisor's
    teardown up to its `ended` event counts as other. Goodput = productive / wall-clock.
    """
    winners = {id(v) for v in per_step.values()}
    dets = [e for e in events if e.get("event") in SupervisorEvent.DETECTIONS]
    launches = [e for e in events if e.get("event") == SupervisorEvent.LAUNCH]
    ends = [e for e in events if e.get("event") == SupervisorEvent.ENDED]
    intervals: list[tuple[int, float, float, str]] = []
    other = 0.0  # within incarnations: drawn as their background, not as intervals
    t0 = min([incs[0].start] + [e["time"] for e in launches[:1]])

    def add(row: int, a: float, b: float, cause: str) -> None:
        intervals.append((row, a - t0, max(a, b) - t0, cause))

    def teardown(inc: Incarnation, until: float) -> bool:
        """After `inc`, the supervisor's detection and teardown up to a job's `ended`."""
        end = next((e["time"] for e in ends if inc.end < e["time"] <= until), None)
        if end is None:
            return False
        det = next((d["time"] for d in dets if inc.start <= d["time"] <= end), None)
        if det is not None and det > inc.end:
            add(inc.index, inc.end, det, "detection")
        add(inc.index, max(inc.end, det or inc.end), end, "other")
        return True

    for i, inc in enumerate(incs):
        prev = incs[i - 1] if i else None
        ended = prev is not None and teardown(prev, inc.start)  # then idle until a new launch
        idle = prev is None or ended or (prev.last(WorkerEvent.DONE) and not prev.ending_fault())
        if idle:  # the first start, or one after a clean end or a job's end: start-up from launch
            lo = prev.end if prev else -float("inf")
            launch = next((e for e in launches if lo <= e["time"] <= inc.start), None)
            if launch is not None:
                add(inc.index, launch["time"], inc.start, "startup")
        else:
            det = next((d["time"] for d in dets if prev.start <= d["time"] < inc.start), None)
            if det is not None and det > prev.end:
                add(prev.index, prev.end, det, "detection")
            add(prev.index, max(prev.end, det or prev.end), inc.start, "restart")
        own = [(a, b, c) for a, b, c in inc.phases()]
        own += [
            (x["time"] - x.get("step_time_s", 0.0), x["time"],
             "productive" if id(x) in winners else "recomputed")
            for x in inc.train
        ]  # fmt: skip
        own += [(e["time"] - e["blocking_s"], e["time"], "checkpoint")
                for e in inc.events if e["event"] == WorkerEvent.SAVE_END and e.get("blocking_s")]  # fmt: skip
        for a, b, c in own:
            add(inc.index, a, b, c)
        other += max(0.0, inc.end - inc.start - sum(max(0.0, b - a) for a, b, _ in own))
    teardown(incs[-1], float("inf"))
    totals = dict.fromkeys(CAUSES, 0.0)
    totals["other"] = other
    for _, a, b, c in intervals:
        totals[c] += b - a
    return intervals, totals, sum(totals.values()), t0


def _status(incs: list[Incarnation], events: list[dict]) -> tuple[str, str]:
    last_inc = incs[-1]
    ended = [
        e for e in events if e.get("event") == SupervisorEvent.ENDED and e["time"] >= last_inc.start
    ]
    gave_up = [
        e
        for e in events
        if e.get("event") == SupervisorEvent.GAVE_UP and e["time"] >= last_inc.start
    ]
    if ended:
        why = gave_up[-1].get("reason", "") if gave_up else ""
        return ended[-1].get("status", "?"), why
    if gave_up:
        return SupervisorEvent.GAVE_UP, gave_up[-1].get("reason", "?")
    done = last_inc.last(WorkerEvent.DONE)
    if done and done.get("complete", True):
        return "completed", ""
    if last_inc.last(WorkerEvent.PREEMPTED):
        return "preempted", ""
    age = time.time() - last_inc.end
    return "in progress", f"or stopped without finishing (newest record {age:.0f} s ago)"


def timeline(events: list[dict], lines: list[dict]) -> Timeline:
    """The run's incident timeline; ValueError if there is nothing to build it from."""
    incs = _incarnations(events, lines)
    if not incs:
        raise ValueError("events.jsonl has no start event and there are no metrics")
    per_step = last_per_step(lines, "loss")
    intervals, totals, wall, t0 = _accounting(incs, per_step, events)
    status, detail = _status(incs, events)
    return Timeline(
        incarnations=incs,
        incidents=_incidents(incs, events, lines, per_step),
        intervals=intervals,
        totals=totals,
        wall_s=wall,
        t0=t0,
        status=status,
        status_detail=detail,
        per_step=per_step,
    )


def of(run_dir: str) -> Timeline:
    """The timeline of a run directory."""
    return timeline(*read_run(run_dir))
