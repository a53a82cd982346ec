"""Orbax checkpoints of the whole training state: async saves, resharded restore, integrity.

Layout: RUN_DIR/checkpoints/<step>/{state, meta}. `state` is the training pytree (params,
optimizer state, step, RNG key); `meta` is JSON: config hash, mesh, process count, jaxpar
version, data position, and a checksum of every array. Orbax commits a step by renaming its
temporary folder, so a process killed mid-save leaves only `<step>.orbax-checkpoint-tmp*`,
which `all_steps()` ignores. Orbax does not checksum array data: jaxpar does, with a
layout-independent integer hash computed on device, so a restore onto any mesh can verify it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.metrics import RunDir

EXIT_PREEMPTED = 42  # worker saved at a preemption notice and left; the supervisor restarts free


class Preempted(Exception):
    """Raised by the loop after a coordinated preemption save; the entrypoint exits 42."""


class CheckpointMismatch(ValueError):
    """The checkpoint was written for another model, optimizer or data configuration."""


class ReplicaMismatch(RuntimeError):
    """Replicas of a parameter disagree across the data-parallel axes."""


# ---- checksums --------------------------------------------------------------------------------

def _mix(x):
    # murmur3 finaliser on uint32: a small change anywhere changes the hash
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _bits_u32(x: jax.Array) -> jax.Array:
    if x.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if x.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    raise ValueError(f"checksum: unsupported dtype {x.dtype}")


def array_hash(x: jax.Array) -> jax.Array:
    """Position-sensitive hash of an array's bits; integer sums mod 2**32 make it exact for any
    reduction order, so it is the same on every mesh layout."""
    bits = _bits_u32(x).reshape(-1)
    idx = jnp.arange(bits.shape[0], dtype=jnp.uint32)
    return jnp.sum(_mix(bits ^ _mix(idx + jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)


@jax.jit
def _tree_hash(tree):
    return jax.tree.map(array_hash, tree)


def checksums(state: dict) -> dict[str, int]:
    """Path -> uint32 checksum of every array of the state (computed on device, layout-free)."""
    hashes = jax.device_get(_tree_hash(state))
    return {jax.tree_util.keystr(p): int(h) for p, h in jax.tree_util.tree_leaves_with_path(hashes)}


def replica_mismatches(params: dict, mesh: jax.sharding.Mesh) -> list[str]:
    """Paths of parameters whose replicas differ across the `data` axis (per-device hashes)."""
    if mesh.shape["data"] == 1:
        return []
    leaves = jax.tree_util.tree_leaves_with_path(params)
    specs = [x.sharding.spec for _, x in leaves]

    def local(*xs):
        out = []
        for x in xs:
            h = array_hash(x)
            differs = jax.lax.pmax(h, "data") != jax.lax.pmin(h, "data")
            out.append(jax.lax.psum(differs.astype(jnp.int32), tuple(mesh.axis_names)))
        return tuple(out)

    fn = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(PartitionSpec() for _ in specs),
        check_vma=False,
    )  # fmt: skip
    counts = jax.device_get(jax.jit(fn)(*[x for _, x in leaves]))
    return [jax.tree_util.keystr(p) for (p, _), c in zip(leaves, counts, strict=True) if c > 0]


# ---- the manager ------------------------------------------------------------------------------

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
    ):
        self.run = run
        self.every = every
        self.directory = run.file("checkpoints")
        self.meta = meta  # config_hash, mesh, nproc, version, ...
        self._saving_step: int | None = None
        self._before_commit = before_commit
        self._sigterm = False
        self.uncommitted = self._uncommitted_dirs()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=use_async,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._pre_commit),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        if jax.process_count() == 1:
            # Without jax.distributed there is no coordination service to deliver the preemption
            # notice: SIGTERM sets a flag the loop polls, like reached_preemption.
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _uncommitted_dirs(self) -> list[str]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(d for d in os.listdir(self.directory) if ".orbax-checkpoint-tmp" in d)

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def _pre_commit(self) -> None:
        # Orbax calls this after every array is written, before the rename that commits.
        if self._before_commit is not None and self._saving_step is not None:
            self._before_commit(self._saving_step)

    # -- saving -------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict, *, force: bool = False) -> float:
        """Start an asynchronous save of `state` at `step`; returns seconds the loop was blocked."""
        if step in self.manager.all_steps():
            return 0.0
        t0 = time.time()
        self.run.event("save_begin", step=step)
        sums = checksums(state)
        meta = {**self.meta, "step": step, "checksums": sums, "time": time.time()}
        self._saving_step = step
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )
        blocked = time.time() - t0
        self.run.event("save_end", step=step, blocking_s=blocked)
        return blocked

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def reached_preemption(self, step: int) -> bool:
        """All processes agree on the same step (coordination service), or SIGTERM when alone."""
        if jax.process_count() == 1:
            return self._sigterm
        return self.manager.reached_preemption(step)

    # -- restoring ----------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        return sorted(self.manager.reload() or self.manager.all_steps())

    def read_meta(self, step: int) -> dict:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(
        self, abstract_state: dict, mesh, *, which: str = "latest", force: bool = False
    ) -> tuple[dict, dict] | None:
        """Restore the newest good checkpoint (or step `which`) onto `abstract_state`'s shardings.

        A checkpoint that fails to read or whose checksums differ is reported and skipped in
        favour of the next older one. Returns (state, meta) or None when there is none.
        """
        if self.uncommitted:
            self.run.event("uncommitted_ignored", dirs=self.uncommitted)
        if which == "none":
            return None
        steps = self.committed_steps()
        if which != "latest":
            want = int(which)
            if want not in steps:
                raise ValueError(
                    f"ckpt.restore={which}: no committed checkpoint at step {want} in "
                    f"{self.directory} (committed: {steps}); use latest, none or one of those"
                )
            steps = [want]
        for step in reversed(steps):
            got = self._try_restore(step, abstract_state, force)
            if got is not None:
                return got
        return None

    def _try_restore(self, step: int, abstract_state: dict, force: bool):
        try:
            meta = self.read_meta(step)
        except Exception as e:  # noqa: BLE001 - any unreadable metadata means a damaged checkpoint
            self.run.event("checkpoint_corrupt", step=step, reason=f"metadata: {e!r}"[:500])
            return None
        self._check_config(meta, force)
        try:
            out = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
            state = out["state"]
            sums = checksums(state)
        except Exception as e:  # noqa: BLE001 - truncated or garbled array files
            self.run.event("checkpoint_corrupt", step=step, reason=f"read: {e!r}"[:500])
            return None
        bad = sorted(k for k, v in meta.get("checksums", {}).items() if sums.get(k) != v)
        if bad:
            self.run.event("checkpoint_corrupt", step=step, reason="checksum mismatch", arrays=bad[:20])
            return None
        return state, meta

    def _check_config(self, meta: dict, force: bool) -> None:
        want, have = self.meta.get("config_hash"), meta.get("config_hash")
        if want != have and not force:
            raise CheckpointMismatch(
                f"checkpoint in {self.directory} was written by config {have} but this run's model/"
                f"optimizer/data config is {want}; use another --run-dir, --set ckpt.restore=none, "
                f"or --set ckpt.force=true to load it anyway"
            )


def shardings_of(mesh, spec_tree) -> dict:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree)


def host_hash(x: np.ndarray) -> int:
    """Checksum of a host array (numpy), equal to `array_hash` of the same values."""
    return int(jax.device_get(array_hash(jnp.asarray(x))))
