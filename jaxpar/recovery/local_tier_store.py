"""What the local snapshot tier (jaxpar/recovery/local_tier.py) and its peer copies (jaxpar/recovery/peer_tier.py)
share: the on-disk slot layout (`slot{0,1}/` holding `data.bin` and, last, the commit marker
`commit.json`), its file helpers, and the exchange of small JSON values between processes on
jax's coordination key-value store.

Trust: folders are this user's and private (0700), files are created afresh (0600, never through
a symlink) and read only when this user owns them and nobody else can write them; a snapshot is
used only with a valid MAC. docs/design.md, "Recovery tiers", "Trust".
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import jax

from jaxpar import _compat
from jaxpar.recovery import compile_cache

DATA, MARKER = "data.bin", "commit.json"
SLOTS = 2
MAX_MARKER_BYTES = 64 << 20  # a commit marker read back: larger is refused
MAC_LABEL = b"jaxpar local snapshot v1"  # the snapshot key: HMAC(compiled-program key, label)
MAC_PIECE = 16 << 20  # the MAC hashes each block in pieces of this size ...
MAC_THREADS = 8  # ... on at most this many threads


class UnsafeFolder(ValueError):
    """A folder of the local tier that other users could write (or not a plain folder of this
    user): the tier refuses it. `reason`: what is wrong, without the fix."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class Refused(OSError):
    """A snapshot file that must not be read: not a regular file of this user, or writable by
    group or others."""


# ---- private folders and files ---------------------------------------------------------------


def check_root(root: str, hint: str) -> None:
    """Create the tier's root (mode 0700) or check an existing one: a folder (not a symlink) of
    this user that group and others cannot write, in a parent others cannot swap it in (not
    writable by them, or sticky like /dev/shm); one that passes is made 0700 if it was not.
    Raises UnsafeFolder naming the fix (`hint`: how to choose another folder)."""
    root = os.path.abspath(root)
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    st = os.stat(parent)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        why = (f"local snapshot folder {root}: its parent is writable by other users and not "
               f"sticky (mode {stat.S_IMODE(st.st_mode):o})")  # fmt: skip
        raise UnsafeFolder(f"{why}; {hint}", why)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    st = os.lstat(root)
    why = _unsafe(st)
    if why:
        raise UnsafeFolder(f"local snapshot folder {root} {why}; {hint}", f"{root} {why}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        private_dir(root)  # an older jaxpar's root: its run folders' names readable by every user


def _unsafe(st: os.stat_result) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder (a symlink or a file)"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(path: str) -> None:
    """Create `path` (mode 0700), or make an existing folder of this user private; refuse a
    symlink or a folder of another user (UnsafeFolder). The parent must exist."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UnsafeFolder(f"local snapshot folder {path} is not a folder ({e.strerror}); "
                           f"remove it") from None  # fmt: skip
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafeFolder(f"local snapshot folder {path} belongs to uid {st.st_uid}, not to "
                               f"you; remove it")  # fmt: skip
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # written by an older jaxpar: readable by every local user
    finally:
        os.close(fd)


def private_dirs(path: str) -> None:
    """`private_dir` for `path` and its missing parents."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        private_dirs(parent)
    private_dir(path)


def create_private(path: str) -> int:
    """A new file at `path` (mode 0600; whatever was there, a symlink included, is removed, never
    followed): its descriptor, open for writing."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def open_own(path: str) -> int:
    """`path` open for reading if it is a regular file of this user that group and others cannot
    write (a symlink is not followed); else Refused (FileNotFoundError when it is not there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise Refused(f"{os.path.basename(path)}: not readable as a file ({e.strerror})") from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif st.st_uid != os.geteuid():
        why = f"belongs to uid {st.st_uid}, not to you"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        os.close(fd)
        raise Refused(f"{os.path.basename(path)}: {why}")
    return fd


def write_private_json(path: str, obj) -> None:
    """Write JSON atomically (a private temporary file, renamed into place)."""
    tmp = f"{path}.tmp.{os.getpid()}"  # processes of a node may write the same file at once
    try:
        with os.fdopen(create_private(tmp), "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: no temporary file left behind
            os.remove(tmp)
        raise


# ---- authentication ----------------------------------------------------------------------------


def snapshot_key() -> bytes:
    """This user's key for snapshot MACs: derived from the compiled-program cache's key."""
    return hmac.new(compile_cache._secret(), MAC_LABEL, hashlib.sha256).digest()


def seal(marker: dict, blocks, key: bytes) -> str:
    """HMAC-SHA256 over the commit marker (all but its `mac`) and the SHA-256 of every piece
    (MAC_PIECE bytes) of every block of the snapshot, in order. The pieces are hashed on several
    threads (hashlib lets go of the GIL): the MAC costs a fraction of the write where cores are
    idle."""
    pieces = [
        v[i : i + MAC_PIECE]
        for v in (memoryview(b).cast("B") for b in blocks)
        for i in range(0, max(len(v), 1), MAC_PIECE)
    ]
    workers = min(len(pieces), os.cpu_count() or 1, MAC_THREADS)
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="jaxpar-mac") as pool:
            digests = list(pool.map(_sha256, pieces))
    else:
        digests = [_sha256(p) for p in pieces]
    body = {k: v for k, v in marker.items() if k != "mac"}
    h = hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), "sha256")
    h.update(b"\0" + b"".join(digests))
    return h.hexdigest()


