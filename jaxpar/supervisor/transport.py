"""The control channel between agents (`jaxpar launch --nnodes N`): newline-delimited JSON over
TCP, authenticated by a shared secret (`token()`).

The handshake, what a leader may say, the limits and the binds: docs/design.md, "Several hosts:
the control channel"; its security: docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import hmac
import queue
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable

from jaxpar.rundir.runlog import SupervisorEvent
from jaxpar.supervisor.channel import (
    HANDSHAKE_S,
    Channel,
    ChannelError,
    Lines,
    mac,
    send_line,
    token,
)
from jaxpar.supervisor.group import LocalGroup, Wakeup
from jaxpar.supervisor.options import Options, say

MAX_HANDSHAKES = 32  # connections being admitted at once
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
    """The leader's listening socket: admits the other agents, each connection in its own thread.

    `event(name, **fields)` records what was refused; `waker` is poked on every message."""

    def __init__(self, opts: Options, key: bytes, event: Callable, waker: Wakeup):
        self.opts, self.key, self.event, self.waker = opts, key, event, waker
        self.joined: queue.Queue = queue.Queue()
        self.taken: dict[int, RemoteNode] = {}
        self._lock = threading.Lock()
        self.closed = False
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        family = socket.AF_INET6 if ":" in opts.bind else socket.AF_INET
        self.server = socket.create_server((opts.bind, opts.control_port), family=family)
        self.server.settimeout(0.5)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, addr = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # a flood: no thread per connection
                self.event(SupervisorEvent.CONTROL_REJECTED, peer=f"{addr[0]}:{addr[1]}",
                           reason=f"more than {MAX_HANDSHAKES} connections at once")  # fmt: skip
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            threading.Thread(target=self._admit, args=(sock, addr), daemon=True).start()

    def _admit(self, sock: socket.socket, addr) -> None:
        try:
            self._handshake(sock, f"{addr[0]}:{addr[1]}")
        finally:
            self._slots.release()

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        sock.settimeout(HANDSHAKE_S)
        lines = Lines(sock)
        try:
            nonce = secrets.token_hex(16)
            send_line(sock, {"challenge": nonce})
            hello = lines.next()
            if hello is None or "hello" not in hello:
                raise ChannelError("no hello")
            rank, nproc = _int(hello, "hello"), _int(hello, "nproc")
            theirs = hello.get("nonce")
            if not isinstance(theirs, str) or not isinstance(hello.get("mac"), str):
                raise ChannelError("no proof of the token")
            if not hmac.compare_digest(
                hello["mac"].encode(), mac(self.key, "f", nonce, theirs, rank, nproc).encode()
            ):
                self._refuse(sock, peer, "authentication failed (the agents' tokens differ)")
                return
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
                    node = RemoteNode(Channel(sock, lines, self.waker), hello)
                    self.taken[rank] = node
            if reason:
                self._refuse(sock, peer, reason)
                return
            self.joined.put(node)
            self.waker.poke()
        except (OSError, ChannelError) as e:
            self.event(
                SupervisorEvent.CONTROL_REJECTED, peer=peer, reason=str(e) or type(e).__name__
            )
            with contextlib.suppress(OSError):
                sock.close()

    def _refuse(self, sock: socket.socket, peer: str, reason: str) -> None:
        self.event(SupervisorEvent.CONTROL_REJECTED, peer=peer, reason=reason)
        say(f"refused a control connection from {peer}: {reason}")
        with contextlib.suppress(OSError):
            send_line(sock, {"refused": reason})
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
            self.server.close()
        return [self.taken[r] for r in sorted(self.taken)]


# ---- a follower ---------------------------------------------------------------------------------


def _connect(opts: Options, key: bytes, waker: Wakeup) -> Channel | str:
    """An authenticated channel to the leader, or the reason it refused us. Servers that cannot
    prove the token are left (and retried until the rendezvous timeout)."""
    deadline = time.time() + opts.rendezvous_timeout_s
    while True:
        try:
            sock = socket.create_connection((opts.host, opts.control_port), timeout=5)
            sock.settimeout(HANDSHAKE_S)
            lines = Lines(sock)
            challenge = lines.next()
            if challenge is None or not isinstance(challenge.get("challenge"), str):
                raise ChannelError("the server sent no challenge")
            nonce, rank, nproc = secrets.token_hex(16), opts.node_rank, opts.nproc
            send_line(sock, {"hello": rank, "nproc": nproc, "host": socket.gethostname(),
                         "nonce": nonce,
                         "mac": mac(key, "f", challenge["challenge"], nonce, rank, nproc)})  # fmt: skip
            reply = lines.next()
            if reply is not None and isinstance(reply.get("refused"), str):
                sock.close()
                return reply["refused"][:200]
            proof = reply.get("welcome") if reply else None
            if not isinstance(proof, str) or not hmac.compare_digest(
                proof.encode(), mac(key, "l", nonce, challenge["challenge"]).encode()
            ):
                raise ChannelError("the server could not prove the token")
            return Channel(sock, lines, waker)
        except (OSError, ChannelError) as e:
            if isinstance(e, ChannelError):
                say(f"node {opts.node_rank}: left {opts.coordinator}: {e}")
                with contextlib.suppress(OSError, UnboundLocalError):
                    sock.close()
            if time.time() > deadline:
                return f"no leader at {opts.coordinator} after {opts.rendezvous_timeout_s:.0f}s"
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
    chan = _connect(opts, key, waker)
    if isinstance(chan, str):
        say(f"node {opts.node_rank}: {chan}")
        return 2 if "no leader" not in chan else 1
    group = LocalGroup(opts, waker)
    signal.signal(signal.SIGTERM, lambda *_: group.send(signal.SIGTERM))  # preemption notice
    say(f"node {opts.node_rank}: joined the leader at {opts.coordinator}")
    stopped: list[int] = []
    try:
        while True:
            for msg in chan.messages():
                if msg is None:
                    say(f"node {opts.node_rank}: leader gone; stopping local workers")
                    return 1
                try:
                    code = _follow(msg, group, chan)
                except (ChannelError, TypeError, ValueError) as e:
                    say(f"node {opts.node_rank}: ignored a malformed message from the leader: {e}")
                    continue
                if code is not None:
                    return code
            for pid, code in group.poll():
                chan.send({"exit": pid, "code": code, "attempt": group.attempt})
            if (now := group.stopped()) != stopped:  # a hang names a stopped worker
                stopped = now
                chan.send({"stopped_workers": now, "attempt": group.attempt})
            waker.wait(opts.poll_s * 5)
    finally:
        group.kill_all()
        group.release_spares()
        chan.close()


def _follow(msg: dict, group: LocalGroup, chan: Channel) -> int | None:
    """Carry out one leader message; an exit code when the agent should leave."""
    cmd = msg.get("cmd")
    if cmd == "start":
        group.start(check_spec(msg.get("spec")))
    elif cmd == "signal":
        sig = _int(msg, "sig")
        if sig not in SIGNALS:
            raise ChannelError(f"signal {sig} is not one the leader may send")
        group.send(sig)
    elif cmd == "stop":
        grace = msg.get("grace_s")
        if not isinstance(grace, int | float) or not 0 <= grace <= 3600:
            raise ChannelError("stop needs grace_s in [0, 3600]")
        chan.send({"stopped": group.stop(float(grace))})
    elif cmd == "exit":
        return _int(msg, "code")
    return None
