"""A worker of one replica group (`jaxpar launch --groups R`): its share of the global batch,
and each step's gradients averaged with process k of the other groups through the leader's
group hub (jaxpar/supervisor/replicas.py) over the authenticated wire of
jaxpar/worker/group_wire.py.

Each group is its own jax.distributed world with its own mesh; across groups the training is
data parallel. A step runs in two compiled halves around the host average:

    loss, aux, grads, extra = gradients(state, batch)    # inside the group, any layout
    loss, aux, grads = hub.average(step, ...)             # this process's shards, quorum's mean
    state, metrics = update(state, loss, aux, grads, extra)   # the optimizer step, in the group

Process k of every group holds the same shards (the groups run one command, so one layout),
so the average is shard by shard on host memory. The hub releases a step's average to every
process of the quorum at once, so all processes of a group apply the same quorum. A group that
(re)starts while the others train receives their state, shard to shard, checksummed.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

import jax
import numpy as np

from jaxpar.config import TrainConfig
from jaxpar.worker import group_wire
from jaxpar.worker.group_wire import WireError


def active() -> bool:
    return group_wire.group_env() is not None


def tidies_checkpoints() -> bool:
    """Whether this process may remove unfinished checkpoint saves when it starts: always outside
    groups; in groups only when no other group ran as this one started (a group restarted beside
    live ones would delete the save they have in flight)."""
    return not active() or os.environ.get(group_wire.ENV_TIDY) == "1"


def group_count() -> int:
    env = group_wire.group_env()
    return env["groups"] if env else 1


def group_cfg(cfg: TrainConfig) -> TrainConfig:
    """The config one group's program is built for: its share of the global batch."""
    r = group_count()
    if r == 1:
        return cfg
    if cfg.data.global_batch % r:
        raise ValueError(
            f"data.global_batch={cfg.data.global_batch} is not divisible by --groups {r}; set "
            f"--set data.global_batch to a multiple of {r}"
        )
    data = dataclasses.replace(cfg.data, global_batch=cfg.data.global_batch // r)
    ckpt = dataclasses.replace(cfg.ckpt, local_every=0)  # the peer group holds the live state
    return dataclasses.replace(cfg, data=data, ckpt=ckpt)


def batch_rows() -> tuple[int, int]:
    """(process index, process count) of this process's rows in the job's global batch."""
    env = group_wire.group_env()
    if env is None:
        return jax.process_index(), jax.process_count()
    p = jax.process_count()
    return env["group"] * p + jax.process_index(), env["groups"] * p


def run_process_index(leads: bool = False) -> int:
    """This process's index in the run directory: group * P + process id, or the process id
    alone while its group `leads` (the quorum's lowest: its process 0 writes the records)."""
    value = os.environ.get(group_wire.ENV_GLOBAL_PROCESS)
    return int(value) if value and not leads else jax.process_index()


# ---- a leaf's shards on this process -------------------------------------------------------------


def local_shards(x: jax.Array) -> list[np.ndarray]:
    """This process's shards of `x` (a copy per addressable device), in device-id order."""
    shards = sorted(x.addressable_shards, key=lambda sh: sh.device.id)
    return [np.asarray(sh.data) for sh in shards]


def from_shards(like: jax.Array, pieces: list[np.ndarray]) -> jax.Array:
    """An array with `like`'s shape and sharding made of this process's `pieces` (local_shards)."""
    shards = sorted(like.addressable_shards, key=lambda sh: sh.device.id)
    if len(shards) != len(pieces):
        raise WireError(f"{len(pieces)} shards for an array with {len(shards)} here")
    arrays = []
    for sh, a in zip(shards, pieces, strict=True):
        if tuple(a.shape) != tuple(sh.data.shape) or a.dtype != sh.data.dtype:
            raise WireError(
                f"a shard of shape {a.shape} {a.dtype} for one of {sh.data.shape} {sh.data.dtype}"
            )
        arrays.append(jax.device_put(a, sh.device))
    return jax.make_array_from_single_device_arrays(like.shape, like.sharding, arrays)


def tree_to_wire(tree: Any) -> tuple[list[np.ndarray], list[int]]:
    """All local shards of `tree`'s leaves, flat, and how many belong to each leaf."""
    flat, counts = [], []
    for leaf in jax.tree.leaves(tree):
        pieces = local_shards(leaf)
        flat += pieces
        counts.append(len(pieces))
    return flat, counts


def tree_from_wire(like: Any, flat: list[np.ndarray], counts: list[int]) -> Any:
    leaves, treedef = jax.tree.flatten(like)
    if len(counts) != len(leaves) or sum(counts) != len(flat):
        raise WireError("the arrays received do not match this state's structure")
    out, at = [], 0
    for leaf, n in zip(leaves, counts, strict=True):
        out.append(from_shards(leaf, flat[at : at + n]))
        at += n
    return jax.tree.unflatten(treedef, out)


# ---- the link to the hub ------------------------------------------------------------------------


def compile_halves(program, abstract_batch: dict) -> tuple[tuple, float]:
    """The group's step programs, compiled ahead of the first step through the compiled-program
    cache (a restarted group loads them): ((gradients, update), seconds); with DiLoCo
    (`comm.diloco_inner_steps`) ((inner step, (replica mean, outer step)), seconds): the inner
    steps stay inside the group and only the outer step's mean crosses groups."""
    from jaxpar.recovery import compile_cache

    t0 = time.time()
    parts, shardings = program.parts, program.state_shardings
    state = program.abstract_state
    if program.sync_every:  # DiLoCo
        inner = program.train_step.lower(state, abstract_batch)
        mean = jax.jit(parts.replica_mean).lower(state)
        mean_c, _ = compile_cache.compile(mean, "group_replica_mean")
        abstract_mean = _with_shardings(jax.eval_shape(parts.replica_mean, state), mean_c)
        outer = jax.jit(parts.outer_step, out_shardings=shardings, donate_argnums=0)
        outer_c, _ = compile_cache.compile(outer.lower(state, abstract_mean), "group_outer")
        step_c, _ = compile_cache.compile(inner, "train_step")
        return (step_c, (mean_c, outer_c)), time.time() - t0

    def gradients(state, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        return parts.state_gradients(state, batch, key)

    grads, _ = compile_cache.compile(
        jax.jit(gradients).lower(state, abstract_batch), "group_gradients"
    )
    outs = _with_shardings(jax.eval_shape(gradients, state, abstract_batch), grads)
    update = jax.jit(parts.update, out_shardings=(shardings, None), donate_argnums=0)
    return (grads, compile_cache.compile(update.lower(state, *outs), "group_update")[0]), (
        time.time() - t0
    )


def _with_shardings(abstract, compiled):
    """`abstract` (eval_shape's output) with the shardings `compiled` gives its outputs."""
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        abstract, compiled.output_shardings,
    )  # fmt: skip


class GroupLink:
    """This process's connection to the group hub, and the group's step programs
    (`compile_halves`)."""

    def __init__(self, programs: tuple, sync_every: int = 0, run=None):
        """`programs` from compile_halves; `sync_every`: DiLoCo's H (0: average every step);
        `run`: the RunDir whose process index follows the lead (the quorum's lowest group's
        process 0 writes the records)."""
        env = group_wire.group_env()
        assert env is not None
        self.group, self.groups = env["group"], env["groups"]
        self.rank = jax.process_index()
        host, _, port = env["hub"].rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=60)
        hello = {"group": self.group, "rank": self.rank, "nproc": jax.process_count(),
                 "pid": os.getpid()}  # fmt: skip
        self.wire = group_wire.client_handshake(sock, env["key"], hello)
        self.quorum: list[int] = []
        self.leads = self.group == 0  # this group is the quorum's lowest: it writes the records
        self.sync_every, self.run = sync_every, run
        self.diloco = sync_every > 0
        self.inner = programs[0] if self.diloco else None  # DiLoCo: the group's own inner step
        self._first, self._second = programs if not self.diloco else programs[1]

    def join(self, state: dict) -> dict:
        """Tell the hub this group is ready at `state`'s step; returns the state to train from:
        `state` itself at the job's start, else a live group's, received shard to shard (with
        DiLoCo: the state before an outer step, which this group then takes with the others)."""
        self.wire.send({"kind": "ready", "step": int(state["step"])})
        header, arrays = self._recv()
        self.quorum = [int(g) for g in header.get("quorum", [])]
        self.leads = bool(self.quorum) and self.group == min(self.quorum)
        if header.get("kind") == "start":
            return state
        if header.get("kind") != "state":
            raise WireError(f"expected the group's state, got {str(header.get('kind'))[:40]}")
        if group_wire.checksum(arrays) != header.get("checksum"):
            raise WireError("the state received does not match its checksum")
        state = tree_from_wire(state, arrays, header.get("counts", []))
        if self.diloco:  # the outer step the donor waits in: its mean, without one of ours
            mean = self._first(state)
            self.wire.send({"kind": "listen", "step": int(header["step"])})
            return self._second(state, self._averaged(mean, int(header["step"]), state)[0])
        return state

    def _recv(self) -> tuple[dict, list[np.ndarray]]:
        header, arrays = self.wire.recv()
        if header.get("kind") == "stop":
            raise WireError(f"the group hub stopped this group: {str(header.get('why'))[:200]}")
        return header, arrays

    def _average(self, tree, step: int, state: dict):
        """`tree` (this process's shards) sent for `step`; the quorum's mean returned."""
        flat, counts = tree_to_wire(tree)
        self.wire.send({"kind": "average", "step": step, "counts": counts}, flat)
        return self._averaged(tree, step, state)

    def _averaged(self, like, step: int, state: dict):
        header, arrays = self._recv()
        while header.get("kind") == "give_state":  # a restarted group joins at this step
            self.send_state(state, step)
            header, arrays = self._recv()
        if header.get("kind") != "averaged" or header.get("step") != step:
            raise WireError(f"expected the average of step {step}, got {str(header)[:80]}")
        self.quorum = [int(g) for g in header.get("quorum", [])]
        self.leads = bool(self.quorum) and self.group == min(self.quorum)
        leaves = jax.tree.leaves(like)
        return tree_from_wire(like, arrays, [len(x.addressable_shards) for x in leaves]), header

    def train_step(self, state: dict, batch: dict) -> tuple[dict, dict]:
        """The group's train step (state, batch) -> (state, metrics), as `Job.train_step`: one
        averaged step, or a DiLoCo inner step followed, every H steps, by the outer step."""
        step = int(state["step"])
        if self.diloco:
            state, m = self.inner(state, batch)
            if (step + 1) % self.sync_every == 0:
                state = self.sync(state, step)
        else:
            state, m = self.step(state, batch, step)
        if self.run is not None:
            self.run.process_index = run_process_index(leads=self.leads)
        return state, m

    def step(self, state: dict, batch: dict, step: int) -> tuple[dict, dict]:
        """One optimizer step: this group's gradients, the quorum's average, the update."""
        loss, aux, grads, extra = self._first(state, batch)
        (loss, aux, grads), _ = self._average((loss, aux, grads), step, state)
        return self._second(state, loss, aux, grads, extra)

    def sync(self, state: dict, step: int) -> dict:
        """DiLoCo's outer step after inner step `step`: the replicas' mean averaged across the
        quorum's groups, then the outer update (the same on every group)."""
        mean, _ = self._average(self._first(state), step, state)
        return self._second(state, mean)

    def send_state(self, state: dict, step: int) -> None:
        """Give a joining group this process's shards of `state` (through the hub): the state
        waiting for the average of `step`."""
        flat, counts = tree_to_wire(state)
        header = {"kind": "state", "step": step, "counts": counts,
                  "checksum": group_wire.checksum(flat)}  # fmt: skip
        self.wire.send(header, flat)

    def close(self, complete: bool) -> None:
        if complete:
            try:
                self.wire.send({"kind": "bye"})
            except OSError:
                pass
        self.wire.close()
