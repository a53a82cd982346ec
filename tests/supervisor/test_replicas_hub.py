"""The replica groups' hub and wire without jax: real sockets on 127.0.0.1, workers played by
threads of this test (jaxpar/supervisor/replicas.py, jaxpar/worker/group_wire.py), and the
one-line refusals of `jaxpar launch --groups`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

from jaxpar.rundir.runlog import append_line
from jaxpar.supervisor.monitor import EventTail
from jaxpar.supervisor.options import Options
from jaxpar.supervisor.replicas import Hub, ReplicaGroup, ReplicaSupervisor
from jaxpar.worker import group_layout, group_wire
from jaxpar.worker.group_wire import Wire, WireError

KEY = b"k" * 32


def _hub(groups: int, min_groups: int, per_group: int = 1) -> tuple[Hub, list]:
    events: list = []
    hub = Hub("127.0.0.1", KEY, groups, per_group, min_groups,
              lambda name, **f: events.append({"event": name, **f}), lambda g: None)  # fmt: skip
    for g in range(groups):
        hub.running(g)
    return hub, events


def _connect(hub: Hub, group: int, rank: int = 0, key: bytes = KEY) -> Wire:
    host, port = hub.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.settimeout(10)
    wire = group_wire.client_handshake(sock, key, {"group": group, "rank": rank})
    sock.settimeout(10)
    return wire


def _until(ok, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not ok():
        assert time.time() < deadline, "the hub did not get there"
        time.sleep(0.01)


def _average(wire: Wire, step: int, *arrays, owns: bool = True) -> None:
    """`arrays` as whole leaves: sent when this process `owns` them (its group's process 0 does
    where a group has several), and their mean wanted back."""
    fields = group_layout.whole(list(arrays), send=owns)
    wire.send({"kind": "average", "step": step, **fields}, list(arrays) if owns else [])


# the state every test's groups hold: its layout in a ready, a donor's in a state message
STATE = [np.zeros(2, np.float32), np.zeros((), np.int32)]


def _ready(step: int, sync_every: int = 0) -> dict:
    return {"kind": "ready", "step": step, "sync_every": sync_every,
            **group_layout.whole(STATE, send=False)}  # fmt: skip


def _state(wire: Wire, step: int, state: list) -> None:
    wire.send({"kind": "state", "step": step, **group_layout.whole(state),
               "checksum": group_wire.checksum(state)}, state)  # fmt: skip


def _start_two(hub: Hub) -> tuple[Wire, Wire]:
    """Groups 0 and 1 (one process each) ready at step 0 and started."""
    w0, w1 = _connect(hub, 0), _connect(hub, 1)
    for w in (w0, w1):
        w.send(_ready(0))
        assert w.recv()[0]["kind"] == "start"
    return w0, w1


def _step_two(w0: Wire, w1: Wire, step: int) -> None:
    """Both groups average `step` (1 and 3: the mean is 2)."""
    _average(w0, step, np.array([1.0], np.float32))
    _average(w1, step, np.array([3.0], np.float32))
    assert w0.recv()[1][0].tolist() == [2.0] and w1.recv()[1][0].tolist() == [2.0]


def test_wire_round_trip_and_tampering_refused():
    a, b = socket.socketpair()
    left, right = Wire(a, KEY, hub=False), Wire(b, KEY, hub=True)
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.float32(2.5), np.zeros(0, np.int32)]
    left.send({"kind": "x"}, arrays)
    header, got = right.recv()
    assert header["kind"] == "x" and [g.shape for g in got] == [(2, 3), (), (0,)]
    assert all(np.array_equal(x, y) for x, y in zip(arrays, got, strict=True))
    assert group_wire.checksum(got) == group_wire.checksum(arrays)
    # a frame under another key fails authentication; a header naming a pickle-able dtype or a
    # huge size is refused before any payload is read
    Wire(a, b"x" * 32, hub=False).send({"kind": "y"}, [np.ones(2, np.float32)])
    with pytest.raises(WireError, match="authentication"):
        right.recv()
    head = b'{"arrays": [["object", [1]]]}'
    a.sendall(struct.pack("!I", len(head)) + head)
    with pytest.raises(WireError, match="bad array spec"):
        Wire(b, KEY, hub=True).recv()
    head = b'{"arrays": [["float32", [1099511627775, 1099511627775]]]}'
    a.sendall(struct.pack("!I", len(head)) + head)
    with pytest.raises(WireError, match="larger than"):
        Wire(b, KEY, hub=True).recv()
    # a frame's buffer grows as its bytes come: 1 GiB announced, 1 KiB sent, little allocated
    head = b'{"arrays": [["uint8", [1073741824]]]}'
    a.sendall(struct.pack("!I", len(head)) + head + b"\0" * 1024)
    a.close()
    tracemalloc.start()
    try:
        with pytest.raises(ConnectionError):
            Wire(b, KEY, hub=True).recv()
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
    b.close()


class _Writes:
    """A socket's sending side that records each write."""

    def __init__(self):
        self.writes: list[bytes] = []

    def setsockopt(self, *args):
        raise OSError("not TCP")

    def sendall(self, data) -> None:
        self.writes.append(bytes(data))


def test_frames_leave_at_once_over_tcp():
    """Every frame is answered, so none may wait for the peer's delayed ACK (Nagle's algorithm
    held a frame's last small write about 40 ms): both ends of a TCP wire send without delay, a
    frame of small arrays goes out in one write, a large one without an extra copy of its
    arrays; both arrive whole."""
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    server.close()
    left, right = Wire(a, KEY, hub=False), Wire(b, KEY, hub=True)
    for sock in (a, b):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    small, big = np.arange(100, dtype=np.float32), np.ones(group_wire.SMALL_FRAME, np.float32)
    for arrays, writes in (([], 1), ([small], 1), ([small, big], 4)):
        rec = _Writes()
        Wire(rec, KEY, hub=False).send({"kind": "x", "n": len(arrays)}, arrays)
        assert len(rec.writes) == writes, [len(w) for w in rec.writes]
        left.send({"kind": "x", "n": len(arrays)}, arrays)
        header, got = right.recv()
        assert header["n"] == len(arrays)
        assert all(np.array_equal(x, y) for x, y in zip(arrays, got, strict=True))
    a.close()
    b.close()


