"""A worker of one replica group (`jaxpar launch --groups R`): its share of the global batch,
and each step's gradients averaged with the other groups through the leader's group hub
(jaxpar/supervisor/replicas.py) over the authenticated wire of jaxpar/worker/group_wire.py.

Each group is its own jax.distributed world with its own mesh; across groups the training is
data parallel. A step runs in two compiled halves around the host average:

    loss, aux, grads, extra = gradients(state, batch)    # inside the group, any layout
    loss, aux, grads = hub.average(step, ...)             # the quorum's mean, this process's shards
    state, metrics = update(state, loss, aux, grads, extra)   # the optimizer step, in the group

Each process sends the shards it owns with their global indices (jaxpar/worker/group_layout.py)
and gets back the mean of every shard it holds, so groups of different layouts (meshes, devices
per process) average together. The hub releases a step's average to every process of the quorum
at once, so all processes of a group apply the same quorum. A group that (re)starts while the
others train receives their state, checksummed: shard to shard when the layouts match,
resharded by the hub otherwise.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import queue
import socket
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxpar.config import TrainConfig
from jaxpar.engine.mesh import BATCH_AXES, batch_parallel_size
from jaxpar.worker import group_exchange, group_layout, group_wire
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


def group_cfg(cfg: TrainConfig, mesh: Any = None) -> TrainConfig:
    """The config one group's program is built for: its share of the global batch. `mesh`
    (a group's): its share must also split over the group's batch axes, said in the job's terms."""
    r = group_count()
    if r == 1:
        return cfg
    if cfg.data.global_batch % r:
        raise ValueError(
            f"data.global_batch={cfg.data.global_batch} is not divisible by --groups {r}; set "
            f"--set data.global_batch to a multiple of {r}"
        )
    if mesh is not None:
        ways = batch_parallel_size(mesh)
        share = cfg.data.global_batch // r
        if share % ways:
            raise ValueError(
                f"data.global_batch={cfg.data.global_batch} over --groups {r} is {share} rows "
                f"per group, not divisible by a group's data-parallel size {ways}; set --set "
                f"data.global_batch to a multiple of {r * ways}"
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


# ---- a tree's pieces on this process -------------------------------------------------------------


def _key(index: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shard's index (slices) as the wire's [start0, stop0, ...]."""
    out: list[int] = []
    for d, n in enumerate(shape):
        sl = index[d] if d < len(index) else slice(None)
        start, stop, _ = sl.indices(n)
        out += [start, stop]
    return tuple(out)


@functools.lru_cache(maxsize=8192)
def _leaf_layout(sharding, shape: tuple[int, ...]) -> tuple[list, list, dict]:
    """(the distinct indices of this process's shards in device-id order, those it owns (no
    device of lower id in the group holds the same index), device id -> index)."""
    owner: dict[tuple, int] = {}
    here: dict[int, tuple] = {}
    me = jax.process_index()
    for device, index in sharding.devices_indices_map(shape).items():
        key = _key(index, shape)
        owner[key] = min(owner.get(key, device.id), device.id)
        if device.process_index == me:
            here[device.id] = key
    have = list(dict.fromkeys(here[d] for d in sorted(here)))
    return have, [k for k in have if owner[k] in here], here


@functools.lru_cache(maxsize=8192)
def _holders(sharding, shape: tuple[int, ...]) -> dict:
    """Index -> the processes of the group holding it (sorted): how the peer-to-peer average
    groups a process's shards (jaxpar/worker/group_exchange.py's Plan)."""
    out: dict[tuple, set] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        out.setdefault(_key(index, shape), set()).add(device.process_index)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def tree_pieces(tree: Any, send: str) -> tuple[dict, list[np.ndarray]]:
    """`tree`'s layout header fields and this process's pieces of it to `send`: "owned" (a
    step's average: each group's processes tile every leaf once), "held" (every distinct shard
    it holds: a state transfer) or "none". What it wants back ("need") is every distinct shard
    it holds."""
    shapes, dtypes, pieces, need, arrays = [], [], [], [], []
    for leaf in jax.tree.leaves(tree):
        have, mine, here = _leaf_layout(leaf.sharding, tuple(leaf.shape))
        chosen = {"owned": mine, "held": have, "none": []}[send]
        if chosen:
            data: dict[tuple, Any] = {}
            for sh in leaf.addressable_shards:
                data.setdefault(here[sh.device.id], sh.data)
            arrays += [group_wire.contiguous(data[k]) for k in chosen]
        shapes.append(tuple(leaf.shape))
        dtypes.append(np.dtype(leaf.dtype).name)
        pieces.append(chosen)
        need.append(have)
    return group_layout.fields(shapes, dtypes, pieces, need), arrays


def tree_from_pieces(like: Any, arrays: list[np.ndarray]) -> Any:
    """A tree with `like`'s shapes and shardings made of `arrays`: the distinct shards this
    process holds, leaf by leaf in device-id order (what its messages name as "need")."""
    leaves, treedef = jax.tree.flatten(like)
    out, at = [], 0
    for leaf in leaves:
        have, _, here = _leaf_layout(leaf.sharding, tuple(leaf.shape))
        mine = arrays[at : at + len(have)]
        if len(mine) != len(have):
            raise WireError("fewer arrays received than this state's shards")
        at += len(have)
        shards = []
        for sh in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
            a = mine[have.index(here[sh.device.id])]
            if tuple(a.shape) != tuple(sh.data.shape) or a.dtype != sh.data.dtype:
                raise WireError(f"a shard of shape {a.shape} {a.dtype} for one of "
                                f"{sh.data.shape} {sh.data.dtype}")  # fmt: skip
            shards.append(jax.device_put(a, sh.device))
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards))
    if at != len(arrays):
        raise WireError("more arrays received than this state's shards")
    return jax.tree.unflatten(treedef, out)


# ---- the link to the hub ------------------------------------------------------------------------


def _packed(arrays: list[np.ndarray]) -> np.ndarray:
    """`arrays`' bytes back to back (a copy): a state transfer's buffer."""
    out = np.empty(sum(a.nbytes for a in arrays), np.uint8)
    at = 0
    for a in arrays:
        out[at : at + a.nbytes] = group_wire.contiguous(a).reshape(-1).view(np.uint8)
        at += a.nbytes
    return out


def _unpacked(buffer: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    """Arrays of `like`'s shapes and dtypes read from `buffer` (views)."""
    out, at = [], 0
    for a in like:
        out.append(buffer[at : at + a.nbytes].view(a.dtype).reshape(a.shape))
        at += a.nbytes
    return out


@dataclasses.dataclass
class _Sums:
    """An exchange's end, from its thread: the sums, or why it failed."""

    epoch: Any
    sums: list[np.ndarray] | None
    error: str | None


_ENGINE: list = []


def engine() -> group_exchange.Engine:
    """This process's peer-to-peer engine, started on first use (importing torch and starting its
    store in a thread of its own: `compile_halves` starts it beside the compilation), its store
    on the address this host reaches the hub from."""
    if not _ENGINE:
        host, _, port = group_wire.group_env()["hub"].rpartition(":")
        host = host.strip("[]")
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_DGRAM) as probe:  # fmt: skip
            probe.connect((host, int(port)))  # no packet: the route's local address
            _ENGINE.append(group_exchange.Engine(probe.getsockname()[0]))
        atexit.register(_ENGINE[0].close)  # before the interpreter's teardown (Engine.close)
    return _ENGINE[0]


