"""Replica groups on several hosts (`jaxpar launch --nnodes N --groups R`).

Each host runs whole groups: R / N of them, of `--nproc` / (R / N) processes each, group g on
host g // (R / N). The leader's supervisor decides for every group as on one host (the hub, the
quorum, restarts); a group on another host is driven over that host's control channel
(`RemoteGroup` on the leader, `FollowerGroups` in the host's agent): start, stop, the
preemption notice, and the exits of its processes back. A group's own jax.distributed world
stays on its host (its coordinator on that host's loopback); only the group hub's traffic
crosses hosts. Hosts may differ in --devices-per-proc and in their command's mesh: groups of
different layouts average and hand their state over through the hub
(jaxpar/worker/group_layout.py); a group holding another state (another model or optimizer)
ends the job with one line.

The group key (what a worker proves to the hub) is never sent: every agent derives it from the
agents' shared token and a nonce the leader makes for the job and sends with each start
(`group_key`). A host whose agent is lost takes its groups with it for good: the others train
on while at least --min-groups remain.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import signal
from typing import Any

from jaxpar.rundir.runlog import SupervisorEvent
from jaxpar.supervisor.channel import printable
from jaxpar.supervisor.options import free_port, join_address, say

NONCE = re.compile(r"[0-9a-f]{32}")


def group_key(token: bytes, nonce: str) -> bytes:
    """The job's group key: the agents' token keyed over the leader's nonce (never sent)."""
    return hmac.new(token, f"jaxpar replica groups|{nonce}".encode(), hashlib.sha256).digest()