def test_hub_quorum_abort_redo_hold_and_rejoin_from_a_peer():
    """Two groups average step 0; group 0 dies while step 1 waits for it: step 1 is released
    over group 1 alone with its own gradients (min 1). With min 2 the next step is held until
    group 0, restarted, has received group 1's state (checksummed) and sent its own gradients."""
    hub, events = _hub(2, min_groups=1)
    try:
        w0, w1 = _connect(hub, 0), _connect(hub, 1)
        for w in (w0, w1):
            w.send(_ready(0))
        assert w0.recv()[0]["kind"] == "start" and w1.recv()[0]["kind"] == "start"
        _average(w0, 0, np.array([1.0, 2.0], np.float32))
        _average(w1, 0, np.array([3.0, 6.0], np.float32))
        for w in (w0, w1):
            header, (mean,) = w.recv()
            assert header["quorum"] == [0, 1] and header["step"] == 0
            assert mean.tolist() == [2.0, 4.0]
        # group 1 waits in step 1's average; group 0 dies before sending its own
        _average(w1, 1, np.array([5.0, 5.0], np.float32))
        w0.close()
        header, (mean,) = w1.recv()
        assert header["quorum"] == [1] and mean.tolist() == [5.0, 5.0]
        assert hub.group_steps_lost == 1
        # from now on a quorum needs both groups: group 1's step 2 is held ...
        hub.min_groups = 2
        hub.running(0)
        _average(w1, 2, np.array([7.0, 7.0], np.float32))
        w0 = _connect(hub, 0)
        w0.send(_ready(0))
        # ... group 1 is asked for its state at step 2, which the hub forwards to group 0
        ask, _ = w1.recv()
        assert ask == {"kind": "give_state", "step": 2, "arrays": []}
        state = [np.array([9.0, 8.0], np.float32), np.array(2, np.int32)]
        _state(w1, 2, state)
        header, got = w0.recv()
        assert header["kind"] == "state" and header["step"] == 2
        assert group_wire.checksum(got) == header["checksum"] == group_wire.checksum(state)
        _average(w0, 2, np.array([1.0, 1.0], np.float32))
        for w in (w0, w1):
            header, (mean,) = w.recv()
            assert header["quorum"] == [0, 1] and mean.tolist() == [4.0, 4.0]
        joined = [e for e in events if e["event"] == "group_joined"]
        assert [e["transfer"] for e in joined] == [False, False, True]
        quorums = [e["quorum"] for e in events if e["event"] == "quorum_changed"]
        assert quorums == [[0, 1], [1], [0, 1]]
        # a worker without the job's key gets nothing
        with pytest.raises((WireError, OSError)):
            _connect(hub, 1, key=b"z" * 32)
    finally:
        hub.close()


def test_hub_asks_the_donor_for_the_step_it_computes_and_holds_that_step_for_the_joiner():
    """A group ready to join is given the state of the step the others compute now: the donor
    is asked at once (before it has sent that step's gradients), and the step is not released
    without the joining group's, even where the donor alone makes a quorum."""
    hub, events = _hub(2, min_groups=1)
    try:
        w0, w1 = _start_two(hub)
        _step_two(w0, w1, 0)
        w0.close()  # group 0 dies in step 1: group 1 goes on alone
        _average(w1, 1, np.array([5.0], np.float32))
        assert w1.recv()[0]["quorum"] == [1]
        hub.running(0)  # restarted, ready while group 1 computes step 2
        w0 = _connect(hub, 0)
        w0.send(_ready(0))
        assert w1.recv()[0] == {"kind": "give_state", "step": 2, "arrays": []}
        assert hub.joined[0] == 2
        _average(w1, 2, np.array([7.0], np.float32))
        time.sleep(0.2)
        assert 2 in hub.pending  # held for group 0
        state = [np.array([9.0, 8.0], np.float32), np.array(2, np.int32)]
        _state(w1, 2, state)
        header, got = w0.recv()
        assert header["kind"] == "state" and header["step"] == 2 and header["quorum"] == [0, 1]
        assert group_wire.checksum(got) == group_wire.checksum(state)
        _average(w0, 2, np.array([1.0], np.float32))
        for w in (w0, w1):
            header, (mean,) = w.recv()
            assert header["quorum"] == [0, 1] and mean.tolist() == [4.0]
        assert [e["transfer"] for e in events if e["event"] == "group_joined"] == [False] * 2 + [
            True
        ]
    finally:
        hub.close()


def test_hub_diloco_joiner_listens_to_the_outer_step_it_joins_at():
    """With DiLoCo a joining group gets the donor's state before an outer step and takes that
    step's mean without giving one (its replicas are the donor's: counting them would weigh the
    donor twice); it is in the quorum from the next outer step on."""
    hub, events = _hub(2, min_groups=1)
    try:
        w1 = _connect(hub, 1)
        hub.alive.discard(0)  # group 0 is restarting: group 1 trains alone
        w1.send(_ready(0, sync_every=4))
        assert w1.recv()[0]["kind"] == "start"
        _average(w1, 3, np.array([2.0], np.float32))
        assert w1.recv()[0]["quorum"] == [1]
        hub.running(0)
        w0 = _connect(hub, 0)
        w0.send(_ready(0, sync_every=4))
        _until(lambda: 0 in hub.transfers)  # group 0 waits for a state before step 7 is sent
        _average(w1, 7, np.array([4.0], np.float32))
        assert w1.recv()[0] == {"kind": "give_state", "step": 7, "arrays": []}
        state = [np.array([1.0, 1.0], np.float32), np.array(7, np.int32)]
        _state(w1, 7, state)
        assert w0.recv()[0]["step"] == 7
        mean = [np.zeros(1, np.float32)]
        w0.send({"kind": "listen", "step": 7, **group_layout.whole(mean, send=False)})
        for w in (w0, w1):
            header, (mean,) = w.recv()
            assert header["quorum"] == [1] and mean.tolist() == [4.0]
        _average(w0, 11, np.array([1.0], np.float32))
        _average(w1, 11, np.array([3.0], np.float32))
        for w in (w0, w1):
            header, (mean,) = w.recv()
            assert header["quorum"] == [0, 1] and mean.tolist() == [2.0]
    finally:
        hub.close()


def test_hub_drops_a_group_that_hangs_in_a_step():
    """A group whose shards do not come (a stopped process) is dropped once the others have
    waited the hang timeout for it; the step goes on without it. Not during the start-up."""
    hub, events = _hub(2, min_groups=1)
    try:
        w0, w1 = _start_two(hub)
        _step_two(w0, w1, 0)
        _average(w0, 1, np.array([5.0], np.float32))
        _until(lambda: hub.pending)
        assert hub.drop_hung(60.0) == {}  # not yet
        assert list(hub.drop_hung(60.0, now=time.time() + 61)) == [1]
        header, (mean,) = w0.recv()
        assert header["quorum"] == [0] and mean.tolist() == [5.0]
        (failure,) = [e for e in events if e["event"] == "group_failure"]
        assert failure["group"] == 1 and failure["why"].startswith("hung")
    finally:
        hub.close()


