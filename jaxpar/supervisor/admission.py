"""Admission of unauthenticated connections to a listening socket: the rules the agents' control
channel (transport.Rendezvous) and the replica groups' hub (replicas.Hub) share.

- The accept loop never ends while the socket is open: out of descriptors (EMFILE, ENFILE),
  buffers or memory, or any other error, it says so once (a minute), backs off (50 ms doubling
  to 1 s) and goes on; out of descriptors it also cuts the oldest handshake short, so that
  connections that prove nothing give way first.
- At most `max_pending` connections are in their handshake at once, each in a thread of its
  own, at most `max_per_source` of them from one address. A new connection from an address at
  its limit takes the slot of that address's oldest handshake, and when every slot is taken it
  takes the oldest one's: a real peer's handshake is one round trip, so connections that never
  finish cannot keep it out, even from its own address (another user on its host, a NAT).
- The whole handshake has `deadline_s`, however slowly its bytes trickle in (the handshake
  reads with `Pending.deadline`; the loop also cuts short any handshake past it).
- A connection that has proven the key leaves the handshake slots (`Gate.admitted`): nothing
  above applies to it any more.
- Refused connections are recorded as `control_rejected` events, rate-limited (`Refusals`).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from jaxpar.rundir.runlog import SupervisorEvent
from jaxpar.supervisor.channel import printable
from jaxpar.supervisor.options import say

MAX_PENDING = 32  # connections in their handshake at once
MAX_PER_SOURCE = 4  # of them from one address
BACKOFF_S = (0.05, 1.0)  # the accept loop's pause after an error: first, longest
SAY_AGAIN_S = 60.0  # an accept error of one kind is said once in this time
# the errors of a process (or host) out of resources: the pending connection stays queued
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Refusals:
    """Refused connections as `control_rejected` events (and console lines): the first `each` of
    every `interval_s` one by one, the rest as one summary event at the end of the interval with
    their count, so that a flood fills neither events.jsonl nor the console. `what` names the
    connections on the console; `fields` are added to every event."""

    def __init__(self, event: Callable, each: int = 10, interval_s: float = 10.0,
                 what: str = "control connection", fields: dict | None = None):  # fmt: skip
        self.event, self.each, self.interval_s = event, each, interval_s
        self.what, self.fields = what, dict(fields or {})
        self._lock = threading.Lock()
        self._since = time.monotonic()
        self.total = 0  # refusals so far
        self._seen = 0  # refusals in this interval
        self._reasons: Counter = Counter()  # those not recorded one by one
        self._sources: Counter = Counter()

    def add(self, peer: str, reason: str, loud: bool = False) -> None:
        """One refusal; `loud`: also said on the console (when recorded one by one)."""
        self.flush()
        with self._lock:
            self.total += 1
            self._seen += 1
            alone = self._seen <= self.each
            if not alone:
                self._reasons[reason] += 1
                self._sources[peer.rpartition(":")[0]] += 1
        if alone:
            self.event(SupervisorEvent.CONTROL_REJECTED, peer=peer, reason=reason, **self.fields)
            if loud:
                say(f"refused a {self.what} from {peer}: {printable(reason)}")

    def flush(self, force: bool = False) -> None:
        """Record the summary of an interval that has ended (`force`: the one under way)."""
        with self._lock:
            if not force and time.monotonic() - self._since < self.interval_s:
                return
            reasons, sources = self._reasons, self._sources
            took = time.monotonic() - self._since
            self._since, self._seen = time.monotonic(), 0
            self._reasons, self._sources = Counter(), Counter()
        count = sum(reasons.values())
        if not count:
            return
        ((top, n),) = sources.most_common(1)
        self.event(SupervisorEvent.CONTROL_REJECTED, peer=f"{len(sources)} address(es), most {top}",
                   reason=f"{count} more connections refused in {took:.0f}s", count=count,
                   reasons=dict(reasons.most_common(5)), sources=dict(sources.most_common(5)),
                   **self.fields)  # fmt: skip
        say(f"refused {count} more {self.what}s in {took:.0f}s ({n} from {top}; "
            f"{printable(reasons.most_common(1)[0][0])})")  # fmt: skip


class Pending:
    """A connection in its handshake: it holds one of the gate's slots until it is admitted,
    refused, or cut short (`evicted` then says why)."""

    def __init__(self, sock: socket.socket, addr, deadline_s: float):
        self.sock, self.source = sock, str(addr[0])
        self.peer = f"{addr[0]}:{addr[1]}"
        self.since = time.monotonic()
        self.deadline = self.since + deadline_s  # time.monotonic() of the handshake's end
        self.evicted: str | None = None


class Gate:
    """Accepts connections on `server` and runs `handshake(pending)` for each in a thread of its
    own under the rules above. An exception from `handshake` (or a connection cut short) is a
    refusal: the socket is closed and the reason recorded in `refusals`. A handshake that
    returns, or calls `admitted`, frees its slot."""

    def __init__(self, server: socket.socket, handshake: Callable[[Pending], None], *,
                 deadline_s: float, refusals: Refusals, max_pending: int = MAX_PENDING,
                 max_per_source: int = MAX_PER_SOURCE, name: str = "jaxpar-accept"):  # fmt: skip
        self.server, self.handshake, self.refusals = server, handshake, refusals
        self.deadline_s, self.name = deadline_s, name
        self.max_pending, self.max_per_source = max_pending, max_per_source
        self.closed = False
        self._lock = threading.Lock()
        self._pending: list[Pending] = []
        self._said: dict[str, float] = {}  # accept error kind -> when it was last said
        server.settimeout(0.5)
        self.thread = threading.Thread(target=self._accept, daemon=True, name=name)
        self.thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def admitted(self, slot: Pending) -> bool:
        """`slot`'s peer has proven the key: it leaves the handshake slots (False if it was cut
        short meanwhile: its socket is being shut down)."""
        with self._lock:
            if slot.evicted is not None:
                return False
            with contextlib.suppress(ValueError):
                self._pending.remove(slot)
            return True

    def close(self) -> None:
        self.closed = True
        with self._lock:
            for slot in list(self._pending):
                self._evict(slot, "cut short: the server closed")

    # -- the accept loop --------------------------------------------------------------------------

    def _accept(self) -> None:
        pause = 0.0
        try:
            while not self.closed and self.server.fileno() >= 0:
                try:
                    self.refusals.flush()
                    self._reap()
                    try:
                        sock, addr = self.server.accept()
                    except TimeoutError:
                        continue
                    self._admit(sock, addr)
                    pause = 0.0
                except Exception as e:  # noqa: BLE001 - the loop must outlive any error
                    if self.closed or self.server.fileno() < 0:
                        return
                    pause = min(max(2 * pause, BACKOFF_S[0]), BACKOFF_S[1])
                    self._failed(e)
                    time.sleep(pause)
        finally:
            self.refusals.flush(force=True)

    def _failed(self, e: Exception) -> None:
        """An error of the accept loop: said once per kind (again after SAY_AGAIN_S); out of
        resources, the oldest handshake is cut short (its descriptor is one a real peer needs)."""
        kind = errno.errorcode.get(e.errno, "") if isinstance(e, OSError) and e.errno else ""
        kind = kind or type(e).__name__
        now = time.monotonic()
        if now - self._said.get(kind, -SAY_AGAIN_S) >= SAY_AGAIN_S:
            self._said[kind] = now
            say(f"{self.name}: cannot accept a connection ({printable(e)}); retrying, connections "
                f"wait meanwhile")  # fmt: skip
        if isinstance(e, OSError) and e.errno in EXHAUSTED:
            with self._lock:
                if self._pending:
                    self._evict(self._pending[0], f"cut short: out of descriptors ({kind})")

    def _admit(self, sock: socket.socket, addr) -> None:
        slot = Pending(sock, addr, self.deadline_s)
        with self._lock:
            mine = [p for p in self._pending if p.source == slot.source]
            if len(mine) >= self.max_per_source:
                self._evict(mine[0], f"cut short: more than {self.max_per_source} handshakes at "
                            f"once from {slot.source}")  # fmt: skip
            if len(self._pending) >= self.max_pending:
                self._evict(self._pending[0],
                            f"cut short: more than {self.max_pending} handshakes at once")  # fmt: skip
            self._pending.append(slot)
        try:
            threading.Thread(target=self._run, args=(slot,), daemon=True,
                             name=f"{self.name}-handshake").start()  # fmt: skip
        except RuntimeError:  # no thread to be had: refused like any other
            self._release(slot)
            self._close(slot)
            self.refusals.add(slot.peer, "no thread for its handshake")

    def _reap(self) -> None:
        """Cut short every handshake past its deadline (the handshake's own reads end it first;
        this is for the one that does not read: stuck in a send)."""
        now = time.monotonic()
        with self._lock:
            for slot in [p for p in self._pending if now > p.deadline]:
                self._evict(slot, f"cut short: not done within {self.deadline_s:g}s")

    def _evict(self, slot: Pending, why: str) -> None:  # under self._lock
        with contextlib.suppress(ValueError):
            self._pending.remove(slot)
        slot.evicted = why
        with contextlib.suppress(OSError):  # its thread sees the end and closes the socket
            slot.sock.shutdown(socket.SHUT_RDWR)

    def _release(self, slot: Pending) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._pending.remove(slot)

    @staticmethod
    def _close(slot: Pending) -> None:
        with contextlib.suppress(OSError):
            slot.sock.close()

    def _run(self, slot: Pending) -> None:
        try:
            self.handshake(slot)
        except Exception as e:  # noqa: BLE001 - whatever a stranger caused: a refusal
            why = printable(e) or type(e).__name__
            if slot.evicted is not None:
                why = f"handshake {slot.evicted} ({why})"
            self._close(slot)
            self.refusals.add(slot.peer, why)
        finally:
            self._release(slot)
