"""The control channel between agents (`jaxpar launch --nnodes N`): newline-delimited JSON over
TCP, authenticated by a shared secret (`token()`).

The handshake, what a leader may say, the limits and the binds: docs/design.md, "Several hosts:
the control channel"; its security: docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable

from jaxpar.supervisor.admission import Gate, Pending, Refusals
from jaxpar.supervisor.channel import (
    Channel,
    ChannelError,
    Lines,
    Session,
    mac,
    printable,
    same,
    send_line,
    token,
)
from jaxpar.supervisor.group import LocalGroup, Wakeup
from jaxpar.supervisor.options import Options, say

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGCONT)  # what a leader may have sent


# ---- the leader's side --------------------------------------------------------------------------


def _int(msg: dict, key: str) -> int:
    v = msg.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ChannelError(f"{key!r} must be an integer")
    return v


class RemoteNode:
    """Another host's agent, driven over its Channel."""

    def __init__(self, chan: Channel, hello: dict):
        self.chan, self.hello, self.lost = chan, hello, False
        self.rank, self.nproc = int(hello["hello"]), int(hello["nproc"])
        self.pending: list[tuple[int, int]] = []
        self.attempt = -1
        self._grace = 0.0
        self._stopped: list[int] = []

    def start(self, spec: dict) -> None:
        self.attempt = int(spec["attempt"])
        self.chan.send({"cmd": "start", "spec": spec})

    def poll(self) -> list[tuple[int, int]]:
        for msg in self.chan.messages():
            if msg is None:
                if self.chan.error and not self.lost:
                    say(f"node {self.rank}: control channel broken ({self.chan.error})")
                self.lost = True
                continue
            try:
                if "exit" in msg and _int(msg, "attempt") == self.attempt:  # not a stopped group's
                    self.pending.append((_int(msg, "exit"), _int(msg, "code")))
                elif "stopped_workers" in msg and _int(msg, "attempt") == self.attempt:
                    ids = msg["stopped_workers"]
                    self._stopped = [i for i in ids if type(i) is int] if type(ids) is list else []
            except ChannelError:
                continue
        out, self.pending = self.pending, []
        return out

    def group_stepping(self) -> None:
        """Nothing to do: a standby group is built on the leader's host only."""

    def stopped(self) -> list[int]:
        """Process ids the agent last saw stopped (SIGSTOP)."""
        return list(self._stopped)

    def signal(self, sig: int) -> None:
        self.chan.send({"cmd": "signal", "sig": int(sig)})

    def request_stop(self, grace_s: float) -> None:
        self.chan.send({"cmd": "stop", "grace_s": grace_s})
        self._grace = grace_s

    def wait_stopped(self) -> dict:
        if self.lost or self.chan.closed:
            return {}
        msg = self.chan.wait_for("stopped", self._grace + 30)
        if msg is None or not isinstance(msg["stopped"], dict):
            self.lost = True
            return {}
        return {k: v for k, v in msg["stopped"].items() if isinstance(v, int)}

    def log_of(self, pid: int) -> str | None:
        return None

    def close(self, code: int) -> None:
        self.chan.send({"cmd": "exit", "code": code})
        self.chan.close()