def test_hub_drops_every_group_when_the_whole_quorum_hangs_and_restarts_them_from_a_checkpoint():
    """Every group of the quorum hung (process 1 of each stopped; group 0's process 0 has sent
    its shards): no group waits for another, yet no step is released. Once the job has waited the
    hang timeout since the last release, every group is dropped as hung; not before, nor in the
    first step. Restarted, both resume from their own restore (the newest checkpoint, step 4):
    neither waits for a peer's state, and what the lost groups left of step 6 does not count."""
    hub, events = _hub(2, min_groups=1, per_group=2)
    try:
        wires = {(g, k): _connect(hub, g, k) for g in range(2) for k in range(2)}
        for w in wires.values():
            w.send(_ready(4))
        assert all(w.recv()[0]["kind"] == "start" for w in wires.values())
        assert hub.drop_hung(60.0, now=time.time() + 1000) == {}  # the first step: start-up
        for step in (4, 5):
            before = time.time()
            for (g, k), w in wires.items():
                _average(w, step, np.array([float(g)], np.float32), owns=k == 0)
            assert all(w.recv()[1][0].tolist() == [0.5] for w in wires.values())
        _average(wires[0, 0], 6, np.array([1.0], np.float32))  # the others never send step 6
        _until(lambda: hub.pending)
        assert hub.drop_hung(60.0, now=before + 59) == {}  # not before the hang timeout
        hung = hub.drop_hung(60.0, now=time.time() + 61)
        assert sorted(hung) == [0, 1] and all(why.startswith("hung") for why in hung.values())
        assert all(w.recv()[0]["kind"] == "stop" for w in wires.values())
        failures = [e for e in events if e["event"] == "group_failure"]
        assert [e["group"] for e in failures] == [0, 1]
        assert all(e["why"].startswith("hung") and e["source"] == "hub" for e in failures)
        # both restarted: the first ready is not refused for want of a donor, both start at 4
        time.sleep(0.3)
        for g in range(2):
            hub.running(g)
        wires = {(g, k): _connect(hub, g, k) for g in range(2) for k in range(2)}
        for w in wires.values():
            w.send(_ready(4))
        assert all(w.recv()[0]["kind"] == "start" for w in wires.values())
        joined = [e for e in events if e["event"] == "group_joined"][2:]
        assert sorted((e["group"], e["step"], e["transfer"], e.get("all_lost")) for e in joined) == [
            (0, 4, False, True), (1, 4, False, True),
        ]  # fmt: skip
        for step in (4, 5, 6):
            for (g, k), w in wires.items():
                if (step, g) != (6, 1):
                    _average(w, step, np.array([2.0 * g], np.float32), owns=k == 0)
            if step == 6:  # group 0 has sent step 6 only now: group 1 is not late
                _until(lambda: len(hub.pending.get(6, {})) == 2)
                assert hub.drop_hung(0.25) == {}
                for k in range(2):
                    _average(wires[1, k], 6, np.array([2.0], np.float32), owns=k == 0)
            assert all(w.recv()[1][0].tolist() == [1.0] for w in wires.values())
    finally:
        hub.close()


def test_hub_gives_the_first_step_the_startup_timeout_once_every_group_is_ready():
    """The job's first step waits for every running group; once all are ready, groups that send
    nothing for the start-up timeout are dropped as hung, and the step goes on without them."""
    hub, events = _hub(3, min_groups=1)
    try:
        w0, w1 = _connect(hub, 0), _connect(hub, 1)
        for w in (w0, w1):
            w.send(_ready(0))
        _until(lambda: len(hub.joined) == 2)
        _average(w0, 0, np.array([1.0], np.float32))
        _until(lambda: hub.pending)
        assert hub.drop_hung(60.0, now=time.time() + 10_000, startup_s=600.0) == {}  # 2 starts
        before = time.time()
        w2 = _connect(hub, 2)
        w2.send(_ready(0))
        assert all(w.recv()[0]["kind"] == "start" for w in (w0, w1, w2))
        assert hub.drop_hung(60.0, now=before + 599, startup_s=600.0) == {}
        hung = hub.drop_hung(60.0, now=time.time() + 601, startup_s=600.0)
        assert sorted(hung) == [1, 2] and all(
            w.startswith("hung: the first") for w in hung.values()
        )
        header, (mean,) = w0.recv()
        assert header["quorum"] == [0] and mean.tolist() == [1.0]
    finally:
        hub.close()


def test_hub_does_not_take_a_long_step_or_a_held_quorum_for_a_hung_one():
    """The rule for a quorum hung as a whole waits at least 10 of the recent times between
    releases (DiLoCo's outer steps are H steps apart), not while a checkpoint save is open, and
    never while a group waits in an average (for a quorum of --min-groups, as here, or for a
    late group: the other rule's)."""
    hub, events = _hub(2, min_groups=2)
    try:
        w0, w1 = _start_two(hub)
        for step in range(3):
            time.sleep(0.5)  # the groups' steps between two releases take 0.5 s
            _step_two(w0, w1, step)
        assert hub.drop_hung(1.0, now=time.time() + 3) == {}  # 10 x 0.5 s, not the timeout's 1 s
        assert hub.drop_hung(1.0, now=time.time() + 1000, saving=True) == {}  # a save is open
        w1.close()  # group 1 dies; group 0 waits in step 3 for a quorum of two
        _until(lambda: 1 not in hub.alive)
        _average(w0, 3, np.array([1.0], np.float32))
        _until(lambda: hub.pending)
        assert hub.drop_hung(1.0, now=time.time() + 1000) == {}
        assert not [e for e in events if e["event"] == "group_failure" and "hung" in e["why"]]
    finally:
        hub.close()


