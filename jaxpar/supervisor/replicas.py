"""`jaxpar launch --groups R`: replica groups whose survivors keep training.

The --nproc processes run as R groups of P = nproc / R, each its own jax.distributed world
(its own coordinator) with its own mesh. Across groups the training is data parallel: every
step each process sends its gradient shards to the leader's group hub (`Hub`, a thread of this
supervisor), which averages process k's shards over the step's quorum and sends the mean back.

Who decides: the hub, in the leader's supervisor. The quorum of step s is every group that is
alive (the supervisor learns of an exit at once, by pidfd; the hub of a closed connection) and
has joined at or before s. A step is released only once every process of the quorum has sent
its shards, and to all of them at once, so every process of a group applies the same quorum.
A group that dies while a step is pending leaves the quorum and the step is released over the
rest with the gradients already held: the survivors lose no step. With fewer than --min-groups
groups in the quorum the hub holds the step until enough groups are back (no group trains
alone). A failed group alone is stopped and restarted; once ready it asks to join, the hub
asks the quorum's lowest group for its state of the step it computes and forwards it, shard to
shard and checksummed, and the group takes part from that step on. A hung group is dropped
once the others have waited the hang timeout for its shards; a quorum hung as a whole (no
shards at all) once no step has been released for the hang timeout. With every group lost the
restarted groups start from the newest checkpoint, as a new job would.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shlex
import signal
import socket
import threading
import time
from typing import Any

from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import SupervisorEvent, write_json
from jaxpar.supervisor.admission import MAX_PENDING, MAX_PER_SOURCE, Gate, Pending, Refusals
from jaxpar.supervisor.channel import printable, token
from jaxpar.supervisor.group_hosts import RemoteGroup, RemoteHost, group_key
from jaxpar.supervisor.incarnation import say_log_tail
from jaxpar.supervisor.job import JobState
from jaxpar.supervisor.monitor import EventTail
from jaxpar.supervisor.options import Options, cannot_write, free_port, join_address, say
from jaxpar.supervisor.policy import exit_text, root_exit
from jaxpar.supervisor.replica_group import ReplicaGroup
from jaxpar.supervisor.transport import Rendezvous
from jaxpar.worker import bootstrap, group_layout, group_wire
from jaxpar.worker.group_exchange import EXTRA
from jaxpar.worker.group_layout import Layout
from jaxpar.worker.group_wire import Outbox, WireError

GROUP_FAILURE = SupervisorEvent.GROUP_FAILURE
GROUP_RESTART = SupervisorEvent.GROUP_RESTART
GROUP_JOINED = SupervisorEvent.GROUP_JOINED
GROUP_STOPPED = SupervisorEvent.GROUP_STOPPED
QUORUM = SupervisorEvent.QUORUM_CHANGED
# a group whose gradient norm is more than this many times the median of the other groups'
# (3 groups or more) is dropped from the step, as one with non-finite values is
NORM_FACTOR = 100.0
# a group whose hub connection closed is given this long for its processes' exits to be seen
# (a process that dies closes its connection first): an exit names the cause, not the connection
LOST_GRACE_S = 2.0


def default_min_groups(groups: int) -> int:
    """More than half of the groups: two partitions can never both train."""
    return groups // 2 + 1


def check_groups(opts: Options) -> None:
    """ValueError (one line naming the fix) for --groups / --min-groups the job cannot run."""
    r = opts.groups
    if r < 1:
        raise ValueError(f"--groups {r} must be >= 1")
    if r == 1:
        if opts.min_groups != 1:
            raise ValueError(f"--min-groups {opts.min_groups} without --groups; give --groups R")
        return
    n = opts.nnodes
    if r % n:
        raise ValueError(f"--groups {r} is not a multiple of --nnodes {n} (each host runs whole "
                         f"groups); give a multiple of {n}")  # fmt: skip
    if opts.nproc % (r // n):
        per = "" if n == 1 else f" (per host) by the {r // n} groups per host"
        raise ValueError(f"--nproc {opts.nproc} is not divisible by --groups {r}{per}; give a "
                         f"multiple")  # fmt: skip
    if not 1 <= opts.min_groups <= r:
        raise ValueError(f"--min-groups {opts.min_groups} must be in [1, --groups {r}]")


# ---- the hub: quorum, average, state transfer ----------------------------------------------------


class Hub:
    """The leader's group hub: one listening socket, one reader thread per worker connection."""

    def __init__(self, bind: str, key: bytes, groups: int, per_group: int, min_groups: int,
                 event, on_drop, advertise: str | None = None,
                 handshake_s: float | None = None) -> None:  # fmt: skip
        self.key, self.groups, self.per_group, self.min_groups = key, groups, per_group, min_groups
        self.event, self.on_drop = event, on_drop
        self.cv = threading.Condition()
        # each worker's connection: frames to it are queued, never sent under the lock
        self.wires: dict[tuple[int, int], Outbox] = {}
        self.ready: dict[int, dict[int, int]] = {}  # group -> rank -> step it is ready at
        self.alive: set[int] = set()  # groups the supervisor runs now
        self.joined: dict[int, int] = {}  # group -> first step it takes part in
        # step -> (group, rank) -> (the layout of its shards, the shards)
        self.pending: dict[int, dict[tuple[int, int], tuple[Layout, list]]] = {}
        # (group, rank) -> the shards of the state it holds (from its ready): what it is sent
        self.layouts: dict[tuple[int, int], Layout] = {}
        # groups that average only at DiLoCo's outer steps: asked for their state at one
        self.outer_only: set[int] = set()
        self.model: tuple | None = None  # the state's leaves (shapes, dtypes): every group's
        self.fatal: str | None = None  # a group that can never take part: the job ends
        self.first_seen: dict[int, float] = {}  # step -> when its first shards arrived
        # DiLoCo: a joining group's processes that take a step's mean without giving one
        self.listeners: dict[int, dict[tuple[int, int], Layout]] = {}
        # joining group -> {"donor", "step", "asked", "got": rank -> the donor's shards, "sent"}
        self.transfers: dict[int, dict] = {}
        self.started = False  # a step has been released
        self.next_step: int | None = None  # the first step not released yet
        self.void: list[int] = []  # joining groups whose donor was lost: to be restarted
        self.last_quorum: list[int] | None = None
        # when the job last made progress (a step released, a group admitted at the start) and
        # the recent times between releases: the clock of the rule for a quorum hung as a whole
        self.progress_at: float | None = None
        self.intervals: list[float] = []
        self.all_lost = False  # every group was lost: the next start resumes from a checkpoint
        self.released = 0
        self.group_steps_lost = 0
        self.finished: set[int] = set()
        # group -> what its average's leaves are, in order ([(name, leaves)]: loss, metrics,
        # gradients), as its processes said: for naming what was not finite
        self.names: dict[int, list[tuple[str, int]]] = {}
        # group -> why the hub dropped it from a step (its contribution was checked): the
        # supervisor's reason for its restart
        self.causes: dict[int, str] = {}
        # the peer-to-peer average (jaxpar/worker/group_exchange.py): each process's store
        # address from its ready, or why its group has no engine
        self.p2p: dict[tuple[int, int], str] = {}
        self.p2p_missing: dict[int, str] = {}
        self.exchanges: dict[int, dict] = {}  # step -> the exchange under way for it
        # step -> (group, why) of a process that sent its shards unasked (no engine there)
        self.why_hub: dict[int, tuple[int, str]] = {}
        self.comm: dict | None = None  # the communicators in force: quorum, epoch, prefix
        self.epoch = 0
        self.hang_s = 60.0  # what an exchange's members wait for each other (the hang timeout)
        self.said_path: str | None = None
        # what passed through the hub: gradients (steps averaged here) and states (transfers)
        self.gradient_bytes = 0
        self.state_bytes = 0
        self.p2p_steps = 0
        self.sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        self.sock.bind((bind, 0))
        self.sock.listen(64)
        # what the workers connect to: the leader's address others reach (several hosts)
        self.address = join_address(advertise or bind, self.sock.getsockname()[1])
        self.closed = False
        self.stopping = False  # the job is being stopped (a preemption): exits are no failures
        # every worker connects from its host's address, all of them at a start: the gate's
        # bounds leave room for all the job's workers at once
        members = groups * per_group
        self.refusals = Refusals(event, what="group hub connection", fields={"server": "hub"})
        deadline_s = handshake_s or group_wire.HANDSHAKE_S
        self.gate = Gate(self.sock, self._serve, deadline_s=deadline_s, refusals=self.refusals,
                         max_pending=max(MAX_PENDING, 2 * members),
                         max_per_source=max(MAX_PER_SOURCE, members), name="jaxpar-hub")  # fmt: skip

    # -- connections ----------------------------------------------------------------------------

    def _serve(self, slot: Pending) -> None:
        """One worker connection (its own thread, admitted by the gate): the handshake, then
        every frame it sends. An error before it proves the group key refuses the connection
        (the gate records it); any error after it drops that worker's group."""
        hello, wire = group_wire.server_handshake(slot.sock, self.key, slot.deadline,
                                                  proven=lambda: self.gate.admitted(slot))  # fmt: skip
        g, k = int(hello.get("group", -1)), int(hello.get("rank", -1))
        if not (0 <= g < self.groups and 0 <= k < self.per_group):
            raise WireError(f"a worker of group {g} rank {k}, outside the job")
        who = (g, k)
        with self.cv:
            if g not in self.alive:
                raise WireError(f"group {g} is not running")
            wire.limit = self._frame_limit()
            box = self.wires[who] = Outbox(wire, name=f"jaxpar-hub-to-{g}.{k}")
        try:
            while True:
                header, arrays = wire.recv()
                with self.cv:
                    if self.wires.get(who) is not box:  # dropped: what it still sends is stale
                        return
                    self._handle(who, header, arrays)
        except Exception as e:  # noqa: BLE001 - a bad frame of any kind ends this connection only
            with self.cv:
                # a group dropped already (its wires gone, perhaps restarted since) or finished
                box = self.wires.get(who)
                current = box is not None and box.wire is wire
                if not current or g in self.finished:
                    wire.close()
                    return
                err = printable(e) or type(e).__name__
                why = f"connection of group {g} process {k} lost ({err})"
                self._drop(g, why, record=not self.stopping)  # a preempted group: no failure
            self.on_drop(g)

    def _frame_limit(self) -> int:
        """The largest frame a worker may send (under self.cv): before the job's state is known
        none carries arrays (a `ready` names its leaves only); after, twice the state's bytes
        (gradients of another dtype) and 1 MiB of metrics."""
        if self.model is None:
            return group_wire.READY_PAYLOAD
        return group_wire.carried(group_layout.nbytes(*self.model))

    def _send(self, who: tuple[int, int], header: dict, arrays: list = ()) -> None:
        box = self.wires.get(who)
        if box is not None:
            box.put(header, arrays)  # a failed send: its reader sees the connection go

    # -- messages (under self.cv) ---------------------------------------------------------------

    def _handle(self, who: tuple[int, int], header: dict, arrays: list) -> None:
        g, k = who
        kind = header.get("kind")
        if kind == "ready":
            self.layouts[who] = group_layout.parse(header, arrays)
            if header.get("sync_every"):
                self.outer_only.add(g)
            self.ready.setdefault(g, {})[k] = int(header.get("step", -1))
            store = header.get("p2p")
            if isinstance(store, str) and 0 < len(store) <= 300 and ":" in store:
                self.p2p[who] = store
                self.p2p_missing.pop(g, None)
            else:
                self.p2p.pop(who, None)
                self.p2p_missing[g] = printable(str(header.get("p2p_missing", "no engine")), 300)
            self._admit(g)
        elif kind == "average":
            step = int(header.get("step", -1))
            layout = group_layout.parse(header, arrays)
            self._name_parts(g, header.get("parts"), len(layout.shapes))
            self.gradient_bytes += sum(a.nbytes for a in arrays)
            why = header.get("p2p_missing")  # it has the engine, but not for these leaves
            why = why if isinstance(why, str) else None if who in self.p2p else \
                self.p2p_missing.get(g, "no engine")  # fmt: skip
            if why is not None and g in self.joined:  # said when the step goes through here
                self.why_hub.setdefault(step, (g, printable(why, 300)))
            if g in self.joined and step >= self.joined[g]:
                self.pending.setdefault(step, {})[who] = (layout, arrays)
                self.first_seen.setdefault(step, time.time())
                self._ask_state(who, step)
                self._release(step)
        elif kind == "report":  # peer to peer: what the screen reads, no arrays
            step = int(header.get("step", -1))
            report = self._report(g, header, arrays)
            if g in self.joined and step >= self.joined[g]:
                self.pending.setdefault(step, {})[who] = report
                self.first_seen.setdefault(step, time.time())
                self._ask_state(who, step)
                self._release(step)
        elif kind == "reduced":
            self._reduced(who, header)
        elif kind == "state":
            self.state_bytes += sum(a.nbytes for a in arrays)
            self._forward_state(who, header, arrays)
        elif kind == "state_sent":
            self._state_sent(who, header)
        elif kind == "listen":  # DiLoCo: the donor's replicas are this group's; not counted
            step = int(header.get("step", -1))
            if self.joined.get(g) != step:
                raise WireError(f"group {g} listens to step {step}, not its first")
            self.listeners.setdefault(step, {})[who] = group_layout.parse(header, arrays)
            if all((g, r) in self.listeners[step] for r in range(self.per_group)):
                self.joined[g] = step + 1
                self._release(step)
        elif kind == "bye":
            self.finished.add(g)
        else:
            raise WireError(f"unknown message {str(kind)[:40]}")

    def _admit(self, g: int) -> None:
        """Group `g` is ready when all its processes are: at the job's start it takes part at
        once (every group starts from the same state); later it waits for a live group's."""
        steps = set(self.ready.get(g, {}).values())
        if len(self.ready.get(g, {})) < self.per_group:
            return
        if len(steps) != 1:
            self._drop(g, f"the processes of group {g} are at different steps {sorted(steps)}")
            return
        (step,) = steps
        if not self._same_model(g):
            return
        if not any(g2 in self.alive for g2 in self.joined):
            # every group was lost: start again from the checkpoint they read; what the lost
            # groups left of their steps (their times above all) must not count against these
            self.all_lost = self.started or self.next_step is not None
            self.started, self.next_step = False, None
            self.pending.clear()
            self.first_seen.clear()
            self.listeners.clear()
            self.exchanges.clear()
            self.why_hub.clear()
            self.comm = None
        if not self.started and self.next_step in (None, step):
            self.next_step = step
            self.joined[g] = step
            self.progress_at = time.time()
            for k in range(self.per_group):  # the job's start: every group that runs takes part
                self._send((g, k), {"kind": "start", "step": step, "quorum": sorted(self.alive)})
            extra = {"all_lost": True} if self.all_lost else {}  # its own restore, no peer's
            self.event(GROUP_JOINED, group=g, step=step, transfer=False, **extra)
            for s in sorted(self.pending):
                self._release(s)
            return
        # a live group's state at its next step not released yet, which this group computes
        # with the others: the donor (the lowest live group) sends it as it computes that step
        # (with DiLoCo: as it waits in its next outer step)
        q = self._quorum(self.next_step) if self.next_step is not None else []
        if not q:
            self._drop(g, f"no live group to give group {g} its state")
            self.void.append(g)
            return
        self.transfers[g] = {"donor": q[0], "step": None, "asked": set(), "got": {},
                             "sent": set(), "t": time.time(), "resharded": False,
                             "p2p": False}  # fmt: skip
        if q[0] not in self.outer_only:
            for k in range(self.per_group):
                self._ask_state((q[0], k), self.next_step)
        for s in sorted(self.pending):
            for k in range(self.per_group):
                if (q[0], k) in self.pending[s]:
                    self._ask_state((q[0], k), s)

    def _same_model(self, g: int) -> bool:
        """Whether group `g`'s processes hold the job's state (its leaves' shapes and dtypes, in
        any layout); if not, the group can never take part: the job ends with `fatal`'s line."""
        models = [self.layouts[(g, k)].model for k in range(self.per_group)]
        if self.model is None:
            self.model = models[0]
            for box in self.wires.values():  # frames may carry the state's arrays from now on
                box.wire.limit = self._frame_limit()
        for model in models:
            if model == self.model:
                continue
            shapes, dtypes = self.model
            if len(model[0]) != len(shapes):
                leaf = None
            else:
                pairs = zip(zip(*model, strict=True), zip(shapes, dtypes, strict=True), strict=True)
                leaf = next(i for i, (a, b) in enumerate(pairs) if a != b)
            if leaf is None:
                what = f"{len(model[0])} leaves against {len(shapes)}"
            else:
                what = (f"leaf {leaf} is {model[1][leaf]}{list(model[0][leaf])} against "
                        f"{dtypes[leaf]}{list(shapes[leaf])}")  # fmt: skip
            self.fatal = (f"group {g} holds another state than the job's ({what}): every group "
                          f"must train the same model and optimizer; give every host the same "
                          f"--recipe and --set values for the model and the optimizer")  # fmt: skip
            self._drop(g, self.fatal)
            return False
        return True

    def _ask_state(self, who: tuple[int, int], step: int) -> None:
        """Ask donor process `who`, waiting for the average of `step`, for its state."""
        ask = False
        for j, t in self.transfers.items():
            if t["donor"] != who[0]:
                continue
            if t["step"] is None:  # the donor's first step from now: the joining group's too
                t["step"] = step
                self.joined[j] = step
                t["p2p"] = self._p2p_transfer(t["donor"], j)
            if t["step"] == step and who[1] not in t["asked"]:
                t["asked"].add(who[1])
                if t["p2p"]:
                    self._give_p2p(j, t, who[1])
                else:
                    ask = True
        if ask:  # one copy of the state serves every group joining at this step
            self._send(who, {"kind": "give_state", "step": step})

    def _p2p_transfer(self, d: int, j: int) -> bool:
        """Whether donor group `d` gives joining group `j` its state peer to peer: both have the
        engine and process k of `j` holds exactly the shards process k of `d` holds."""
        if d in self.outer_only:
            return False
        for k in range(self.per_group):
            if (d, k) not in self.p2p or (j, k) not in self.p2p:
                return False
            want, have = self.layouts.get((j, k)), self.layouts.get((d, k))
            if want is None or have is None or want.need != have.need:
                return False
        return True

    def _give_p2p(self, j: int, t: dict, k: int) -> None:
        """Ask donor process k for its state for joining group `j`, peer to peer: the donor's
        process is rank 0 of a communicator of two with `j`'s process k, at the donor's store,
        under a prefix with a secret made here; only the checksum comes through the hub."""
        self.epoch += 1
        spec = {"store": self.p2p[(t["donor"], k)], "world": 2, "timeout_s": self.hang_s,
                "prefix": f"jaxpar/state/{self.epoch}/{secrets.token_hex(16)}"}  # fmt: skip
        self._send((t["donor"], k), {"kind": "give_state", "step": t["step"], "p2p": spec})
        self._send((j, k), {"kind": "receive_state", "step": t["step"], "rank": 1,
                            "donor": t["donor"], **spec})  # fmt: skip

    def _state_sent(self, who: tuple[int, int], header: dict) -> None:
        """Donor process `who` sent its state peer to peer (its checksum here, forwarded to the
        joining process, which checks what it received), or failed to: the transfer is void."""
        g, k = who
        check, error = header.get("checksum"), header.get("error")
        for j, t in list(self.transfers.items()):
            if not t.get("p2p") or t["donor"] != g or header.get("step") != t["step"]:
                continue
            if k in t["sent"] or k not in t["asked"]:
                continue
            if error is not None or not isinstance(check, str) or len(check) != 64:
                self.void.append(j)
                self._drop(j, f"the state transfer to it failed ({printable(str(error), 200)})")
                continue
            head = {"kind": "state", "step": t["step"], "checksum": check, "p2p": True,
                    "quorum": self._quorum(t["step"])}  # fmt: skip
            self._send((j, k), head)
            t["sent"].add(k)
            if len(t["sent"]) == self.per_group:
                del self.transfers[j]
                self.event(GROUP_JOINED, group=j, step=t["step"], transfer=True,
                           donor=t["donor"], resharded=False, p2p=True,
                           seconds=round(time.time() - t["t"], 3))  # fmt: skip

    def _quorum(self, step: int) -> list[int]:
        return sorted(g for g, first in self.joined.items() if first <= step and g in self.alive)

    def _release(self, step: int) -> None:
        q = self._quorum(step)
        if not self.started and any(g not in self.joined for g in self.alive):
            return  # the job's first step waits for every group that is starting
        if len(q) < self.min_groups:
            return  # held until enough groups are back: a minority never trains alone
        got = self.pending.get(step, {})
        if not all((g, k) in got for g in q for k in range(self.per_group)):
            return
        if step in self.exchanges:  # under way: re-formed over the quorum left, if it changed
            if self.exchanges[step]["quorum"] != q:
                self._exchange(step, q)
            return
        reports = [who for who, v in got.items() if isinstance(v, dict)]
        if reports:
            why = self._hub_path(step, q, got)
            if why is not None:  # this step through the hub: its reporters send their shards
                for who in reports:
                    del got[who]
                    self._send(who, {"kind": "send", "step": step})
                self._say_path(why)
                return
            found = {}
            for g in q:
                mine = [got[(g, k)] for k in range(self.per_group)]
                bad = sorted({leaf for r in mine for leaf in r["bad"]})
                found[g] = (bad, math.sqrt(sum(r["sq"] for r in mine)), mine[0]["leaves"])
            bad = self._screen(step, q, found)
            if bad is not None:
                self.causes[bad[0]] = bad[1]
                self._drop(*bad)
                return
            self._say_path(None)
            self._exchange(step, q)
            return
        parts = {g: [got[(g, k)] for k in range(self.per_group)] for g in q}
        lacking = [self.why_hub[step]] if self.why_hub.get(step, (-1,))[0] in q else []
        if lacking:  # said once: a group without the engine, or leaves it cannot sum
            self._say_path(f"group {lacking[0][0]} cannot exchange peer to peer "
                           f"({lacking[0][1]})")  # fmt: skip
        model = parts[q[0]][0][0].model
        for g in q:  # each group's processes tile every leaf once, in any layout
            lays = [lay for lay, _ in parts[g]]
            if any(lay.model != model for lay in lays) or not group_layout.tiles(lays):
                self._drop(g if g != q[0] else q[-1], f"group {g} sent shards that do not make "
                           f"up the leaves of group {q[0]}'s")  # fmt: skip
                return
        found = {}
        for g in q:
            spans, at = {}, 0
            for name, n in self.names.get(g, []):
                spans[name] = range(at, at + n)
                at += n
            found[g] = (*group_layout.screen(parts[g], spans.get("gradients")),
                        len(parts[g][0][0].shapes))  # fmt: skip
        bad = self._screen(step, q, found)
        if bad is not None:  # out of this step and restarted from a peer; the rest go on
            g, why = bad
            self.causes[g] = why
            self._drop(g, why)
            return
        listeners = self.listeners.get(step, {})
        for who, lay in list(listeners.items()):
            if lay.model != model:
                self._drop(who[0], f"group {who[0]} wants shards of another tree")
                return
        means = group_layout.mean([p for g in q for p in parts[g]], len(q))
        head = {"kind": "averaged", "step": step, "quorum": q}
        for g in q:
            for k in range(self.per_group):
                out = group_layout.cut(means, got[(g, k)][0])
                self.gradient_bytes += sum(a.nbytes for a in out)
                self._send((g, k), head, out)
        for who, lay in listeners.items():
            out = group_layout.cut(means, lay)
            self.gradient_bytes += sum(a.nbytes for a in out)
            self._send(who, head, out)
        self._released(step, q, "hub")

    def _released(self, step: int, q: list[int], path: str) -> None:
        """Step `step`'s average is out to quorum `q` (through the hub or peer to peer)."""
        del self.pending[step]
        self.why_hub.pop(step, None)
        self.listeners.pop(step, None)
        self.first_seen.pop(step, None)
        now = time.time()
        if self.progress_at is not None:
            self.intervals = [*self.intervals[-19:], now - self.progress_at]
        self.progress_at = now
        self.all_lost = False
        self.next_step = step + 1
        self.started = True
        self.released += 1
        self.group_steps_lost += self.groups - len(q)
        if q != self.last_quorum:
            self.event(QUORUM, step=step + 1, quorum=q, groups=self.groups, exchange=path)
            self.last_quorum = q
        self.cv.notify_all()

    def _report(self, g: int, header: dict, arrays: list) -> dict:
        """A process's report for the peer-to-peer average, checked: {"bad", "sq", "digest",
        "leaves"}; WireError when malformed."""
        leaves, bad, sq = header.get("leaves"), header.get("bad"), header.get("sq")
        digest = header.get("digest")
        ok = not arrays and type(leaves) is int and 0 < leaves <= group_layout.MAX_LEAVES
        ok = ok and isinstance(bad, list) and len(bad) <= leaves
        ok = ok and all(type(b) is int and 0 <= b < leaves for b in bad)
        ok = ok and isinstance(sq, int | float) and not sq < 0  # inf and NaN: a bad norm
        if not ok or not isinstance(digest, str) or len(digest) > 64:
            raise WireError(f"a malformed report {str(header)[:80]}")
        self._name_parts(g, header.get("parts"), leaves)
        return {"bad": bad, "sq": float(sq), "digest": digest, "leaves": leaves}

    def _hub_path(self, step: int, q: list[int], got: dict) -> str | None:
        """Why step `step` averages through the hub rather than peer to peer (None: it does
        not)."""
        for g in q:
            for k in range(self.per_group):
                if not isinstance(got[(g, k)], dict) or (g, k) not in self.p2p:
                    h, why = self.why_hub.get(step, (g, self.p2p_missing.get(g, "no engine")))
                    return f"group {h} cannot exchange peer to peer ({why})"
        if self.listeners.get(step):
            return f"a group joins by listening to step {step + 1}'s average (DiLoCo)"
        for k in range(self.per_group):
            digests = {got[(g, k)]["digest"] for g in q}
            if len(digests) > 1:
                return (f"the groups' layouts differ (process {k} of groups {q} hold different "
                        f"shards): their shards are resharded by the hub")  # fmt: skip
        return None

    def _say_path(self, why: str | None) -> None:
        """Say once how the groups' gradients average, when that changes."""
        line = why or "p2p"
        if line == self.said_path:
            return
        if why is None:
            say(f"the replica groups' gradients average peer to peer (Gloo, {EXTRA}); the group "
                f"hub keeps the quorum")  # fmt: skip
        else:
            say(f"the replica groups' gradients average through the group hub: {why}")
        self.said_path = line

    def _exchange(self, step: int, q: list[int], fresh: bool = False) -> None:
        """Tell every process of quorum `q` to sum its shards of `step` with the processes
        holding the same shards in the other groups: process k of each group, over the
        communicators in force, formed anew when the quorum changed or an exchange failed
        (`fresh`). Process k of the quorum's lowest group serves the rendezvous; the prefix
        holds a secret made here, sent only over the groups' authenticated wires."""
        c = self.comm
        if fresh or c is None or c["quorum"] != q:
            self.epoch += 1
            c = self.comm = {"quorum": q, "epoch": self.epoch,
                             "prefix": f"jaxpar/{self.epoch}/{secrets.token_hex(16)}"}  # fmt: skip
        old = self.exchanges.get(step)
        self.exchanges[step] = {"quorum": q, "epoch": c["epoch"], "ok": set(), "failed": {},
                                "t": time.time(), "tries": old["tries"] if old else 0}  # fmt: skip
        for k in range(self.per_group):
            head = {"kind": "exchange", "step": step, "epoch": c["epoch"], "quorum": q,
                    "world": len(q), "store": self.p2p[(q[0], k)], "prefix": f"{c['prefix']}/{k}",
                    "timeout_s": self.hang_s}  # fmt: skip
            for rank, g in enumerate(q):
                self._send((g, k), {**head, "rank": rank})

    def _reduced(self, who: tuple[int, int], header: dict) -> None:
        """A process's word on its exchange: the step is committed once every member's sums
        succeeded; re-formed once every member answered and one failed (a peer cut off, not
        lost); after two such failures the quorum's highest group leaves it."""
        step = int(header.get("step", -1))
        ex = self.exchanges.get(step)
        if ex is None or header.get("epoch") != ex["epoch"] or who[0] not in ex["quorum"]:
            return  # an exchange given up
        if header.get("ok") is True:
            ex["ok"].add(who)
        else:
            ex["failed"][who] = printable(str(header.get("error", "")), 200)
        q = ex["quorum"]
        members = [(g, k) for g in q for k in range(self.per_group)]
        if all(m in ex["ok"] for m in members) and self._quorum(step) != q:
            # a group joined at this step meanwhile (its donor gives the state it computes
            # from): the step waits for its report, then is exchanged again over all of them
            del self.exchanges[step]
            self._release(step)
        elif all(m in ex["ok"] for m in members):
            head = {"kind": "averaged", "step": step, "quorum": q, "epoch": ex["epoch"]}
            for m in members:
                self._send(m, head)
            del self.exchanges[step]
            self.p2p_steps += 1
            self._released(step, q, "p2p")
        elif all(m in ex["ok"] or m in ex["failed"] for m in members):
            ex["tries"] += 1
            first = next(iter(ex["failed"].values()))
            if ex["tries"] < 2:
                self._exchange(step, q, fresh=True)
                return
            g = q[-1]
            self.causes[g] = why = (f"the exchange of step {step + 1} failed twice with every "
                                    f"group answering ({first}): group {g} leaves the quorum")  # fmt: skip
            self.comm = None
            self._drop(g, why)

    def _name_parts(self, g: int, parts: object, leaves: int) -> None:
        """Group `g`'s naming of its average's leaves ([[name, count], ...] adding up to them);
        anything else is ignored (the leaves are then numbered only)."""
        ok = isinstance(parts, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int
            and p[1] >= 0 for p in parts
        )  # fmt: skip
        if ok and sum(p[1] for p in parts) == leaves and len(parts) <= 8:
            self.names[g] = [(printable(name, 40), n) for name, n in parts]
        else:
            self.names.pop(g, None)

    def _screen(self, step: int, q: list[int], found: dict) -> tuple[int, str] | None:
        """The first group of quorum `q` whose contribution to `step` must not enter the average,
        and why: a NaN or an infinity anywhere in it, or (with 3 groups or more) a gradient norm
        more than NORM_FACTOR times the median of the other groups'. `found`: group -> (its
        non-finite leaves, its gradient norm, its leaves), from its shards or its report."""
        norms = {}
        for g in q:
            bad, norms[g], leaves = found[g]
            if bad:
                spans, at = {}, 0
                for name, n in self.names.get(g, []):
                    spans[name] = range(at, at + n)
                    at += n
                what = sorted({next((name for name, r in spans.items() if leaf in r), "")
                               for leaf in bad} - {""}) or ["values"]  # fmt: skip
                return g, (f"non-finite {' and '.join(what)} in step {step + 1} (NaN or inf in "
                           f"{len(bad)} of its {leaves} leaves), dropped before the average")  # fmt: skip
        for g in q if len(q) >= 3 else []:
            others = sorted(norms[h] for h in q if h != g)
            median = others[len(others) // 2]
            if median > 0 and norms[g] > NORM_FACTOR * median:
                return g, (f"gradient norm {norms[g]:.3g} in step {step + 1}, more than "
                           f"{NORM_FACTOR:g} times the other groups' median {median:.3g}, "
                           f"dropped before the average")  # fmt: skip
        return None

    def take_causes(self) -> dict[int, str]:
        """Groups the hub dropped for their contribution since the last call, and why."""
        with self.cv:
            out, self.causes = self.causes, {}
            return out

    def _forward_state(self, who: tuple[int, int], header: dict, arrays: list) -> None:
        g, k = who
        layout = group_layout.parse(header, arrays)
        for j, t in list(self.transfers.items()):
            if t["donor"] != g or k in t["got"] or header.get("step") != t["step"] or t["p2p"]:
                continue
            t["got"][k] = (layout, arrays, header.get("checksum"))
            self._pass_state(j, t)

    def _pass_state(self, j: int, t: dict) -> None:
        """Send joining group `j`'s processes the donor's state: process k's as the donor's
        process k sent it when it needs exactly those shards (the layouts match), else resharded
        here once every donor process's shards have come (their checksums checked here)."""
        for k in range(self.per_group):
            want, got = self.layouts.get((j, k)), t["got"].get(k)
            if k in t["sent"] or want is None:
                continue
            if got is not None and got[0].pieces == want.need:
                arrays, check = got[1], got[2]
            elif len(t["got"]) == self.per_group:
                if "leaves" not in t:
                    parts = list(t["got"].values())
                    if any(group_wire.checksum(a) != c for _, a, c in parts):
                        raise WireError(f"group {t['donor']}'s state does not match its checksum")
                    lays = [lay for lay, _, _ in parts]
                    if any(lay.model != want.model for lay in lays) or not group_layout.covers(
                        lays
                    ):
                        raise WireError(f"group {t['donor']}'s state does not make up the job's")
                    t["leaves"] = group_layout.assemble([(lay, a) for lay, a, _ in parts])
                arrays = group_layout.cut(t["leaves"], want)
                check, t["resharded"] = group_wire.checksum(arrays), True
            else:
                continue
            head = {"kind": "state", "step": t["step"], "checksum": check,
                    "quorum": self._quorum(t["step"])}  # fmt: skip
            self.state_bytes += sum(a.nbytes for a in arrays)
            self._send((j, k), head, arrays)
            t["sent"].add(k)
        if len(t["sent"]) == self.per_group:
            del self.transfers[j]
            self.event(GROUP_JOINED, group=j, step=t["step"], transfer=True, donor=t["donor"],
                       resharded=t["resharded"], seconds=round(time.time() - t["t"], 3))  # fmt: skip

    def _drop(self, g: int, why: str, record: bool = True) -> None:
        """Group `g` is out: its processes are told to stop, the pending steps are released
        over the rest (the survivors' gradients are held here), a transfer it gave is void."""
        was_in = g in self.alive
        self.alive.discard(g)
        self.joined.pop(g, None)
        self.ready.pop(g, None)
        self.transfers.pop(g, None)
        self.outer_only.discard(g)
        self.names.pop(g, None)
        for k in range(self.per_group):
            self.layouts.pop((g, k), None)
            self.p2p.pop((g, k), None)
        for k in range(self.per_group):
            box = self.wires.pop((g, k), None)
            if box is not None:  # told why, if it still reads; closed within seconds anyway
                box.put({"kind": "stop", "why": why})
                box.close(grace_s=5.0)
        for step in self.pending:
            for k in range(self.per_group):
                self.pending[step].pop((g, k), None)
        if was_in and record:
            self.event(GROUP_FAILURE, group=g, why=why, source="hub")
        for j, t in list(self.transfers.items()):
            if t["donor"] == g:  # a transfer cut short: the joining group starts again
                self.void.append(j)
                self._drop(j, f"its donor group {g} was lost during the state transfer")
        for step in sorted(self.pending):
            self._release(step)

    # -- the supervisor's side ------------------------------------------------------------------

    def drop_hung(
        self, timeout_s: float, now: float | None = None, saving: bool = False,
        startup_s: float | None = None,
    ) -> dict[int, str]:  # fmt: skip
        """Hung groups, dropped so the others go on (returned: group -> why):

        - a group of a pending step's quorum that has not sent its shards `timeout_s` after the
          step's first ones arrived (a hung or stopped process);
        - every group of the quorum when none of them has sent all its shards and no step has
          been released for `timeout_s` (at least 10 of the recent times between releases:
          DiLoCo's outer steps are H steps apart) — all of them stopped or stuck inside their
          own group. In the job's first step (a start, where programs may still warm up) the
          limit is `startup_s` (none without it) from the moment every running group is ready,
          and only the groups that have not sent their shards are dropped. Never once a group
          has finished, nor while a group is `saving` a checkpoint (the caller gives an open
          save the start-up time, as a plain job's monitor does).
        """
        now = time.time() if now is None else now
        hung: dict[int, str] = {}
        with self.cv:
            self.hang_s = timeout_s
            for step, ex in sorted(self.exchanges.items()):  # a member silent inside an exchange
                if now - ex["t"] < timeout_s:
                    continue
                done = ex["ok"] | set(ex["failed"])
                late = [g for g in ex["quorum"] if any((g, k) not in done
                                                       for k in range(self.per_group))]  # fmt: skip
                if len(late) == len(ex["quorum"]):
                    continue  # every member still inside: their own timeouts end it first
                for g in late:
                    hung[g] = (f"hung: no word from inside step {step + 1}'s exchange "
                               f"{timeout_s:.0f}s after it began")  # fmt: skip
                    self._drop(g, hung[g])
            for step in sorted(self.pending) if self.started else []:  # not in the start-up
                if now - self.first_seen.get(step, now) < timeout_s:
                    continue
                got = self.pending[step]
                late = [g for g in self._quorum(step)
                        if any((g, k) not in got for k in range(self.per_group))]  # fmt: skip
                if len(late) == len(self._quorum(step)):
                    continue  # nobody is waiting
                for g in late:
                    hung[g] = (f"hung: no gradients for step {step} {timeout_s:.0f}s after the "
                               f"other groups'")  # fmt: skip
                    self._drop(g, hung[g])
            if hung or saving:  # after a drop a step went on
                return hung
            return self._quorum_hung(timeout_s, now, startup_s)

    def _quorum_hung(self, timeout_s: float, now: float, startup_s: float | None) -> dict[int, str]:
        """The quorum's groups not in a step's average when no step has been released for the
        limit (see drop_hung)."""
        if self.stopping or self.finished or self.progress_at is None:
            return {}
        q = sorted(g for g in self.joined if g in self.alive)
        sent = {g for g in q for got in self.pending.values()
                if all((g, k) in got for k in range(self.per_group))}  # fmt: skip
        idle = now - self.progress_at
        if self.started:
            if not q or sent:  # a group waits in an average: for the others, or a quorum
                return {}
            median = sorted(self.intervals)[len(self.intervals) // 2] if self.intervals else 0.0
            limit = max(timeout_s, 10 * median)
            why = (f"hung: no step released for {idle:.0f}s (hang timeout {limit:.0f}s) with no "
                   f"group of the quorum {q} in a step's average")  # fmt: skip
        else:  # the first step waits for every running group: once all are ready, start-up's
            if startup_s is None or not q or any(g not in self.joined for g in self.alive):
                return {}
            limit = startup_s
            why = (f"hung: the first step not released {idle:.0f}s after every group was ready "
                   f"(start-up timeout {limit:.0f}s)")  # fmt: skip
        if idle < limit:
            return {}
        late = [g for g in q if g not in sent]
        for g in late:
            self._drop(g, why)
        return dict.fromkeys(late, why)

    def running(self, g: int) -> None:
        with self.cv:
            self.alive.add(g)
            self.finished.discard(g)

    def drop(self, g: int, why: str) -> None:
        with self.cv:
            if g in self.alive:
                self._drop(g, why)

    def take_void_transfers(self) -> list[int]:
        with self.cv:
            out, self.void = list(self.void), []
            return out

    def close(self) -> None:
        self.closed = True
        self.gate.close()
        with contextlib.suppress(OSError):
            self.sock.close()
        with self.cv:
            for box in self.wires.values():
                box.close()


# ---- the supervisor -------------------------------------------------------------------------------


class ReplicaSupervisor(JobState):
    """Runs R replica groups: a failed group is restarted alone while the others train."""

    def __init__(self, opts: Options):
        super().__init__(opts)
        self.per_group = opts.nproc * opts.nnodes // opts.groups
        self.hub: Hub | None = None
        self.groups: list[ReplicaGroup | RemoteGroup] = []
        self.hosts: list[RemoteHost] = []  # the other hosts' agents (--nnodes > 1)
        self.nonce = ""  # what the group key is derived from on several hosts
        self.done: set[int] = set()
        self.gone: set[int] = set()  # groups lost with their host: never restarted
        self.group_restarts = 0
        self.tail: EventTail | None = None  # the workers' events: checkpoint saves
        self.saving: tuple[int, float] | None = None  # an open save: (incarnation, since)
        self._said: str | None = None  # the hub's fatal line, once said
        self.lost_since: dict[int, float] = {}  # group -> when the hub lost its connection
        # (incarnation, job-wide process) -> the ending fault injected there (its event)
        self.injected: dict[tuple[int, int], str] = {}
        self.exit_logs: dict[int, str] = {}  # group -> the log of the exit it failed with

    def _on_signal(self, signum, frame) -> None:
        self.stop_request = signum
        self.waker.poke()

    def run(self) -> int:
        t0 = time.time()
        if not self.take_lock():  # one job per run directory
            return 2
        o = self.opts
        try:  # several hosts: the group key is derived from the agents' token, never sent
            shared = token(o) if o.nnodes > 1 else b""
        except ValueError as e:
            self.lock.release()
            say(f"error: {e}")
            return 2
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        status, code = "failed", 1
        if o.nnodes > 1:
            self.nonce = secrets.token_hex(16)
            key = group_key(shared, self.nonce)
        else:
            key = secrets.token_bytes(32)  # this job's group key: the workers' and the hub's only
        per_host = o.groups // o.nnodes
        self.incarnation = sum(1 for e in runlog.read_jsonl(self.events_path)
                               if e.get("event") == runlog.WorkerEvent.START)  # fmt: skip
        try:
            # this host's groups, their spare pools forked before the hub's and the rendezvous'
            # threads exist (a fork, not a cold start); the hub's address is theirs once it binds
            self.groups = [ReplicaGroup(o, self.waker, g, "", key) for g in range(per_host)]
            for g, grp in enumerate(self.groups):
                grp.open_pool(self._spec(g, coordinator="", bind=""))
            if o.nnodes > 1:
                server = Rendezvous(o, shared, self.event, self.waker)
                nodes = server.wait(lambda: self.stop_request is not None)
                odd = [n.rank for n in nodes if n.nproc != o.nproc]
                if odd:
                    raise RuntimeError(f"the agents of nodes {odd} run another --nproc than "
                                       f"{o.nproc}: replica groups need the same on every host")  # fmt: skip
                self.hosts = [RemoteHost(n, self.event) for n in nodes]
            self.hub = Hub(o.bind, key, o.groups, self.per_group, o.min_groups, self.event,
                           lambda g: self.waker.poke(),
                           advertise=o.host if o.nnodes > 1 else None,
                           handshake_s=o.handshake_timeout_s)  # fmt: skip
            self.slots = [(n, i) for n in range(o.nnodes) for i in range(o.nproc)]
            self.tail = EventTail(self.events_path)
            self.event(SupervisorEvent.LAUNCH, nproc=len(self.slots), nnodes=o.nnodes,
                       devices_per_proc=o.devices_per_proc, max_restarts=o.max_restarts,
                       groups=o.groups, min_groups=o.min_groups,
                       command=shlex.join(o.command), pid=os.getpid())  # fmt: skip
            for grp in self.groups:
                grp.hub = self.hub.address
            self.groups += [RemoteGroup(self.hosts[g // per_host - 1], g)
                            for g in range(per_host, o.groups)]  # fmt: skip
            for g in range(o.groups):
                self._start(g)
            hosts = f" on {o.nnodes} hosts" if o.nnodes > 1 else ""
            say(f"{o.groups} replica groups of {self.per_group} process(es) started{hosts}, "
                f"group hub {self.hub.address}")  # fmt: skip
            status, code = self._loop()
        except (RuntimeError, OSError) as e:
            say(f"error: {e}")
        finally:
            for grp in self.groups:
                grp.kill_all()
                grp.release_spares()
                grp.release_pool()
                grp.release_standby()
            for host in self.hosts:
                host.close(code)
            if self.hub is not None:
                self.hub.close()
            for s, h in handlers.items():
                signal.signal(s, h)
            self._summary(time.time() - t0, status)
            self.lock.release()
        return code

    def _start(self, g: int) -> None:
        """Start group `g`: its standby group where one is ready (--standby), else its spares
        (pre-started processes, imports done), else cold. A group on another host is started by
        that host's agent (spares there, else cold), which picks the group's coordinator; its
        reply is the `group_started` event."""
        assert self.hub is not None
        grp = self.groups[g]
        spec = self._spec(g)
        ids = spec["process_ids"]
        if isinstance(grp, RemoteGroup):
            spec.update(coordinator="", bind="", group=g, groups=self.opts.groups,
                        hub=self.hub.address, group_nonce=self.nonce)  # fmt: skip
            self.hub.running(g)
            grp.t_spawn = time.time()
            grp.start(spec)
            return
        bind = grp.world_bind()
        port = free_port(bind)
        spec.update(coordinator=join_address("127.0.0.1", port), bind=join_address(bind, port))
        path = "spares" if grp.warm(len(ids)) else "cold"
        if grp.standby_ready():  # built for this group's next start: its own world, warmed up
            spec, path = dict(grp.standby_spec() or {}, standby=True), "standby"
        self.hub.running(g)
        grp.t_spawn = time.time()
        grp.start(spec)
        self.event(SupervisorEvent.GROUP_STARTED, group=g, nproc=self.per_group,
                   process_ids=ids, coordinator=spec["coordinator"], path=path,
                   pids=[grp.procs[p].pid for p in ids])  # fmt: skip

    def _spec(self, g: int, **extra) -> dict:
        """The plan of group `g`'s next start (where its coordinator listens comes with it)."""
        grp = self.groups[g]
        return {"incarnation": self.incarnation, "nproc": self.per_group,
                "process_ids": list(range(g * self.per_group, (g + 1) * self.per_group)),
                "attempt": self.group_restarts, "faults": self.opts.faults,
                "collective_timeout": self.opts.collective_timeout or 600.0,
                "run_lock": self.lock.token,
                # no other group runs: this one may remove unfinished saves (none is in flight)
                "tidy": not any(o.alive() for o in self.groups if o is not grp), **extra}  # fmt: skip

    def _mark_joined(self) -> None:
        """A group in the quorum of the last step released is past its start-up and its first
        step: its spares and standby group may be built now (on a small machine they would slow
        the first step, which after a failure is part of the rejoin)."""
        assert self.hub is not None
        with self.hub.cv:
            joined = set(self.hub.joined) & self.hub.alive & set(self.hub.last_quorum or ())
        for g in joined:
            self.groups[g].mark_stepping()  # on another host: its agent is told
        for g, grp in enumerate(self.groups):
            if isinstance(grp, ReplicaGroup) and grp.standby_news():
                self.event(SupervisorEvent.GROUP_STANDBY_READY, group=g, node=0)

    def _loop(self) -> tuple[str, int]:
        assert self.hub is not None
        while True:
            if self.stop_request == signal.SIGTERM:
                return self._preempt()
            if self.stop_request is not None:
                say("interrupted: stopping the replica groups")
                return "interrupted", 130
            failed: dict[int, str] = {}
            self._mark_joined()
            out = self._hosts_lost() or self._refused()
            if out is not None:
                return out
            exits: dict[int, list[tuple[int, int]]] = {}
            for g, grp in enumerate(self.groups):
                if g in self.gone:
                    continue
                for pid, rc in grp.poll():
                    if rc == bootstrap.EXIT_USAGE:  # the same error in every restart
                        return self._usage_error(g, pid)
                    if rc != 0:
                        exits.setdefault(g, []).append((pid, rc))
                if g not in exits and g not in self.done and grp.finished():
                    self.done.add(g)
            hang, startup, _ = self.timeouts()
            now = time.time()
            hung = self.hub.drop_hung(hang, saving=self._saving(now, startup), startup_s=startup)
            for g, codes in exits.items():  # after _saving: the injected faults are read
                failed[g] = self._exit_why(g, *root_exit(codes))
            for g, why in hung.items():
                failed.setdefault(g, why)
            for g, why in self._hung_in_startup(now, startup):
                failed.setdefault(g, why)
            for g in self.hub.take_void_transfers():
                failed.setdefault(g, "the state transfer to it was cut short")
            with self.hub.cv:
                lost = [g for g in range(len(self.groups))
                        if g not in self.hub.alive and g not in self.done | self.gone]  # fmt: skip
            # groups the hub dropped for their contribution: that is why they restart (their
            # processes, told to stop, exit after the hub said why)
            causes = self.hub.take_causes()
            failed.update(causes)
            for g in causes:
                self.exit_logs.pop(g, None)
            for g in lost:
                if g in failed:
                    continue
                # a process that dies closes its connection first: its exit, seen within the
                # grace, names the cause; a connection lost with every process alive is one
                if now - self.lost_since.setdefault(g, now) >= LOST_GRACE_S:
                    failed[g] = "its connection to the group hub was lost"
            with self.hub.cv:
                training = (set(self.hub.joined) & self.hub.alive) - set(failed)
            if failed and not training:
                say(
                    f"no replica group is training ({len(failed)} failed now): they restart from "
                    f"the newest checkpoint in {self.run_dir}/checkpoints"
                )
            if self._refused() is not None:  # not restarted: the job ends
                return self._refused()
            for g, why in sorted(failed.items()):
                if g in self.gone:
                    continue
                out = self._fail(g, why, training=training)
                if out is not None:
                    return out
            if self.done and len(self.done | self.gone) == len(self.groups):
                return "completed", 0
            with self.hub.cv:
                waiting = [g for g in range(len(self.groups))
                           if g not in self.done | self.gone and g not in self.hub.joined]  # fmt: skip
            if self.done and len(self.done | self.gone) + len(waiting) == len(self.groups):
                for g in waiting:  # restarted, still waiting for a state nobody will give now
                    self.groups[g].stop(0.0)
                    self.event(GROUP_STOPPED, group=g, why="the other groups finished the run")
                return "completed", 0
            self.waker.wait(0.25)

    def _hosts_lost(self) -> tuple[str, int] | None:
        """An agent that refused to start its group ends the job (exit 2, its line); groups whose
        host's agent is lost leave for good (their processes went with it, or are stopped by
        their agent); the job fails once fewer than --min-groups are left."""
        assert self.hub is not None
        for grp in self.groups:
            if isinstance(grp, RemoteGroup) and grp.refused is not None:
                reason = f"node {grp.host.rank} refused group {grp.group}: {grp.refused}"
                self.event(SupervisorEvent.GAVE_UP, reason=reason)
                say(f"error: {reason}")
                return "failed", 2
        newly = []
        for g, grp in enumerate(self.groups):
            if g in self.gone or not isinstance(grp, RemoteGroup) or not grp.node_lost():
                continue
            newly.append(g)
            self.gone.add(g)
            why = f"the agent of node {grp.host.rank} (its host) was lost"
            self.hub.drop(g, why)
            self.event(GROUP_FAILURE, group=g, why=why, source="supervisor", permanent=True)
        left = len(self.groups) - len(self.gone)
        for g in sorted(newly):
            grp = self.groups[g]
            say(f"group {g} lost with node {grp.host.rank}: it is not restarted"
                + ("; the other groups keep training" if left >= self.opts.min_groups else ""))  # fmt: skip
        if self.gone and left < self.opts.min_groups:
            return self._give_up(
                f"{left} replica group(s) left after a host was lost, fewer than --min-groups "
                f"{self.opts.min_groups}",
                f"The run resumes from the newest checkpoint in {self.run_dir}/checkpoints (the "
                f"same command lines, or --min-groups {left}).",
            )  # fmt: skip
        return None

    def _give_up(self, reason: str, then: str) -> tuple[str, int]:
        self.event(SupervisorEvent.GAVE_UP, reason=reason)
        say(f"giving up: {reason}. {then}")
        return "gave_up", 1

    def _refused(self) -> tuple[str, int] | None:
        """A group the hub found can never take part (another model): the job ends, exit 2."""
        assert self.hub is not None
        if self.hub.fatal is None:
            return None
        if self.hub.fatal is not self._said:
            self._said = self.hub.fatal
            self.event(SupervisorEvent.GAVE_UP, reason=self.hub.fatal)
            say(f"error: {self.hub.fatal}")
        return "failed", 2

    def _saving(self, now: float, startup: float) -> bool:
        """A checkpoint save (the lowest group's) is open and within the start-up timeout: the
        quorum is not judged hung as a whole meanwhile (a save may compile, as in a plain job)."""
        assert self.tail is not None
        for e in self.tail.read():
            if e.get("event") == runlog.WorkerEvent.SAVE_BEGIN:
                self.saving = (e.get("incarnation"), now)
            elif e.get("event") == runlog.WorkerEvent.SAVE_END:
                self.saving = None
            elif (
                e.get("event") == runlog.WorkerEvent.FAULT_INJECTED
                and e.get("kind") in runlog.ENDING_FAULTS
            ):  # an exit it causes names it
                self.injected[(e.get("incarnation"), e.get("process"))] = str(e.get("spec"))
        live = {grp.spec["incarnation"] for grp in self.groups if grp.spec and grp.alive()}
        if self.saving is not None and self.saving[0] not in live:  # its group is gone
            self.saving = None
        return self.saving is not None and now - self.saving[1] <= startup

    def _hung_in_startup(self, now: float, startup: float) -> list[tuple[int, str]]:
        """Running groups not ready (every process's program built, its state read) within the
        start-up timeout of their start: hung before their first step, where no step's average
        waits for them yet."""
        assert self.hub is not None
        with self.hub.cv:
            ready = set(self.hub.joined) | set(self.hub.transfers)
        return [(g, f"hung: not ready within the start-up timeout {startup:.0f}s")
                for g, grp in enumerate(self.groups)
                if g not in self.done | self.gone and g not in ready and grp.alive()
                and now - grp.t_spawn > startup]  # fmt: skip

    def _preempt(self) -> tuple[str, int]:
        """SIGTERM: the notice goes to every worker; the quorum's lowest group saves at the step
        it stops at (the others stop without saving), and nothing is restarted."""
        say("SIGTERM: passing the preemption notice to the replica groups (the lowest saves)")
        assert self.hub is not None
        self.hub.stopping = True
        for grp in self.groups:
            grp.send(signal.SIGTERM)
        deadline = time.time() + self.opts.preempt_grace_s
        while any(grp.alive() for grp in self.groups) and time.time() < deadline:
            self.waker.wait(self.opts.poll_s)
        return "preempted", bootstrap.EXIT_PREEMPTED

    def _fail(self, g: int, why: str, training: set[int] = frozenset()) -> tuple[str, int] | None:
        """Group `g` failed: out of the quorum at once, its other processes stopped, restarted.
        `training`: the other groups still training (none: every group restarts)."""
        assert self.hub is not None
        self.hub.drop(g, why)
        with self.hub.cv:
            self.hub.causes.pop(g, None)  # this restart is the one for it
        self.lost_since.pop(g, None)
        self.groups[g].stop(0.0)
        self.event(GROUP_FAILURE, group=g, why=why, source="supervisor")
        say(f"group {g} failed ({why}){self._meanwhile(training)}")
        say_log_tail(self.exit_logs.pop(g, None))
        if self.group_restarts >= self.opts.max_restarts:
            reason = f"restart budget spent ({self.group_restarts} of --max-restarts " \
                     f"{self.opts.max_restarts})"  # fmt: skip
            self.event(SupervisorEvent.GAVE_UP, reason=reason)
            say(f"giving up: {reason}. Checkpoints in {self.run_dir}/checkpoints are intact.")
            return "gave_up", 1
        self.group_restarts += 1
        self.restarts += 1
        self.counted += 1
        self.incarnation += 1
        self.event(GROUP_RESTART, group=g, attempt=self.group_restarts, reason=why)
        self._start(g)
        return None

    def _meanwhile(self, training: set[int]) -> str:
        """What the groups still training do while a failed group restarts, under the quorum in
        force: they train on while they are at least --min-groups, else each step waits for it."""
        if not training:
            return ""
        m = self.opts.min_groups
        if len(training) >= m:
            return "; the other groups keep training"
        who = f"group {min(training)}" if len(training) == 1 else f"groups {sorted(training)}"
        return (f"; {who} wait{'s' if len(training) == 1 else ''} for it: a step needs "
                f"--min-groups {m} groups, so none is released until it is back (--min-groups "
                f"{len(training)} would let {'it' if len(training) == 1 else 'them'} train on)")  # fmt: skip

    def _exit_why(self, g: int, pid: int, code: int) -> str:
        """Why group `g` failed when its process `pid` exited with `code`: the code and the
        signal, and the fault injected there if one was (as a plain launch says)."""
        grp = self.groups[g]
        inc = grp.spec["incarnation"] if grp.spec else self.incarnation
        ids = getattr(grp, "ids", None) or list(getattr(grp, "procs", {}))
        spec = self.injected.get((inc, pid)) or next(
            (self.injected[(inc, p)] for p in ids if (inc, p) in self.injected), None
        )
        log = self._log_of(g, pid)
        if log:
            self.exit_logs[g] = log
        return f"process {pid} {exit_text(code)}" + (f" — injected fault {spec}" if spec else "")

    def _log_of(self, g: int, pid: int) -> str | None:
        """The log of process `pid` of group `g` (on another host: in the shared run directory,
        by the name its agent gives it)."""
        grp = self.groups[g]
        if isinstance(grp, ReplicaGroup):
            return grp.logs.get(pid)
        if not grp.spec:
            return None
        name = f"inc{grp.spec['incarnation']}-group{grp.attempt}-proc{pid}.log"
        return os.path.join(self.run_dir, runlog.LOGS, name)

    def _usage_error(self, g: int, pid: int) -> tuple[str, int]:
        """A process that exited 2 (a usage or configuration error) fails the same way in every
        restart: its log's last lines (its error line) and the job ends."""
        log = self._log_of(g, pid)
        say_log_tail(log)
        return self._give_up(
            f"process {pid} of group {g} exited with code 2 (a usage or configuration error, "
            f"restarting will not help)",
            (f"Its log: {log}. " if log else "")
            + f"Checkpoints in {self.run_dir}/checkpoints are intact.",
        )  # fmt: skip

    def _summary(self, wall_s: float, status: str) -> None:
        from jaxpar.rundir import goodput  # numpy: only at the end

        try:
            summary = goodput.summarize_run(
                self.run_dir, wall_s, self.restarts, status, counted_restarts=self.counted,
                nproc=len(self.slots) or self.opts.nproc,
            )  # fmt: skip
            hub = self.hub
            summary["groups"] = {
                "groups": self.opts.groups, "min_groups": self.opts.min_groups,
                "group_restarts": self.group_restarts,
                "steps_released": hub.released if hub else 0,
                "group_steps_lost": hub.group_steps_lost if hub else 0,
                "steps_peer_to_peer": hub.p2p_steps if hub else 0,
                "hub_gradient_bytes": hub.gradient_bytes if hub else 0,
                "hub_state_bytes": hub.state_bytes if hub else 0,
            }  # fmt: skip
            write_json(os.path.join(self.run_dir, runlog.SUMMARY), summary)
        except OSError as e:
            cannot_write(os.path.join(self.run_dir, runlog.SUMMARY), e)
            return
        say(goodput.format_summary(summary))
        g = summary["groups"]
        say(f"replica groups: {g['steps_released']} steps averaged, {g['group_steps_lost']} "
            f"group-steps lost, {g['group_restarts']} group restart(s)")  # fmt: skip


def run_groups(opts: Options) -> int:
    return ReplicaSupervisor(opts).run()


__all__: list[Any] = ["Hub", "ReplicaSupervisor", "check_groups", "default_min_groups"]
