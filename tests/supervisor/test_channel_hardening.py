"""The control channel against a network attacker, in one process (no `jaxpar launch`): messages
after the handshake are authenticated in sequence (a relay's injected line, a replayed or
reordered message close the channel, nothing in them is obeyed), a fake leader's text is printed
escaped, slow handshakes cannot keep a real agent out, a flood of refused connections is
summarised, and the workers never see the agents' secret."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxpar.rundir.runlog import read_jsonl
from jaxpar.supervisor import transport
from jaxpar.supervisor.channel import Channel, Lines, Session, send_line
from jaxpar.supervisor.group import LocalGroup, Wakeup
from jaxpar.supervisor.options import TOKEN_ENV, Options
from tests.support.net import accepted, slow_loris

pytestmark = pytest.mark.timeout(120)

SECRET = "a shared secret of the job, long enough"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _opts(tmp_path: Path, port: int, rank: int, **kw) -> Options:
    kw = {"handshake_timeout_s": 2.0, "rendezvous_timeout_s": 30.0, **kw}
    return Options(command=["true"], nproc=1, run_dir=str(tmp_path / "run"), nnodes=2,
                   node_rank=rank, coordinator=f"127.0.0.1:{port}", spares=False, **kw)  # fmt: skip


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    return SECRET.encode()


@pytest.fixture
def follow(monkeypatch):
    """run_follower in this (the main) thread, its SIGTERM handler undone afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    yield transport.run_follower
    signal.signal(signal.SIGTERM, before)


def _leader(tmp_path: Path, key: bytes, events: list | None = None, **kw):
    port = _port()
    sink = events if events is not None else []
    rdv = transport.Rendezvous(_opts(tmp_path, port, 0, **kw), key, lambda name, **f: sink.append(f),
                               Wakeup())  # fmt: skip
    return rdv, port


def _join_in_background(rdv) -> list:
    got: list = []
    threading.Thread(target=lambda: got.extend(rdv.wait(lambda: False)), daemon=True).start()
    return got


# ---- a relay that passes the handshake through, then speaks for the leader ----------------------


def _pump(src: socket.socket, dst: socket.socket, inject: bytes | None) -> None:
    """Forward src -> dst; after the first chunk holding a welcome, add `inject`."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
            if inject and b"welcome" in data:
                dst.sendall(inject)
                inject = None
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _relay(listen: socket.socket, leader_port: int, inject: bytes) -> None:
    follower, _ = listen.accept()
    leader = socket.create_connection(("127.0.0.1", leader_port))
    threading.Thread(target=_pump, args=(follower, leader, None), daemon=True).start()
    _pump(leader, follower, inject)


@pytest.mark.parametrize("inject", [True, False], ids=["injected", "genuine"])
def test_relay_cannot_speak_for_the_leader(tmp_path, secret, follow, capfd, inject):
    rdv, leader_port = _leader(tmp_path, secret)
    joined = _join_in_background(rdv)
    line = json.dumps({"cmd": "exit", "code": 0}).encode() + b"\n"
    with socket.create_server(("127.0.0.1", 0)) as listen:
        relay = threading.Thread(target=_relay, args=(listen, leader_port, line if inject else b""),
                                 daemon=True)  # fmt: skip
        relay.start()
        if not inject:  # the leader's own exit order, through the same relay, is obeyed
            threading.Thread(target=lambda: _close_when_joined(joined, 7), daemon=True).start()
        code = follow(_opts(tmp_path, listen.getsockname()[1], 1))
    err = capfd.readouterr().err
    assert "joined the leader" in err, err
    if inject:
        assert code == 1, err  # a broken channel, not the injected "exit 0"
        assert "control channel broken (a message without authentication)" in err, err
    else:
        assert code == 7, err
    rdv.server.close()


def _close_when_joined(joined: list, code: int) -> None:
    deadline = time.time() + 60
    while not joined and time.time() < deadline:
        time.sleep(0.05)
    joined[0].close(code)


# ---- replayed, reordered -------------------------------------------------------------------------


def _sealed(n: int) -> list[bytes]:
    """The leader's first n messages of one session, as they travel."""
    s = Session(SECRET.encode(), "aa" * 16, "bb" * 16, leader=True)
    return [(json.dumps(s.seal({"cmd": "signal", "sig": i})) + "\n").encode() for i in range(n)]