def test_supervisor_gives_an_open_save_the_startup_time(tmp_path):
    """The supervisor reads the workers' save_begin / save_end from events.jsonl: a save open in
    a running group holds the quorum-hang rule for the start-up timeout; a save whose group has
    died holds nothing."""
    opts = Options(command=[sys.executable, "-c", "import time; time.sleep(120)"], nproc=1,
                   run_dir=str(tmp_path / "run"), groups=1)  # fmt: skip
    sup = ReplicaSupervisor(opts)
    os.makedirs(sup.run_dir)
    sup.tail = EventTail(sup.events_path)
    grp = ReplicaGroup(opts, sup.waker, 0, "127.0.0.1:1", KEY)
    sup.groups = [grp]
    grp.start({"incarnation": 3, "coordinator": "127.0.0.1:1", "bind": "127.0.0.1:1",
               "nproc": 1, "process_ids": [0], "attempt": 0, "collective_timeout": 60.0})  # fmt: skip
    try:
        now = time.time()
        assert not sup._saving(now, 600.0)
        append_line(sup.events_path, {"event": "save_begin", "incarnation": 3, "step": 4})
        assert sup._saving(now, 600.0) and sup._saving(now + 599, 600.0)
        assert not sup._saving(now + 601, 600.0)  # a save open past the start-up timeout
        append_line(sup.events_path, {"event": "save_end", "incarnation": 3, "step": 4})
        assert not sup._saving(now, 600.0)
        append_line(sup.events_path, {"event": "save_begin", "incarnation": 3, "step": 8})
        assert sup._saving(now, 600.0)
        grp.kill_all()
        assert not sup._saving(now, 600.0)  # its group is gone: no save will end
    finally:
        grp.kill_all()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "3", "--groups", "2"], "--nproc 3 is not divisible by --groups 2; give a multiple"),
        (["--nproc", "4", "--groups", "2", "--min-groups", "3"], "--min-groups 3 must be in [1, --groups 2]"),
        (["--nproc", "2", "--min-groups", "2"], "--min-groups 2 without --groups; give --groups R"),
    ],
)  # fmt: skip
def test_groups_bad_input_one_line(tmp_path, args, message):
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", *args, "--run-dir", str(tmp_path / "r"),
           "--", sys.executable, "-c", "pass"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {message}"]


USAGE_WORKER = """
import os, sys, time
time.sleep(int(os.environ['JAXPAR_GROUP']))
print("error: data.global_batch=3 is not divisible by --groups 2", file=sys.stderr)
sys.exit(2)
"""


def test_a_groups_configuration_error_is_not_restarted(tmp_path):
    """A group's process that exits 2 (a usage or configuration error, e.g. a global batch the
    groups do not divide) would fail the same way in every restart: the job gives up at once,
    with the worker's error line and its log's path, as a plain launch does."""
    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "2", "--groups", "2",
           "--no-spares", "--run-dir", str(run), "--", sys.executable, "-c", USAGE_WORKER]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "giving up: process 0 of group 0 exited with code 2 (a usage or configuration " \
        "error, restarting will not help)" in out.stderr, out.stderr  # fmt: skip
    log = run / "logs" / "inc0-group0-proc0.log"
    assert f"last lines of {log}:\n    error: data.global_batch=3 is not divisible by " \
        f"--groups 2" in out.stderr, out.stderr  # fmt: skip
    assert f"Its log: {log}." in out.stderr
    assert "group 0 failed" not in out.stderr


# Both groups (one process each) join the job's first step; then group 1's process closes its
# hub connection and dies 0.4 s later (a process that dies closes its sockets first; the
# supervisor may see the closed connection before the exit): killed, or exiting 44 after a `nan`
# fault's event.
LOST_FIRST_WORKER = """
import os, signal, socket, sys, time
import numpy as np
from jaxpar.rundir.writer import RunDir
from jaxpar.worker import group_layout, group_wire
g, p = int(os.environ["JAXPAR_GROUP"]), int(os.environ["JAXPAR_GLOBAL_PROCESS"])
run_dir = os.environ["JAXPAR_RUN_DIR"]
host, port = os.environ["JAXPAR_GROUP_HUB"].rsplit(":", 1)
sock = socket.create_connection((host, int(port)), timeout=10)
wire = group_wire.client_handshake(sock, bytes.fromhex(os.environ["JAXPAR_GROUP_KEY"]),
                                   {"group": g, "rank": 0})
wire.send({"kind": "ready", "step": 0, **group_layout.whole([np.zeros(2, np.float32)], send=False)})
if g == 0:
    open(os.path.join(run_dir, "group0-ready"), "w").close()
    time.sleep(120)
while not os.path.exists(os.path.join(run_dir, "group0-ready")):
    time.sleep(0.05)
if sys.argv[1] == "nan":
    run = RunDir(run_dir, 1, int(os.environ["JAXPAR_INCARNATION"]))
    run.event("fault_injected", all_processes=True, kind="nan", spec="nan@8", process=p, step=8,
              permanent=False)
time.sleep(0.3)
sock.close()
time.sleep(0.4)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(44)
"""


@pytest.mark.parametrize(
    "how, min_groups, why, meanwhile",
    [
        ("kill", [], "process 1 was killed by SIGKILL (code -9)",
         "; group 0 waits for it: a step needs --min-groups 2 groups, so none is released until "
         "it is back (--min-groups 1 would let it train on)"),
        ("nan", ["--min-groups", "1"], "process 1 exited with code 44 (a non-finite loss, or a "
         "state of NaNs that was not saved) — injected fault nan@8",
         "; the other groups keep training"),
    ],
)  # fmt: skip
def test_a_group_that_dies_is_named_by_its_exit_not_its_lost_connection(tmp_path, how,
                                                                         min_groups, why, meanwhile):  # fmt: skip
    """Whichever the supervisor sees first, the closed hub connection or the exit, the failure
    names the exit (code, signal, the injected fault); and what the other group does meanwhile
    follows the quorum in force: with two groups the default --min-groups is 2, so it waits."""
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "2", "--groups", "2",
           *min_groups, "--no-spares", "--max-restarts", "1", "--run-dir", str(tmp_path / "r"),
           "--", sys.executable, "-c", LOST_FIRST_WORKER, how]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.count(f"group 1 failed ({why}){meanwhile}\n") == 2, out.stderr
    assert "connection to the group hub was lost" not in out.stderr, out.stderr
    assert "giving up: restart budget spent (1 of --max-restarts 1)" in out.stderr


