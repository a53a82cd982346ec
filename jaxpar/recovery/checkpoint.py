"""Orbax checkpoints of the whole training state: async saves, resharded restore, integrity.

RUN_DIR/checkpoints/<step>/{state, meta, checksums.json}. Crash consistency (a commit is a
rename), integrity (layout-independent checksums of every array; a damaged step is moved aside)
and the replica check: docs/design.md, "Recovery tiers", "Persistent checkpoints".
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

from jaxpar import _compat
from jaxpar.engine.mesh import REPLICA_AXES
from jaxpar.recovery import compile_cache, save_watch
from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import WorkerEvent, write_json
from jaxpar.rundir.writer import RunDir

TMP_SUFFIX = runlog.TMP_SUFFIX  # orbax's uncommitted-step suffix
CORRUPT_SUFFIX = ".corrupt"  # a damaged checkpoint is renamed aside, never deleted
CHECKSUMS_FILE = "checksums.json"


class Preempted(Exception):
    """Raised by the loop after a coordinated preemption save; the entrypoint exits 42 (130
    after Ctrl-C, `interrupted`)."""

    def __init__(
        self, message: str, step: int = 0, interrupted: bool = False, run_dir: str | None = None
    ):
        super().__init__(message)
        self.step, self.interrupted, self.run_dir = step, interrupted, run_dir


class CheckpointMismatch(ValueError):
    """The checkpoint was written for another model, optimizer or data configuration."""


class NonFiniteState(RuntimeError):
    """The state to be saved holds NaNs or infinities (its loss was finite: its gradients were
    not); nothing is saved from it."""

    def __init__(self, step: int, bad: dict[str, int]):
        first = next(iter(bad))
        super().__init__(
            f"the state of step {step} holds non-finite values ({sum(bad.values())} in "
            f"{len(bad)} arrays, e.g. {first}); it is not saved: restart from the last good "
            f"checkpoint"
        )
        self.step, self.bad = step, bad


def refuse_nonfinite(run: RunDir, step: int, bad: dict[str, int], where: str) -> None:
    """Record (a `nonfinite` event naming the arrays) and raise NonFiniteState for a state
    `where` would have saved."""
    if bad:
        run.event(
            WorkerEvent.NONFINITE, step=step, where=where, arrays=dict(list(bad.items())[:20])
        )
        raise NonFiniteState(step, bad)


class ReplicaMismatch(RuntimeError):
    """Replicas of a parameter disagree across the data-parallel axes."""


# ---- a full disk ------------------------------------------------------------------------------

_NO_SPACE = ("No space left on device", "os_error_code='28'", "[Errno 28]", "ENOSPC")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it came from, is a full disk or quota (orbax and
    tensorstore wrap the OSError into ValueErrors that only say so in their text)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(exc) for marker in _NO_SPACE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_path(exc: BaseException, default: str) -> str:
    """The file a disk-full error names (OSError.filename, or the first quoted path)."""
    if isinstance(exc, OSError) and exc.filename:
        return str(exc.filename)
    found = re.search(r'"(/[^"]+)"', str(exc))
    return found.group(1) if found else default


class _DiskFullLogFilter(logging.Filter):
    """Orbax logs every failed background write with its traceback (4 per failed save); a full
    disk is reported once, as one line, by the entry point instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not any(marker in text for marker in _NO_SPACE)


logging.getLogger("absl").addFilter(_DiskFullLogFilter())
_compat.drain_orbax_event_loops()  # a failed save or restore: no "Event loop is closed" tracebacks
save_watch.install()  # a write that failed here is raised at once, not after orbax's barriers


# ---- hashing ----------------------------------------------------------------------------------

_GOLDEN = 0x9E3779B9