class Rendezvous:
    """The leader's listening socket: admits the other agents under the rules of
    jaxpar/supervisor/admission.py (bounded handshakes, each in its own thread, a deadline of
    `opts.handshake_timeout_s` for the whole of it, the oldest cut short for a new one, an accept
    loop that outlives any error). `event(name, **fields)` records what was refused
    (rate-limited: `Refusals`); `waker` is poked on every message."""

    def __init__(self, opts: Options, key: bytes, event: Callable, waker: Wakeup):
        self.opts, self.key, self.waker = opts, key, waker
        self.refusals = Refusals(event)
        self.joined: queue.Queue = queue.Queue()
        self.taken: dict[int, RemoteNode] = {}
        self._lock = threading.Lock()
        self.closed = False
        family = socket.AF_INET6 if ":" in opts.bind else socket.AF_INET
        self.server = socket.create_server((opts.bind, opts.control_port), family=family)
        self.gate = Gate(self.server, self._handshake, deadline_s=opts.handshake_timeout_s,
                         refusals=self.refusals, name="jaxpar-rendezvous")  # fmt: skip

    def _handshake(self, slot: Pending) -> None:
        """One connection's handshake (in its own thread); an exception refuses it (Gate)."""
        sock, peer = slot.sock, slot.peer
        lines = Lines(sock)
        nonce = secrets.token_hex(16)
        sock.settimeout(self.opts.handshake_timeout_s)
        send_line(sock, {"challenge": nonce})
        hello = lines.next(slot.deadline)
        if hello is None or "hello" not in hello:
            raise ChannelError("no hello")
        rank, nproc = _int(hello, "hello"), _int(hello, "nproc")
        theirs = hello.get("nonce")
        if not isinstance(theirs, str) or len(theirs) > 64 or "mac" not in hello:
            raise ChannelError("no proof of the token")
        if not same(hello["mac"], mac(self.key, "f", nonce, theirs, rank, nproc)):
            self._refuse(sock, peer, "authentication failed (the agents' tokens differ)",
                         (theirs, nonce))  # fmt: skip
            return
        if not self.gate.admitted(slot):  # cut short meanwhile
            raise ChannelError("proved the token too late")
        with self._lock:
            if not 0 < rank < self.opts.nnodes:
                reason = f"node rank {rank} is not in [1, {self.opts.nnodes})"
            elif rank in self.taken or self.closed:
                reason = f"node rank {rank} has already joined"
            elif not 0 < nproc <= 4096:
                reason = f"nproc {nproc} is not in [1, 4096]"
            else:
                reason = None
                send_line(sock, {"welcome": mac(self.key, "l", theirs, nonce)})
                session = Session(self.key, nonce, theirs, leader=True)
                node = RemoteNode(Channel(sock, lines, session, self.waker), hello)
                self.taken[rank] = node
        if reason:
            self._refuse(sock, peer, reason, (theirs, nonce))
            return
        self.joined.put(node)
        self.waker.poke()

    def _refuse(self, sock: socket.socket, peer: str, reason: str, nonces: tuple) -> None:
        """Tell an agent why it is refused, with a MAC it can verify if it has the token (and a
        stranger's text can be told from ours: it cannot make one)."""
        self.refusals.add(peer, reason, loud=True)
        with contextlib.suppress(OSError):
            send_line(sock, {"refused": reason, "mac": mac(self.key, "r", *nonces, reason)})
            sock.close()

    def wait(self, stop: Callable[[], bool]) -> list[RemoteNode]:
        """Every other agent, by rank; RuntimeError after the rendezvous timeout or on `stop()`."""
        o = self.opts
        deadline = time.time() + o.rendezvous_timeout_s
        say(f"waiting for {o.nnodes - 1} agent(s) at {o.coordinator}")
        try:
            while len(self.taken) < o.nnodes - 1 or self.joined.qsize() < o.nnodes - 1:
                if time.time() > deadline or stop():
                    raise RuntimeError(
                        f"only {len(self.taken) + 1} of {o.nnodes} agents joined at "
                        f"{o.coordinator} within {o.rendezvous_timeout_s:.0f}s"
                    )
                self.waker.wait(0.5)
        finally:
            with self._lock:
                self.closed = True
            self.gate.close()
            self.server.close()
        return [self.taken[r] for r in sorted(self.taken)]


# ---- a follower ---------------------------------------------------------------------------------


def _handshake(opts: Options, key: bytes, waker: Wakeup) -> Channel | tuple[int, str]:
    """One attempt: an authenticated channel, (2, the leader's reason) when the leader (proven
    by its MAC) refused us; ChannelError when the server could not prove the token."""
    sock = socket.create_connection((opts.host, opts.control_port), timeout=5)
    try:
        deadline = time.monotonic() + opts.handshake_timeout_s
        lines = Lines(sock)
        challenge = lines.next(deadline)
        theirs = challenge.get("challenge") if challenge else None
        if not isinstance(theirs, str) or len(theirs) > 64:
            raise ChannelError("the server sent no challenge")
        nonce, rank, nproc = secrets.token_hex(16), opts.node_rank, opts.nproc
        sock.settimeout(opts.handshake_timeout_s)
        send_line(sock, {"hello": rank, "nproc": nproc, "host": socket.gethostname(),
                         "nonce": nonce, "mac": mac(key, "f", theirs, nonce, rank, nproc)})  # fmt: skip
        reply = lines.next(deadline) or {}
        if "refused" in reply:
            reason = reply["refused"]
            if not same(reply.get("mac"), mac(key, "r", nonce, theirs, reason)):
                raise ChannelError(
                    "refused by a server that could not prove the token (do the agents' tokens "
                    f"differ?): {printable(reason)}"
                )
            sock.close()
            return 2, printable(reason)
        if not same(reply.get("welcome"), mac(key, "l", nonce, theirs)):
            raise ChannelError("the server could not prove the token")
        return Channel(sock, lines, Session(key, theirs, nonce, leader=False), waker)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise


def _connect(opts: Options, key: bytes, waker: Wakeup) -> Channel | tuple[int, str]:
    """An authenticated channel to the leader, or (exit code, why not). Servers that cannot prove
    the token are left (and retried until the rendezvous timeout); nothing they say is obeyed."""
    deadline = time.time() + opts.rendezvous_timeout_s
    left_one = ""
    while True:
        try:
            return _handshake(opts, key, waker)
        except (OSError, ChannelError) as e:
            if isinstance(e, ChannelError):
                if str(e) != left_one:  # said once, not once per attempt
                    say(f"node {opts.node_rank}: left {opts.coordinator}: {e}")
                left_one = str(e)
            if time.time() > deadline:
                why = f"no leader at {opts.coordinator} after {opts.rendezvous_timeout_s:.0f}s"
                return (2, f"{why}; last: {left_one}") if left_one else (1, why)
            time.sleep(0.5)


