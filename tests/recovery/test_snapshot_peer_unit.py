"""Peer copies of local snapshots without a launch: a request that reaches a server before its
process has learnt the group's token is held, not refused (the race that made a lost host's
restore reject a good peer copy under load); a failed fetch says why; a restore that finds
snapshots but none usable records the fallback for the trainer to announce.

    python -m pytest tests/recovery/test_snapshot_peer_unit.py
"""

from __future__ import annotations

import json
import os
import socket
import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.recovery import local_tier, peer_tier
from jaxpar.recovery.local_tier_store import DATA
from jaxpar.rundir.writer import RunDir

TOKEN = "t" * 32


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_COORDINATOR", "127.0.0.1:1")  # the address the server binds
    srv = peer_tier.Server(str(tmp_path / "node"), nproc=2, limit=1 << 20)
    slots = srv.slots(0)
    d = slots.begin(0)
    with open(os.path.join(d, DATA), "wb") as f:
        f.write(b"x" * 100)
    slots.commit(0, {"step": 5, "nbytes": 100})
    yield srv
    srv.close()


def _get(addr, step: int) -> tuple[dict, bytes]:
    with socket.create_connection(tuple(addr), timeout=30) as sock, sock.makefile("rb") as f:
        msg = {"op": "get", "src": 0, "step": step, "token": TOKEN}
        sock.sendall((json.dumps(msg) + "\n").encode())
        reply = json.loads(f.readline())
        return reply, bytes(f.read(reply.get("nbytes", 0)))


def test_request_before_the_token_is_known_is_held_not_refused(server):
    met = threading.Event()

    def learn_token():
        met.set()
        server.met(TOKEN)

    threading.Timer(0.5, learn_token).start()
    reply, data = _get(server.addr, 5)
    assert reply["ok"] and reply["marker"]["step"] == 5 and data == b"x" * 100, reply
    assert met.is_set()  # the reply came only once the token was known: it was held


def _peers(server, holder_addr):
    run = SimpleNamespace(event=lambda *a, **k: None)
    tier = SimpleNamespace(process=0, run=run)
    offers = [{"token": TOKEN, "addr": ["127.0.0.1", 1], "held": {}},
              {"token": None, "addr": holder_addr, "held": {"0": [5]}}]  # fmt: skip
    return peer_tier.Peers(tier, server, offers, [[0], [1]])


def test_fetch_gets_the_copy_and_says_why_not(server, monkeypatch):
    server.met(TOKEN)
    peers = _peers(server, server.addr)
    marker, data, why = peers.fetch(5)
    assert marker["step"] == 5 and bytes(data) == b"x" * 100 and why == ""
    assert peers.fetch(4)[2] == "no copy (own or peer)"
    sleeps = []  # the pauses between retry rounds
    monkeypatch.setattr(peer_tier.time, "sleep", sleeps.append)
    peers.offers[1]["held"]["0"].append(4)  # listed, yet gone: refused, not retried
    marker, _, why = peers.fetch(4)
    assert marker is None and "no such copy" in why and sleeps == [], (why, sleeps)
    with socket.socket() as s:  # a holder that does not answer: retried, then the error
        s.bind(("127.0.0.1", 0))
        dead = ["127.0.0.1", s.getsockname()[1]]
    marker, _, why = _peers(server, dead).fetch(5)
    assert marker is None and why.startswith("peer copy not fetched") and "Error" in why, why
    assert len(sleeps) == peer_tier.FETCH_ATTEMPTS - 1, sleeps
    peers.close()


def test_offered_and_candidates():
    offers = [{"own": [], "held": {"1": [4, 5]}}, {"own": [5, 6], "held": {"0": [5, 6]}}]
    assert local_tier.candidates(offers, 2) == [6, 5]
    offers = [{"own": [], "held": {}}, {"own": [5], "held": {"0": [5, 6]}}]
    assert local_tier.candidates(offers, 2) == [5]
    assert local_tier.offered(offers, 2) == {5, 6}


def test_unusable_snapshots_are_recorded_as_a_fallback(tmp_path):
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    rep = NamedSharding(mesh, PartitionSpec())
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep)}
    run = RunDir(str(tmp_path / "run"))

    def tier():
        return local_tier.LocalTier(run, abstract, every=1, root=str(tmp_path / "local"),
                                  binding={"config_hash": "c0", "mesh": "m"})  # fmt: skip

    t = tier()
    assert t.restore(None) is None and t.fallback is None  # nothing there: no fallback
    for step in (1, 2):
        t.offer(step, {"w": jax.device_put(np.full(4, step, np.float32), rep)})
    t.close()
    for d in t.own.dirs:  # both snapshots corrupted
        with open(os.path.join(d, DATA), "r+b") as f:
            f.write(b"\xff" * 4)
    t = tier()
    assert t.restore(3) is None and t.fallback is None  # the persistent one is newer anyway
    t = tier()
    assert t.restore(None) is None
    assert t.fallback == {"skipped": [2, 1], "incomplete": []}
    rejected = [e for e in run.events() if e["event"] == "snapshot_rejected"]
    assert [e["step"] for e in rejected] == [2, 1]
