"""The replica groups' wire: authenticated frames of numpy arrays between a worker and the
leader's group hub (jaxpar/supervisor/replicas.py). No jax, no pickles.

A frame is

    u32 header length | header (JSON object) | payload | HMAC-SHA256 (32 bytes)

The header names the message and its arrays as [[dtype, shape], ...]; the payload is their raw
bytes (C order) back to back, exactly as many as the header's arrays add up to. The MAC covers
"DIR|SEQ|" + header + payload under the session key, as on the agents' control channel: DIR is
"h" from the hub and "w" from a worker, SEQ counts 0, 1, ... per direction, so a frame that is
altered, replayed or reordered fails. The session key is HMAC-SHA256(K, "groups|NW|NH") of the
job's group key K (JAXPAR_GROUP_KEY, made by the leader for this job) and both sides' nonces.
Header and payload sizes are bounded; dtypes are a fixed list of plain numeric ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import queue
import secrets
import socket
import struct
import threading
import time

import numpy as np

from jaxpar.worker import bootstrap

# The environment `jaxpar launch --groups R` adds to each worker's.
ENV_GROUP = "JAXPAR_GROUP"  # this worker's group, 0..R-1
ENV_GROUPS = "JAXPAR_GROUPS"  # R
ENV_GLOBAL_PROCESS = bootstrap.ENV_GLOBAL_PROCESS  # group * P + process id
ENV_HUB = "JAXPAR_GROUP_HUB"  # HOST:PORT of the leader's group hub
ENV_KEY = "JAXPAR_GROUP_KEY"  # the job's group key (hex), made by the leader
# "1": no other group runs while this one starts, so it may remove unfinished checkpoint saves
# (another group's save in flight is never one)
ENV_TIDY = "JAXPAR_GROUP_TIDY"

MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 36  # 64 GiB: one process's share of a state
# what a connection's frames may carry before the job's state is known (a `ready` names its
# leaves, no arrays); after, `carried(the state's bytes)`
READY_PAYLOAD = 1 << 20
CHUNK = 1 << 24  # a frame's bytes are read (and its buffer grown) this much at a time
SMALL_FRAME = 1 << 16  # array bytes up to which a frame is sent in one write (copied once)
DTYPES = frozenset(
    ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
     "uint32", "uint64", "bool")
)  # fmt: skip
HANDSHAKE_S = 30.0


class WireError(Exception):
    """A frame that is malformed, too large or not authentic: the connection is dropped."""


def carried(state_bytes: int) -> int:
    """The most a frame of a job whose state is `state_bytes` carries: a state transfer holds at
    most the state, a step's average its gradients (at most twice the parameters' bytes, in
    another dtype) and metrics; at most MAX_PAYLOAD."""
    return min(2 * state_bytes + READY_PAYLOAD, MAX_PAYLOAD)


def session_key(key: bytes, worker_nonce: str, hub_nonce: str) -> bytes:
    return hmac.new(key, f"groups|{worker_nonce}|{hub_nonce}".encode(), hashlib.sha256).digest()


def proof(key: bytes, *parts: object) -> str:
    return hmac.new(key, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def specs_of(arrays: list[np.ndarray]) -> list:
    return [[a.dtype.name, list(a.shape)] for a in arrays]


def check_specs(specs: object) -> int:
    """The payload bytes of `specs` ([[dtype, shape], ...]); WireError when malformed."""
    if not isinstance(specs, list):
        raise WireError("arrays must be a list")
    total = 0
    for spec in specs:
        ok = isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES
        shape = spec[1] if ok else None
        if not ok or not isinstance(shape, list) or len(shape) > 16:
            raise WireError(f"bad array spec {str(spec)[:80]}")
        if not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise WireError(f"bad array shape {str(shape)[:80]}")
        total += math.prod(shape) * np.dtype(spec[0]).itemsize
        if total > MAX_PAYLOAD:
            raise WireError(f"arrays larger than {MAX_PAYLOAD} bytes")
    return total


def unpack(specs: list, payload: bytes | memoryview) -> list[np.ndarray]:
    out, at = [], 0
    for dtype, shape in specs:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        out.append(np.frombuffer(payload, dtype, math.prod(shape), at).reshape(shape))
        at += n
    return out


def contiguous(a) -> np.ndarray:
    """`a` as a C-ordered array of its own shape (0-d stays 0-d, unlike np.ascontiguousarray)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(a.shape)


