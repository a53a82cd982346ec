"""The local snapshot tier: the whole training state in node-local RAM every few steps.

Each process copies its shards of the state on device and a background thread writes them to
`LOCAL_ROOT/run-<key>/proc<P>/slot{0,1}/` (data, then a commit marker); a restart restores the
newest step every process holds, verified and bound to this run and layout. Design (double
buffering, restore, binding, `ckpt.local_every`): docs/design.md, "Recovery tiers".
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.recovery import compile_cache, local_tier_clean, peer_tier
from jaxpar.recovery.checkpoint import say
from jaxpar.recovery.local_tier_store import (  # noqa: F401 - DATA, MARKER, SLOTS: the tier's file layout
    DATA,
    MARKER,
    SLOTS,
    Refused,
    Slots,
    UnsafeFolder,
    authentic,
    check_root,
    exchange,
    file_size,
    kv_client,
    load_bytes,
    read_marker,
    seal,
    snapshot_key,
    write_data,
)
from jaxpar.rundir.runlog import WorkerEvent
from jaxpar.rundir.writer import RunDir

AUTO_BYTES = 256 * 2**20  # per process: above this, snapshot every ceil(bytes / AUTO_BYTES)
ENV_LOCAL_DIR = "JAXPAR_LOCAL_DIR"
ROOT_FIX = (f"chmod 700 it if it is yours, else set ckpt.local_dir or ${ENV_LOCAL_DIR} to a folder "
            f"only you can write")  # fmt: skip
FORMAT = 2  # 2: commit markers carry a MAC
KV_TIMEOUT_MS = 1000  # one wait on the key-value store; the writer loops until it stops


def default_root(configured: str = "") -> str:
    """Where local tiers live: `ckpt.local_dir`, else $JAXPAR_LOCAL_DIR, else RAM (/dev/shm)."""
    if configured:
        return configured
    if os.environ.get(ENV_LOCAL_DIR):
        return os.environ[ENV_LOCAL_DIR]
    return shared_root()


def shared_root() -> str:
    """The default root: a predictable name in a folder every local user can write."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"jaxpar-{os.getuid()}")


def private_root(root: str) -> str:
    """Beside `root`, a folder whose name only this user can know: a tag derived from the user's
    key (the one the snapshots' MACs come from), the same for every process that holds the key,
    so another local user cannot create it first."""
    tag = hmac.new(snapshot_key(), b"jaxpar local tier root", hashlib.sha256).hexdigest()[:16]
    return f"{root}-{tag}"


def usable_root(root: str) -> tuple[str, str | None]:
    """The tier's root, checked (created 0700): `root`, or where `root` is the shared default
    and is not usable (another user created it first, a symlink, open to others), this user's
    `private_root` beside it. Returns (root, the line that says so or None); UnsafeFolder
    (naming the fix) for a folder the user chose, or when neither is usable."""
    try:
        check_root(root, ROOT_FIX)
        return root, None
    except UnsafeFolder as e:
        if os.path.abspath(root) != shared_root():
            raise
        try:  # the key may be unusable too (a home that cannot be written): refused as before
            alt = private_root(root)
            check_root(alt, ROOT_FIX)
        except (OSError, ValueError):
            raise e from None
        return alt, (f"warning: {e.reason}; local snapshots go to {alt}, a folder of yours that "
                     f"no other user can name (set ckpt.local_dir or ${ENV_LOCAL_DIR} to choose "
                     f"one)")  # fmt: skip


def run_key(run_path: str) -> str:
    return hashlib.sha256(os.path.realpath(run_path).encode()).hexdigest()[:16]


def node_dir(root: str, run_path: str) -> str:
    """This run's local tier on this node (one directory per run directory)."""
    return os.path.join(root, f"run-{run_key(run_path)}")


def plan_every(setting: int, nbytes: int) -> int:
    """Snapshot interval: `setting` if >= 0, else 1 up to AUTO_BYTES per process, then more."""
    if setting >= 0:
        return setting
    return max(1, math.ceil(nbytes / AUTO_BYTES))


# ---- layout: which blocks of which leaves this process holds -------------------------------


@dataclass(frozen=True)
class Block:
    leaf: int
    index: tuple[tuple[int, int], ...]  # (start, stop) per dimension of the global array
    shape: tuple[int, ...]
    dtype: str
    devices: tuple[int, ...]  # ids of this process's devices holding this block

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