def _receive(lines: list[bytes]) -> tuple[list, str]:
    a, b = socket.socketpair()
    with a:
        chan = Channel(b, Lines(b), Session(SECRET.encode(), "aa" * 16, "bb" * 16, leader=False))
        # one write: the channel closes on the first message it refuses, and a later write
        # would then meet a closed socket (EPIPE) on a loaded machine; then the end of stream,
        # so that a channel that refuses nothing closes too
        a.sendall(b"".join(lines))
        a.shutdown(socket.SHUT_WR)
        got = []
        while (msgs := chan.messages(timeout=10)) and msgs[-1] is not None:
            got += msgs
        chan.close()
        return got + msgs[:-1], chan.error


def test_replayed_or_reordered_messages_are_refused():
    m0, m1, m2 = _sealed(3)
    assert _receive([m0, m1, m2]) == ([{"cmd": "signal", "sig": i} for i in range(3)] + [], "")
    got, error = _receive([m0, m1, m1, m2])  # replayed
    assert got == [{"cmd": "signal", "sig": 0}, {"cmd": "signal", "sig": 1}]
    assert "out of sequence (expected 2)" in error, error
    got, error = _receive([m1, m0])  # reordered
    assert got == [] and "out of sequence (expected 0)" in error, error
    forged = json.loads(m0)
    forged["body"] = json.dumps({"cmd": "exit", "code": 0})
    got, error = _receive([(json.dumps(forged) + "\n").encode()])  # altered
    assert got == [] and error == "message 0 failed authentication"
    other = Session(SECRET.encode(), "aa" * 16, "bb" * 16, leader=False)  # the follower's own
    echo = (json.dumps(other.seal({"cmd": "exit", "code": 0})) + "\n").encode()
    got, error = _receive([echo])  # reflected back at its sender
    assert got == [] and error == "message 0 failed authentication"


# ---- a fake leader's refusal ---------------------------------------------------------------------

EVIL = "\x1b]0;owned\x07\x1b[2J\x1b[31mnode rank 1 has already joined\u202e"


def _fake_leader(server: socket.socket, stop: threading.Event, tries: list) -> None:
    for sock in accepted(server, stop):
        with sock:
            send_line(sock, {"challenge": "00" * 16})
            tries.append(Lines(sock).next())
            send_line(sock, {"refused": EVIL})


def test_fake_leaders_refusal_is_not_believed_and_printed_escaped(tmp_path, secret, follow, capfd):
    stop, tries = threading.Event(), []
    with socket.create_server(("127.0.0.1", 0)) as server:
        fake = threading.Thread(target=_fake_leader, args=(server, stop, tries), daemon=True)
        fake.start()
        opts = _opts(tmp_path, server.getsockname()[1], 1, rendezvous_timeout_s=2.0)
        code = follow(opts)
        stop.set()
        fake.join(30)
    err = capfd.readouterr().err
    assert len(tries) >= 2, err  # it kept looking for a leader that can prove the token
    assert code == 2, err
    assert "could not prove the token" in err and "no leader at" in err, err
    assert "\x1b" not in err and "\x07" not in err and "\u202e" not in err, repr(err)
    assert "\\x1b]0;owned\\x07" in err, err


# ---- slow handshakes -----------------------------------------------------------------------------


@pytest.mark.parametrize("first, sources", [(1, 1), (2, 10)], ids=["own-address", "10-others"])
def test_slow_handshakes_do_not_keep_a_real_agent_out(tmp_path, secret, first, sources):
    """40 connections that never finish their handshake (the deadline is long here), from the
    agent's own address or from 10 others: the agent takes the slot of the oldest of its address
    (or of all) and joins at once, where a refusal of its connection would keep it out."""
    events: list = []
    rdv, port = _leader(tmp_path, secret, events, handshake_timeout_s=60.0)
    stop, opened = threading.Event(), []
    loris = threading.Thread(target=slow_loris, args=(port, stop, 40, sources, opened, first),
                             daemon=True)  # fmt: skip
    loris.start()
    try:
        deadline = time.time() + 30
        while len(opened) < 40:  # every slow connection is in before the agent comes
            assert time.time() < deadline
            time.sleep(0.05)
        chan = transport._connect(_opts(tmp_path, port, 1, rendezvous_timeout_s=8), secret,
                                  Wakeup())  # fmt: skip
        assert isinstance(chan, Channel), chan
        (node,) = rdv.wait(lambda: False)
        assert node.rank == 1
    finally:
        stop.set()
        loris.join(30)
        rdv.server.close()
    reasons = " ".join(str(e) for e in events)  # how slow connections were turned away
    assert "handshake cut short: more than" in reasons, reasons
    chan.close()


