"""`jaxpar launch`: start the workers, watch them, restart the group, shrink it, keep the ledger.

    jaxpar launch --nproc 4 --devices-per-proc 2 --run-dir runs/x -- python -m train --steps 200

One agent per host. With --nnodes > 1 the agent of --node-rank 0 leads: it owns the policy and
writes the supervisor events; the others run their own command line as local workers when it
says so, over an authenticated TCP channel at --coordinator HOST:PORT, and report every worker
exit. A failure anywhere restarts the whole job. The run directory must be shared (as Orbax
checkpoints require). Workers get the environment described in jaxpar/worker/bootstrap.py; the summary is
jaxpar/rundir/goodput.py's.

Elastic shrink (a `fault_injected` with `permanent`, or a lost agent): the job continues on the
largest process count >= --min-nproc that the global batch (RUN_DIR/config.json) divides, with
the mesh's batch axes (jaxpar.engine.mesh.BATCH_AXES) shrunk and more gradient-accumulation
microbatches so that each device keeps its rows per microbatch. The layout reaches the workers in
their environment (JAXPAR_MESH, JAXPAR_MICROBATCHES), which the training loop applies over its
command line, so any entrypoint can be shrunk.

The pieces (none imports jax):

    options    Options, their validation, the console voice
    policy     pure decisions: exit causes, root cause, backoff, crash loop, shrink, stragglers,
               the worker environment
    monitor    heartbeats, the events tail, the hang decision, the step in progress
    group      this host's workers and hot spares; wake-ups on child exit (pidfd)
    standby    this host's standby group: the next group's workers, started ahead
    transport  the agents' authenticated control channel: leader rendezvous, remote nodes,
               the follower agent
    incarnation  one group on every node: spawn, watch, record the failure, stop the survivors
    loop       the leader's restart loop: restart, back off, give up or shrink
"""

from __future__ import annotations

from jaxpar.engine.mesh import mesh_text
from jaxpar.supervisor.channel import Channel
from jaxpar.supervisor.group import LocalGroup, LocalNode, Wakeup
from jaxpar.supervisor.loop import Supervisor
from jaxpar.supervisor.monitor import EventTail, Heartbeats, Monitor
from jaxpar.supervisor.options import Options, check_options, free_port, say, split_address
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
    return Supervisor(opts).run()