def _mix(x):
    # murmur3 finaliser on uint32: a small change anywhere changes the hash. numpy constants: a
    # jnp constant is a device array made for every use, and a state has hundreds of uses.
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _bits_u32(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if x.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    raise ValueError(f"checksum: unsupported dtype {x.dtype} (32-bit and narrower types only)")


def _element_hashes(block: jax.Array, global_shape: tuple[int, ...], offsets) -> jax.Array:
    """uint32 per element of a block of an array at `offsets`, keyed by global element positions,
    so the sum of the block hashes of any partition equals the whole array's hash (mod 2**32)."""
    idx = None
    stride = 1
    for d in reversed(range(block.ndim)):
        pos = jax.lax.broadcasted_iota(jnp.uint32, block.shape, d) + offsets[d]
        term = pos * np.uint32(stride % 2**32)
        idx = term if idx is None else idx + term
        stride *= global_shape[d]
    if idx is None:  # a scalar: position 0
        idx = jnp.zeros(block.shape, jnp.uint32)
    return _mix(_bits_u32(block) ^ _mix(idx + np.uint32(_GOLDEN)))


def _block_hash(block: jax.Array, global_shape: tuple[int, ...], offsets) -> jax.Array:
    """Hash of one block of an array at `offsets` (the sum of its element hashes, mod 2**32)."""
    return jnp.sum(_element_hashes(block, global_shape, offsets), dtype=jnp.uint32)


def _hash_and_nonfinite(block: jax.Array, global_shape: tuple[int, ...], offsets):
    """(hash, count of NaNs and infinities) of one block, in one reduction: one kernel per block
    instead of two (XLA compiles a kernel per reduction, ~5-10 ms each on a CPU host, and a
    state has tens to hundreds of leaves)."""
    h = _element_hashes(block, global_shape, offsets)
    if not jnp.issubdtype(block.dtype, jnp.floating):
        return jnp.sum(h, dtype=jnp.uint32), np.uint32(0)
    bad = (~jnp.isfinite(block)).astype(jnp.uint32)
    zero = np.uint32(0)
    dims = tuple(range(block.ndim))
    return jax.lax.reduce((h, bad), (zero, zero), _add_pairs, dims)


def _add_pairs(a, b):  # one function object: jax traces the reducer once, not once per block
    return a[0] + b[0], a[1] + b[1]


def array_hash(x: jax.Array) -> jax.Array:
    """Position-sensitive hash of an array's bits (the value `checksums` reports)."""
    return _block_hash(x, x.shape, (0,) * x.ndim)


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _padded_spec(x) -> tuple:
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (len(x.shape) - len(spec))


def _local_hash_program(leaves: list, mesh) -> Callable:
    """Compiled: every device hashes its blocks and counts their non-finite values ->
    uint32[devices, 2 x leaves] (the hashes, then the counts), gathered everywhere."""
    specs = [_padded_spec(x) for x in leaves]
    shapes = [tuple(x.shape) for x in leaves]
    for x, spec in zip(leaves, specs, strict=True):
        for dim, entry in zip(x.shape, spec, strict=True):
            ways = int(np.prod([mesh.shape[a] for a in _axes_of(entry)]))
            if dim % ways:
                raise ValueError(f"checksum: dim {dim} of {x.shape} not divisible by {ways} {spec}")

    def local(*blocks):
        pairs = []  # per block: (hash, count of NaNs and infinities)
        for block, shape, spec in zip(blocks, shapes, specs, strict=True):
            offsets = []
            for d, entry in enumerate(spec):
                index = np.uint32(0)
                for a in _axes_of(entry):
                    index = index * np.uint32(mesh.shape[a]) + jax.lax.axis_index(a)
                offsets.append(jnp.asarray(index).astype(jnp.uint32) * np.uint32(block.shape[d]))
            # the count: a state that holds any NaN or infinity is not saved
            pairs.append(_hash_and_nonfinite(block, shape, offsets))
        hashes, bad = [h for h, _ in pairs], [n for _, n in pairs]
        vec = jnp.stack(hashes + bad) if hashes else jnp.zeros((0,), jnp.uint32)
        return jax.lax.all_gather(vec, tuple(mesh.axis_names))

    fn = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(PartitionSpec(*s) for s in specs),
        out_specs=PartitionSpec(), check_vma=False,
    )  # fmt: skip
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    # The program is a function of the leaves' shapes, dtypes and layouts, the mesh and this
    # file: a restarted process loads it without tracing ~50 hash blocks again (2+ s).
    key = (
        repr([(s, str(x.dtype), spec) for s, x, spec in zip(shapes, leaves, specs, strict=True)]),
        repr((mesh.axis_names, mesh.devices.shape, [d.id for d in mesh.devices.flat])),
        compile_cache.source_digest(__file__),
    )
    return compile_cache.compile_by_key("checksum", key, lambda: jax.jit(fn).lower(*abstract))[0]