# ---- a flood of refusals -------------------------------------------------------------------------


def test_a_flood_of_refused_connections_is_summarised(tmp_path, secret):
    path = tmp_path / "events.jsonl"

    def event(name, **fields):
        with open(path, "a") as f:
            f.write(json.dumps({"event": name, **fields}) + "\n")

    port = _port()
    rdv = transport.Rendezvous(_opts(tmp_path, port, 0), secret, event, Wakeup())
    rdv.refusals.interval_s = 3600  # one interval: the test does not depend on timing
    for _ in range(300):  # connect, hang up
        with socket.create_connection(("127.0.0.1", port)):
            pass
    deadline = time.time() + 60
    while rdv.refusals.total < 300:
        assert time.time() < deadline, rdv.refusals.total
        time.sleep(0.05)
    with pytest.raises(RuntimeError):
        rdv.wait(lambda: True)  # closes the listener: the summary of the interval is written
    deadline = time.time() + 30
    while len(lines := list(read_jsonl(str(path)))) < 11 and time.time() < deadline:
        time.sleep(0.05)
    assert len(lines) == 11, lines
    assert all(e["event"] == "control_rejected" for e in lines)
    assert [e.get("count") for e in lines] == [None] * 10 + [290], lines
    assert lines[-1]["sources"] == {"127.0.0.1": 290}, lines[-1]


def test_refusals_each_interval_then_a_summary(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(transport.time, "monotonic", lambda: now[0])
    got: list = []
    r = transport.Refusals(lambda name, **f: got.append(f), each=2, interval_s=10)
    for t in (0, 1, 2, 3, 11, 12, 13, 30):
        now[0] = t
        r.add(f"10.0.0.{t}:1", "no hello")
    r.flush(force=True)
    assert [(f["peer"], f.get("count")) for f in got] == [
        ("10.0.0.0:1", None), ("10.0.0.1:1", None), ("2 address(es), most 10.0.0.2", 2),
        ("10.0.0.11:1", None), ("10.0.0.12:1", None), ("1 address(es), most 10.0.0.13", 1),
        ("10.0.0.30:1", None),
    ]  # fmt: skip


# ---- the workers do not get the secret -----------------------------------------------------------

CHILD = "import os; print('child sees', os.environ.get('JAXPAR_LAUNCH_TOKEN'))"


def test_workers_and_their_children_do_not_see_the_token(tmp_path, secret):
    script = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"
    opts = Options(command=[sys.executable, "-c", script], nproc=1, run_dir=str(tmp_path),
                   spares=False)  # fmt: skip
    group = LocalGroup(opts)
    group.start({"attempt": 0, "incarnation": 0, "process_ids": [0], "nproc": 1,
                 "coordinator": "127.0.0.1:1", "bind": "127.0.0.1", "collective_timeout": 60})  # fmt: skip
    try:
        deadline = time.time() + 60
        while not (exits := group.poll()):
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        group.kill_all()
    assert exits == [(0, 0)]
    log = Path(group.logs[0]).read_text()
    assert "child sees None" in log, log


# ---- every interface: refused as a coordinator, said when asked for ------------------------------


@pytest.mark.parametrize("coordinator", ["0:29400", "0.0.0.0:29400", "[::]:29400", "0.0:29400"])
def test_a_wildcard_coordinator_is_refused_in_one_line(coordinator, capsys, tmp_path):
    from jaxpar import cli

    rc = cli.main(["launch", "--nproc", "1", "--nnodes", "2", "--coordinator", coordinator,
                   "--run-dir", str(tmp_path / "r"), "--", sys.executable, "-c", "pass"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "names every interface" in err and "--host 0.0.0.0" in err, err
    assert not (tmp_path / "r").exists()


def test_listening_on_every_interface_is_said(capsys, tmp_path):
    from jaxpar.supervisor.options import announce_binds

    announce_binds(Options(command=["x"], nproc=1, run_dir=str(tmp_path)))
    announce_binds(_opts(tmp_path, 29400, 0))
    announce_binds(_opts(tmp_path, 29400, 1, bind_host="0.0.0.0"))  # a follower binds nothing
    assert capsys.readouterr().err == ""
    announce_binds(_opts(tmp_path, 29400, 0, bind_host="::"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "listen on every interface" in err, err
