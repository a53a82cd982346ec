"""Compiled programs kept on disk, one file per process, so a restarted group skips compilation.

    compile_cache.configure(os.path.join(run_dir, "compiled"))   # once per process
    compiled, hit = compile_cache.compile(jitted.lower(*abstract_args), "train_step")

Why not jax's own cache, the key, authentication, the shared tier: docs/design.md, "Compiled programs".
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import secrets
import stat
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

_state: dict[str, Any] = {
    "dir": None,
    "shared": None,
    "stats": {"hits": 0, "misses": 0, "load_s": 0.0},
    "jax_hits": 0,  # executables jax loaded from its own persistent cache
}
# An executable jax loaded from its persistent cache serialises into a blob that loads but fails
# when run (CPU, jax 0.10: "NOT_FOUND: Function ... not found"): such programs are not stored.
JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
KEEP = 32  # newest entries kept per directory (other layouts after a shrink add entries)
KEEP_SHARED = 512  # newest entries kept per process index in the shared folder
ENV_SHARED = "JAXPAR_COMPILE_CACHE_DIR"


def configure(directory: str | None, readonly: bool = False, shared: str | None = None) -> None:
    """Cache compiled programs under `directory` (None: off). Call before compiling.

    readonly: entries are loaded but nothing is written (a standby worker before "go"); what
    would have been stored is kept and stored by the next `configure` of the same directory.
    shared: a folder shared by runs, looked up after `directory` (None or "": none)."""
    _state["shared"] = (shared or None) if directory else None
    if directory:
        if not readonly:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            if _state["shared"]:
                try:
                    os.makedirs(_state["shared"], mode=0o700, exist_ok=True)
                except OSError as e:  # e.g. a file there, no permission: the run dir alone
                    warnings.warn(f"compile cache: not using {_state['shared']} ({e})",
                                  stacklevel=2)  # fmt: skip
                    _state["shared"] = None
        if not _state.get("listening"):
            jax.monitoring.register_event_listener(_count_jax_cache_hits)
            _state["listening"] = True
    pending = _state.pop("pending", [])
    _state["dir"], _state["readonly"] = directory, readonly
    for path, compiled in pending:
        if readonly or os.path.dirname(path) != directory:
            continue
        try:
            _store(path, compiled)
        except Exception as e:  # e.g. host callbacks, a full disk: run uncached
            warnings.warn(f"compile cache: not caching {path} ({type(e).__name__}: {e})",
                          stacklevel=2)  # fmt: skip


def _count_jax_cache_hits(event: str, **_: Any) -> None:
    if event == JAX_CACHE_HIT:
        _state["jax_hits"] += 1


def directory() -> str | None:
    return _state["dir"]


def shared_directory(configured: str) -> str | None:
    """The shared folder: `run.compile_cache_dir`, else $JAXPAR_COMPILE_CACHE_DIR, else none."""
    return configured or os.environ.get(ENV_SHARED) or None


def stats() -> dict[str, Any]:
    """Hits, misses and seconds spent loading, for this process since it started."""
    return dict(_state["stats"])


def _key(program_parts: tuple) -> str:
    """Hash of the program's identity plus everything else its binary depends on."""
    from jax.extend import backend as jex_backend

    h = hashlib.sha256()
    backend = jex_backend.get_backend()
    devices = [(d.id, d.process_index, d.device_kind) for d in jax.devices()]
    for part in (
        *program_parts,
        jax.__version__,
        getattr(jax.lib, "__version__", ""),
        backend.platform,
        backend.platform_version,
        os.environ.get("XLA_FLAGS", ""),
        repr(devices),
        repr((jax.process_index(), jax.process_count())),
    ):
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _path(name: str, key: str, folder: str | None = None) -> str:
    return os.path.join(folder or _state["dir"], f"{name}-{key}-p{jax.process_index()}.bin")


MAGIC = b"JAXPARX1"  # file format: MAGIC, 32-byte HMAC-SHA256, pickled payload
ENV_KEY_FILE = "JAXPAR_CACHE_KEY"


class Untrusted(Exception):
    """A cache file that must not be deserialised (foreign, tampered or too widely writable)."""


def key_path() -> str:
    """Where this user's cache key lives (outside any run directory)."""
    if os.environ.get(ENV_KEY_FILE):
        return os.environ[ENV_KEY_FILE]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpar", "compile-cache.key")


def _secret() -> bytes:
    """This user's HMAC key, created (0600, random) on first use; refused if others can read
    or write it."""
    path = key_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise Untrusted(f"key file {path} must be yours and mode 0600")
        key = f.read()
    if len(key) < 32:
        raise Untrusted(f"key file {path} is too short")
    return key


def _mac(key: bytes, name: str, payload: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + payload, hashlib.sha256).digest()