_PROGRAMS: dict = {}
_PROGRAMS_LOCK = threading.Lock()  # warmed up in the compile thread, used in the main one


def _program_for(leaves: list):
    key = tuple((tuple(x.shape), str(x.dtype), x.sharding) for x in leaves)
    with _PROGRAMS_LOCK:
        if key not in _PROGRAMS:
            _PROGRAMS[key] = _local_hash_program(leaves, leaves[0].sharding.mesh)
        return _PROGRAMS[key]


class _Hashes:
    """Per-device block hashes of a tree (dispatched; `.get()` waits for them)."""

    def __init__(self, tree):
        flat = jax.tree_util.tree_leaves_with_path(tree)
        self.paths = [jax.tree_util.keystr(p) for p, _ in flat]
        leaves = [x for _, x in flat]
        self.specs = [_padded_spec(x) for x in leaves]
        self.mesh = leaves[0].sharding.mesh if leaves else None
        self._out = _program_for(leaves)(*leaves) if leaves else None

    def _all(self) -> np.ndarray:
        out = np.asarray(jax.device_get(self._out))
        return out.reshape(*self.mesh.devices.shape, 2 * len(self.paths))

    def get(self) -> np.ndarray:
        """uint32[*mesh shape, leaves]: the hash of each device's block of each leaf."""
        return self._all()[..., : len(self.paths)]

    def nonfinite(self) -> dict[str, int]:
        """Path -> how many NaNs and infinities the leaf holds (one copy of each block counted;
        a leaf with any on any device is named): the same answer on every process."""
        if self._out is None:
            return {}
        counts = self._all()[..., len(self.paths) :]
        anywhere = counts.reshape(-1, len(self.paths)).any(axis=0)
        out = {}
        for j, path in enumerate(self.paths):
            if anywhere[j]:
                out[path] = max(int(np.sum(counts[self._one_copy(j) + (j,)], dtype=np.uint64)), 1)
        return out

    def _one_copy(self, j: int) -> tuple:
        """The index of one copy of leaf `j`'s blocks: coordinate 0 along every mesh axis the
        leaf is replicated over."""
        used = {a for e in self.specs[j] for a in _axes_of(e)}
        return tuple(slice(None) if a in used else 0 for a in self.mesh.axis_names)

    def checksums(self) -> dict[str, int]:
        if self._out is None:
            return {}
        blocks = self.get()
        return {path: int(np.sum(blocks[self._one_copy(j) + (j,)], dtype=np.uint64) % 2**32)
                for j, path in enumerate(self.paths)}  # fmt: skip


_LAST: list = []  # [(leaves, _Hashes)]: the replica check before a save hashes the saved state


def _hashes(tree) -> _Hashes:
    """`_Hashes` of `tree`, reusing the last result when it is for the very same arrays (the
    memo holds them, so their ids cannot be reused meanwhile)."""
    leaves = jax.tree.leaves(tree)
    if _LAST and len(_LAST[0][0]) == len(leaves):
        if all(a is b for a, b in zip(_LAST[0][0], leaves, strict=True)):
            return _LAST[0][1]
    result = _Hashes(tree)
    _LAST[:] = [(leaves, result)]
    return result


def warm_up(abstract_tree) -> None:
    """Compile the hash program for a tree of ShapeDtypeStructs with shardings (ahead of use)."""
    leaves = jax.tree.leaves(abstract_tree)
    if leaves:
        _program_for(leaves)


def warm_replica_check(tree, mesh: jax.sharding.Mesh) -> None:
    """Run the replica check once on a throwaway `tree` and forget it: the hash program is loaded
    and its collectives connect now (gloo connects at a program's first run), not in a restore."""
    replica_mismatches(tree, mesh)
    _LAST.clear()


def checksums(state) -> dict[str, int]:
    """Path -> uint32 checksum of every array of the state (computed on device, layout-free)."""
    return _hashes(state).checksums()