def compile_halves(program, abstract_batch: dict) -> tuple[tuple, float]:
    """The group's step programs, compiled ahead of the first step through the compiled-program
    cache (a restarted group loads them): ((gradients, update), seconds); with DiLoCo
    (`comm.diloco_inner_steps`) ((inner step, (replica mean, outer step)), seconds): the inner
    steps stay inside the group and only the outer step's mean crosses groups."""
    from jaxpar.recovery import compile_cache

    engine()  # torch's import and the store beside the compilation
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

    spread = _spread_gradients(shardings["params"], state["params"])

    def gradients(state, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        loss, aux, grads, extra = parts.state_gradients(state, batch, key)
        if spread is not None:
            grads = jax.lax.with_sharding_constraint(grads, spread)
        return loss, aux, grads, extra, gradient_screen(grads)

    grads, _ = compile_cache.compile(
        jax.jit(gradients).lower(state, abstract_batch), "group_gradients"
    )
    outs = _with_shardings(jax.eval_shape(gradients, state, abstract_batch), grads)[:4]
    update = jax.jit(parts.update, out_shardings=(shardings, None), donate_argnums=0)
    return (grads, compile_cache.compile(update.lower(state, *outs), "group_update")[0]), (
        time.time() - t0
    )


def gradient_screen(grads) -> tuple:
    """The screen of a gradient tree, computed where the gradients lie (inside the gradient
    program: no host pass over them): per leaf, its largest magnitude m (NaN exactly when the
    leaf holds a NaN or an infinity; 0 for a leaf that is not floating) and r, the sum of the
    squares of its finite values divided by m (at most its size: no square overflows). Two vectors
    (m, r) in float32, or float64 where a leaf is; `screened` reads them."""
    import jax.numpy as jnp

    leaves = jax.tree.leaves(grads)
    floating = [g for g in leaves if jnp.issubdtype(g.dtype, jnp.floating)]
    dtype = jnp.result_type(jnp.float32, *(g.dtype for g in floating))
    ms, rs = [], []
    for g in leaves:
        if not jnp.issubdtype(g.dtype, jnp.floating):
            ms.append(jnp.zeros((), dtype))
            rs.append(jnp.zeros((), dtype))
            continue
        a = jnp.abs(g).astype(dtype)
        finite = jnp.isfinite(a)
        # counted, not carried by the max: a max across devices need not propagate a NaN
        # (XLA CPU's all-reduce drops it)
        odd = jnp.sum(~finite, dtype=jnp.int32)
        a = jnp.where(finite, a, jnp.zeros((), dtype))
        m = jnp.max(a, initial=jnp.zeros((), dtype))
        r = jnp.sum(jnp.square(a / jnp.where(m > 0, m, jnp.ones((), dtype))))
        ms.append(jnp.where(odd > 0, jnp.asarray(jnp.nan, dtype), m))
        rs.append(r)
    if not leaves:
        return jnp.zeros((0,), dtype), jnp.zeros((0,), dtype)
    return jnp.stack(ms), jnp.stack(rs)


def screened(screen: tuple) -> tuple[list[int], float]:
    """(the leaves holding a NaN or an infinity, the sum of squares of the others in float64)
    from gradient_screen's (m, r): each leaf's m²·r."""
    m, r = (np.asarray(x if x.is_fully_addressable else x.addressable_data(0), np.float64)
            for x in screen)  # fmt: skip
    ok = np.isfinite(m)
    return [int(i) for i in np.flatnonzero(~ok)], float(np.sum(m[ok] * m[ok] * r[ok]))


def _spread_gradients(shardings, abstract):
    """Where a group spans several processes: `spread_over_batch` of the gradients' shardings, so
    the group's processes each hold a part of every leaf they would replicate (the CUDA and TPU
    compilers reduce them with a reduce-scatter; XLA's CPU backend all-reduces and slices), and
    each process sums only its part with the other groups (group_exchange: its own bytes, none
    twice); the update gathers what it needs. None for a group of one process (nothing to split
    across processes)."""
    return spread_over_batch(shardings, abstract) if jax.process_count() > 1 else None


def spread_over_batch(shardings, abstract):
    """`shardings` with each leaf also split over the batch axes it is replicated on (their
    product, on its first dimension they divide that is not split yet); None when no leaf
    changes (no batch axis of size > 1 free, or no dimension it divides)."""
    spread = []

    def one(sharding, leaf):
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return sharding
        mesh, spec = sharding.mesh, list(sharding.spec)
        used = {a for entry in spec if entry is not None
                for a in (entry if isinstance(entry, tuple) else (entry,))}  # fmt: skip
        free = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1 and a not in used)
        ways = int(np.prod([mesh.shape[a] for a in free])) if free else 1
        if ways == 1:
            return sharding
        spec += [None] * (len(leaf.shape) - len(spec))
        for d, n in enumerate(leaf.shape):
            if spec[d] is None and n % ways == 0:
                spec[d] = free if len(free) > 1 else free[0]
                spread.append(d)
                return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return sharding

    out = jax.tree.map(one, shardings, abstract)
    return out if spread else None