def test_a_group_started_beside_live_groups_leaves_their_save_in_flight(tmp_path, monkeypatch):
    """orbax removes the unfinished saves it finds as a checkpointer starts. A group restarted
    while another group saves (seen: group 1 restarted during group 0's save of step 4, which
    then committed damaged and the next run started from step 0) must not: only a group that
    starts with no other group running tidies the shared folder."""
    from jaxpar.recovery.checkpoint import Checkpointer
    from jaxpar.rundir.writer import RunDir
    from jaxpar.worker import groups

    opts = Options(command=["x"], nproc=2, run_dir=str(tmp_path / "run"), groups=2)
    grp = ReplicaGroup(opts, None, 1, "127.0.0.1:1", KEY)
    spec = {"coordinator": "127.0.0.1:2", "bind": "127.0.0.1:2", "nproc": 1, "incarnation": 1,
            "collective_timeout": 60.0}  # fmt: skip
    beside, alone = grp._env({**spec, "tidy": False}, 1, 0), grp._env({**spec, "tidy": True}, 1, 0)
    assert beside[group_wire.ENV_TIDY] == "0" and alone[group_wire.ENV_TIDY] == "1"
    for env, tidies in ((beside, False), (alone, True), ({}, True)):
        for name in (group_wire.ENV_GROUPS, group_wire.ENV_GROUP, group_wire.ENV_HUB,
                     group_wire.ENV_KEY, group_wire.ENV_TIDY):  # fmt: skip
            monkeypatch.delenv(name, raising=False)
            if name in env:
                monkeypatch.setenv(name, env[name])
        assert groups.tidies_checkpoints() is tidies, env.get(group_wire.ENV_TIDY)

    run = RunDir(str(tmp_path / "run"), 0)
    in_flight = tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp"
    in_flight.mkdir(parents=True)
    (in_flight / "manifest.ocdbt").write_bytes(b"being written")
    ckpt = Checkpointer(run, every=0, keep=2, meta={}, tidy=False)
    ckpt.close()
    assert (in_flight / "manifest.ocdbt").read_bytes() == b"being written"
    ckpt = Checkpointer(run, every=0, keep=2, meta={})  # a job's first start: tidies
    ckpt.close()
    _until(lambda: not in_flight.exists(), timeout=30.0)  # orbax's cleanup runs on a thread


ROWS = [(0, 1, 0, 2), (1, 2, 0, 2)]  # a (2, 2) leaf split by rows: process k holds row k
COLS = [(0, 2, 0, 1), (0, 2, 1, 2)]  # ... by columns: process k holds column k


def _split(wire: Wire, kind: str, step: int, full: np.ndarray, index: tuple, **extra) -> None:
    """Process `wire` sends its piece `index` of the (2, 2) leaf `full`, and wants it back."""
    piece = np.ascontiguousarray(full[index[0] : index[1], index[2] : index[3]])
    fields = group_layout.fields([(2, 2)], ["float32"], [[index]], [[index]])
    wire.send({"kind": kind, "step": step, **fields, **extra}, [piece])


def _restart_group_0(hub: Hub, wires: dict, shape: tuple, held: list) -> None:
    """Group 0's connections lost, the group running again and its processes ready, process k
    holding `held[k]` of a leaf of `shape`."""
    for k in range(2):
        wires[0, k].close()
    _until(lambda: 0 not in hub.alive)
    hub.running(0)
    for k in range(2):
        wires[0, k] = _connect(hub, 0, k)
        fields = group_layout.fields([shape], ["float32"], [[]], [[held[k]]])
        wires[0, k].send({"kind": "ready", "step": 0, **fields})


def test_hub_averages_and_hands_over_between_groups_of_different_layouts():
    """Group 0's two processes split a leaf by rows, group 1's by columns: the mean is of the
    whole leaves, each process gets its own part of it; a group restarted in the rows layout gets
    group 1's state resharded (checksummed anew), and one holding another state ends the job."""
    hub, events = _hub(2, min_groups=1, per_group=2)
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    b = np.array([[5.0, 6.0], [7.0, 8.0]], np.float32)
    try:
        wires = {(g, k): _connect(hub, g, k) for g in range(2) for k in range(2)}
        for (g, k), w in wires.items():
            layout = ROWS if g == 0 else COLS
            w.send({"kind": "ready", "step": 0,
                    **group_layout.fields([(2, 2)], ["float32"], [[]], [[layout[k]]])})  # fmt: skip
        assert all(w.recv()[0]["kind"] == "start" for w in wires.values())
        for (g, k), w in wires.items():
            _split(w, "average", 0, a if g == 0 else b, (ROWS if g == 0 else COLS)[k])
        want = (a + b) / 2
        assert wires[0, 1].recv()[1][0].tolist() == want[1:2, :].tolist()
        assert wires[1, 1].recv()[1][0].tolist() == want[:, 1:2].tolist()
        for w in (wires[0, 0], wires[1, 0]):
            w.recv()
        # group 0 restarts; group 1 (columns) gives its state at step 1, resharded to rows
        _restart_group_0(hub, wires, (2, 2), ROWS)
        _until(lambda: 0 in hub.transfers)
        state = np.array([[9.0, 10.0], [11.0, 12.0]], np.float32)
        for k in range(2):
            _split(wires[1, k], "average", 1, b, COLS[k])
        for k in range(2):
            assert wires[1, k].recv()[0] == {"kind": "give_state", "step": 1, "arrays": []}
            piece = [np.ascontiguousarray(state[:, k : k + 1])]
            _split(wires[1, k], "state", 1, state, COLS[k],
                   checksum=group_wire.checksum(piece))  # fmt: skip
        for k in range(2):
            header, got = wires[0, k].recv()
            assert header["kind"] == "state" and header["checksum"] == group_wire.checksum(got)
            assert got[0].tolist() == state[k : k + 1, :].tolist()
        joined = [e for e in events if e["event"] == "group_joined" and e["transfer"]]
        assert [(e["group"], e["resharded"]) for e in joined] == [(0, True)]
        # a group holding a leaf of another shape can never take part: the job ends
        _restart_group_0(hub, wires, (2, 3), [(0, 2, 0, 3)] * 2)
        _until(lambda: hub.fatal is not None)
        assert "leaf 0 is float32[2, 3] against float32[2, 2]" in hub.fatal
        assert "same model and optimizer" in hub.fatal
    finally:
        hub.close()


# ---- strangers at the hub's port: a flood, slow handshakes, a frame too large ----------------------

FLOODED_HUB = """
import json, os, resource, sys, threading, time
from jaxpar.supervisor.replicas import Hub

hub = Hub("127.0.0.1", bytes.fromhex(sys.argv[1]), 2, 1, 1, lambda name, **f: None,
          lambda g: None)
for g in range(2):
    hub.running(g)
peak = [0]

def watch():
    while True:
        peak[0] = max(peak[0], threading.active_count())
        time.sleep(0.01)

threading.Thread(target=watch, daemon=True).start()
# two descriptors to spare: the flood runs past the limit at once
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))
print(hub.address, flush=True)
sys.stdin.readline()
print(json.dumps({"threads": peak[0], "joined": sorted(hub.joined)}), flush=True)
"""


