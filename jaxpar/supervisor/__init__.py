"""`jaxpar launch`: start the workers, watch them, restart the group, shrink it, keep the ledger.

    jaxpar launch --nproc 4 --devices-per-proc 2 --run-dir runs/x -- python -m train --steps 200

One agent per host; no module of this package imports jax. Design: docs/design.md, "Supervisor
and worker" (the pieces, shrink, hangs, the control channel); deployments: docs/cluster.md.
"""

from __future__ import annotations

from jaxpar.engine.mesh import mesh_text
from jaxpar.supervisor.channel import Channel
from jaxpar.supervisor.group import LocalGroup, LocalNode, Wakeup
from jaxpar.supervisor.loop import Supervisor
from jaxpar.supervisor.monitor import EventTail, Heartbeats, Monitor
from jaxpar.supervisor.options import (
    Options,
    announce_binds,
    check_options,
    free_port,
    say,
    split_address,
)
from jaxpar.supervisor.policy import (
    THREAD_FLAGS,
    CrashLoop,
    Outcome,
    backoff_s,
    classify_exit,
    find_stragglers,
    root_exit,
    shrink_plan,
    worker_env,
)
from jaxpar.supervisor.transport import RemoteNode, run_follower

__all__ = [
    "THREAD_FLAGS",
    "Channel",
    "CrashLoop",
    "EventTail",
    "Heartbeats",
    "LocalGroup",
    "LocalNode",
    "Monitor",
    "Options",
    "Outcome",
    "RemoteNode",
    "Supervisor",
    "Wakeup",
    "backoff_s",
    "check_options",
    "classify_exit",
    "find_stragglers",
    "free_port",
    "main",
    "mesh_text",
    "root_exit",
    "run_follower",
    "say",
    "shrink_plan",
    "split_address",
    "worker_env",
]


def main(opts: Options) -> int:
    """`jaxpar launch`: lead the job (node rank 0) or follow the leader."""
    if opts.nnodes > 1 and opts.node_rank != 0:
        return run_follower(opts)
    announce_binds(opts)
    if opts.groups > 1:
        from jaxpar.supervisor.replicas import run_groups

        return run_groups(opts)
    return Supervisor(opts).run()