def _with_shardings(abstract, compiled):
    """`abstract` (eval_shape's output) with the shardings `compiled` gives its outputs."""
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        abstract, compiled.output_shardings,
    )  # fmt: skip


class GroupLink:
    """This process's connection to the group hub, and the group's step programs
    (`compile_halves`).

    A reader thread takes every frame from the hub. It answers a `give_state` (a group joins at
    the step this process computes) itself, from the state that step started from, which does
    not change until the step's update; the rest goes to the training thread. So a donor gives
    its state while it computes the step, and the joining group computes the same step beside
    it."""

    def __init__(self, programs: tuple, sync_every: int = 0, run=None, faults=None):
        """`programs` from compile_halves; `sync_every`: DiLoCo's H (0: average every step);
        `run`: the RunDir whose process index follows the lead (the quorum's lowest group's
        process 0 writes the records); `faults`: this process's injected faults (`killgive`,
        `killavg`)."""
        env = group_wire.group_env()
        assert env is not None
        self.group, self.groups = env["group"], env["groups"]
        self.rank = jax.process_index()
        host, _, port = env["hub"].rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=60)
        hello = {"group": self.group, "rank": self.rank, "nproc": jax.process_count(),
                 "pid": os.getpid()}  # fmt: skip
        self.wire = group_wire.client_handshake(sock, env["key"], hello)
        self.engine = engine()  # the peer-to-peer average (jaxpar[gloo]), started already
        self._plans: dict = {}
        self._inbox: queue.Queue = queue.Queue()
        # (step, state) of the step this process computes, until its update takes the state
        self._current: tuple[int, dict] | None = None
        self._current_cv = threading.Condition()
        self._closed = False
        self.quorum: list[int] = []
        self.leads = self.group == 0  # this group is the quorum's lowest: it writes the records
        self.sync_every, self.run, self.faults = sync_every, run, faults
        self.diloco = sync_every > 0
        self.inner = programs[0] if self.diloco else None  # DiLoCo: the group's own inner step
        self._first, self._second = programs if not self.diloco else programs[1]
        threading.Thread(target=self._read, daemon=True, name="jaxpar-group-link").start()

    def join(self, state: dict) -> dict:
        """Tell the hub this group is ready at `state`'s step; returns the state to train from:
        `state` itself at the job's start, else a live group's, received shard to shard (with
        DiLoCo: the state before an outer step, which this group then takes with the others)."""
        fields, _ = tree_pieces(state, "none")  # the shards this process wants of a peer's state
        # what the hub's frames may carry: the state, or gradients and metrics
        self.wire.limit = group_wire.carried(
            group_layout.nbytes(fields["shapes"], fields["dtypes"])
        )
        ready = {"kind": "ready", "step": int(state["step"]), "sync_every": self.sync_every}
        store = self.engine.ready()
        ready.update({"p2p": store} if store else {"p2p_missing": str(self.engine.missing)[:300]})
        self.wire.send({**ready, **fields})
        header, arrays = self._recv()
        if header.get("kind") == "receive_state":  # peer to peer from the donor's process
            _, mine = tree_pieces(state, "held")  # what comes: the shards this process holds
            buffer = np.empty(sum(a.nbytes for a in mine), np.uint8)
            try:
                self.engine.transfer(header, buffer)
            except Exception as e:  # noqa: BLE001 - this group is restarted
                raise WireError(f"the state transfer from group {header.get('donor')} failed "
                                f"({type(e).__name__}: {e})") from e  # fmt: skip
            arrays = _unpacked(buffer, mine)
            header, _ = self._recv()  # the donor's checksum, through the hub
            if header.get("kind") != "state" or not header.get("p2p"):
                raise WireError(f"expected the state's checksum, got {str(header)[:80]}")
        self.quorum = [int(g) for g in header.get("quorum", [])]
        self.leads = bool(self.quorum) and self.group == min(self.quorum)
        if header.get("kind") == "start":
            return state
        if header.get("kind") != "state":
            raise WireError(f"expected the group's state, got {str(header.get('kind'))[:40]}")
        if group_wire.checksum(arrays) != header.get("checksum"):
            raise WireError("the state received does not match its checksum")
        state = tree_from_pieces(state, arrays)
        if self.diloco:  # the outer step the donor waits in: its mean, without one of ours
            step = int(header["step"])
            self._computing(step, state)  # a group joining after this one may ask for it
            mean = self._first(state)
            fields, _ = tree_pieces(mean, "none")
            self.wire.send({"kind": "listen", "step": step, **fields})
            mean = self._averaged(mean, step)[0]
            self._computing(None)
            return self._second(state, mean)
        return state

    def _read(self) -> None:
        """The reader thread: a `give_state` answered by a thread of its own, every other frame to
        `_recv`."""
        try:
            while True:
                header, arrays = self.wire.recv()
                if header.get("kind") == "give_state":  # answered beside the reading
                    step, spec = int(header.get("step", -1)), header.get("p2p")
                    threading.Thread(target=self._give, args=(step, spec), daemon=True).start()
                else:
                    self._inbox.put((header, arrays))
        except Exception as e:  # noqa: BLE001 - the training thread raises it as WireError
            self._inbox.put(e)

    def _give(self, step: int, spec: dict | None = None) -> None:
        """Send the hub this process's shards of the state `step` started from, once this
        process computes `step` (it may still be in the update of the step before). A step
        already behind it means the joining group was dropped: nothing is sent. With `spec`
        (the hub's, when the joining process holds the same shards and both have the engine)
        the shards go peer to peer to it, and only their checksum through the hub."""
        with self._current_cv:
            while not self._closed and (self._current is None or self._current[0] < step):
                self._current_cv.wait(1.0)
            if self._closed or self._current[0] != step:
                return
            if self.faults is not None:
                self.faults.before_give(step)
            # under the lock: the update, which takes (donates) the state, waits for the copy
            fields, arrays = tree_pieces(self._current[1], "held")
            if spec is not None:
                buffer = _packed(arrays)
        if spec is None:
            header = {"kind": "state", "step": step, **fields,
                      "checksum": group_wire.checksum(arrays)}  # fmt: skip
            self.wire.send(header, arrays)
            return
        reply = {"kind": "state_sent", "step": step,
                 "checksum": group_wire.checksum(_unpacked(buffer, arrays))}  # fmt: skip
        try:
            self.engine.transfer({**spec, "rank": 0}, buffer)
        except Exception as e:  # noqa: BLE001 - said to the hub, which voids the transfer
            reply = {"kind": "state_sent", "step": step, "error": f"{type(e).__name__}: {e}"[:300]}
        self.wire.send(reply)

    def _computing(self, step: int | None, state: dict | None = None) -> None:
        """Publish the step this process computes from `state` (None: its update takes it)."""
        with self._current_cv:
            self._current = None if step is None else (step, state)
            self._current_cv.notify_all()

    def _recv(self, sums: bool = False) -> tuple[dict, list[np.ndarray]]:
        """The next frame from the hub (with `sums`: or an exchange's end, a `_Sums`)."""
        item = self._inbox.get()
        while isinstance(item, _Sums) and not sums:  # an exchange given up, ending late
            item = self._inbox.get()
        if isinstance(item, _Sums):
            return item
        if isinstance(item, Exception):
            self._inbox.put(item)  # every later call fails the same way
            raise WireError(f"the connection to the group hub failed ({item})")
        header, arrays = item
        if header.get("kind") == "stop":
            raise WireError(f"the group hub stopped this group: {str(header.get('why'))[:200]}")
        return header, arrays

    def _average(self, tree, step: int, parts: tuple[str, ...] = (), screen=None):
        """`tree` (this process's shards) sent for `step`; the quorum's mean returned. `parts`
        names the parts of a tuple `tree` (the hub names what it refuses by them); `screen`:
        gradient_screen of its "gradients" part, computed on the devices."""
        names = [[n, len(jax.tree.leaves(t))] for n, t in zip(parts, tree, strict=True)] \
            if parts else []  # fmt: skip
        fields: dict = {}
        if self.engine.address is not None:
            plan = self._plan(jax.tree.leaves(tree))
            if plan.usable:
                out = self._exchange(tree, step, names, screen)
                if out is not None:
                    return out
            else:  # the hub says why the step goes through it
                fields["p2p_missing"] = plan.why_not
        more, arrays = tree_pieces(tree, "owned")
        fields.update(more)
        if parts:
            fields["parts"] = names
        self.wire.send({"kind": "average", "step": step, **fields}, arrays)
        if self.faults is not None:
            self.faults.inside_average(step)
        return self._averaged(tree, step)

    def _plan(self, leaves: list) -> group_exchange.Plan:
        """How this process's held shards of a tree of `leaves` are summed (cached per layout)."""
        key = tuple((leaf.sharding, tuple(leaf.shape), np.dtype(leaf.dtype).name)
                    for leaf in leaves)  # fmt: skip
        plan = self._plans.get(key)
        if plan is None:
            keys, held_by = [], []
            for sharding, shape, _ in key:
                keys.append(_leaf_layout(sharding, shape)[0])
                held_by.append(_holders(sharding, shape))
            plan = self._plans[key] = group_exchange.Plan(
                keys, held_by, [k[2] for k in key], [k[1] for k in key]
            )
        return plan

    def _exchange(self, tree, step: int, names: list, screen=None):
        """`step`'s average peer to peer: this process's report (its non-finite leaves and sum of
        squares) to the hub, then the sums of its held shards over each exchange the hub names,
        until the hub commits one (`averaged`, no arrays: every member's sums succeeded); None
        when the hub asks for the shards instead (the hub path).

        With `screen` (gradient_screen of the gradients, whole leaves, the same on every process
        of the group) the gradients are not read on the host for the report: every process names
        the non-finite leaves, and the group's process 0 alone carries the sum of squares (the
        hub adds the group's processes' sums). The other parts (loss, metrics) are screened here."""
        leaves = jax.tree.leaves(tree)
        plan = self._plan(leaves)
        pieces: dict[tuple[int, tuple], np.ndarray] = {}
        owned, held = [], []
        for i, leaf in enumerate(leaves):
            have, mine, here = _leaf_layout(leaf.sharding, tuple(leaf.shape))
            data: dict[tuple, Any] = {}
            for sh in leaf.addressable_shards:
                data.setdefault(here[sh.device.id], sh.data)
            for k in have:
                pieces[(i, k)] = group_wire.contiguous(data[k])
                held.append((i, k))
            owned += [(i, pieces[(i, k)]) for k in mine]
        span, at = None, 0
        for name, n in names:
            span = range(at, at + n) if name == "gradients" else span
            at += n
        if screen is not None and span is not None:
            rest = [(i, a) for i, a in owned if i not in span]
            bad, _ = group_exchange.screen(rest, range(0))
            grad_bad, squares = screened(screen)
            bad = sorted(set(bad) | {span.start + i for i in grad_bad})
            squares = squares if self.rank == 0 else 0.0
        else:
            bad, squares = group_exchange.screen(owned, span)
        report = {"kind": "report", "step": step, "bad": bad, "sq": squares,
                  "digest": plan.digest, "leaves": len(leaves)}  # fmt: skip
        if names:
            report["parts"] = names
        self.wire.send(report)
        # summed in place by each exchange: one the hub gave up may still write into its
        # buffers, so every later exchange of the step sums a fresh pack
        buffers = plan.pack(pieces)
        sums, flight = None, None  # the sums of exchange `sums[0]`; the epoch in flight
        while True:
            item = self._recv(sums=True)
            if isinstance(item, _Sums):
                if item.epoch != flight:
                    continue  # an exchange given up for a newer one
                flight = None
                if item.error is None:
                    sums = (item.epoch, item.sums)
                reply = {"kind": "reduced", "step": step, "epoch": item.epoch,
                         "ok": item.error is None, "error": (item.error or "")[:300]}  # fmt: skip
                self.wire.send(reply)
                continue
            header, _ = item
            kind = header.get("kind")
            if kind == "send":  # the hub path for this step (a group without the engine, ...)
                return None
            if kind == "exchange" and header.get("step") == step:
                sums, flight = None, header.get("epoch")
                self.engine.begin(flight)
                if self.faults is not None:
                    self.faults.inside_average(step)
                if buffers is None:
                    buffers = plan.pack(pieces)
                threading.Thread(target=self._sum, args=(header, buffers), daemon=True,
                                 name="jaxpar-exchange-sums").start()  # fmt: skip
                buffers = None
            elif kind == "averaged" and header.get("step") == step and sums is not None \
                    and header.get("epoch") == sums[0]:  # fmt: skip
                self.quorum = [int(g) for g in header.get("quorum", [])]
                self.leads = bool(self.quorum) and self.group == min(self.quorum)
                means = plan.unpack(sums[1], pieces, len(self.quorum))
                return tree_from_pieces(tree, [means[p] for p in held]), header
            else:
                raise WireError(f"expected step {step}'s exchange, got {str(header)[:80]}")

    def _sum(self, spec: dict, buffers: list[np.ndarray]) -> None:
        """An exchange's sums (its own thread; the training thread waits for them or for the
        hub's next word), put in the inbox as a `_Sums`."""
        try:
            self._inbox.put(_Sums(spec.get("epoch"), self.engine.sums(spec, buffers), None))
        except Exception as e:  # noqa: BLE001 - any failure is said to the hub
            self._inbox.put(_Sums(spec.get("epoch"), None, f"{type(e).__name__}: {e}"))

    def _averaged(self, like, step: int):
        header, arrays = self._recv()
        if header.get("kind") != "averaged" or header.get("step") != step:
            raise WireError(f"expected the average of step {step}, got {str(header)[:80]}")
        self.quorum = [int(g) for g in header.get("quorum", [])]
        self.leads = bool(self.quorum) and self.group == min(self.quorum)
        return tree_from_pieces(like, arrays), header

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
        self._computing(step, state)
        loss, aux, grads, extra, screen = self._first(state, batch)
        if self.faults is not None:
            changed = self.faults.before_average(step, grads)
            if changed is not grads:  # (nangrad, which may fire on one process of the group
                grads, screen = changed, None  # alone: no collective) screened on the host
        (loss, aux, grads), _ = self._average((loss, aux, grads), step,
                                              ("loss", "metrics", "gradients"), screen)  # fmt: skip
        self._computing(None)
        return self._second(state, loss, aux, grads, extra)

    def sync(self, state: dict, step: int) -> dict:
        """DiLoCo's outer step after inner step `step`: the replicas' mean averaged across the
        quorum's groups, then the outer update (the same on every group)."""
        self._computing(step, state)
        mean = self._first(state)
        if self.faults is not None:
            mean = self.faults.before_average(step, mean)
        mean, _ = self._average(mean, step)
        self._computing(None)
        return self._second(state, mean)

    def close(self, complete: bool) -> None:
        with self._current_cv:
            self._closed = True
            self._current_cv.notify_all()
        if complete:
            try:
                self.wire.send({"kind": "bye"})
            except OSError:
                pass
        self.wire.close()
