"""What `jaxpar bench survivors` measures, from a run's trace, the same way for jaxpar and torchft.

A trace is what a run left: the steps it trained (`Step`: when, which step, which replica groups
took part and how many examples they trained, and optionally each group's "life" — a PID or an
incarnation that changes when the group restarts), the PIDs of its worker slots over time
(`Restart`: a slot whose PID changed), and the benchmark's own SIGKILLs (`Kill`).

- throughput: examples trained per second within the measured window.
- healthy restarts: worker processes restarted although no kill hit their replica group (a
  process of the killed group restarted with it is the group's own restart, not counted).
- steps rewound: per failure, the most steps a surviving group trained again (its step counter
  went back to or below a step it had already trained).
- rejoin: seconds from a kill until the killed group trains a step again in its new life;
  ready to step: from the restarted group being ready (all its processes up, where the run
  records it) to that step, against the run's step time.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field

import psutil

KILL_WAIT_S = 120  # a slot being restarted: wait this long for its new process to kill


@dataclass(frozen=True)
class Step:
    t: float  # wall time the step was logged
    step: int
    groups: tuple[int, ...]  # the replica groups that trained it
    examples: float  # examples trained by those groups in it
    lives: dict[int, int] | None = field(default=None, compare=False)  # group -> PID/incarnation


@dataclass(frozen=True)
class Kill:
    t: float
    group: int
    slot: int  # the worker's index among all processes
    pid: int


@dataclass(frozen=True)
class Restart:
    t: float  # when the slot's new PID was first seen
    slot: int
    group: int


def window(steps: list[Step], start: float, seconds: float) -> list[Step]:
    return [s for s in steps if start <= s.t <= start + seconds]


def throughput(steps: list[Step], start: float, seconds: float) -> float:
    """Examples per second trained in [start, start + seconds]."""
    return sum(s.examples for s in window(steps, start, seconds)) / seconds


def restarts(samples: list[tuple[float, dict[int, int]]], per_group: int) -> list[Restart]:
    """Each slot whose PID changed between samples (time, {slot: pid}); a slot missing from a
    sample (its process not known yet) keeps its last PID."""
    last: dict[int, int] = {}
    out = []
    for t, pids in sorted(samples, key=lambda s: s[0]):
        for slot, pid in pids.items():
            if slot in last and last[slot] != pid:
                out.append(Restart(t, slot, slot // per_group))
            last[slot] = pid
    return out


def _kill_before(kills: list[Kill], t: float) -> Kill | None:
    before = [k for k in kills if k.t <= t]
    return max(before, key=lambda k: k.t) if before else None


def healthy_restarts(found: list[Restart], kills: list[Kill]) -> int:
    """Restarted processes of groups that the latest kill before the restart did not hit."""
    n = 0
    for r in found:
        k = _kill_before(kills, r.t)
        if k is None or k.group != r.group:
            n += 1
    return n


def steps_rewound(steps: list[Step], kills: list[Kill]) -> int:
    """Per kill, the most steps any surviving group trained again after it, summed over kills."""
    per_kill: dict[int, int] = {}
    for g in sorted({g for s in steps for g in s.groups}):
        newest = None
        trained = (s for s in steps if g in s.groups and s.examples > 0)  # not a discarded step
        for s in sorted(trained, key=lambda s: s.t):
            if newest is not None and s.step <= newest:
                k = _kill_before(kills, s.t)
                if k is not None and k.group != g:
                    i = kills.index(k)
                    per_kill[i] = max(per_kill.get(i, 0), newest - s.step + 1)
            newest = s.step if newest is None else max(newest, s.step)
    return sum(per_kill.values())


def rejoin_times(steps: list[Step], kills: list[Kill]) -> list[float | None]:
    """Per kill: seconds until the killed group trained a step in a new life (its life changed,
    where steps carry lives; else a step it took part in after one it sat out); None if never."""
    ordered = sorted(steps, key=lambda s: s.t)
    out: list[float | None] = []
    for k in kills:
        g = k.group
        before = [s for s in ordered if s.t <= k.t and g in s.groups and s.lives]
        life = before[-1].lives.get(g) if before else None
        sat_out = False
        found = None
        for s in ordered:
            if s.t <= k.t:
                continue
            if s.lives is not None and g in s.lives:
                if g in s.groups and (life is None or s.lives[g] != life):
                    found = s.t
                    break
            elif g not in s.groups:
                sat_out = True
            elif sat_out:
                found = s.t
                break
        out.append(None if found is None else found - k.t)
    return out


@dataclass(frozen=True)
class Ready:
    t: float  # when a restarted group's processes were all ready (before its state came)
    group: int


def ready_to_step(steps: list[Step], kills: list[Kill], readies: list[Ready]) -> list[float | None]:
    """Per kill: seconds from the killed group being ready again to its first step (None where
    either is not known)."""
    out: list[float | None] = []
    for k, rejoin in zip(kills, rejoin_times(steps, kills), strict=True):
        ready = min((r.t for r in readies if r.group == k.group and r.t > k.t), default=None)
        out.append(None if rejoin is None or ready is None else k.t + rejoin - ready)
    return out


def step_time(steps: list[Step]) -> float | None:
    """The median time between a group's consecutive steps."""
    gaps = []
    for g in sorted({g for s in steps for g in s.groups}):
        times = sorted(s.t for s in steps if g in s.groups)
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return median(gaps)


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(
    steps: list[Step],
    kills: list[Kill],
    samples: list[tuple[float, dict[int, int]]],
    per_group: int,
    start: float,
    seconds: float,
    readies: list[Ready] = (),
) -> dict:
    """The figures of one run (before throughput_kept, which needs the run without faults)."""
    rejoins = rejoin_times(steps, kills)
    after_ready = ready_to_step(steps, kills, list(readies))
    return {
        "kills": len(kills),
        "killed_groups": [k.group for k in kills],
        "throughput": throughput(steps, start, seconds),
        "steps": len(window(steps, start, seconds)),
        "healthy_restarts": healthy_restarts(restarts(samples, per_group), kills),
        "steps_rewound": steps_rewound(steps, kills),
        "rejoin_s": median(rejoins),
        "rejoins_s": rejoins,
        # the goal: a restarted group steps within one step of being ready
        "ready_to_step_s": median(after_ready),
        "ready_to_steps_s": after_ready,
        "step_s": step_time(window(steps, start, seconds)),
    }