def _sha256(piece) -> bytes:
    return hashlib.sha256(piece).digest()


def authentic(marker: dict, data, key: bytes) -> bool:
    """Whether `marker["mac"]` is this user's MAC of the marker and `data` (split into the blocks
    the marker lists)."""
    mac, view = marker.get("mac"), memoryview(data)
    try:
        blocks = [view[e["offset"] : e["offset"] + e["nbytes"]] for e in marker["blocks"]]
    except (KeyError, TypeError):
        return False
    return isinstance(mac, str) and hmac.compare_digest(mac, seal(marker, blocks, key))


# ---- slots -------------------------------------------------------------------------------------


def read_marker(slot_dir: str) -> dict | None:
    """The slot's commit marker, or None (absent, unreadable, refused by `open_own`)."""
    try:
        with os.fdopen(open_own(os.path.join(slot_dir, MARKER)), "rb") as f:
            marker = json.loads(f.read(MAX_MARKER_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


class Slots:
    """Two slot directories under `root`; a slot is valid when its commit marker is there."""

    def __init__(self, root: str):
        self.root = root
        self.dirs = [os.path.join(root, f"slot{k}") for k in range(SLOTS)]

    def committed(self) -> dict[int, dict]:
        """slot -> marker, for slots with a readable marker."""
        out = {}
        for k, d in enumerate(self.dirs):
            m = read_marker(d)
            if m is not None:
                out[k] = m
        return out

    def torn(self) -> list[int]:
        """Slots with data but no commit marker (a write that never finished)."""
        return [
            k
            for k, d in enumerate(self.dirs)
            if os.path.exists(os.path.join(d, DATA)) and read_marker(d) is None
        ]

    def pick(self, keep: int | None) -> int:
        """The slot to overwrite: not the one holding step `keep`; else the older or empty one."""
        have = self.committed()
        free = [k for k in range(SLOTS) if k not in have]
        if free:
            return free[0]
        others = [k for k in have if have[k]["step"] != keep] or list(have)
        return min(others, key=lambda k: have[k]["step"])

    def refused(self) -> dict[int, str]:
        """slot -> why, for slots whose files are there but refused by `open_own`."""
        out = {}
        for k, d in enumerate(self.dirs):
            for name in (MARKER, DATA):
                try:
                    os.close(open_own(os.path.join(d, name)))
                except Refused as e:
                    out[k] = str(e)
                    break
                except OSError:
                    continue
        return out

    def begin(self, k: int) -> str:
        """Invalidate slot k (its marker goes first) and return its directory (created private,
        as are its parents)."""
        d = self.dirs[k]
        private_dirs(self.root)
        private_dir(d)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(d, MARKER))
        return d

    def commit(self, k: int, marker: dict) -> None:
        write_private_json(os.path.join(self.dirs[k], MARKER), marker)

    def find(self, step: int) -> int | None:
        for k, m in self.committed().items():
            if m["step"] == step:
                return k
        return None

    def drop_except(self, step: int | None) -> None:
        """Invalidate every slot not holding `step` (marker first), and free its data."""
        for k, m in self.committed().items():
            if m["step"] != step:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.begin(k), DATA))


def write_data(path: str, chunks) -> None:
    """A new private file at `path` (see `create_private`) holding `chunks`."""
    try:
        with os.fdopen(create_private(path), "wb") as f:
            for c in chunks:
                f.write(c)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: free what the partial write took
            os.remove(path)
        raise


def file_size(path: str) -> int:
    """The size of a regular file at `path` (a symlink is not followed), else -1."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def load_bytes(path: str) -> bytearray:
    """The bytes of a file `open_own` accepts (else Refused, or another OSError)."""
    with os.fdopen(open_own(path), "rb") as f:
        return bytearray(f.read())


def read_bytes(path: str) -> bytearray | None:
    try:
        return load_bytes(path)
    except OSError:
        return None


# ---- cross-process exchange (jax's coordination key-value store) -----------------------------


def kv_client():
    """jax.distributed's client (None in a single process). jax has no public key-value API;
    Orbax uses the same client for its cross-process metadata."""
    if jax.process_count() == 1:
        return None
    return _compat.distributed_client()


def exchange(tag: str, obj, timeout_s: float = 300.0) -> list:
    """Every process's `obj` (JSON), in process order; `tag` must be unique per incarnation."""
    client = kv_client()
    if client is None:
        return [obj]
    client.key_value_set(f"jaxpar/{tag}/{jax.process_index()}", json.dumps(obj))
    ms = int(timeout_s * 1000)
    return [
        json.loads(client.blocking_key_value_get(f"jaxpar/{tag}/{q}", ms))
        for q in range(jax.process_count())
    ]
