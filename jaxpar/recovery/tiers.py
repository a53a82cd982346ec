"""Restore tiers: where a training process gets its starting state from, and saves it to.

    tiers = build_tiers(TierSetup(...))        # TIERS, fastest first; a builder may return None
    state, restored = restore_newest(tiers, init)   # then, after each step, t.save where t.due

The `Tier` interface, the order, fallbacks and adding a tier: docs/design.md, "Recovery tiers".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import __version__
from jaxpar.config import TrainConfig, config_hash, hashed_dict
from jaxpar.data import sources as data_lib
from jaxpar.engine.mesh import MeshSpec
from jaxpar.recovery import local_tier
from jaxpar.recovery.checkpoint import Checkpointer, ReplicaMismatch, replica_mismatches, say
from jaxpar.rundir.runlog import WorkerEvent
from jaxpar.rundir.writer import RunDir


@dataclass
class TierSetup:
    """What a tier's builder gets: the run, its config and mesh, the abstract training state."""

    cfg: TrainConfig
    run: RunDir
    mesh: jax.sharding.Mesh
    abstract_state: dict
    per_replica_params: bool = False  # DiLoCo: parameters held once per data replica
    before_commit: Callable[[int], None] | None = None  # faults: persistent save, pre-commit
    before_snapshot: Callable[[int], None] | None = None  # faults: local snapshot, pre-commit
    # remove unfinished saves at start (False where another process may be saving: replica groups)
    tidy_checkpoints: bool = True

    @property
    def mesh_text(self) -> str:
        return str(MeshSpec(**dict(self.mesh.shape)))


@dataclass
class Restored:
    """A state a tier restored, and which tier (`local`, `peer` or `persistent`) at which step."""

    state: dict
    step: int
    tier: str


@dataclass
class Attempt:
    """What the tiers tried before the one that restored: steps they rejected after loading
    (listed in the restore event) and the fallbacks they announce."""

    rejected: list[int] = field(default_factory=list)


class Tier(Protocol):
    name: str

    def newest_step(self) -> int | None:
        """The newest committed step this tier holds (None: none); faster tiers restore only
        states at least this new."""

    def restore(self, floor: int | None, attempt: Attempt) -> Restored | None:
        """The newest usable state at least as new as `floor` (None: any), or None. Every
        process calls it (a tier may meet its peers here)."""

    def started_from(self, restored: Restored | None, state: dict) -> None:
        """The run starts from `state` (restored by this tier, another one, or initialised)."""

    def due(self, step: int) -> bool: ...

    def save(self, step: int, state: dict) -> None: ...

    def warm_up(self) -> None:
        """Compile what saving needs soon (runs beside the step's compilation and the restore;
        the first step waits for it)."""

    def warm_behind(self) -> None:
        """Compile what saving needs later (runs in the background once the steps have begun:
        nothing waits for it but the save that uses it)."""

    def ready(self) -> None:
        """Warmed up, before the first step: say so (an event) if the tier has anything to say."""

    def close(self, *, complete: bool, failed: bool) -> None:
        """The loop ended (`complete`: every step done; `failed`: by an error)."""


def config_meta(cfg: TrainConfig) -> dict:
    """What a checkpoint records of its config, and what a restore compares."""
    return {"config_hash": config_hash(cfg), "config": hashed_dict(cfg)}


def check_replicas(run: RunDir, mesh, state: dict, when: str) -> None:
    """Data-parallel replicas of the parameters and optimizer state must be equal."""
    bad = replica_mismatches(state, mesh)
    if bad:
        run.event(WorkerEvent.REPLICA_MISMATCH, when=when, step=int(state["step"]), params=bad[:20])
        raise ReplicaMismatch(
            f"{len(bad)} parameters differ between data-parallel replicas ({when}, step "
            f"{int(state['step'])}), e.g. {bad[0]}; restart from the last good checkpoint"
        )