def check_group_spec(spec: dict, nnodes: int, node_rank: int) -> int:
    """The group of a leader's start message for a replica group on host `node_rank`;
    ValueError if malformed."""
    r = spec.get("groups")
    if type(r) is not int or not 1 < r <= 4096 or r % nnodes:
        raise ValueError(f"spec 'groups' must be a multiple of {nnodes} in [2, 4096]")
    here = range(node_rank * (r // nnodes), (node_rank + 1) * (r // nnodes))
    g = spec.get("group")
    if type(g) is not int or g not in here:
        raise ValueError(f"spec 'group' must be one of this host's groups {list(here)}")
    hub = spec.get("hub")
    if not isinstance(hub, str) or not 0 < len(hub) <= 300:
        raise ValueError("spec 'hub' must be an address")
    if not isinstance(spec.get("group_nonce"), str) or not NONCE.fullmatch(spec["group_nonce"]):
        raise ValueError("spec 'group_nonce' must be 32 hex digits")
    if type(spec.get("tidy", False)) is not bool:
        raise ValueError("spec 'tidy' must be true or false")
    if len(spec["process_ids"]) != spec["nproc"]:
        raise ValueError("spec 'process_ids' must name 'nproc' processes")
    return g


# ---- the leader's side -----------------------------------------------------------------------


class RemoteHost:
    """One other host's agent as the leader sees it: routes its messages to its groups."""

    def __init__(self, node, event) -> None:
        self.node, self.event = node, event  # a transport.RemoteNode (its channel and rank)
        self.groups: dict[int, RemoteGroup] = {}
        self.lost = False

    @property
    def rank(self) -> int:
        return self.node.rank

    def pump(self) -> None:
        """Read the agent's messages: exits and starts of its groups' processes."""
        chan = self.node.chan
        for msg in chan.messages():
            if msg is None:
                if not self.lost:
                    why = f" ({chan.error})" if chan.error else ""
                    say(f"node {self.rank}: control channel lost{why}")
                self.lost = True
                continue
            grp = self.groups.get(msg.get("group")) if type(msg.get("group")) is int else None
            if grp is not None:
                grp.take(msg)

    def close(self, code: int) -> None:
        self.node.close(code)


class RemoteGroup:
    """A replica group on another host, behind the interface of a local `ReplicaGroup`."""

    def __init__(self, host: RemoteHost, group: int):
        self.host, self.group = host, group
        host.groups[group] = self
        self.spec: dict | None = None
        self.attempt = -1
        self.ids: list[int] = []
        self.exits: dict[int, int] = {}
        self.pending: list[tuple[int, int]] = []
        self.seen: set[str] = set()
        self.stepping = False
        self.t_spawn = 0.0
        self.refused: str | None = None  # why the agent would not start it (its own line)

    def take(self, msg: dict) -> None:
        if msg.get("attempt") != self.attempt:
            return  # a stopped incarnation's
        if "refused" in msg:
            self.refused = printable(msg["refused"], 300)
            return
        if "exit" in msg and type(msg["exit"]) is int and type(msg.get("code")) is int:
            if msg["exit"] in self.ids and msg["exit"] not in self.exits:
                self.exits[msg["exit"]] = msg["code"]
                self.pending.append((msg["exit"], msg["code"]))
        elif msg.get("standby_ready") is True:
            self.host.event(SupervisorEvent.GROUP_STANDBY_READY, group=self.group,
                            node=self.host.rank)  # fmt: skip
        elif "started" in msg and isinstance(msg.get("pids"), list):
            pids = [p for p in msg["pids"] if type(p) is int][: len(self.ids)]
            path = msg.get("path") if msg.get("path") in ("spares", "cold", "standby") else "cold"
            if self.spec is not None and type(msg.get("incarnation")) is int:  # a standby's own
                self.spec = dict(self.spec, incarnation=msg["incarnation"])
            self.host.event(SupervisorEvent.GROUP_STARTED, group=self.group, nproc=len(self.ids),
                            process_ids=self.ids, node=self.host.rank, path=path, pids=pids)  # fmt: skip

    def node_lost(self) -> bool:
        self.host.pump()
        return self.host.lost

    def mark_stepping(self) -> None:
        """The group stepped in a quorum: its agent may build its spares and standby group."""
        if not self.stepping:
            self.stepping = True
            self.host.node.chan.send({"cmd": "stepping", "group": self.group,
                                      "attempt": self.attempt})  # fmt: skip

    def start(self, spec: dict) -> None:
        self.stepping = False
        self.spec, self.attempt = spec, int(spec["attempt"])
        self.ids, self.exits, self.pending = list(spec["process_ids"]), {}, []
        self.host.node.chan.send({"cmd": "start", "spec": spec})

    def poll(self) -> list[tuple[int, int]]:
        self.host.pump()
        out, self.pending = self.pending, []
        return out

    def alive(self) -> list[int]:
        self.host.pump()
        if self.host.lost:
            return []
        return [p for p in self.ids if p not in self.exits]

    def finished(self) -> bool:
        """Every process of its current start exited with 0."""
        return bool(self.ids) and not self.alive() and all(
            self.exits.get(p) == 0 for p in self.ids
        )  # fmt: skip

    def send(self, sig: int) -> None:
        self.host.node.chan.send({"cmd": "signal", "sig": int(sig), "group": self.group})

    def stop(self, grace_s: float) -> dict:
        """Asked of the agent (it stops the processes before it starts anything else)."""
        self.host.node.chan.send({"cmd": "stop", "grace_s": grace_s, "group": self.group})
        self.exits.update(dict.fromkeys(self.ids, -int(signal.SIGKILL)))  # not exits to report
        return {}

    def kill_all(self) -> None:
        if self.ids and not self.host.lost:
            self.stop(0.0)

    def standby_ready(self) -> bool:
        return False

    def standby_spec(self) -> dict | None:
        return None

    def release_spares(self) -> None:
        """The agent releases its own when it leaves."""

    def release_pool(self) -> None:
        """The agent releases its own when it leaves."""

    def release_standby(self) -> None:
        """Never one on another host."""


# ---- another host's agent ----------------------------------------------------------------------


class FollowerGroups:
    """The replica groups of this host, started and stopped as the leader says."""

    def __init__(self, opts, waker, token: bytes):
        self.opts, self.waker, self.token = opts, waker, token
        self.groups: dict[int, Any] = {}  # group -> ReplicaGroup

    def start(self, spec: dict) -> dict:
        """Start group spec["group"] (this agent's command line; its coordinator on this
        host's loopback); the reply for the leader."""
        from jaxpar.supervisor.replica_group import ReplicaGroup  # numpy: only with groups here

        g = check_group_spec(spec, self.opts.nnodes, self.opts.node_rank)
        offset = self.opts.node_rank * self.opts.nproc
        if not all(offset <= p < offset + self.opts.nproc for p in spec["process_ids"]):
            raise ValueError(f"spec 'process_ids' are not this host's ({offset}...)")
        grp, key = self.groups.get(g), group_key(self.token, spec["group_nonce"])
        if grp is None or (grp.hub, grp.key) != (spec["hub"], key):
            if grp is not None:  # another job's group (a leader started again): gone first
                grp.kill_all()
                grp.release_spares()
                grp.release_pool()
            grp = ReplicaGroup(self.opts, self.waker, g, spec["hub"], key, groups=spec["groups"],
                               host_offset=offset)  # fmt: skip
            self.groups[g] = grp
        if grp.standby_ready():  # this agent's --standby: built for this group's next start
            spec, path = dict(grp.standby_spec() or {}, attempt=spec["attempt"]), "standby"
        else:
            port = free_port("127.0.0.1")
            spec = dict(spec, coordinator=join_address("127.0.0.1", port),
                        bind=join_address("127.0.0.1", port), standby=False)  # fmt: skip
            path = "spares" if grp.warm(len(spec["process_ids"])) else "cold"
        grp.start(spec)
        pids = [grp.procs[p].pid for p in spec["process_ids"]]
        return {"started": True, "group": g, "attempt": grp.attempt, "pids": pids, "path": path,
                "incarnation": spec["incarnation"]}  # fmt: skip

    def stepping(self, g: object, attempt: object) -> None:
        """Group `g`'s start `attempt` stepped in a quorum: its spares and standby group
        may be built (an older attempt's word is stale)."""
        grp = self.groups.get(g) if type(g) is int else None
        if grp is None:
            raise ValueError(f"no group {g!r} on this host")
        if grp.attempt == attempt:
            grp.mark_stepping()

    def stop(self, g: object, grace_s: float) -> None:
        grp = self.groups.get(g) if type(g) is int else None
        if grp is None:
            raise ValueError(f"no group {g!r} on this host")
        grp.stop(grace_s)

    def send(self, sig: int, g: object = None) -> None:
        for k, grp in self.groups.items():
            if g is None or g == k:
                grp.send(sig)

    def poll(self) -> list[dict]:
        """Exits of this host's group processes, as messages for the leader."""
        out = [{"exit": pid, "code": code, "attempt": grp.attempt, "group": g}
               for g, grp in self.groups.items() for pid, code in grp.poll()]  # fmt: skip
        out += [{"standby_ready": True, "attempt": grp.attempt, "group": g}
                for g, grp in self.groups.items() if grp.standby_news()]  # fmt: skip
        return out

    def close(self) -> None:
        for grp in self.groups.values():
            grp.kill_all()
            grp.release_spares()
            grp.release_standby()
            grp.release_pool()


__all__ = ["FollowerGroups", "RemoteGroup", "RemoteHost", "check_group_spec", "group_key"]