def replica_mismatches(tree, mesh: jax.sharding.Mesh) -> list[str]:
    """Paths of arrays (parameters, or the whole state) whose replicas differ across the replica
    axes (`data`, jaxpar.engine.mesh.REPLICA_AXES), from per-device block hashes."""
    axes = [a for a in REPLICA_AXES if mesh.shape[a] > 1]
    if not axes:
        return []
    hashes = _hashes(tree)
    blocks = hashes.get()
    bad = []
    for j, (path, spec) in enumerate(zip(hashes.paths, hashes.specs, strict=True)):
        sharded = {a for e in spec for a in _axes_of(e)}
        col = blocks[..., j]
        for ax in axes:
            if ax in sharded:
                continue  # sharded over the axis: its blocks differ by design
            axis = list(mesh.axis_names).index(ax)
            if not np.all(col == np.take(col, [0], axis=axis)):
                bad.append(path)
                break
    return bad


# ---- the manager ------------------------------------------------------------------------------


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler with replica-parallel writes off.

    Replica-parallel splits every replicated array into per-replica slices with eager jax
    slices, each compiled on first use: ~400 compilations (7-20 s on a loaded CPU) inside the
    first save for gpt_tiny on dp8. Replica 0 writing each array instead cut the first save to
    ~0.3 s and later ones from ~0.25 to ~0.1 s here.
    """
    th = ocp.type_handlers
    default = th.get_type_handler(jax.Array)
    array = th.ArrayHandler(
        use_replica_parallel=False,
        array_metadata_store=getattr(default, "_array_metadata_store", None),
    )
    pairs = [(t, th.get_type_handler(t)) for t in th.supported_types() if t is not jax.Array]
    return ocp.PyTreeCheckpointHandler(
        type_handler_registry=th.create_type_handler_registry(*pairs, (jax.Array, array))
    )


def _all_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (one small collective when there are several)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


class Checkpointer:
    """Saves and restores one run's checkpoints; writes save/restore events to the run dir."""

    def __init__(
        self,
        run: RunDir,
        *,
        every: int,
        keep: int,
        meta: dict,
        use_async: bool = True,
        before_commit: Callable[[int], None] | None = None,
        tidy: bool = True,
    ):
        """`tidy`: orbax removes the unfinished saves it finds (`N.orbax-checkpoint-tmp`) as it
        starts; False where another process may have a save in flight in the same folder."""
        self.run = run
        self.every = every
        self.use_async = use_async
        self.directory = run.file(runlog.CHECKPOINTS)
        self.meta = meta  # config_hash, mesh, nproc, version, ...
        self._before_commit = before_commit
        self._pending: tuple[int, _Hashes] | None = None  # the save orbax is finishing
        self._own_steps: set[int] = set()  # restored or saved by this incarnation
        self._sigterm = False
        self._failed = False  # a save failed: orbax's threads may wait at a barrier for good
        self.uncommitted = self._uncommitted_dirs()
        # Always orbax's async checkpointer (the commit hook needs it); synchronous saves wait.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=tidy,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._pre_commit),
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={"state": _state_handler(), "meta": ocp.JsonCheckpointHandler()},
        )
        self._old_sigterm = None
        self._old_sigint = None
        self.interrupted = False  # Ctrl-C (SIGINT) asked for the stop
        if threading.current_thread() is threading.main_thread():
            if jax.process_count() == 1:
                # Without jax.distributed there is no coordination service to deliver the
                # preemption notice: SIGTERM sets a flag the loop polls, like reached_preemption.
                self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            # Ctrl-C: the first is a preemption notice (a coordinated save), a second stops now.
            self._old_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _uncommitted_dirs(self) -> list[str]:
        return runlog.uncommitted_saves(self.directory)

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:
            say("interrupted again: stopping now without saving")
            os._exit(130)
        self.interrupted = True
        if self.run.is_writer:
            say("interrupted: saving a checkpoint at the next step (Ctrl-C again to stop at once)")
        if jax.process_count() == 1:
            self._sigterm = True
        else:  # jax's preemption notifier listens for SIGTERM and tells every process
            os.kill(os.getpid(), signal.SIGTERM)

    def warm_up(self, abstract_state) -> None:
        """Compile the checksum program now, so the first save blocks only for the save."""
        warm_up(abstract_state)

    # -- saving -------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _pre_commit(self) -> None:
        # Orbax calls this on process 0, in its save thread, after every process has written its
        # arrays and before the rename that commits the step.
        step, hashes = self._pending
        tmp = glob.glob(os.path.join(glob.escape(self.directory), f"{step}{TMP_SUFFIX}*"))
        target = tmp[0] if tmp else os.path.join(self.directory, str(step))  # no-rename storage
        write_json(os.path.join(target, CHECKSUMS_FILE), hashes.checksums())
        if self._before_commit is not None:
            self._before_commit(step)

    def save(self, step: int, state: dict, *, force: bool = False) -> float:
        """Start a save of `state` at `step` (asynchronous unless configured otherwise).

        `force` is kept for callers; every call saves (the loop decides when). Returns the
        seconds the loop was blocked, also recorded as `blocking_s` in the save_end event.
        """
        if step in self._own_steps:
            return 0.0  # already committed from this very state (restored, or a final re-save)
        t0 = time.time()
        # a state with NaNs or infinities is never saved (it would be restored by every restart);
        # the same hash program gives the checksums read in _pre_commit
        hashes = _hashes(state)
        refuse_nonfinite(self.run, step, hashes.nonfinite(), "checkpoint")
        self.run.event(WorkerEvent.SAVE_BEGIN, step=step)
        self.wait()  # one save in flight: a slow previous one blocks too
        if step in self.manager.all_steps():  # left by a run restored from an older step
            self.manager.delete(step)
            self.run.event(WorkerEvent.CHECKPOINT_REPLACED, step=step)
        self._check_space(state)
        meta = {**self.meta, "step": step, "data_position": step, "time": time.time()}
        self._pending = (step, hashes)
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )  # fmt: skip
        if not self.use_async:
            self.wait()
        blocked = time.time() - t0
        self._own_steps.add(step)
        self.run.event(
            WorkerEvent.SAVE_END, step=step, blocking_s=blocked, use_async=self.use_async
        )
        return blocked

    def _check_space(self, state: dict) -> None:
        """Refuse a save the disk cannot hold, on every process at once (ENOSPC naming the
        directory). A save that runs out of space midway fails on some processes only, and
        orbax's other processes then wait at a barrier for its timeout (10 minutes), hiding
        the failure; refusing it before anything is written stops the whole job at once."""
        steps = committed_on_disk(self.directory)
        need = _bytes_on_disk(os.path.join(self.directory, str(steps[-1]))) if steps else 0
        need = need or sum(x.nbytes for x in jax.tree.leaves(state))  # before the first commit
        need = int(need * SPACE_MARGIN) + SPACE_RESERVE
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = need  # cannot tell: let the save find out
        if not _all_agree(free >= need):
            raise OSError(
                errno.ENOSPC,
                f"No space left on device: the next checkpoint needs about {need >> 10} KiB, "
                f"{free >> 10} KiB free",
                self.directory,
            )

    def wait(self) -> None:
        """Wait for the save in flight; its error (e.g. a full disk) is raised here, as soon as
        this process's write failed (the others' then wait at orbax's barrier until stopped)."""
        self._failing(lambda: save_watch.wait(self.manager.wait_until_finished, self.directory))

    def check(self) -> None:
        """Raise the error of a failed background save now (called every step), so a save that
        cannot finish stops the run at once instead of at the next save."""
        self._failing(self._check_now)

    def _check_now(self) -> None:
        error = save_watch.failed(self.directory)
        if error is not None:
            raise error
        self.manager.check_for_errors()

    def _failing(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:
            self._failed = True
            if is_disk_full(e) and self.run.is_writer:
                self.discard_uncommitted()  # free the space the failed save took
            raise

    def discard_uncommitted(self) -> None:
        """Remove the folders of saves that never committed (after a failed save)."""
        runlog.discard_uncommitted(self.directory)

    def close(self) -> None:
        try:
            if not self._failed:  # else orbax's close would wait at the failed save's barrier
                self.wait()
                self.manager.close()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None
            if self._old_sigint is not None:
                signal.signal(signal.SIGINT, self._old_sigint)
                self._old_sigint = None

    def reached_preemption(self, step: int) -> bool:
        """All processes agree on the same step (coordination service), or SIGTERM when alone."""
        if jax.process_count() == 1:
            return self._sigterm
        return self.manager.reached_preemption(step)

    # -- restoring ----------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int) -> dict:
        """Committed step `step`'s metadata with its checksum table (meta["checksums"]).

        Both files are untrusted input, read bounded: anything but what a save writes raises
        ValueError naming the file."""
        meta = read_meta_object(self.directory, step)
        path = os.path.join(self.directory, str(step), CHECKSUMS_FILE)
        sums = runlog.read_json_object(path, "checksum table", _DAMAGED)
        if not all(type(v) is int for v in sums.values()):
            raise ValueError(f"{path}: not a checksum table (values must be integers){_DAMAGED}")
        meta["checksums"] = sums
        return meta

    def restore(
        self, abstract_state: dict, *, which: str = "latest", force: bool = False
    ) -> tuple[dict, dict] | None:
        """Restore the newest good checkpoint (or step `which`) onto `abstract_state`'s shardings.

        A checkpoint that fails to read or whose checksums differ is reported, moved aside and
        skipped in favour of the next older one (meta["skipped"] lists them). Returns
        (state, meta), or None when there is none or `which` is "none".
        """
        if self.uncommitted:
            self.run.event(WorkerEvent.UNCOMMITTED_IGNORED, dirs=self.uncommitted)
        if which == "none":
            return None
        steps = restore_candidates(which, self.committed_steps(), self.directory)
        skipped = []
        for step in reversed(steps):
            got = self._try_restore(step, abstract_state, force)
            if got is not None:
                state, meta = got
                meta["skipped"] = skipped
                self._own_steps.add(step)
                return state, meta
            skipped.append(step)
        if which != "latest":
            raise ValueError(
                f"ckpt.restore={which}: checkpoint {which} is damaged (see events.jsonl); "
                f"use ckpt.restore=latest to fall back to an older one"
            )
        if skipped:
            self.run.event(WorkerEvent.NO_GOOD_CHECKPOINT, skipped=skipped)
            if self.run.is_writer:
                say(f"every checkpoint is corrupt (steps {skipped}), starting from step 0")
        return None

    def _try_restore(self, step: int, abstract_state: dict, force: bool):
        reason, meta = None, None
        try:
            meta = self.read_meta(step)
        except Exception as e:  # noqa: BLE001 - any unreadable metadata means a damaged checkpoint
            reason = f"metadata: {e}" if isinstance(e, ValueError) else f"metadata: {e!r}"
        if not _all_agree(reason is None):
            return self._reject(step, reason or "metadata unreadable on another process")
        hash_differs = self._check_config(meta, force)
        state = None
        try:
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
            item = ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args)
            out = self.manager.restore(step, args=ocp.args.Composite(state=item))
            state = out["state"]
        except Exception as e:  # noqa: BLE001 - truncated or garbled array files
            if hash_differs:  # forced onto another model: a shape error is not damage
                raise CheckpointMismatch(f"forced restore of step {step} failed: {e!r}") from e
            reason = f"read: {e!r}"
        if not _all_agree(reason is None):
            return self._reject(step, reason or "read failed on another process")
        sums = checksums(state)
        bad = sorted(k for k, v in meta["checksums"].items() if sums.get(k) != v)
        missing = sorted(set(sums) - set(meta["checksums"]))
        if bad or missing:
            return self._reject(step, "checksum mismatch", arrays=(bad + missing)[:20])
        return state, meta

    def _reject(self, step: int, reason: str, **fields) -> None:
        self.run.event(WorkerEvent.CHECKPOINT_CORRUPT, step=step, reason=reason[:500], **fields)
        if self.run.is_writer:
            src = os.path.join(self.directory, str(step))
            dst = f"{src}{CORRUPT_SUFFIX}-{int(time.time())}"
            os.replace(src, dst)
            say(f"checkpoint step {step} is damaged ({reason[:120]}); set aside as {dst}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxpar_quarantine_{step}")
        self.manager.reload()
        return None

    def _check_config(self, meta: dict, force: bool) -> bool:
        """Refuse a checkpoint of another model/optimizer/data config unless forced.

        Returns whether the hashes differ (a forced restore)."""
        want, have = self.meta.get("config_hash"), meta.get("config_hash")
        if want == have:
            return False
        if not force:
            raise CheckpointMismatch(
                mismatch_message(self.directory, meta, self.meta, self.meta.get("config"))
            )
        self.run.event(
            WorkerEvent.RESTORE_FORCED, step=meta.get("step"), from_config=have, to_config=want
        )
        return True