def _private(st: os.stat_result) -> bool:
    """Owned by this user and not writable by group or others."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _load(path: str):
    from jax.experimental import serialize_executable

    folder = os.path.dirname(path)
    if not _private(os.stat(folder, follow_symlinks=False)) or os.path.islink(folder):
        raise Untrusted(f"{folder} is writable by other users or not owned by you")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        if not _private(os.fstat(f.fileno())):
            raise Untrusted("writable by other users or not owned by you")
        data = f.read()
    head, mac, payload = data[: len(MAGIC)], data[len(MAGIC) : len(MAGIC) + 32], data[40:]
    if head != MAGIC or not hmac.compare_digest(
        mac, _mac(_secret(), os.path.basename(path), payload)
    ):
        raise Untrusted("not written by this user's jaxpar (HMAC mismatch)")
    blob, in_tree, out_tree = pickle.loads(payload)  # authenticated above
    return serialize_executable.deserialize_and_load(blob, in_tree, out_tree), data


def _store(path: str, compiled) -> bytes:
    from jax.experimental import serialize_executable

    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    payload = pickle.dumps((blob, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
    data = MAGIC + _mac(_secret(), os.path.basename(path), payload) + payload
    _write(path, data, KEEP)
    return data


def _write(path: str, data: bytes, keep: int) -> None:
    """Write a whole entry (the MAC covers its file name, so the same bytes serve both tiers)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # readers see a whole file or none
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a full disk leaves no partial file behind
        raise
    _prune(os.path.dirname(path), keep)


def _prune(directory: str, keep: int = KEEP) -> None:
    mine = f"-p{jax.process_index()}.bin"
    entries = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(mine)]
    if len(entries) <= keep:
        return
    entries.sort(key=_mtime)
    for old in entries[:-keep]:
        with contextlib.suppress(OSError):
            os.remove(old)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # removed meanwhile by another process pruning the shared folder
        return 0.0


def compile(lowered: jax.stages.Lowered, name: str):  # noqa: A001 - mirrors Lowered.compile
    """`lowered.compile()`, served from and written to the cache when one is configured, keyed
    by the lowered program's text. Returns (compiled, hit)."""
    if not _state["dir"]:
        return lowered.compile(), False
    return _cached(name, _key((lowered.as_text(),)), lowered.compile)


def compile_by_key(name: str, parts: tuple, lower: Callable[[], jax.stages.Lowered]):
    """Like `compile`, but keyed by `parts` instead of the lowered text, so a hit skips tracing
    and lowering too. Only for programs whose HLO is a function of `parts` alone: jaxpar's own
    fixed programs, with the source file that builds them among the parts. Returns (compiled, hit).
    """
    if not _state["dir"]:
        return lower().compile(), False
    return _cached(name, _key(parts), lambda: lower().compile())


def source_digest(path: str) -> str:
    """sha256 of a source file: a `compile_by_key` part that changes when the code does."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _cached(name: str, key: str, build: Callable[[], Any]):
    """Serialising needs a compiled program with no host callbacks; one that cannot be
    serialised is simply not cached."""
    path = _path(name, key)
    readonly = _state.get("readonly")
    found = _lookup(path, drop=not readonly)
    shared = _state["shared"] and _path(name, key, _state["shared"])
    if found is None and shared:
        found = _lookup(shared, drop=not readonly)
        if found is not None:
            _state["stats"]["shared_hits"] = _state["stats"].get("shared_hits", 0) + 1
            if not readonly:
                _try_write(name, path, found[1], KEEP)  # this run's restarts need only its own
    if found is not None:
        return found[0], True
    jax_hits = _state["jax_hits"]
    compiled = build()
    _state["stats"]["misses"] += 1
    if _state["jax_hits"] != jax_hits:  # served by jax's own cache (or one compiled alongside)
        return compiled, False
    if readonly:
        _state.setdefault("pending", []).append((path, compiled))
        return compiled, False
    try:
        data = _store(path, compiled)
    except Exception as e:  # e.g. host callbacks, a full disk: run uncached
        warnings.warn(f"compile cache: not caching {name} ({type(e).__name__}: {e})", stacklevel=3)
    else:
        if shared:
            _try_write(name, shared, data, KEEP_SHARED)
    return compiled, False


def _lookup(path: str, drop: bool):
    """(compiled, file bytes) from a verified entry, else None; a file that fails verification
    or loading is counted as rejected and, when `drop`, removed."""
    if not os.path.exists(path):
        return None
    t0 = time.time()
    try:
        found = _load(path)
    except Exception as e:  # a torn, stale, foreign or planted file: compile afresh
        warnings.warn(f"compile cache: dropping {path} ({type(e).__name__}: {e})", stacklevel=4)
        _state["stats"]["rejected"] = _state["stats"].get("rejected", 0) + 1
        if drop:
            with contextlib.suppress(OSError):
                os.remove(path)
        return None
    if drop:
        with contextlib.suppress(OSError):  # pruned meanwhile by another process
            os.utime(path)  # recently used: kept by _prune
    _state["stats"]["hits"] += 1
    _state["stats"]["load_s"] += time.time() - t0
    return found


def _try_write(name: str, path: str, data: bytes, keep: int) -> None:
    try:
        _write(path, data, keep)
    except OSError as e:  # a full or read-only folder: the program still runs
        warnings.warn(f"compile cache: not caching {name} in {os.path.dirname(path)} ({e})",
                      stacklevel=4)  # fmt: skip
