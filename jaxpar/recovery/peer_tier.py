"""Peer copies of local snapshots: each node's snapshots also live in another node's RAM.

Every process runs a small TCP server; process P's snapshots go to the process of the same local
rank on the next node (a ring), and a process whose own snapshot is gone fetches the copy. The
ring, the protocol and its token: docs/design.md, "Recovery tiers", "Peer copies".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import threading
import time

from jaxpar import _compat
from jaxpar.recovery import local_tier_store as snap
from jaxpar.rundir.runlog import WorkerEvent

LOOPBACK = ("127.0.0.1", "localhost", "::1")
IO_TIMEOUT_S = 120.0
FETCH_ATTEMPTS = 3  # rounds over the holders of a copy when a connection fails (not a refusal)
COMPLETE_WAIT_S = 60.0  # a completed job: how long a process waits for the others' writers


def _host() -> str:
    """This process's address as the other processes reach it (that of the coordinator route)."""
    coord = os.environ.get("JAXPAR_COORDINATOR", "")
    if not coord:
        coord = _compat.coordinator_address() or ""
    host = coord.rsplit(":", 1)[0].strip("[]")
    if not host or host in LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]


def _read_exact(f, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


def _header(f) -> dict:
    line = f.readline(1 << 20)
    if not line.endswith(b"\n"):
        raise ConnectionError("no header from peer")
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("header is not an object")
    return msg


class _Conn:
    """One connection the server serves, read against a deadline for a whole request (header and
    payload), however slowly its bytes arrive; `trusted` once it has shown the group's token."""

    def __init__(self, sock: socket.socket, source: str):
        self.sock, self.source, self.trusted, self.deadline = sock, source, False, 0.0
        self.leaving = False  # evicted, or its thread has closed it and is about to end
        self.thread: threading.Thread | None = None  # the thread that serves it, then closes it
        self._buf = bytearray()

    def _io(self, read, *args):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError("request deadline passed")
        self.sock.settimeout(left)
        try:
            return read(*args)
        except TimeoutError:
            raise ConnectionError("request deadline passed") from None

    def readline(self, limit: int) -> bytes:
        while b"\n" not in self._buf and len(self._buf) < limit:
            data = self._io(self.sock.recv, 65536)
            if not data:
                break
            self._buf += data
        end = self._buf.find(b"\n") + 1 or min(limit, len(self._buf))
        line, self._buf = bytes(self._buf[:end]), self._buf[end:]
        return line

    def readinto(self, view: memoryview) -> int:
        if self._buf:
            k = min(len(view), len(self._buf))
            view[:k], self._buf = self._buf[:k], self._buf[k:]
            return k
        return self._io(self.sock.recv_into, view, len(view))  # straight into the buffer


class Server:
    """Receives and serves the peer copies kept in this node's local tier.

    At most MAX_CONNECTIONS connections are served at once (a thread each), at most
    MAX_PER_SOURCE of those that have not shown the token from one address; a new connection's
    first request header must arrive within HEADER_S, every request (header and payload) within
    IO_TIMEOUT_S plus its size at MIN_RATE, and when every slot is taken a new connection takes
    the one of the oldest connection that has not shown the token."""

    MAX_CONNECTIONS = 32
    MAX_PER_SOURCE = 8
    HEADER_S = 10.0
    MIN_RATE = 8 << 20  # bytes/s

    def __init__(self, node: str, nproc: int, limit: int):
        self.node, self.nproc, self.limit = node, nproc, limit
        self.token: str | None = None  # set by `met` once the group has met
        self._met = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._conns_lock = threading.Lock()
        host = _host()
        self.sock = socket.create_server((host, 0), family=_family(host))
        self.addr = [host, self.sock.getsockname()[1]]
        self._closed = False
        threading.Thread(target=self._accept, name="jaxpar-peer", daemon=True).start()

    def met(self, token: str) -> None:
        """The group's token is known: requests are served from now on. A request that arrives
        earlier (another process left the exchange first and fetches at once) waits for it."""
        self.token = token
        self._met.set()

    def slots(self, src: int) -> snap.Slots:
        return snap.Slots(os.path.join(self.node, "peer", f"proc{int(src)}"))

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, addr = self.sock.accept()
            except OSError:
                return
            conn = self._admit(sock, addr[0])
            self._reap()
            if conn is None:
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            conn.thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            conn.thread.start()

    def _admit(self, sock: socket.socket, source: str) -> _Conn | None:
        """A slot for a new connection; None when its address holds too many that have not shown
        the token, or every slot is held by connections that have."""
        with self._conns_lock:
            live = [c for c in self._conns if not c.leaving]
            strangers = [c for c in live if not c.trusted]
            if sum(c.source == source for c in strangers) >= self.MAX_PER_SOURCE:
                return None
            if len(live) >= self.MAX_CONNECTIONS:
                if not strangers:
                    return None
                strangers[0].leaving = True  # the oldest
                with contextlib.suppress(OSError):
                    strangers[0].sock.shutdown(socket.SHUT_RDWR)
            conn = _Conn(sock, source)
            self._conns.append(conn)
            return conn

    def _reap(self) -> None:
        """Waits for the threads of the connections that are leaving (evicted, or done) to end:
        a connection's slot is free only once its socket is closed and its thread gone, so the
        server never holds more than MAX_CONNECTIONS of either, however late a leaving thread
        gets to run."""
        with self._conns_lock:
            gone = [c for c in self._conns if c.leaving]
        for c in gone:
            if c.thread is not None:
                c.thread.join(self.HEADER_S)
        with self._conns_lock:
            self._conns = [c for c in self._conns if c not in gone]

    def _serve(self, conn: _Conn) -> None:
        try:
            with conn.sock:
                while True:
                    wait = IO_TIMEOUT_S if conn.trusted else self.HEADER_S  # idle, then a header
                    conn.deadline = time.monotonic() + wait
                    msg = _header(conn)
                    wait = IO_TIMEOUT_S + self._payload(msg) / self.MIN_RATE
                    conn.deadline = time.monotonic() + wait
                    reply, payload = self._handle(msg, conn)
                    size = len(payload) if payload is not None else 0
                    conn.sock.settimeout(IO_TIMEOUT_S + size / self.MIN_RATE)  # the whole reply
                    conn.sock.sendall((json.dumps(reply) + "\n").encode())
                    if payload is not None:
                        conn.sock.sendall(payload)
        except (OSError, ValueError, ConnectionError):
            return
        finally:
            with self._conns_lock:
                conn.leaving = True  # the next connection accepted waits for this thread's end

    def _payload(self, msg: dict) -> int:
        """The bytes that follow a request's header (0 if it announces none within bounds)."""
        marker = msg.get("marker")
        n = marker.get("nbytes") if isinstance(marker, dict) else None
        return n if type(n) is int and 0 <= n <= self.limit else 0

    def _handle(self, msg: dict, f: _Conn) -> tuple[dict, bytes | None]:
        src = msg.get("src")
        end = time.monotonic() + IO_TIMEOUT_S
        while not self._met.wait(0.5):  # an evicted connection stops waiting at once
            if f.leaving or time.monotonic() > end:
                raise ValueError("group token not known")
        if msg.get("token") != self.token:
            raise ValueError("bad token")
        f.trusted = True  # from here on no stranger can evict it, even mid-payload
        if not isinstance(src, int) or not 0 <= src < self.nproc:
            raise ValueError("bad source process")
        if msg.get("op") == "put":
            marker = msg.get("marker")
            n = marker.get("nbytes") if isinstance(marker, dict) else None
            if not isinstance(n, int) or not 0 <= n <= self.limit or "step" not in marker:
                raise ValueError("bad marker")
            data = _read_exact(f, n)
            with self._lock:  # one writer per source at a time
                slots = self.slots(src)
                have = slots.committed()
                newest = max((m["step"] for m in have.values()), default=None)
                k = slots.pick(keep=newest)
                d = slots.begin(k)
                snap.write_data(os.path.join(d, snap.DATA), [data])
                slots.commit(k, marker)
            return {"ok": True}, None
        if msg.get("op") == "get":
            slots = self.slots(src)
            k = slots.find(int(msg.get("step", -1)))
            data = (
                snap.read_bytes(os.path.join(slots.dirs[k], snap.DATA)) if k is not None else None
            )
            marker = snap.read_marker(slots.dirs[k]) if k is not None else None
            if data is None or marker is None:
                return {"ok": False, "why": "no such copy"}, None
            return {"ok": True, "marker": marker, "nbytes": len(data)}, bytes(data)
        raise ValueError("bad op")

    def held(self, run_key: str) -> dict[str, list[int]]:
        """src -> steps of the peer copies in this node's directory that look usable."""
        out: dict[str, list[int]] = {}
        for src in range(self.nproc):
            slots = self.slots(src)
            for k, m in slots.committed().items():
                b = m.get("binding") or {}
                size = snap.file_size(os.path.join(slots.dirs[k], snap.DATA))
                if b.get("run") == run_key and b.get("process") == src and size == m.get("nbytes"):
                    out.setdefault(str(src), []).append(m["step"])
        return out

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Peers:
    """This process's view of the group's peer copies: where to send, where to fetch."""

    def __init__(self, tier, server: Server, offers: list[dict], nodes: list[list[int]]):
        self.tier, self.server, self.offers = tier, server, offers
        self.token = offers[0]["token"]
        me = tier.process
        i = next(n for n, procs in enumerate(nodes) if me in procs)
        rank = nodes[i].index(me)
        dest_node = nodes[(i + 1) % len(nodes)]
        self.dest = dest_node[rank % len(dest_node)]
        self._conn: tuple | None = None  # (socket, reader, address)
        self._failed = False

    @classmethod
    def meet(
        cls, tier, own: dict[int, int], unusable: list[dict] | None = None
    ) -> tuple[list[dict], list[list[int]], Peers | None]:
        """Exchange offers with every process (`own`: step -> slot of its usable snapshots;
        `unusable`: those it found but cannot use); returns (offers, the processes of each node,
        Peers or None on one node)."""
        if tier.nproc == 1:
            return [{"own": sorted(own), "held": {}, "unusable": unusable or []}], [[0]], None
        server = Server(tier.node, tier.nproc, limit=4 * tier.nbytes + (1 << 20))
        node = f"{socket.gethostname()}:{os.path.realpath(tier.node)}"
        mine = {"own": sorted(own), "held": server.held(tier.binding["run"]),
                "unusable": unusable or [], "node": node, "addr": server.addr,
                "token": secrets.token_hex(16) if tier.process == 0 else None}  # fmt: skip
        offers = snap.exchange("offer", mine)
        server.met(offers[0]["token"])
        keys: list[str] = []
        for o in offers:
            if o["node"] not in keys:
                keys.append(o["node"])
        nodes = [[q for q, o in enumerate(offers) if o["node"] == k] for k in keys]
        if len(keys) < 2:
            server.close()
            return offers, nodes, None
        return offers, nodes, cls(tier, server, offers, nodes)

    # -- sending (the tier's writer thread) -----------------------------------------------------

    def _request(self, addr, header: dict, chunks=()) -> tuple[dict, object]:
        if self._conn is None or self._conn[2] != tuple(addr):
            self._drop_conn()
            sock = socket.create_connection(tuple(addr), timeout=IO_TIMEOUT_S)
            self._conn = (sock, sock.makefile("rb"), tuple(addr))
        sock, f, _ = self._conn
        sock.sendall((json.dumps({**header, "token": self.token}) + "\n").encode())
        for c in chunks:
            sock.sendall(memoryview(c))
        return _header(f), f

    def _drop_conn(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn[1].close()
                self._conn[0].close()
            self._conn = None

    def replicate(self, marker: dict, chunks: list) -> None:
        """Send one committed snapshot to this process's peer; a failure is logged once."""
        try:
            reply, _ = self._request(self.offers[self.dest]["addr"],
                                     {"op": "put", "src": self.tier.process, "marker": marker},
                                     chunks)  # fmt: skip
            if not reply.get("ok"):
                raise ConnectionError(f"peer refused: {reply}")
        except (OSError, ValueError, ConnectionError) as e:
            self._drop_conn()
            if not self._failed:
                self._failed = True
                self.tier.run.event(WorkerEvent.PEER_REPLICATION_FAILED, all_processes=True,
                                    step=marker["step"], peer=self.dest, error=str(e)[:300])  # fmt: skip

    # -- restoring ------------------------------------------------------------------------------

    def fetch(self, step: int) -> tuple[dict | None, bytearray | None, str]:
        """This process's snapshot of `step` from a process holding its peer copy:
        (marker, bytes, "") or (None, None, why not). A failed connection is retried."""
        me = str(self.tier.process)
        holders = [q for q, o in enumerate(self.offers) if step in o.get("held", {}).get(me, [])]
        if not holders:
            return None, None, "no copy (own or peer)"
        errors: list[str] = []
        for attempt in range(FETCH_ATTEMPTS):
            if attempt:
                time.sleep(attempt)
            errors, retry = [], False
            for q in holders:
                try:
                    reply, f = self._request(self.offers[q]["addr"],
                                             {"op": "get", "src": self.tier.process,
                                              "step": step})  # fmt: skip
                    if not reply.get("ok"):
                        errors.append(f"process {q}: {str(reply.get('why', 'refused'))[:100]}")
                        continue
                    n = int(reply["nbytes"])
                    if not 0 <= n <= self.server.limit:
                        self._drop_conn()  # its bytes are not read: the stream is out of step
                        errors.append(f"process {q}: {n} bytes is out of bounds")
                        continue
                    return reply["marker"], _read_exact(f, n), ""
                except (OSError, ValueError, ConnectionError, KeyError, TypeError) as e:
                    self._drop_conn()
                    errors.append(f"process {q}: {type(e).__name__}: {str(e)[:100]}")
                    retry = True
            if not retry:
                break
        return None, None, "peer copy not fetched: " + "; ".join(errors)

    def drop_held(self, keep: int | None = None) -> None:
        """Invalidate the peer copies this node holds, except those of step `keep`."""
        with self.server._lock:
            for src in range(self.tier.nproc):
                self.server.slots(src).drop_except(keep)

    def remove_held(self) -> None:
        """The job completed: once every process's writer has stopped (so that no copy is on its
        way here any more), remove the peer copies this node holds."""
        self._drop_conn()
        with contextlib.suppress(Exception):  # a process that never comes: remove them anyway
            snap.exchange("complete", True, timeout_s=COMPLETE_WAIT_S)
        with self.server._lock:  # rmtree follows no symlink
            for src in range(self.tier.nproc):
                shutil.rmtree(self.server.slots(src).root, ignore_errors=True)

    def close(self) -> None:
        self._drop_conn()
        self.server.close()
