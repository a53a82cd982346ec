"""The agents' control channel under attack, against running `jaxpar launch --nnodes N` jobs of
fake workers (no jax): strangers, malformed and oversized messages, a duplicate node rank and a
fake leader are refused, and the job finishes unharmed."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from jaxpar.supervisor.channel import Lines, mac, send_line  # noqa: E402
from tests.support.launch_util import Launch, clean_env, fake_cmd  # noqa: E402
from tests.support.net import accepted  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect(port: int, deadline_s: float = 60.0) -> socket.socket:
    deadline = time.time() + deadline_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            assert time.time() < deadline, "the leader never listened"
            time.sleep(0.1)


def _attack_hello_abc(port: int) -> dict | None:
    with _connect(port) as s:
        lines = Lines(s)
        lines.next()  # the challenge
        send_line(s, {"hello": "abc"})
        return lines.next()


def _attack_hello_first(port: int) -> dict | None:
    """Says hello before the challenge, claiming rank 1 (the old protocol)."""
    with _connect(port) as s:
        send_line(s, {"hello": 1, "nproc": 1, "host": "intruder"})
        lines = Lines(s)
        lines.next()  # the challenge
        return lines.next()


def _attack_wrong_token(port: int) -> dict | None:
    with _connect(port) as s:
        lines = Lines(s)
        nonce = lines.next()["challenge"]
        mine = "ab" * 16
        send_line(s, {"hello": 1, "nproc": 1, "host": "x", "nonce": mine,
                      "mac": mac(b"not the token at all", "f", nonce, mine, 1, 1)})  # fmt: skip
        return lines.next()


def _attack_invalid_json(port: int, hold: threading.Event) -> None:
    """An invalid JSON line, then the connection held open while the real agent joins."""
    with _connect(port) as s:
        s.sendall(b'{"hello": 1, nproc\n')
        hold.wait(60)


def _attack_huge_line(port: int) -> bool:
    """100 MB without a newline: the leader must hang up long before the end."""
    chunk = b"x" * (1 << 20)
    with _connect(port) as s:
        try:
            for _ in range(100):
                s.sendall(chunk)
        except OSError:
            return True
    return False


def test_leader_refuses_strangers_and_duplicates_and_finishes(tmp_path):
    port = _free_port()
    common = ["--nproc", "1", "--nnodes", "3", "--coordinator", f"127.0.0.1:{port}"]
    cmd = fake_cmd(tmp_path, "train", 6)
    run_dir = tmp_path / "run"
    runs = [Launch(run_dir, [*common, "--node-rank", "0"], cmd, name="node0")]
    try:
        assert _attack_hello_abc(port) is None  # dropped: connection closed, no reply
        assert _attack_hello_first(port) is None
        refused = _attack_wrong_token(port)
        assert refused["refused"] == "authentication failed (the agents' tokens differ)"
        hold = threading.Event()
        holder = threading.Thread(target=_attack_invalid_json, args=(port, hold))
        holder.start()
        assert _attack_huge_line(port)
        # the real agents join while the invalid-JSON connection is still open
        runs.append(Launch(run_dir, [*common, "--node-rank", "1"], cmd, name="node1"))
        deadline = time.time() + 60
        while "joined the leader" not in runs[1].output():
            assert time.time() < deadline and runs[1].proc.poll() is None, runs[1].output()
            time.sleep(0.1)
        dup = Launch(run_dir, [*common, "--node-rank", "1"], cmd, name="dup")
        runs.append(dup)
        assert dup.wait(60) == 2, dup.output()
        assert "node rank 1 has already joined" in dup.output()
        assert "Traceback" not in dup.output()
        runs.append(Launch(run_dir, [*common, "--node-rank", "2"], cmd, name="node2"))
        assert runs[0].wait(120) == 0, runs[0].output()
        hold.set()
        holder.join(30)
        assert runs[1].wait(60) == 0 and runs[3].wait(60) == 0
    finally:
        for r in runs:
            r.close()
    leader = runs[0]
    reasons = [e["reason"] for e in leader.events("control_rejected")]
    assert len(reasons) >= 5, reasons  # abc, hello-first, wrong token, huge line, duplicate
    assert any("longer than" in r for r in reasons), reasons
    assert any("already joined" in r for r in reasons), reasons
    assert [s["nproc"] for s in leader.events("start")] == [3]
    assert leader.summary()["status"] == "completed"
    assert "Traceback" not in leader.output()
    token = run_dir / "launch-token"
    assert token.stat().st_mode & 0o777 == 0o600


def _fake_leader(port: int, marker: Path, stop: threading.Event, seen: list) -> None:
    """Listens where the leader will, and orders whoever connects to run a command: first the
    old way (no handshake), then after a challenge with a made-up welcome."""
    with socket.create_server(("127.0.0.1", port)) as server:
        n = 0
        for sock in accepted(server, stop):
            with sock:
                sock.settimeout(5)
                order = {"cmd": "start", "spec": {"incarnation": 0, "coordinator": "127.0.0.1:1",
                         "bind": "127.0.0.1:1", "nproc": 1, "process_ids": [0], "attempt": 0,
                         "faults": [], "collective_timeout": 60,
                         "command": ["touch", str(marker)]}}  # fmt: skip
                try:
                    if n % 2:
                        lines = Lines(sock)
                        send_line(sock, {"challenge": "00" * 16})
                        seen.append(lines.next())
                        send_line(sock, {"welcome": "ff" * 32})
                    send_line(sock, order)
                    time.sleep(0.5)
                except OSError:
                    pass
            n += 1


def test_follower_ignores_a_fake_leader_then_joins_the_real_one(tmp_path):
    port = _free_port()
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    common = ["--nproc", "1", "--nnodes", "2", "--coordinator", f"127.0.0.1:{port}"]
    stop, seen = threading.Event(), []
    fake = threading.Thread(target=_fake_leader, args=(port, marker, stop, seen))
    fake.start()
    cmd = fake_cmd(tmp_path, "train", 6)
    env = {**clean_env(), "JAXPAR_LAUNCH_TOKEN": "a shared secret of the job " * 2}
    runs = [Launch(run_dir, [*common, "--node-rank", "1"], cmd, env=env, name="node1")]
    try:
        deadline = time.time() + 60
        while len(seen) < 2:  # it tried the fake leader both ways
            assert time.time() < deadline and runs[0].proc.poll() is None, runs[0].output()
            time.sleep(0.1)
        stop.set()
        fake.join(30)
        runs.append(Launch(run_dir, [*common, "--node-rank", "0"], cmd, env=env, name="node0"))
        assert runs[1].wait(120) == 0, runs[1].output()
        assert runs[0].wait(60) == 0, runs[0].output()
    finally:
        stop.set()
        for r in runs:
            r.close()
    assert not marker.exists()
    assert "could not prove the token" in runs[0].output()
    assert "Traceback" not in runs[0].output()
    assert seen[-1]["hello"] == 1 and "mac" in seen[-1]  # it proved itself, never obeyed
    assert [s["nproc"] for s in runs[1].events("start")] == [2]
    assert not (run_dir / "launch-token").exists()  # the token came from the environment
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_leader_listens_on_the_coordinator_address_only(tmp_path):
    import psutil

    port = _free_port()
    args = [
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--coordinator",
        f"127.0.0.2:{port}",
    ]
    run = Launch(tmp_path / "run", args, fake_cmd(tmp_path, "train", 2))
    try:
        deadline = time.time() + 60
        listening: list = []
        while not listening:
            assert time.time() < deadline and run.proc.poll() is None, run.output()
            conns = psutil.Process(run.proc.pid).net_connections(kind="tcp")
            listening = [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]
            time.sleep(0.1)
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.2", port)]
    finally:
        run.close()


def test_stopped_worker_on_another_host_is_the_one_named(tmp_path):
    port = _free_port()
    common = ["--nproc", "1", "--nnodes", "2", "--coordinator", f"127.0.0.1:{port}"]
    env = {**clean_env(), "FAKE_STEP_S": "0.1"}
    cmd = fake_cmd(tmp_path, "train", 40)
    run_dir = tmp_path / "run"
    runs = [
        Launch(run_dir, [*common, "--node-rank", "0", "--hang-timeout", "1.5"], cmd, env=env,
               name="node0"),
        Launch(run_dir, [*common, "--node-rank", "1"], cmd, env=env, name="node1"),
    ]  # fmt: skip
    try:
        hb = run_dir / "heartbeats" / "proc1.json"
        deadline = time.time() + 120
        while True:  # process 1 runs on node 1
            assert time.time() < deadline and runs[0].proc.poll() is None, runs[0].output()
            try:
                rec = json.loads(hb.read_text())
                if rec["step"] >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        os.kill(rec["pid"], signal.SIGSTOP)
        assert runs[0].wait(120) == 0, runs[0].output()
        assert runs[1].wait(60) == 0, runs[1].output()
    finally:
        for r in runs:
            r.close()
    (f,) = runs[0].events("failure")
    assert (f["cause"], f["process"]) == ("hang", 1), f