def check_spec(spec: object) -> dict:
    """The leader's start message, checked field by field (ChannelError if malformed)."""
    if not isinstance(spec, dict):
        raise ChannelError("spec is not an object")
    for key in ("incarnation", "nproc", "attempt"):
        _int(spec, key)
    for key in ("coordinator", "bind"):
        if not isinstance(spec.get(key), str) or len(spec[key]) > 300:
            raise ChannelError(f"spec {key!r} must be a string")
    ids = spec.get("process_ids")
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ChannelError("spec 'process_ids' must be a list of process ids")
    faults = spec.get("faults", [])
    if not isinstance(faults, list) or not all(isinstance(f, str) for f in faults):
        raise ChannelError("spec 'faults' must be a list of strings")
    if not isinstance(spec.get("collective_timeout"), int | float):
        raise ChannelError("spec 'collective_timeout' must be a number")
    if not isinstance(spec.get("run_lock", ""), str):
        raise ChannelError("spec 'run_lock' must be a string")
    layout = spec.get("layout")
    if layout is not None and not (
        isinstance(layout, dict) and isinstance(layout.get("mesh"), str)
        and type(layout.get("microbatches")) is int
    ):  # fmt: skip
        raise ChannelError("spec 'layout' must be {mesh, microbatches}")
    return spec


def run_follower(opts: Options) -> int:
    """Agent on a host other than --node-rank 0: runs its own command line as the leader
    coordinates (incarnation, ports, process ids)."""
    try:
        key = token(opts)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    waker = Wakeup()
    group = LocalGroup(opts, waker)
    group.open_pool_early()  # a fork, before the control channel's threads
    chan = _connect(opts, key, waker)
    if isinstance(chan, tuple):
        group.release_pool()
        say(f"node {opts.node_rank}: {chan[1]}")
        return chan[0]
    from jaxpar.supervisor.group_hosts import FollowerGroups

    replicas = FollowerGroups(opts, waker, key)  # this host's replica groups, if the job has any

    def notice(*_) -> None:  # the preemption notice
        group.send(signal.SIGTERM)
        replicas.send(signal.SIGTERM)

    signal.signal(signal.SIGTERM, notice)
    say(f"node {opts.node_rank}: joined the leader at {opts.coordinator}")
    stopped: list[int] = []
    try:
        while True:
            for msg in chan.messages():
                if msg is None:
                    why = f"control channel broken ({chan.error})" if chan.error else "leader gone"
                    say(f"node {opts.node_rank}: {why}; stopping local workers")
                    return 1
                try:
                    code = _follow(msg, group, chan, replicas)
                except (ChannelError, TypeError, ValueError, KeyError) as e:
                    say(f"node {opts.node_rank}: ignored a malformed message from the leader: "
                        f"{printable(e)}")  # fmt: skip
                    continue
                if code is not None:
                    return code
            for pid, code in group.poll():
                chan.send({"exit": pid, "code": code, "attempt": group.attempt})
            for exited in replicas.poll():
                chan.send(exited)
            if (now := group.stopped()) != stopped:  # a hang names a stopped worker
                stopped = now
                chan.send({"stopped_workers": now, "attempt": group.attempt})
            waker.wait(opts.poll_s * 5)
    finally:
        group.kill_all()
        group.release_spares()
        group.release_pool()
        replicas.close()
        chan.close()


def _follow(msg: dict, group: LocalGroup, chan: Channel, replicas) -> int | None:
    """Carry out one leader message; an exit code when the agent should leave. A message
    naming a `group` is for one of this host's replica groups (`replicas`, FollowerGroups)."""
    cmd = msg.get("cmd")
    if cmd == "start":
        spec = check_spec(msg.get("spec"))
        if "group" in spec:
            try:
                chan.send(replicas.start(spec))
            except ValueError as e:  # said to the leader, which gives up with this line
                say(f"node {replicas.opts.node_rank}: refused to start a replica group: {e}")
                chan.send({"group": spec.get("group"), "attempt": spec["attempt"],
                           "refused": str(e)[:300]})  # fmt: skip
        else:
            group.start(spec)
    elif cmd == "signal":
        sig = _int(msg, "sig")
        if sig not in SIGNALS:
            raise ChannelError(f"signal {sig} is not one the leader may send")
        if "group" in msg:
            replicas.send(sig, msg["group"])
        else:
            group.send(sig)
    elif cmd == "stop":
        grace = msg.get("grace_s")
        if not isinstance(grace, int | float) or not 0 <= grace <= 3600:
            raise ChannelError("stop needs grace_s in [0, 3600]")
        if "group" in msg:  # no reply: the leader starts it again next, or leaves
            replicas.stop(msg["group"], float(grace))
        else:
            chan.send({"stopped": group.stop(float(grace))})
    elif cmd == "stepping":  # a replica group that stepped in a quorum: its standby may be built
        replicas.stepping(msg.get("group"), msg.get("attempt"))
    elif cmd == "exit":
        return _int(msg, "code")
    return None