class PersistentTier:
    """Orbax checkpoints in RUN_DIR/checkpoints: restorable onto any mesh or process count."""

    name = "persistent"

    def __init__(self, setup: TierSetup):
        cfg = setup.cfg
        meta = {
            **config_meta(cfg),
            "mesh": setup.mesh_text,
            "nproc": jax.process_count(),
            "jaxpar_version": __version__,
            "data": {"source": data_lib.source_label(cfg.data.source), "seed": cfg.data.seed},
        }
        self.setup = setup
        self.checkpointer = Checkpointer(
            setup.run, every=cfg.ckpt.every, keep=cfg.ckpt.keep, meta=meta,
            use_async=cfg.ckpt.use_async, before_commit=setup.before_commit,
            tidy=setup.tidy_checkpoints,
        )  # fmt: skip

    def newest_step(self) -> int | None:
        if self.setup.cfg.ckpt.restore != "latest":
            return None
        steps = self.checkpointer.committed_steps()
        return steps[-1] if steps else None

    def restore(self, floor: int | None, attempt: Attempt) -> Restored | None:
        s, ckpt = self.setup, self.checkpointer
        target, old_data = self._layout_bound_target()
        got = ckpt.restore(target, which=s.cfg.ckpt.restore, force=s.cfg.ckpt.force)
        if got is None:
            return None
        state, meta = got
        if old_data is not None:  # residuals of another data size: start error feedback afresh
            state["comm"] = jax.tree.map(
                lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding),
                s.abstract_state["comm"],
            )
            s.run.event(
                WorkerEvent.COMM_STATE_RESET, from_data=old_data, to_data=s.mesh.shape["data"]
            )
        s.run.event(
            WorkerEvent.RESTORE, step=int(meta["step"]), tier="persistent",
            from_mesh=meta.get("mesh"), to_mesh=ckpt.meta["mesh"], from_nproc=meta.get("nproc"),
            to_nproc=jax.process_count(), skipped_corrupt=meta.get("skipped", []),
            local_skipped=attempt.rejected,
        )  # fmt: skip
        check_replicas(s.run, s.mesh, state, "restore")
        return Restored(state, int(meta["step"]), "persistent")

    def _layout_bound_target(self) -> tuple[dict, int | None]:
        """Restore target, adjusted for state whose shape depends on the data-axis size.

        Error-feedback residuals ("comm", one per data replica) restore only onto the same data
        size; onto another they are restored as saved and then reset to zero. DiLoCo's
        per-replica parameters cannot be re-split: that restore is refused with a clear error.
        Returns (target, data size of the checkpoint when it differs from this mesh's, else
        None)."""
        s, ckpt = self.setup, self.checkpointer
        target = s.abstract_state
        bound = "comm" in target or s.per_replica_params
        steps = ckpt.committed_steps() if bound and s.cfg.ckpt.restore != "none" else []
        if not steps:
            return target, None
        step = int(s.cfg.ckpt.restore) if s.cfg.ckpt.restore.isdigit() else steps[-1]
        old = MeshSpec.parse(ckpt.read_meta(step)["mesh"]).data
        if old == s.mesh.shape["data"]:
            return target, None
        if s.per_replica_params:
            raise ValueError(
                f"this DiLoCo checkpoint holds {old} replicas but the mesh has data="
                f"{s.mesh.shape['data']}; restore it with the same data-axis size"
            )
        replicated = NamedSharding(s.mesh, PartitionSpec())
        comm = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((old, *x.shape[1:]), x.dtype, sharding=replicated),
            target["comm"],
        )
        return {**target, "comm": comm}, old

    def started_from(self, restored: Restored | None, state: dict) -> None:
        pass

    def warm_up(self) -> None:
        pass

    def warm_behind(self) -> None:
        # the checksum program compiled (or loaded) while the first steps run: not in a
        # restart's way (a restore from this tier that checks its replicas compiles it first),
        # nor in the first save's unless that comes before it is ready (the save then waits)
        self.checkpointer.warm_up(self.setup.abstract_state)

    def ready(self) -> None:
        pass

    def close(self, *, complete: bool, failed: bool) -> None:
        self.checkpointer.close()

    def due(self, step: int) -> bool:
        last = self.setup.cfg.train.steps
        return self.checkpointer.due(step) or (step == last and self.setup.cfg.ckpt.every > 0)

    def save(self, step: int, state: dict, *, force: bool = False) -> None:
        check_replicas(self.setup.run, self.setup.mesh, state, "save")
        self.checkpointer.save(step, state, force=force)