def checksum(arrays: list[np.ndarray]) -> str:
    """SHA-256 over the arrays' specs and bytes (a state transfer is checked end to end)."""
    h = hashlib.sha256(json.dumps(specs_of(arrays)).encode())
    for a in arrays:
        h.update(contiguous(a).data)
    return h.hexdigest()


class Wire:
    """One authenticated connection: `send(header, arrays)` and `recv() -> (header, arrays)`.
    A frame may carry at most `limit` bytes of arrays (set by its owner once it knows the job's
    state: `carried`); its bytes are read as they come, so a header that announces more than
    arrives costs no more memory than what did."""

    def __init__(self, sock: socket.socket, key: bytes, *, hub: bool, limit: int = MAX_PAYLOAD):
        self.sock, self.key, self.limit = sock, key, limit
        # Every frame is answered (a report by the exchange, the sums by the average): with
        # Nagle's algorithm its last small write (the tag) waited for the peer's delayed ACK,
        # about 40 ms per frame, several frames per step.
        with contextlib.suppress(OSError):  # not TCP (a socketpair): nothing to turn off
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out_dir, self.in_dir = ("h", "w") if hub else ("w", "h")
        self.sent = self.received = 0
        self._lock = threading.Lock()

    def _mac(self, direction: str, n: int, header: bytes, payload: list) -> bytes:
        m = hmac.new(self.key, f"{direction}|{n}|".encode(), hashlib.sha256)
        m.update(header)
        for p in payload:
            m.update(p)
        return m.digest()

    def send(self, header: dict, arrays: list[np.ndarray] = ()) -> None:
        arrays = [contiguous(a) for a in arrays]
        head = json.dumps({**header, "arrays": specs_of(arrays)}).encode()
        views = [memoryview(a).cast("B") if a.size else b"" for a in arrays]
        with self._lock:
            n, self.sent = self.sent, self.sent + 1
            tag = self._mac(self.out_dir, n, head, views)
            if sum(len(v) for v in views) <= SMALL_FRAME:  # one write: one segment to answer
                self.sock.sendall(b"".join([struct.pack("!I", len(head)), head, *views, tag]))
                return
            self.sock.sendall(struct.pack("!I", len(head)) + head)
            for v in views:
                self.sock.sendall(v)
            self.sock.sendall(tag)

    def _exactly(self, n: int) -> bytearray:
        """`n` bytes, the buffer grown (doubled, from CHUNK) as they arrive."""
        buf, got = bytearray(min(n, CHUNK)), 0
        while got < n:
            if got == len(buf):
                buf.extend(bytes(min(n - got, len(buf))))
            with memoryview(buf) as view, view[got:] as rest:
                k = self.sock.recv_into(rest, min(len(rest), CHUNK))
            if not k:
                raise ConnectionError("connection closed")
            got += k
        return buf

    def recv(self) -> tuple[dict, list[np.ndarray]]:
        (size,) = struct.unpack("!I", self._exactly(4))
        if size > MAX_HEADER:
            raise WireError(f"frame header longer than {MAX_HEADER} bytes")
        head = bytes(self._exactly(size))
        try:
            header = json.loads(head)
        except (ValueError, RecursionError):
            header = None
        if not isinstance(header, dict):
            raise WireError("frame header is not a JSON object")
        specs = header.get("arrays", [])
        size = check_specs(specs)
        if size > self.limit:
            raise WireError(f"a frame of {size} bytes, more than this connection carries "
                            f"({self.limit})")  # fmt: skip
        payload = self._exactly(size)
        tag = bytes(self._exactly(32))
        n, self.received = self.received, self.received + 1
        if not hmac.compare_digest(tag, self._mac(self.in_dir, n, head, [payload])):
            raise WireError(f"frame {n} failed authentication")
        return header, unpack(specs, payload)

    def close(self) -> None:
        """Close the connection; a thread blocked sending or receiving on it returns (OSError)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


class Outbox:
    """A wire's frames, queued and written by a thread of their own: whoever queues them (the
    hub, under its lock) never waits for the peer, so a peer that stops reading (cut off the
    network, stopped) holds up only its own connection."""

    def __init__(self, wire: Wire, name: str = "jaxpar-outbox"):
        self.wire = wire
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def put(self, header: dict, arrays: list[np.ndarray] = ()) -> None:
        self._queue.put((header, list(arrays)))

    def close(self, grace_s: float = 0.0) -> None:
        """Close once the frames queued so far are written, or after `grace_s` at the latest."""
        self._queue.put(None)
        if grace_s <= 0:
            self.wire.close()
            return
        timer = threading.Timer(grace_s, self.wire.close)
        timer.daemon = True
        timer.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            try:
                self.wire.send(*item)
            except OSError:
                break  # its reader sees the connection go
        self.wire.close()


def client_handshake(sock: socket.socket, key: bytes, hello: dict) -> Wire:
    """A worker's side: send `hello` with a nonce and proof, check the hub's; the session wire."""
    nonce = secrets.token_hex(16)
    body = json.dumps(hello, sort_keys=True)
    line = {"hello": body, "nonce": nonce, "mac": proof(key, "hello", body, nonce)}
    sock.settimeout(HANDSHAKE_S)
    sock.sendall((json.dumps(line) + "\n").encode())
    reply = _read_line(sock)
    hub_nonce = reply.get("nonce")
    if not isinstance(hub_nonce, str) or not hmac.compare_digest(
        str(reply.get("mac", "")).encode(), proof(key, "welcome", nonce, hub_nonce).encode()
    ):
        raise WireError("the group hub did not prove the job's group key")
    sock.settimeout(None)
    return Wire(sock, session_key(key, nonce, hub_nonce), hub=False)


def server_handshake(
    sock: socket.socket, key: bytes, deadline: float | None = None, proven=None
) -> tuple[dict, Wire]:
    """The hub's side: (the worker's hello, the session wire); WireError on a bad proof, or when
    the hello is not in by `deadline` (time.monotonic(), for the whole handshake). `proven()` is
    called once the hello's proof holds; False (the connection was cut short) ends it there."""
    if deadline is None:
        deadline = time.monotonic() + HANDSHAKE_S
    line = _read_line(sock, deadline)
    body, nonce = line.get("hello"), line.get("nonce")
    if not isinstance(body, str) or not isinstance(nonce, str) or len(nonce) > 64:
        raise WireError("a connection without a hello")
    if not hmac.compare_digest(
        str(line.get("mac", "")).encode(), proof(key, "hello", body, nonce).encode()
    ):
        raise WireError("a hello that failed authentication")
    if proven is not None and not proven():
        raise WireError("proved the group key too late")
    try:
        hello = json.loads(body)
    except (ValueError, RecursionError):
        hello = None
    if not isinstance(hello, dict):
        raise WireError("a hello that is not a JSON object")
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    hub_nonce = secrets.token_hex(16)
    reply = {"nonce": hub_nonce, "mac": proof(key, "welcome", nonce, hub_nonce)}
    sock.sendall((json.dumps(reply) + "\n").encode())
    sock.settimeout(None)
    return hello, Wire(sock, session_key(key, nonce, hub_nonce), hub=True)


def _read_line(sock: socket.socket, deadline: float | None = None) -> dict:
    buf = b""
    while b"\n" not in buf:
        if deadline is not None:  # the whole handshake, however the bytes trickle in
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError("the handshake did not complete in time")
            sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            raise WireError("the handshake did not complete in time") from None
        if not data:
            raise WireError("connection closed during the handshake")
        buf += data
        if len(buf) > 16384:
            raise WireError("handshake line too long")
    try:
        msg = json.loads(buf.split(b"\n", 1)[0])
    except (ValueError, RecursionError):
        msg = None
    if not isinstance(msg, dict):
        raise WireError("handshake line is not a JSON object")
    return msg


def group_env() -> dict | None:
    """{"group", "groups", "hub", "key"} from this worker's environment; None outside groups."""
    if not os.environ.get(ENV_GROUPS):
        return None
    return {
        "group": int(os.environ[ENV_GROUP]),
        "groups": int(os.environ[ENV_GROUPS]),
        "hub": os.environ[ENV_HUB],
        "key": bytes.fromhex(os.environ[ENV_KEY]),
    }