# ---- checks before a run writes anything --------------------------------------------------------


def say(text: str) -> None:
    """One line on the console (stderr): what a user must know even without reading events."""
    print(f"jaxpar: {text}", file=sys.stderr, flush=True)


SPACE_MARGIN = 1.25  # a save needs the newest checkpoint's size times this, plus the reserve
SPACE_RESERVE = 256 << 10  # room left for logs, metadata and temporary files


def _bytes_on_disk(folder: str) -> int:
    """The bytes of the files under `folder` (symlinks not followed)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def committed_on_disk(ckpt_dir: str) -> list[int]:
    """Committed steps under `ckpt_dir` (orbax's step folders), read without orbax."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


def restore_candidates(which: str, steps: list[int], directory: str) -> list[int]:
    """The committed `steps` (oldest first) a restore tries for ckpt.restore=`which`: all of
    them for "latest", else just that step, which must be committed (ValueError)."""
    if which == "latest":
        return steps
    if not which.isdigit() or int(which) not in steps:
        raise ValueError(
            f"ckpt.restore={which}: no committed checkpoint at that step in {directory} "
            f"(committed: {steps}); use latest, none or one of those"
        )
    return [int(which)]


_DAMAGED = "; the checkpoint is damaged or was not written by jaxpar"


def read_meta_object(ckpt_dir: str, step: int) -> dict:
    """A committed step's `meta` item (JSON written by `Checkpointer.save`), checked: ValueError
    naming the file when it is garbage or lacks what a save writes."""
    path = os.path.join(ckpt_dir, str(step), "meta", "metadata")
    meta = runlog.read_json_object(path, "checkpoint metadata object", _DAMAGED)
    if type(meta.get("step")) is not int or meta["step"] != step:
        raise ValueError(f"{path}: 'step' is {meta.get('step')!r}, not {step}{_DAMAGED}")
    for key in ("mesh", "config_hash"):
        if key in meta and not isinstance(meta[key], str):
            raise ValueError(f"{path}: {key!r} is {meta[key]!r}, not a string{_DAMAGED}")
    return meta


def read_meta_file(ckpt_dir: str, step: int) -> dict | None:
    """A committed step's `meta` item, or None when it is unreadable."""
    try:
        return read_meta_object(ckpt_dir, step)
    except ValueError:
        return None


def mismatch_message(directory: str, have: dict, want: dict, want_config: dict | None) -> str:
    """The config-hash refusal: which fields differ (when the checkpoint recorded its config),
    and the ways forward."""
    from jaxpar.config import config_diff

    step = have.get("step")
    if isinstance(have.get("config"), dict) and want_config is not None:
        changes = config_diff(have["config"], want_config)
        what = "; ".join(changes[:8]) + (
            f"; and {len(changes) - 8} more" if len(changes) > 8 else ""
        )
    else:
        what = f"config hash {have.get('config_hash')} → {want.get('config_hash')}"
    return (
        f"checkpoint step {step} in {directory} was written with another model/optimizer/data "
        f"config ({what}); run with the checkpoint's settings, use another --run-dir, "
        f"--set ckpt.restore=none to start afresh, or --set ckpt.force=true to load it anyway"
    )


def preflight(
    ckpt_dir: str, meta: dict, *, which: str = "latest", force: bool = False
) -> int | None:
    """The step a restore would start from (None: none), checked before anything is written.

    Raises CheckpointMismatch for a checkpoint of another config (unless `force`) and ValueError
    for a `which` step that is not committed. Unreadable steps are left to the restore, which
    sets them aside."""
    if which == "none":
        return None
    steps = restore_candidates(which, committed_on_disk(ckpt_dir), ckpt_dir)
    for step in reversed(steps):
        have = read_meta_file(ckpt_dir, step)
        if have is None:
            continue
        if have.get("config_hash") != meta.get("config_hash") and not force:
            raise CheckpointMismatch(mismatch_message(ckpt_dir, have, meta, meta.get("config")))
        return step
    return None