class LocalSnapshotTier:
    """The local snapshot tier (node RAM) with its peer copies: `local` or `peer` restores."""

    name = "local"

    def __init__(self, setup: TierSetup):
        cfg = setup.cfg
        self.setup = setup
        binding = {"config_hash": config_hash(cfg), "mesh": setup.mesh_text}
        self.snapshots = local_tier.LocalTier(
            setup.run, setup.abstract_state, every=cfg.ckpt.local_every, binding=binding,
            root=local_tier.default_root(cfg.ckpt.local_dir), before_commit=setup.before_snapshot,
        )  # fmt: skip
        self.fallback: dict | None = None  # snapshots were there but none was used

    def newest_step(self) -> int | None:
        return None  # the fastest tier: nothing waits on it

    def restore(self, floor: int | None, attempt: Attempt) -> Restored | None:
        s, tier = self.setup, self.snapshots
        if s.cfg.ckpt.restore != "latest":
            tier.restore(-1)  # meets the peers; an explicit step or a fresh start
            return None
        got = tier.restore(floor)
        if got is None:
            self.fallback = tier.fallback
            return None
        state, info = got
        if info["replicas_differ"]:  # (compared by the tier: each block's CRC on every process)
            s.run.event(WorkerEvent.SNAPSHOT_REJECTED, step=info["step"], tier=info["tier"],
                        reason="data-parallel replicas differ")  # fmt: skip
            attempt.rejected += [*info["skipped"], info["step"]]
            tier.discard()
            self.fallback = {"skipped": list(attempt.rejected), "incomplete": []}
            return None
        s.run.event(
            WorkerEvent.RESTORE, step=info["step"], tier=info["tier"], from_mesh=s.mesh_text,
            to_mesh=s.mesh_text, from_nproc=jax.process_count(), to_nproc=jax.process_count(),
            fetched=info["fetched"], local_skipped=info["skipped"],
        )  # fmt: skip
        return Restored(state, info["step"], info["tier"])

    def started_from(self, restored: Restored | None, state: dict) -> None:
        if restored is not None and restored.tier in ("local", "peer"):
            return
        step = int(state["step"])
        if self.fallback is not None:
            self._announce_fallback("persistent" if restored else "init", step)
        self.snapshots.forget_except(step)  # other steps are another timeline

    def _announce_fallback(self, source: str, step: int) -> None:
        """Local snapshots were there but none could be used: never a silent step back."""
        run, fallback = self.setup.run, self.fallback
        unusable = fallback.get("unusable", [])
        run.event(WorkerEvent.LOCAL_FALLBACK, to=source, step=step, skipped=fallback["skipped"],
                  incomplete=fallback["incomplete"], unusable=unusable)  # fmt: skip
        if run.is_writer:
            why = []
            if fallback["skipped"]:
                why.append(f"step(s) {fallback['skipped']} rejected (see snapshot_rejected)")
            if fallback["incomplete"]:
                why.append(f"step(s) {fallback['incomplete']} not held for every process")
            if unusable:
                u = unusable[0]
                at = "" if u.get("step") is None else f" of step {u['step']}"
                more = f" and {len(unusable) - 1} more" if len(unusable) > 1 else ""
                why.append(f"process {u.get('process')}'s snapshot{at}: {u.get('why')}{more}")
            to = f"the persistent checkpoint of step {step}" if source == "persistent" else "step 0"
            say(f"warning: no local snapshot usable ({'; '.join(why)}); restarting from {to}")

    def warm_up(self) -> None:
        self.snapshots.warm_up()  # the on-device copy program (a snapshot may follow step 1)

    def warm_behind(self) -> None:
        pass

    def ready(self) -> None:
        self.setup.run.event(WorkerEvent.LOCAL_TIER, **self.snapshots.describe())

    def close(self, *, complete: bool, failed: bool) -> None:
        # a finished run's final state is in a persistent checkpoint
        self.snapshots.close(complete=complete, failed=failed)
        if not failed:
            stats = vars(self.snapshots.stats)
            self.setup.run.event(WorkerEvent.LOCAL_TIER_STATS, all_processes=True, **stats)

    def due(self, step: int) -> bool:
        return self.snapshots.due(step)

    def save(self, step: int, state: dict) -> None:
        self.snapshots.offer(step, state)  # a copy off the device, written in the background


def local_snapshots(setup: TierSetup) -> LocalSnapshotTier | None:
    return LocalSnapshotTier(setup) if setup.cfg.ckpt.local_every != 0 else None


# Fastest first; the last one is always there (the persistent checkpoints).
TIERS: list[Callable[[TierSetup], Any]] = [local_snapshots, PersistentTier]


def build_tiers(setup: TierSetup) -> list[Tier]:
    tiers = [t for t in (build(setup) for build in TIERS) if t is not None]
    assert tiers and tiers[-1].name == "persistent", "the persistent tier comes last"
    return tiers


def restore_newest(tiers: list[Tier], init: Callable[[], dict]) -> tuple[dict, Restored | None]:
    """The newest usable state of the tiers (fastest first: a tie goes to the faster tier), else
    `init()`; every tier is told where the run starts from."""
    attempt = Attempt()
    restored = None
    for i, tier in enumerate(tiers):
        behind = [n for n in (t.newest_step() for t in tiers[i + 1 :]) if n is not None]
        restored = tier.restore(max(behind) if behind else None, attempt)
        if restored is not None:
            break
    state = restored.state if restored is not None else init()
    for tier in tiers:
        tier.started_from(restored, state)
    return state, restored