def rate_series(steps: list[Step], start: float, seconds: float, bin_s: float) -> list[float]:
    """Examples per second in consecutive bins of `bin_s` over the window (for the plot)."""
    n = max(1, int(seconds // bin_s))
    bins = [0.0] * n
    for s in window(steps, start, seconds):
        bins[min(n - 1, int((s.t - start) // bin_s))] += s.examples
    return [b / bin_s for b in bins]


# ---- the fault schedule ----------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    return set()


def kill_random(rng: random.Random, slots: int, per_group: int, pids, root_pids) -> Kill:
    """SIGKILL the live worker of a random slot (waiting while that slot is being restarted)."""
    slot = rng.randrange(slots)
    deadline = time.time() + KILL_WAIT_S
    while time.time() < deadline:
        pid = pids().get(slot)
        live = set().union(*(_descendants(p) for p in root_pids()))
        if pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                return Kill(time.time(), slot // per_group, slot, pid)
        time.sleep(0.1)
    raise RuntimeError(f"worker slot {slot} had no live process for {KILL_WAIT_S} s")


def schedule(start: float, period: float | None, seconds: float) -> list[float]:
    """Kill times: every `period` s after `start`, inside the window of `seconds` s."""
    if not period:
        return []
    return [
        start + k * period for k in range(1, int(seconds // period) + 1) if k * period < seconds
    ]