def _norm(idx: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    out = []
    for s, dim in zip(idx, shape, strict=False):
        start, stop, _ = s.indices(dim)
        out.append((start, stop))
    return tuple(out) + tuple((0, d) for d in shape[len(out) :])


def layout(abstract_state) -> tuple[list[str], list[Block], str]:
    """(leaf paths, this process's distinct blocks in a fixed order, layout digest)."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    paths, blocks = [], []
    for i, (path, x) in enumerate(flat):
        paths.append(jax.tree_util.keystr(path))
        groups: dict[tuple, list[int]] = {}
        for dev, idx in x.sharding.addressable_devices_indices_map(x.shape).items():
            groups.setdefault(_norm(idx, x.shape), []).append(dev.id)
        for index, devs in sorted(groups.items(), key=lambda kv: min(kv[1])):
            shape = tuple(b - a for a, b in index)
            blocks.append(Block(i, index, shape, str(jnp.dtype(x.dtype)), tuple(sorted(devs))))
    desc = [
        (p, list(x.shape), str(jnp.dtype(x.dtype))) for p, (_, x) in zip(paths, flat, strict=True)
    ]
    desc.append([(b.leaf, b.index, b.devices) for b in blocks])
    digest = hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:32]
    return paths, blocks, digest


# ---- one double-buffered slot directory (own snapshots or a peer's copies) -------------------


def verify(marker: dict, binding: dict, blocks: list[Block], size: int) -> str | None:
    """Why a marker cannot be used with this layout (None when it can; CRCs checked later)."""
    if marker.get("binding") != binding:
        theirs = marker.get("binding") or {}
        diff = sorted(k for k in set(binding) | set(theirs) if binding.get(k) != theirs.get(k))
        return f"written for another run or layout ({', '.join(diff) or 'binding'})"
    entries = marker.get("blocks")
    if not isinstance(entries, list) or len(entries) != len(blocks):
        return "block list does not match the layout"
    offset = 0
    for e, b in zip(entries, blocks, strict=True):
        if not isinstance(e, dict) or e.get("offset") != offset or e.get("nbytes") != b.nbytes:
            return "block sizes do not match the layout"
        offset += b.nbytes
    if size != offset or marker.get("nbytes") != offset:
        return f"data is {size} bytes, the marker says {marker.get('nbytes')}, layout {offset}"
    return None


def check_crcs(marker: dict, data: memoryview) -> list[int]:
    """Indices of blocks whose CRC-32 differs."""
    bad = []
    for i, e in enumerate(marker["blocks"]):
        chunk = data[e["offset"] : e["offset"] + e["nbytes"]]
        if zlib.crc32(chunk) != e.get("crc"):
            bad.append(i)
    return bad


# ---- the tier ---------------------------------------------------------------------------------


@dataclass
class Stats:
    snapshots: int = 0
    wait_s: float = 0.0  # the loop blocked for the memory bound
    write_s: float = 0.0  # writer thread, per snapshot, summed
    max_held: int = 0  # most snapshots of this process present at once (files + in flight)


class LocalTier:
    """One process's local snapshots: `offer` after each step, `restore` at start-up."""

    def __init__(
        self,
        run: RunDir,
        abstract_state,
        *,
        every: int,
        root: str,
        binding: dict,
        before_commit: Callable[[int], None] | None = None,
    ):
        self.run = run
        self.process = jax.process_index()
        self.nproc = jax.process_count()
        self.paths, self.blocks, digest = layout(abstract_state)
        self._crcs: dict[str, int] = {}  # the last state _load returned: each block's CRC
        self.nbytes = sum(b.nbytes for b in self.blocks)
        self.every = plan_every(every, self.nbytes)
        # UnsafeFolder (a ValueError: one line, exit 2); another user's default root: our own
        root, moved = usable_root(root)
        if moved:
            say(moved)  # each process's log once; the `local_tier` event's `dir` records it
        self.root = root
        self.node = node_dir(root, run.path)
        # stale folders of this node go first; the run directory's identity binds every snapshot
        ident, removed = local_tier_clean.prepare(root, self.node, run.path, self.nproc)
        if removed:
            run.event(WorkerEvent.LOCAL_TIER_CLEANED, all_processes=True, removed=removed[:20],
                      count=len(removed))  # fmt: skip
        self.binding = {**binding, "format": FORMAT, "run": run_key(run.path), "layout": digest,
                        "nproc": self.nproc, "process": self.process, "run_id": ident}  # fmt: skip
        self.own = Slots(os.path.join(self.node, f"proc{self.process}"))
        self.before_commit = before_commit
        self.stats = Stats()
        self.error: str | None = None
        self.peers = None  # peer_tier.Peers once restore() has met the other processes
        # after a restore() that found nothing usable although snapshots at least as new as the
        # persistent checkpoint exist: {"skipped": rejected steps, "incomplete": steps some
        # processes hold but not all, and "unusable" when some were found but not offered:
        # unusable_at} (the caller announces the fallback)
        self.fallback: dict | None = None
        # snapshots this process found but could not offer: [{"step": int | None, "why": str}]
        self.unusable: list[dict] = []
        self.nodes: list[list[int]] = [[self.process]]  # processes per node, once met
        self._prev: int | None = None  # newest step this incarnation holds committed
        self._restored: int | None = None  # the step restored: complete everywhere already
        self._older: int | None = None  # the snapshot before _prev (its key is deleted next)
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._copy = None
        self._abstract = abstract_state
        self._thread: threading.Thread | None = None

    # -- start-up -------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile (or load) the on-device copy program before the first step."""
        if self.every <= 0:
            return
        abstract = self._abstract
        key = (
            repr(jax.tree.map(lambda x: (x.shape, str(x.dtype), x.sharding), abstract)),
            compile_cache.source_digest(__file__),
        )

        def lower():
            shardings = jax.tree.map(lambda x: x.sharding, abstract)
            leaves = jax.tree.leaves(abstract)
            everywhere = jax.sharding.NamedSharding(leaves[0].sharding.mesh, PartitionSpec())

            def copy(s):  # and whether it is all finite (one answer on every process)
                floats = [x for x in jax.tree.leaves(s) if jnp.issubdtype(x.dtype, jnp.floating)]
                finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in floats] or [True]))
                return jax.tree.map(jnp.copy, s), finite

            fn = jax.jit(copy, out_shardings=(shardings, everywhere))
            return fn.lower(abstract)

        self._copy = compile_cache.compile_by_key("snapshot_copy", key, lower)[0]

    def describe(self) -> dict:
        return {"every": self.every, "bytes_per_process": self.nbytes, "dir": self.node,
                "blocks": len(self.blocks), "peer": self.peers is not None}  # fmt: skip

    # -- saving ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0 and self.error is None

    def offer(self, step: int, state: dict) -> None:
        """After `step` completed: start a snapshot of `state` if one is due (non-blocking unless
        the previous one is still being written)."""
        if not self.due(step):
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="jaxpar-snapshot", daemon=True)
            self._thread.start()
        if not self._idle.is_set():
            t0 = time.time()
            self._idle.wait()
            self.stats.wait_s += time.time() - t0
        if self.error is not None:
            return
        if self._copy is None:
            self.warm_up()
        copy = self._copy(state)  # dispatched; the writer waits for it, the loop does not
        self._idle.clear()
        self._queue.put((step, *copy))

    def wait(self) -> None:
        """Block until the snapshot in flight (if any) is committed."""
        self._idle.wait()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, tree, finite = item
            t0 = time.time()
            try:
                if not bool(finite.addressable_data(0)):  # never a snapshot of NaNs or infinities
                    self.run.event(WorkerEvent.NONFINITE, step=step, where="snapshot")
                    continue
                self._write(step, tree)
                self.stats.snapshots += 1
            except _Stopped:
                return
            except Exception as e:  # noqa: BLE001 - the tier turns off; training goes on
                self.error = f"{type(e).__name__}: {e}"[:500]
                self.run.event(
                    WorkerEvent.SNAPSHOT_ERROR, all_processes=True, step=step, error=self.error
                )
            finally:
                del tree, item
                self.stats.write_s += time.time() - t0
                self._idle.set()

    def _chunks(self, leaves: list) -> list[np.ndarray]:
        by_leaf: dict[int, dict] = {}
        out = []
        for b in self.blocks:
            if b.leaf not in by_leaf:
                by_leaf[b.leaf] = {s.device.id: s for s in leaves[b.leaf].addressable_shards}
            data = np.asarray(by_leaf[b.leaf][b.devices[0]].data)  # waits for the copy
            out.append(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        return out

    def _write(self, step: int, tree) -> None:
        if self._prev is not None and self._prev != self._restored:
            self._wait_others(self._prev)
        chunks = self._chunks(jax.tree.leaves(tree))
        entries, offset = [], 0
        for c in chunks:
            entries.append({"offset": offset, "nbytes": int(c.nbytes), "crc": zlib.crc32(c)})
            offset += int(c.nbytes)
        marker = {"step": step, "data_position": step, "binding": self.binding,
                  "blocks": entries, "nbytes": offset, "time": time.time(),
                  "incarnation": self.run.incarnation}  # fmt: skip
        marker["mac"] = seal(marker, chunks, snapshot_key())
        k = self.own.pick(keep=self._prev)
        held = len(self.own.committed()) + 1  # before the overwrite: committed + this one
        self.stats.max_held = max(self.stats.max_held, min(held, SLOTS))
        d = self.own.begin(k)
        write_data(os.path.join(d, DATA), chunks)
        if self.before_commit is not None:
            self.before_commit(step)
        if self._stop.is_set():  # the run failed meanwhile: leave this one uncommitted
            raise _Stopped
        self.own.commit(k, marker)
        self.stats.max_held = max(self.stats.max_held, len(self.own.committed()))
        if self.peers is not None:
            self.peers.replicate(marker, chunks)
        del chunks
        client = kv_client()
        if client is not None:
            client.key_value_set(f"jaxpar/snap/{step}/{self.process}", "1", allow_overwrite=True)
            # Two back, never one: a slower process may still be waiting for our previous key;
            # it has passed the wait for the one before (we waited for its commit after it).
            if self._older is not None:
                with contextlib.suppress(Exception):
                    client.key_value_delete(f"jaxpar/snap/{self._older}/{self.process}")
        self._older, self._prev = self._prev, step

    def _wait_others(self, step: int) -> None:
        """Until every process has committed its snapshot of `step` (own slot + peer copy)."""
        client = kv_client()
        if client is None:
            return
        for q in range(self.nproc):
            if q == self.process:
                continue
            while True:
                if self._stop.is_set():
                    raise _Stopped
                try:
                    client.blocking_key_value_get(f"jaxpar/snap/{step}/{q}", KV_TIMEOUT_MS)
                    break
                except Exception as e:  # noqa: BLE001 - a timeout: look at the stop flag, retry
                    if "DEADLINE" not in str(e).upper() and "TIMEOUT" not in str(e).upper():
                        raise

    def close(self, *, complete: bool = False, failed: bool = False) -> None:
        """Stop the writer. Normally after the snapshot in flight; `failed` (an error is on its
        way out): at once. `complete`: the run finished and its final state is in a persistent
        checkpoint, so this process's snapshots (and the peer copies held here) are removed."""
        if self._thread is not None:
            if not (failed or complete) and self.error is None:
                self._idle.wait(timeout=120)  # a stop by wall time: keep the last snapshot
            self._stop.set()
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            # after a failure only briefly: the writer stops before its commit marker
            self._thread.join(timeout=5 if failed else 60)
        if self.peers is not None:
            if complete and not failed:  # the job is done: its copies here are of no use
                self.peers.remove_held()
            self.peers.close()
        if complete:
            shutil.rmtree(self.own.root, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.node, "peer"))  # only once empty
            local_tier_clean.release(self.node)  # the last process of the node removes it

    # -- restoring ------------------------------------------------------------------------------

    def _own_offer(self) -> dict[int, int]:
        """step -> slot of this process's usable snapshots (binding and sizes checked)."""
        out: dict[int, int] = {}
        self.unusable = []
        refused = self.own.refused()
        committed = self.own.committed()
        for k, marker in committed.items():
            size = file_size(os.path.join(self.own.dirs[k], DATA))
            why = refused.get(k) or verify(marker, self.binding, self.blocks, size)
            if why is None:
                out[marker["step"]] = k
            else:
                self._unusable(marker["step"], why, rejected=True)
        for k, why in refused.items():
            if k not in committed:  # its marker is refused: its step is unknown
                self._unusable(None, why, rejected=True)
        for k in self.own.torn():
            if k not in refused:
                self.run.event(WorkerEvent.SNAPSHOT_TORN, all_processes=True, slot=k, tier="local")
                self._unusable(None, "torn (no commit marker: a write that never finished)")
        return out

    def _unusable(self, step: int | None, why: str, rejected: bool = False) -> None:
        """Record a snapshot found but not offered (`rejected`: with a snapshot_rejected event)."""
        self.unusable.append({"step": step, "why": why})
        if rejected:
            self.run.event(WorkerEvent.SNAPSHOT_REJECTED, all_processes=True, step=step,
                           tier="local", reason=why)  # fmt: skip

    def node_index(self) -> int:
        """This process's node (0 = the node of process 0), once `restore` has met the others."""
        return next(i for i, procs in enumerate(self.nodes) if self.process in procs)

    def restore(self, persistent_newest: int | None) -> tuple[dict, dict] | None:
        """The newest snapshot complete over all processes, if not older than the newest
        persistent checkpoint: (state, info) with info = {step, tier, fetched, skipped}.
        Every process must call it at start-up (it also meets the peers); persistent_newest
        -1 means: do not restore from this tier (a fresh start or an explicit step)."""
        own = self._own_offer()
        offers, self.nodes, self.peers = peer_tier.Peers.meet(self, own, self.unusable)
        self.fallback = None
        if persistent_newest is not None and persistent_newest < 0:
            return None
        floor = -1 if persistent_newest is None else persistent_newest  # a tie goes to RAM
        steps = candidates(offers, self.nproc)
        skipped: list[int] = []
        for step in steps:  # newest first; a rejected step makes way for the next older one
            if step < floor:
                break
            got, source, why = self._load(step, own)
            # each block's CRC as written: the replica check of the restored state, with no
            # program to run (blocks of the same index on two processes are replicas)
            crcs = self._crcs if got is not None else {}
            results = exchange(f"restore/{step}", {"ok": got is not None, "source": source,
                                                   "why": why, "crcs": crcs})  # fmt: skip
            if all(r["ok"] for r in results):
                fetched = [q for q, r in enumerate(results) if r["source"] == "peer"]
                self._prev = step
                self.forget_except(step)
                info = {"step": step, "tier": "peer" if fetched else "local", "fetched": fetched,
                        "skipped": skipped, "replicas_differ": self._replicas_differ(results)}  # fmt: skip
                return got, info
            bad = {q: r["why"] for q, r in enumerate(results) if not r["ok"]}
            self.run.event(WorkerEvent.SNAPSHOT_REJECTED, step=step, tier="local", processes=bad)
            skipped.append(step)
        incomplete = sorted((s for s in offered(offers, self.nproc) - set(steps) if s >= floor),
                            reverse=True)  # fmt: skip
        unusable = unusable_at(offers, floor)
        if skipped or incomplete or unusable:
            self.fallback = {"skipped": skipped, "incomplete": incomplete}
            if unusable:
                self.fallback["unusable"] = unusable
        return None

    def _replicas_differ(self, results: list[dict]) -> list[str]:
        """Paths of the leaves whose copies of one block differ between processes (by the CRCs
        each process's snapshot recorded for it)."""
        seen: dict[str, int] = {}
        bad: set[str] = set()
        for r in results:
            crcs = r.get("crcs")
            for key, crc in crcs.items() if isinstance(crcs, dict) else ():
                if seen.setdefault(key, crc) != crc:
                    leaf = key.partition(":")[0]
                    bad.add(
                        self.paths[int(leaf)]
                        if leaf.isdigit() and int(leaf) < len(self.paths)
                        else leaf
                    )
        return sorted(bad)

    def _load(self, step: int, own: dict[int, int]) -> tuple[dict | None, str, str]:
        """(state, "local" | "peer", why-not) for `step` on this process; the CRC of each block
        of the state returned in `self._crcs` ("LEAF:INDEX" -> CRC)."""
        if step in own:
            try:
                data = load_bytes(os.path.join(self.own.dirs[own[step]], DATA))
            except OSError as e:  # Refused: not this user's file, or writable by others
                return None, "local", str(e) if isinstance(e, Refused) else "snapshot vanished"
            marker = read_marker(self.own.dirs[own[step]])
            source = "local"
        elif self.peers is not None:
            marker, data, why = self.peers.fetch(step)
            source = "peer"
            if marker is None:
                return None, source, why
        else:
            return None, "none", "no copy"
        if marker is None or data is None or marker.get("step") != step:
            return None, source, "snapshot vanished or unreadable"
        why = verify(marker, self.binding, self.blocks, len(data))
        if why:
            return None, source, why
        try:
            ok = authentic(marker, data, snapshot_key())
        except (OSError, compile_cache.Untrusted) as e:
            return None, source, f"MAC not checked: {e}"
        if not ok:
            # The CRCs only say which: torn or damaged blocks, or an edit (CRCs recomputed), a
            # plant, a snapshot sealed with another user's key. Data the MAC accepts needs no
            # second pass over it.
            bad = check_crcs(marker, memoryview(data))
            if bad:
                return None, source, f"CRC mismatch in blocks {bad[:10]}"
            return None, source, "MAC mismatch: not written by this user's jaxpar"
        self._crcs = {f"{b.leaf}:{list(b.index)}": e.get("crc")
                      for b, e in zip(self.blocks, marker["blocks"], strict=True)}  # fmt: skip
        return self._assemble(marker, data), source, ""

    def _assemble(self, marker: dict, data: bytearray) -> dict:
        flat, treedef = jax.tree_util.tree_flatten(self._abstract)
        per_leaf: dict[int, dict[int, np.ndarray]] = {}
        for b, e in zip(self.blocks, marker["blocks"], strict=True):
            raw = np.frombuffer(data, np.uint8, e["nbytes"], e["offset"])
            arr = raw.view(jnp.dtype(b.dtype)).reshape(b.shape)
            for dev in b.devices:
                per_leaf.setdefault(b.leaf, {})[dev] = arr
        devices = {d.id: d for d in jax.local_devices()}
        orders = [list(x.sharding.addressable_devices_indices_map(x.shape)) for x in flat]
        # every block onto its device in one call (one per block costs ~ms each on a busy host)
        blocks = [per_leaf[i][d.id] for i, order in enumerate(orders) for d in order]
        bufs = iter(jax.device_put(blocks, [devices[d.id] for order in orders for d in order]))
        leaves = [
            jax.make_array_from_single_device_arrays(
                x.shape, x.sharding, [next(bufs) for _ in order]
            )
            for x, order in zip(flat, orders, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def forget_except(self, step: int | None) -> None:
        """After a restore at `step` (None: from scratch or persistent): snapshots of other
        steps belong to another timeline and are invalidated, here and in held peer copies."""
        self.own.drop_except(step)
        if self.peers is not None:
            self.peers.drop_held(keep=step)
        self._prev = step if step is not None and self.own.find(step) is not None else None
        self._restored = self._prev

    def discard(self) -> None:
        """Invalidate everything (a restored snapshot failed a later check)."""
        self.forget_except(None)


class _Stopped(Exception):
    pass


def _holdings(offers: list[dict], nproc: int) -> list[set[int]]:
    """Per process: the steps of its snapshots found anywhere (its own, or a peer copy)."""
    have: list[set[int]] = [set(o["own"]) for o in offers]
    for o in offers:
        for src, steps in o.get("held", {}).items():
            if 0 <= int(src) < nproc:
                have[int(src)] |= set(steps)
    return have


def candidates(offers: list[dict], nproc: int) -> list[int]:
    """Steps, newest first, for which every process has its own snapshot or a peer copy."""
    have = _holdings(offers, nproc)
    return sorted(set.intersection(*have), reverse=True) if have else []


def offered(offers: list[dict], nproc: int) -> set[int]:
    """Steps of which at least one process's snapshot exists somewhere."""
    return set().union(*_holdings(offers, nproc))


def unusable_at(offers: list[dict], floor: int) -> list[dict]:
    """The snapshots processes found but could not offer that a restore at `floor` or newer
    passes over: those of a known step >= floor, and those of an unknown step (torn, refused)
    when no persistent checkpoint is there (floor -1: the run starts from step 0)."""
    out = []
    for q, o in enumerate(offers):
        for u in o.get("unusable", []):
            step = u.get("step")
            if (floor < 0 and step is None) or (isinstance(step, int) and step >= floor):
                out.append({"process": q, **u})
    return out
