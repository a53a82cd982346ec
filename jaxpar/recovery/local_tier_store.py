"""What the local snapshot tier (jaxpar/recovery/local_tier.py) and its peer copies (jaxpar/recovery/peer_tier.py)
share: the on-disk slot layout (`slot{0,1}/` holding `data.bin` and, last, the commit marker
`commit.json`), its file helpers, and the exchange of small JSON values between processes on
jax's coordination key-value store.
"""

from __future__ import annotations

import contextlib
import json
import os

import jax

from jaxpar import _compat

DATA, MARKER = "data.bin", "commit.json"
SLOTS = 2


def read_marker(slot_dir: str) -> dict | None:
    try:
        with open(os.path.join(slot_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
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

    def begin(self, k: int) -> str:
        """Invalidate slot k (its marker goes first) and return its directory."""
        d = self.dirs[k]
        os.makedirs(d, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(d, MARKER))
        return d

    def commit(self, k: int, marker: dict) -> None:
        d = self.dirs[k]
        tmp = os.path.join(d, MARKER + ".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(marker, f)
            os.replace(tmp, os.path.join(d, MARKER))
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk: no temporary file left behind
                os.remove(tmp)
            raise

    def find(self, step: int) -> int | None:
        for k, m in self.committed().items():
            if m["step"] == step:
                return k
        return None

    def drop_except(self, step: int | None) -> None:
        """Invalidate every slot not holding `step`."""
        for k, m in self.committed().items():
            if m["step"] != step:
                self.begin(k)


def write_data(path: str, chunks) -> None:
    try:
        with open(path, "wb") as f:
            for c in chunks:
                f.write(c)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: free what the partial write took
            os.remove(path)
        raise


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def read_bytes(path: str) -> bytearray | None:
    try:
        with open(path, "rb") as f:
            return bytearray(f.read())
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
