"""The fault kinds of `--fault KIND@S...` (jaxpar/worker/faults.py): one table, no jax.

Each row: the kind, where it fires, whether it ends the incarnation, the exception the worker
exits with when the fault causes one, the spec's grammar and what it does. Everything else is
derived from it: `faults.KINDS` (the parser, `python -m train --help`), `runlog.ENDING_FAULTS`
(the timeline's incident causes, the supervisor's failed step), the name of an injected fault in
the message of the exception it caused. The supervisor and the timeline read it without jax.

A new kind is a row here and its implementation in jaxpar/worker/faults.py (`IMPLEMENTATIONS`,
keyed by kind); tests/rundir/test_fault_kinds.py checks that the two agree.

Injection points (`at`), in the order they come at step S:

    before_step      the process arrives at step S (steps < S complete and logged), before its
                     progress heartbeat; kill, hang and sigterm fire before a `slow` sleep
    on_state         the training state, just before step S's compiled step (a function of it)
    before_commit    orbax's commit hook for the save of step S: arrays written, not committed
                     (runs on process 0)
    before_snapshot  the local tier's hook: snapshot S written, its commit marker not yet
    before_give      a replica group's process asked by the group hub for its state at step S
                     (a group rejoins from it), before it sends any of it
    before_average   a replica group's process has computed step S's gradients, before it sends
                     them to the hub (a function of them)
    inside_average   a replica group's process has sent the hub its shards of step S's
                     gradients and waits for the quorum's average

Kinds of one injection point fire in the order of the table.
"""

from __future__ import annotations

from dataclasses import dataclass

POINTS = ("before_step", "on_state", "before_commit", "before_snapshot", "before_give",
          "before_average", "inside_average")  # fmt: skip


@dataclass(frozen=True)
class FaultKind:
    name: str
    at: str  # the injection point (POINTS)
    ends: bool  # ends the incarnation: the cause of the incident it leads to
    raises: str | None  # the exception (class name) the worker exits with because of it
    usage: str  # the spec's grammar (any kind also takes :repeat)
    doc: str


TABLE: tuple[FaultKind, ...] = (
    FaultKind("kill", "before_step", True, None, "kill@S[:process=P][:permanent]",
              "SIGKILL to itself (permanent: the slot is lost for good, the job shrinks)"),
    FaultKind("hang", "before_step", True, None, "hang@S[:process=P]",
              "writes its progress heartbeat for S, then stays alive and makes no progress"),
    FaultKind("sigterm", "before_step", True, "Preempted", "sigterm@S[:process=P]",
              "preemption notice: a coordinated save, then exit 42"),
    FaultKind("slow", "before_step", False, None, "slow@S:process=P:seconds=X",
              "every step from S sleeps X seconds (an incarnation that restored past S sleeps "
              "from its first step, with :repeat)"),
    FaultKind("losthost", "before_step", True, None, "losthost@S:node=N",
              "node N is lost: its local snapshot tier is deleted, its agent (`jaxpar launch`), "
              "workers and the firing process (the lowest-numbered of node N) are SIGKILLed"),
    FaultKind("corrupt", "before_step", False, None, "corrupt@S",
              "waits for an in-flight save, then flips a byte inside an array file of the "
              "newest committed checkpoint"),
    FaultKind("diverge", "on_state", False, "ReplicaMismatch", "diverge@S[:process=P]",
              "perturbs that process's replica of the parameters (caught at the next save)"),
    FaultKind("nan", "on_state", True, "NonFiniteLoss", "nan@S",
              "multiplies the parameters by NaN just before step S on every process (process P "
              "logs it): the step's loss and gradients are non-finite, exit 44"),
    FaultKind("killsave", "before_commit", True, None, "killsave@S",
              "SIGKILL after the step-S checkpoint wrote its arrays, before its commit"),
    FaultKind("killsnap", "before_snapshot", True, None, "killsnap@S[:process=P]",
              "SIGKILL after the local snapshot of step S wrote its data, before its commit "
              "marker (a torn snapshot)"),
    FaultKind("killgive", "before_give", True, None, "killgive@S[:process=P]",
              "SIGKILL when first asked for its state at step S or later, before sending it "
              "(--groups: the donor of a rejoining group lost during the state transfer)"),
    FaultKind("nangrad", "before_average", True, None, "nangrad@S[:process=P]",
              "multiplies that process's gradients of step S (or of the first step after S it "
              "computes) by NaN once they are computed, its loss finite (--groups: the hub "
              "drops its group from the step, which restarts and rejoins from a peer)"),
    FaultKind("killavg", "inside_average", True, None, "killavg@S[:process=P]",
              "SIGKILL a moment after sending the group hub its shards of step S's gradients, "
              "before the average comes back (--groups: a member lost inside the average)"),
)  # fmt: skip

KINDS: tuple[str, ...] = tuple(k.name for k in TABLE)
BY_NAME: dict[str, FaultKind] = {k.name: k for k in TABLE}
# Injected faults that end an incarnation (slow, diverge and corrupt do not, by themselves).
ENDING: tuple[str, ...] = tuple(k.name for k in TABLE if k.ends)


def at(point: str) -> tuple[str, ...]:
    """The kinds that fire at `point`, in firing order."""
    if point not in POINTS:
        raise ValueError(f"injection point {point!r}: use one of {POINTS}")
    return tuple(k.name for k in TABLE if k.at == point)


def raised_as(exception_name: str) -> tuple[str, ...]:
    """The kinds that show up as an exception of this class name (e.g. "NonFiniteLoss")."""
    return tuple(k.name for k in TABLE if k.raises == exception_name)