def test_hub_outlives_a_flood_past_its_descriptor_limit_and_lets_a_member_in():
    """The hub's process may hold two more descriptors; 150 idle connections from the member's
    own address flood its port. The accept loop meets EMFILE, says so once, backs off and goes
    on, holding few connections and threads; a real member still joins."""
    from tests.support.launch_util import REPO

    child = subprocess.Popen(
        [sys.executable, "-c", FLOODED_HUB, KEY.hex()], cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    flood: list[socket.socket] = []
    try:
        host, port = child.stdout.readline().strip().rsplit(":", 1)
        for _ in range(150):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            flood.append(s)
        time.sleep(1.0)
        deadline, wire = time.time() + 60, None
        while wire is None:  # a restarted worker tries again; the accept loop must be there
            assert time.time() < deadline and child.poll() is None, "no member got in"
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.settimeout(5)
                wire = group_wire.client_handshake(sock, KEY, {"group": 0, "rank": 0})
            except (OSError, WireError):
                time.sleep(0.5)
        sock.settimeout(10)
        wire.send(_ready(0))
        assert wire.recv()[0]["kind"] == "start"
        child.stdin.write("report\n")
        child.stdin.flush()
        report = json.loads(child.stdout.readline())
    finally:
        for s in flood:
            s.close()
        child.kill()
        _, err = child.communicate(timeout=30)
    assert report["joined"] == [0], report
    assert report["threads"] <= 16, report  # bounded: not one per connection
    assert err.count("cannot accept a connection ([Errno 24]") == 1, err


def test_hub_cuts_slow_handshakes_at_their_deadline_and_a_member_gets_in_beside_them(monkeypatch):
    """Connections that send a byte every 0.2 s are cut at the hub's handshake deadline (1 s
    for the whole handshake, not per read), and 40 of them from a member's own address do not
    keep the member out."""
    from tests.support.net import slow_loris

    monkeypatch.setattr(group_wire, "HANDSHAKE_S", 1.0)
    hub, events = _hub(2, min_groups=1)
    port = int(hub.address.rsplit(":", 1)[1])
    stop, opened = threading.Event(), []
    try:
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        t0 = time.monotonic()
        with contextlib.suppress(OSError):
            while time.monotonic() - t0 < 10:
                slow.sendall(b" ")
                slow.settimeout(0.2)
                with contextlib.suppress(TimeoutError):
                    if slow.recv(1) == b"":
                        break
        took = time.monotonic() - t0
        slow.close()
        assert took < 5, f"a trickling handshake held its slot for {took:.1f}s"
        loris = threading.Thread(target=slow_loris, args=(port, stop, 40, 1, opened, 1),
                                 daemon=True)  # fmt: skip
        loris.start()
        _until(lambda: len(opened) >= 40, timeout=30)
        w0 = _connect(hub, 0)
        w0.send(_ready(0))
        assert w0.recv()[0]["kind"] == "start"
    finally:
        stop.set()
        hub.close()
    reasons = [e["reason"] for e in events if e["event"] == "control_rejected"]
    assert all(e.get("server") == "hub" for e in events if e["event"] == "control_rejected")
    # the deadline ends it by the handshake's own read timeout or, first on a loaded machine, by
    # the admission watchdog's eviction: either is the whole-handshake deadline
    deadline = ("handshake did not complete in time", "cut short: not done within")
    assert any(d in r for r in reasons for d in deadline), reasons


def test_a_frame_larger_than_the_state_drops_that_connection_only():
    """After the handshake a frame announcing 60 GiB (within the wire's absolute bound) is
    refused before anything is allocated: it is more than the job's state can make a frame
    carry. Its group is dropped; the other trains on."""
    hub, events = _hub(2, min_groups=1)
    try:
        w0, w1 = _start_two(hub)
        head = json.dumps({"kind": "average", "step": 0,
                           "arrays": [["float32", [15 << 30]]]}).encode()  # fmt: skip
        w1.sock.sendall(struct.pack("!I", len(head)) + head + b"\0" * 64)
        _until(lambda: any(e["event"] == "group_failure" for e in events))
        (failure,) = [e for e in events if e["event"] == "group_failure"]
        assert failure["group"] == 1 and "more than this connection carries" in failure["why"]
        _average(w0, 0, np.array([1.0], np.float32))
        header, (mean,) = w0.recv()
        assert header["quorum"] == [0] and mean.tolist() == [1.0]
    finally:
        hub.close()


def test_a_groups_non_finite_or_outlying_gradients_are_dropped_before_the_average():
    """Three groups: group 1's gradients hold a NaN (its loss finite), then group 2's norm is far
    above the others'. Each is dropped from the step before it enters the average, named with
    its cause; the step is released over the rest; the supervisor is told why."""
    hub, events = _hub(3, min_groups=1)

    def send(w, step, loss, grads):
        tree = [np.float32(loss), np.asarray(grads, np.float32)]
        fields = group_layout.whole(tree)
        w.send({"kind": "average", "step": step, "parts": [["loss", 1], ["gradients", 1]],
                **fields}, tree)  # fmt: skip

    try:
        wires = [_connect(hub, g) for g in range(3)]
        for w in wires:
            w.send(_ready(0))
        assert all(w.recv()[0]["kind"] == "start" for w in wires)
        for g, grads in enumerate(([1.0, 1.0], [np.nan, 1.0], [3.0, 3.0])):
            send(wires[g], 0, 2.0, grads)
        for g in (0, 2):
            header, (loss, mean) = wires[g].recv()
            assert header["quorum"] == [0, 2] and mean.tolist() == [2.0, 2.0]
        assert wires[1].recv()[0]["kind"] == "stop"
        causes = hub.take_causes()
        assert list(causes) == [1] and causes[1].startswith("non-finite gradients in step 1")
        hub.running(1)  # back, with the donor's state ...
        hub.min_groups, hub.joined[1] = 1, 1  # ... in step 2's quorum (as after a transfer)
        wires[1] = _connect(hub, 1)
        for g, grads in enumerate(([1.0, 1.0], [2.0, 2.0], [1e6, 1e6])):
            send(wires[g], 1, 2.0, grads)
        for g in (0, 1):
            header, (loss, mean) = wires[g].recv()
            assert header["quorum"] == [0, 1] and mean.tolist() == [1.5, 1.5]
        failures = {e["group"]: e["why"] for e in events if e["event"] == "group_failure"}
        assert failures[1].startswith("non-finite gradients in step 1"), failures
        assert "gradient norm 1.41e+06 in step 2, more than 100 times" in failures[2], failures
    finally:
        hub.close()


STORES = [f"127.0.0.1:{4000 + g}" for g in range(3)]  # the workers' rendezvous stores


def _report(w: Wire, step: int, digest: str = "d", bad=(), sq: float = 1.0) -> None:
    """A worker's report for the peer-to-peer average (two leaves: the loss, its gradients)."""
    w.send({"kind": "report", "step": step, "bad": list(bad), "sq": sq, "digest": digest,
            "leaves": 2, "parts": [["loss", 1], ["gradients", 1]]})  # fmt: skip


def _started_p2p(hub: Hub, groups=(0, 1)) -> list[Wire]:
    """Workers of `groups` connected, ready with their peer-to-peer stores, and started."""
    wires = [_connect(hub, g) for g in groups]
    for g, w in zip(groups, wires, strict=True):
        w.send({**_ready(0), "p2p": STORES[g]})
    assert all(w.recv()[0]["kind"] == "start" for w in wires)
    return wires


def _exchanged(ws: list[Wire], step: int, quorum: list[int], store: str):
    """The exchange each of `ws` (quorum's processes, in order) is told of: its epoch."""
    heads = [w.recv()[0] for w in ws]
    assert all(h["kind"] == "exchange" and h["step"] == step for h in heads), heads
    assert [h["rank"] for h in heads] == list(range(len(quorum)))
    assert {h["store"] for h in heads} == {store}  # the quorum's lowest group's
    assert len({(h["epoch"], h["prefix"], h["world"]) for h in heads}) == 1
    assert all(h["quorum"] == quorum and h["arrays"] == [] for h in heads)
    return heads[0]["epoch"]


def _reduced(w: Wire, step: int, epoch, ok: bool = True) -> None:
    w.send({"kind": "reduced", "step": step, "epoch": epoch, "ok": ok,
            "error": "" if ok else "RuntimeError: Connection reset by peer"})  # fmt: skip


def test_hub_peer_to_peer_screens_reports_reforms_communicators_and_falls_back_to_itself(capsys):
    """The peer-to-peer average as the hub sees it (workers played here): reports in, exchanges
    out, no arrays either way. Groups of different layouts (digests) average through the hub;
    a non-finite report drops its group before the exchange; a failed exchange is re-formed
    fresh; the communicators are kept while the quorum is; a member silent inside an exchange
    past the hang timeout leaves and the rest commit; a group without the engine sends its
    shards and the others are asked for theirs."""
    hub, events = _hub(3, min_groups=1)
    report, reduced = _report, _reduced

    def exchange(ws, step, quorum):
        return _exchanged(ws, step, quorum, STORES[quorum[0]])

    try:
        wires = _started_p2p(hub, range(3))
        # step 0: group 2 holds other shards: every group is asked for its shards
        for g, w in enumerate(wires):
            report(w, 0, digest="other" if g == 2 else "d")
        assert all(w.recv()[0] == {"kind": "send", "step": 0, "arrays": []} for w in wires)
        for w in wires:
            _average(w, 0, np.array([3.0], np.float32))
        assert all(w.recv()[1][0].tolist() == [3.0] for w in wires)
        assert "through the group hub: the groups' layouts differ" in capsys.readouterr().err
        hub_bytes = hub.gradient_bytes
        # step 1: group 1's report names a non-finite leaf: out before the exchange
        for g, w in enumerate(wires):
            report(w, 1, bad=[1] if g == 1 else [])
        assert wires[1].recv()[0]["kind"] == "stop"
        assert hub.take_causes()[1].startswith("non-finite gradients in step 2")
        survivors = [wires[0], wires[2]]
        e1 = exchange(survivors, 1, [0, 2])
        reduced(wires[0], 1, e1)
        reduced(wires[2], 1, e1, ok=False)  # every member answered, one failed: formed anew
        e2 = exchange(survivors, 1, [0, 2])
        assert e2 != e1
        for w in survivors:
            reduced(w, 1, e2)
        for w in survivors:
            head, arrays = w.recv()
            assert head["kind"] == "averaged" and head["epoch"] == e2 and arrays == []
        # step 2: the same quorum keeps its communicators; group 2 goes silent inside it
        for w in survivors:
            report(w, 2)
        assert exchange(survivors, 2, [0, 2]) == e2
        reduced(wires[0], 2, e2, ok=False)  # its peer's timeout
        _until(lambda: bool(hub.exchanges[2]["failed"]))
        assert hub.drop_hung(30.0, now=time.time() + 31) == {
            2: "hung: no word from inside step 3's exchange 30s after it began"}  # fmt: skip
        assert wires[2].recv()[0]["kind"] == "stop"
        e3 = exchange([wires[0]], 2, [0])
        reduced(wires[0], 2, e3)
        assert wires[0].recv()[0] == {"kind": "averaged", "step": 2, "quorum": [0], "epoch": e3,
                                      "arrays": []}  # fmt: skip
        assert hub.gradient_bytes == hub_bytes and hub.p2p_steps == 2
        # step 3: group 1 is back without the engine: group 0 is asked for its shards
        hub.running(1)
        hub.joined[1], hub.p2p_missing[1] = 3, "jaxpar[gloo] is not installed"
        wires[1] = _connect(hub, 1)
        report(wires[0], 3)
        _average(wires[1], 3, np.array([1.0], np.float32))
        assert wires[0].recv()[0] == {"kind": "send", "step": 3, "arrays": []}
        _average(wires[0], 3, np.array([3.0], np.float32))
        assert [w.recv()[1][0].tolist() for w in wires[:2]] == [[2.0], [2.0]]
        assert "group 1 cannot exchange peer to peer (jaxpar[gloo] is not installed)" in \
            capsys.readouterr().err  # fmt: skip
        paths = [(e["quorum"], e["exchange"]) for e in events if e["event"] == "quorum_changed"]
        assert paths == [([0, 1, 2], "hub"), ([0, 2], "p2p"), ([0], "p2p"), ([0, 1], "hub")]
    finally:
        hub.close()


def test_hub_peer_to_peer_step_a_group_joins_at_waits_for_it_and_is_exchanged_again():
    """Group 2 joins while groups 0 and 1 are inside step 1's exchange: its donor gives the state
    it computes step 1 from (peer to peer: only its checksum through the hub), so step 1 is not
    committed over [0, 1]: it waits for group 2's report and is exchanged again over all
    three."""
    hub, events = _hub(3, min_groups=1)
    hub.alive.discard(2)  # not started yet
    try:
        w0, w1 = _started_p2p(hub)
        for w in (w0, w1):
            _report(w, 0)
        e = _exchanged([w0, w1], 0, [0, 1], STORES[0])
        for w in (w0, w1):
            _reduced(w, 0, e)
        assert w0.recv()[0]["kind"] == w1.recv()[0]["kind"] == "averaged"
        for w in (w0, w1):
            _report(w, 1)
        assert _exchanged([w0, w1], 1, [0, 1], STORES[0]) == e
        hub.running(2)
        w2 = _connect(hub, 2)
        w2.send({**_ready(0), "p2p": STORES[2]})
        # the same layout and the engine on both sides: the state goes peer to peer, group 0's
        # process to group 2's, in a communicator of two at group 0's store
        give, receive = w0.recv()[0], w2.recv()[0]
        assert give["kind"] == "give_state" and give["step"] == 1, give
        assert receive["kind"] == "receive_state" and receive["rank"] == 1, receive
        assert give["p2p"]["store"] == receive["store"] == STORES[0]
        assert give["p2p"]["prefix"] == receive["prefix"] and receive["world"] == 2
        for w in (w0, w1):
            _reduced(w, 1, e)
        w0.send({"kind": "state_sent", "step": 1, "checksum": "c" * 64})
        assert w2.recv()[0] == {"kind": "state", "step": 1, "checksum": "c" * 64, "p2p": True,
                                "quorum": [0, 1, 2], "arrays": []}  # fmt: skip
        _report(w2, 1)
        e2 = _exchanged([w0, w1, w2], 1, [0, 1, 2], STORES[0])
        assert e2 != e
        for w in (w0, w1, w2):
            _reduced(w, 1, e2)
        for w in (w0, w1, w2):
            assert w.recv()[0] == {"kind": "averaged", "step": 1, "quorum": [0, 1, 2],
                                   "epoch": e2, "arrays": []}  # fmt: skip
        assert hub.p2p_steps == 2 and hub.gradient_bytes == hub.state_bytes == 0
        (joined,) = [e for e in events if e["event"] == "group_joined" and e["transfer"]]
        assert joined["group"] == 2 and joined["donor"] == 0 and joined["p2p"], joined
    finally:
        hub.close()


def test_hub_peer_to_peer_diloco_joiner_listens_through_the_hub_then_exchanges():
    """Peer to peer with DiLoCo: the joiner's first outer step (it listens, giving no mean) goes
    through the hub (the donor is asked for its shards), the next one peer to peer."""
    hub, _ = _hub(2, min_groups=1)
    try:
        w1 = _connect(hub, 1)
        hub.alive.discard(0)
        w1.send({**_ready(0, sync_every=4), "p2p": STORES[1]})
        assert w1.recv()[0]["kind"] == "start"
        _report(w1, 3)
        e = _exchanged([w1], 3, [1], STORES[1])
        _reduced(w1, 3, e)
        assert w1.recv()[0]["kind"] == "averaged"
        hub.running(0)
        w0 = _connect(hub, 0)
        w0.send({**_ready(0, sync_every=4), "p2p": STORES[0]})
        _until(lambda: 0 in hub.transfers)
        _report(w1, 7)
        assert w1.recv()[0] == {"kind": "give_state", "step": 7, "arrays": []}  # a DiLoCo donor
        _state(w1, 7, [np.array([1.0, 1.0], np.float32), np.array(7, np.int32)])
        assert w0.recv()[0]["step"] == 7
        w0.send({"kind": "listen", "step": 7,
                 **group_layout.whole([np.zeros(1, np.float32)], send=False)})  # fmt: skip
        assert w1.recv()[0] == {"kind": "send", "step": 7, "arrays": []}
        _average(w1, 7, np.array([4.0], np.float32))
        for w in (w0, w1):
            header, (mean,) = w.recv()
            assert header["quorum"] == [1] and mean.tolist() == [4.0]
        for w in (w0, w1):
            _report(w, 11)
        e = _exchanged([w0, w1], 11, [0, 1], STORES[0])
        for w in (w0, w1):
            _reduced(w, 11, e)
        assert w0.recv()[0]["quorum"] == w1.recv()[0]["quorum"] == [0, 1]
    finally:
        hub.close()


def test_hub_peer_to_peer_exchange_failing_twice_with_every_member_answering_drops_the_highest():
    """Two groups that reach the hub but not each other (a partition between their hosts): each
    exchange fails on both sides; after the second the quorum's highest group leaves it, named
    why, and the other commits the step alone."""
    hub, _ = _hub(2, min_groups=1)
    try:
        w0, w1 = _started_p2p(hub)
        for w in (w0, w1):
            _report(w, 0)
        for _ in range(2):
            e = _exchanged([w0, w1], 0, [0, 1], STORES[0])
            for w in (w0, w1):
                _reduced(w, 0, e, ok=False)
        assert w1.recv()[0]["kind"] == "stop"
        why = hub.take_causes()[1]
        assert why.startswith("the exchange of step 1 failed twice with every group answering")
        e = _exchanged([w0], 0, [0], STORES[0])
        _reduced(w0, 0, e)
        assert w0.recv()[0]["quorum"] == [0]
    finally:
        hub.close()


def test_hub_peer_to_peer_leaves_the_engine_cannot_sum_go_through_the_hub(capsys):
    """A process with the engine whose leaves Gloo cannot sum sends its shards with the reason:
    the others are asked for theirs, and the launch says why once."""
    hub, _ = _hub(2, min_groups=1)
    try:
        w0, w1 = _started_p2p(hub)
        _report(w0, 0)
        fields = group_layout.whole([np.array([1.0], np.float32)])
        w1.send({"kind": "average", "step": 0, "p2p_missing": "leaves of dtype bool, which "
                 "Gloo does not sum", **fields}, [np.array([1.0], np.float32)])  # fmt: skip
        assert w0.recv()[0] == {"kind": "send", "step": 0, "arrays": []}
        _average(w0, 0, np.array([3.0], np.float32))
        assert w0.recv()[1][0].tolist() == w1.recv()[1][0].tolist() == [2.0]
        assert ("through the group hub: group 1 cannot exchange peer to peer (leaves of dtype "
                "bool, which Gloo does not sum)") in capsys.readouterr().err  # fmt: skip
    finally:
        hub.close()
