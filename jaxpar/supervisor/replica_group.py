"""One replica group's workers on this host (`jaxpar launch --groups R`): process k of the group
is jax process k of its own world, told the hub's address and the job's group key. Used by the
leader's supervisor (jaxpar/supervisor/replicas.py) for its own groups and by another host's
agent (jaxpar/supervisor/group_hosts.py) for that host's."""

from __future__ import annotations

import os

from jaxpar.rundir import runlog
from jaxpar.supervisor.group import LocalGroup
from jaxpar.supervisor.options import Options
from jaxpar.supervisor.policy import worker_env
from jaxpar.worker import group_wire


class ReplicaGroup(LocalGroup):
    """One replica group's workers: process k of the group is jax process k of its own world."""

    def __init__(self, opts: Options, waker, group: int, hub: str, key: bytes,
                 groups: int | None = None, host_offset: int = 0):  # fmt: skip
        super().__init__(opts, waker)
        self.group, self.hub, self.key = group, hub, key
        self.n_groups = groups or opts.groups
        self.host_offset = host_offset  # the global id of this host's first process
        self.t_spawn = 0.0  # when its current processes were started (the supervisor's clock)
        self._told = None  # the standby group last reported ready

    def finished(self) -> bool:
        """Every process of its current start exited with 0."""
        return bool(self.procs) and not self.alive() and all(
            p.returncode == 0 for p in self.procs.values()
        )  # fmt: skip

    def _standby_here(self) -> bool:
        return True  # a replica group's world is on its own host: a standby on any host

    def world_bind(self) -> str:
        """Where this group's coordinator listens, its standby's too: the group's world is on
        this host, so on loopback (on one host the job's bind is loopback too)."""
        return self.opts.bind if self.opts.nnodes == 1 else "127.0.0.1"

    def _standby_bind(self) -> str:
        return self.world_bind()

    def mark_stepping(self) -> None:
        """The group stepped in a quorum: its spares and standby group may be built now."""
        self.seen |= {runlog.WorkerEvent.START, runlog.WorkerEvent.COMPILED}
        self.stepping = True

    def standby_news(self) -> bool:
        """True once for each standby group of this group, when it is ready."""
        if self.standby is None or self.standby is self._told or not self.standby_ready():
            return False
        self._told = self.standby
        return True

    def _env(self, spec: dict, pid: int, local_rank: int) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k != "JAXPAR_LAUNCH_TOKEN"}
        env = worker_env(
            base, coordinator=spec["coordinator"], bind=spec["bind"], nproc=spec["nproc"],
            process_id=local_rank, local_rank=pid - self.host_offset,
            devices_per_proc=self.opts.devices_per_proc,
            run_dir=self.opts.run_dir, incarnation=spec["incarnation"],
            faults=spec.get("faults", self.opts.faults),
            heartbeat_timeout=spec["collective_timeout"],
            collective_timeout=spec["collective_timeout"], run_lock=spec.get("run_lock"),
        )  # fmt: skip
        env.update({
            group_wire.ENV_GROUP: str(self.group), group_wire.ENV_GROUPS: str(self.n_groups),
            group_wire.ENV_GLOBAL_PROCESS: str(pid), group_wire.ENV_HUB: self.hub,
            group_wire.ENV_KEY: self.key.hex(),
            group_wire.ENV_TIDY: "1" if spec.get("tidy") else "0",
        })  # fmt: skip
        return env


__all__ = ["ReplicaGroup"]
