"""The peer-copy server under idle and slow connections: a bounded number of connections (and
threads), a whole-request deadline however slowly bytes arrive, a per-address limit, and the
group's own requests still served.

    python -m pytest tests/recovery/test_peer_server_limits.py
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time

import psutil
import pytest

from jaxpar.recovery import peer_tier

pytestmark = pytest.mark.timeout(120)

TOKEN = "t" * 32


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_COORDINATOR", "127.0.0.1:1")  # the address the server binds
    srv = peer_tier.Server(str(tmp_path / "node"), nproc=2, limit=1 << 20)
    srv.met(TOKEN)
    yield srv
    srv.close()


def _request(sock: socket.socket, f, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
    sock.sendall((json.dumps({**header, "token": TOKEN}) + "\n").encode() + payload)
    reply = json.loads(f.readline())
    return reply, f.read(reply.get("nbytes", 0)) if reply.get("ok") else b""


def _put_then_get(addr, data: bytes) -> bytes:
    """One connection: a copy sent, then read back (the group's requests, as Peers makes them)."""
    with socket.create_connection(tuple(addr), timeout=30) as sock, sock.makefile("rb") as f:
        marker = {"step": 3, "nbytes": len(data)}
        reply, _ = _request(sock, f, {"op": "put", "src": 1, "marker": marker}, data)
        assert reply == {"ok": True}, reply
        reply, got = _request(sock, f, {"op": "get", "src": 1, "step": 3})
        assert reply["ok"] and reply["marker"]["step"] == 3, reply
        return got


def _open(addr, source: str) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind((source, 0))
        s.settimeout(10)
        s.connect(tuple(addr))
        return s
    except OSError:
        s.close()
        return None


def _served(addr) -> int:
    """This process's sockets on the server's side of its address (the listener aside). The
    address, not only the port: a client socket bound to 127.0.0.N may get the server's port
    number as its own (another address), and is not the server's."""
    host, port = addr
    conns = psutil.Process().net_connections(kind="tcp")
    return sum(1 for c in conns if c.laddr and c.laddr.port == port and c.laddr.ip == host
               and c.status != "LISTEN")  # fmt: skip


@contextlib.contextmanager
def _crowd(server, n: int, sources: int):
    """n idle connections from `sources` addresses, each opened in turn; checks that while they
    are opened and then dealt with, the server holds a thread per connection served and no more,
    and a socket per connection served plus the one just accepted while it decides whether that
    one gets a slot. Yields the sockets; closes them on the way out."""
    before = threading.active_count()
    most_threads = most_served = 0
    socks = []
    try:
        for i in range(n):
            socks.append(_open(server.addr, f"127.0.0.{2 + i % sources}"))
            most_threads = max(most_threads, threading.active_count() - before)
            if i % 5 == 0:
                most_served = max(most_served, _served(server.addr))
        for _ in range(20):  # until the server has dealt with every connection
            most_threads = max(most_threads, threading.active_count() - before)
            most_served = max(most_served, _served(server.addr))
            time.sleep(0.1)
        assert all(s is not None for s in socks)
        assert most_threads <= peer_tier.Server.MAX_CONNECTIONS, most_threads
        assert most_served <= peer_tier.Server.MAX_CONNECTIONS + 1, most_served
        yield socks
    finally:
        for s in socks:
            if s is not None:
                s.close()


def test_idle_connections_hold_a_bounded_number_of_threads_and_files(server):
    # from 20 addresses, 10 each: the per-address limit turns 2 away
    with _crowd(server, 200, sources=20):
        # a process of the group still gets through: it takes the oldest stranger's slot
        assert _put_then_get(server.addr, b"y" * 300_000) == b"y" * 300_000


def test_one_address_holds_few_connections(server):
    server.HEADER_S = 300.0  # only the per-address limit closes anything here
    socks = [_open(server.addr, "127.0.0.2") for _ in range(20)]
    over = 20 - peer_tier.Server.MAX_PER_SOURCE
    try:
        closed: set = set()
        deadline = time.time() + 60
        while len(closed) < over and time.time() < deadline:  # those over the limit: at once
            ready, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.5)
            closed |= {s for s in ready if s.recv(1) == b""}
        time.sleep(0.5)
        assert not select.select([s for s in socks if s not in closed], [], [], 0)[0]
        assert len(closed) == over, len(closed)
    finally:
        for s in socks:
            s.close()


def test_a_header_that_trickles_in_is_cut_at_the_deadline(server):
    server.HEADER_S = 1.0
    header = (json.dumps({"op": "get", "src": 0, "step": 1, "token": TOKEN}) + "\n").encode()
    with socket.create_connection(tuple(server.addr), timeout=10) as s:
        sent = 0
        for byte in header:  # a byte every 0.1 s: each read is quick, the whole is not
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            sent += 1
            if select.select([s], [], [], 0.1)[0] and s.recv(1) == b"":
                break
        assert sent < len(header), "the server waited for the whole slow header"
    assert _put_then_get(server.addr, b"z" * 10) == b"z" * 10  # a slot was freed


def test_the_bound_holds_when_evicted_connections_are_slow_to_close(server, monkeypatch):
    """On a loaded machine an evicted connection's thread may run long after its eviction: the
    server still holds no more than its bound (it accepts nothing more until that thread has
    closed its socket), whereas counting on the thread to close it soon lets sockets pile up."""
    header = peer_tier._header

    def slow_header(f):
        try:
            return header(f)
        except (OSError, ValueError):
            time.sleep(0.3)  # the evicted thread gets the CPU late
            raise

    monkeypatch.setattr(peer_tier, "_header", slow_header)
    # ten evictions in a row; 6 addresses, 7 each: under the per-address limit
    with _crowd(server, peer_tier.Server.MAX_CONNECTIONS + 10, sources=6):
        pass
