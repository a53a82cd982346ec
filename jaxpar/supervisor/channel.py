"""The agents' control channel: newline-delimited JSON over TCP between agents that share a
secret, with bounded messages (framing, the token, the per-message authentication of a session,
the authenticated connection)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import threading
import time

from jaxpar.supervisor.group import Wakeup
from jaxpar.supervisor.options import TOKEN_ENV, TOKEN_FILE, Options

MAX_LINE = 1 << 20  # bytes per message: a spec is a few hundred
MAX_SKIPPED = 64  # malformed messages in a row before the peer is dropped


class ChannelError(Exception):
    """A peer broke the protocol (too long, not JSON, wrong proof): the connection is dropped."""


# ---- the shared secret --------------------------------------------------------------------------


def token(opts: Options) -> bytes:
    """The agents' shared secret: --token-file, else $JAXPAR_LAUNCH_TOKEN, else RUN_DIR/launch-token,
    created (0600) by the first agent to get there. ValueError names the fix."""
    if opts.token_file:
        return _read_token(opts.token_file)
    if os.environ.get(TOKEN_ENV):
        secret = os.environ[TOKEN_ENV].strip().encode()
        if len(secret) < 16:
            raise ValueError(f"${TOKEN_ENV} is shorter than 16 characters; give a longer secret")
        return secret
    path = os.path.join(opts.run_dir, TOKEN_FILE)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.makedirs(opts.run_dir, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            with contextlib.suppress(FileExistsError):  # another agent was first: use theirs
                os.link(tmp, path)  # atomic: readers never see a half-written token
        except OSError as e:
            raise ValueError(
                f"cannot create the launch token {path}: {e.strerror or e}; give --token-file "
                f"or ${TOKEN_ENV}"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return _read_token(path)


def _read_token(path: str) -> bytes:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            text = f.read(4096).strip()
    except OSError as e:
        raise ValueError(f"cannot read the launch token {path}: {e.strerror}") from None
    if st.st_mode & 0o077 or st.st_uid != os.getuid():
        raise ValueError(
            f"launch token {path} must belong to you and be readable only by you: chmod 600 {path}"
        )
    if len(text) < 16:
        raise ValueError(f"launch token {path} is shorter than 16 characters; write a longer one")
    return text


def mac(key: bytes, *parts: object) -> str:
    msg = "|".join(str(p) for p in parts).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def same(proof: object, expected: str) -> bool:
    """Whether a peer's `proof` (any JSON value) is the MAC `expected` (constant time)."""
    return isinstance(proof, str) and hmac.compare_digest(proof.encode(), expected.encode())


def printable(text: object, limit: int = 200) -> str:
    """A peer's text made safe to print: cut to `limit` characters, every control or format
    character (terminal escapes, bidi overrides, newlines) written as its escape."""
    s = str(text)
    cut = s[:limit]
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in cut)
    return out + ("..." if len(s) > limit else "")


class Session:
    """Per-message authentication once the handshake is done. Both sides derive the session key
    HMAC-SHA256(T, "session|NL|NF") from the token and both nonces; every message travels as
    {"n": SEQ, "body": JSON, "mac": HMAC-SHA256(key, "DIR|SEQ|JSON")}, DIR "l" from the leader
    and "f" from a follower, SEQ counting 0, 1, ... per direction. A message whose MAC does not
    verify, or whose SEQ is not the next one (replayed, reordered, dropped), is a ChannelError."""

    def __init__(self, secret: bytes, leader_nonce: str, follower_nonce: str, *, leader: bool):
        ctx = f"session|{leader_nonce}|{follower_nonce}".encode()
        self.key = hmac.new(secret, ctx, hashlib.sha256).digest()
        self.out_dir, self.in_dir = ("l", "f") if leader else ("f", "l")
        self.sent = self.received = 0

    def seal(self, msg: dict) -> dict:
        body = json.dumps(msg)
        n, self.sent = self.sent, self.sent + 1
        return {"n": n, "body": body, "mac": mac(self.key, self.out_dir, n, body)}

    def open(self, frame: dict) -> dict:
        n, body = frame.get("n"), frame.get("body")
        if type(n) is not int or not isinstance(body, str) or "mac" not in frame:
            raise ChannelError("a message without authentication")
        if not same(frame["mac"], mac(self.key, self.in_dir, n, body)):
            raise ChannelError(f"message {n} failed authentication")
        if n != self.received:
            raise ChannelError(
                f"message {n} is out of sequence (expected {self.received}): replayed or reordered"
            )
        self.received += 1
        try:
            msg = json.loads(body)
        except (ValueError, RecursionError):
            msg = None
        if not isinstance(msg, dict):
            raise ChannelError(f"message {n} is not a JSON object")
        return msg


# ---- framing ------------------------------------------------------------------------------------


class Lines:
    """Reads bounded JSON lines from a socket."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def next(self, deadline: float | None = None) -> dict | None:
        """The next message (a JSON object); None at end of stream. ChannelError if a line is too
        long, or if none is complete by `deadline` (time.monotonic()); a line that is not a JSON
        object is skipped."""
        skipped = 0
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError):  # not JSON, or nested too deep
                    msg = None
                if isinstance(msg, dict):
                    return msg
                skipped += 1
                if skipped > MAX_SKIPPED:
                    raise ChannelError(f"more than {MAX_SKIPPED} malformed messages in a row")
            if len(self.buf) > MAX_LINE:
                raise ChannelError(f"message longer than {MAX_LINE} bytes")
            if deadline is not None:  # the whole exchange, however the bytes trickle in
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelError("the handshake did not complete in time")
                self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                if deadline is None:
                    raise
                raise ChannelError("the handshake did not complete in time") from None
            if not data:
                return None
            self.buf += data


def send_line(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


class Channel:
    """An authenticated connection; a reader thread queues incoming messages (None: closed).
    Every message is sealed and opened by the `session`: the first one that does not verify
    closes the channel (`error` says why) and nothing from it is queued."""

    def __init__(
        self, sock: socket.socket, lines: Lines, session: Session, waker: Wakeup | None = None
    ):
        self.sock, self.lines, self.session, self.waker = sock, lines, session, waker
        self.inbox: queue.Queue = queue.Queue()
        self.closed = False
        self.error = ""  # why the channel closed, when the peer broke the protocol
        self._lock = threading.Lock()
        sock.settimeout(None)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while (frame := self.lines.next()) is not None:
                self.inbox.put(self.session.open(frame))
                if self.waker:
                    self.waker.poke()
        except ChannelError as e:
            self.error = str(e)
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.closed = True
        self.inbox.put(None)
        if self.waker:
            self.waker.poke()

    def send(self, msg: dict) -> None:
        with self._lock:  # one sequence: sealed and sent in order
            try:
                self.sock.sendall((json.dumps(self.session.seal(msg)) + "\n").encode())
            except OSError:
                self.closed = True

    def messages(self, timeout: float = 0.0) -> list[dict | None]:
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def wait_for(self, key: str, timeout: float) -> dict | None:
        """The next message carrying `key` (others are put back afterwards)."""
        deadline, held = time.time() + timeout, []
        try:
            while time.time() < deadline:
                try:
                    msg = self.inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if msg is None:
                    self.inbox.put(None)
                    return None
                if key in msg:
                    return msg
                held.append(msg)
            return None
        finally:
            for m in held:
                self.inbox.put(m)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
