"""The replica groups' peer-to-peer average: process k of each group of a step's quorum sums the
shards it holds with process k of the others over Gloo (torch.distributed's ProcessGroupGloo, host
memory), in a communicator formed for that quorum. The engine is the optional extra
`jaxpar[gloo]` (torch, CPU); without it every step averages through the leader's group hub.

Who talks to whom comes only over the authenticated hub wire (jaxpar/worker/group_wire.py): the
hub screens the groups' reports (finite, gradient norm), decides the quorum, and sends every
process an `exchange`: its rank, the quorum's size, the address of the rendezvous store (a
TCPStore served by process k of the quorum's lowest group) and a prefix holding a secret the hub
made for that communicator. A process that fails inside the exchange (a peer died, hung or cut
off) says so to the hub, which re-forms the communicators over the quorum that is left.

Each process's shards are summed in classes: the shards held by the same processes of the group,
per dtype, in one canonical order (leaf, index). Processes of a group that hold a shard in common
(replicated leaves) reduce the same buffer in the same ring order, so their copies stay bitwise
equal.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading

import numpy as np

from jaxpar.worker.group_layout import screen_pieces

EXTRA = "jaxpar[gloo]"
# "hub": every step averages through the group hub, the engine installed or not
ENV_EXCHANGE = "JAXPAR_GROUP_EXCHANGE"
# what Gloo sums here (the wire's dtypes less bool and the unsigned ones Gloo has no sum for)
SUMMED = frozenset(("float16", "float32", "float64", "int8", "int32", "int64", "uint8"))
STARTUP_S = 120.0  # importing torch and starting the store, beside the programs' compilation
TRANSFER_CHUNK = 1 << 28  # a state transfer's broadcasts: 256 MiB each


class Engine:
    """This process's side of the exchange: a rendezvous store it serves (used while its group
    is the quorum's lowest), and one Gloo communicator per exchange the hub names."""

    def __init__(self, host: str):
        self.host = host
        self.address: str | None = None  # HOST:PORT of this process's store
        self.missing: str | None = None  # why there is no engine here
        self._ready = threading.Event()
        self._pg = None  # (epoch, communicator) of the exchange last formed
        self._epoch = None  # the exchange the hub named last
        self._lock = threading.Lock()
        if os.environ.get(ENV_EXCHANGE) == "hub":
            self.missing = f"{ENV_EXCHANGE}=hub"
            self._ready.set()
        else:
            threading.Thread(target=self._start, daemon=True, name="jaxpar-exchange").start()

    def _start(self) -> None:
        try:
            import torch.distributed as dist  # noqa: F401 - the extra, imported off the step
        except ImportError as e:
            self.missing = f"{EXTRA} is not installed ({e})"
            self._ready.set()
            return
        try:
            # port 0: the system picks it; no worker is waited for (clients come per exchange)
            self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=60))  # fmt: skip
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.address = f"{host}:{self._store.port}"
        except Exception as e:  # noqa: BLE001 - any failure leaves the hub path
            self.missing = f"the exchange's store did not start ({type(e).__name__}: {e})"
        self._ready.set()

    def ready(self, timeout_s: float = STARTUP_S) -> str | None:
        """This process's store address once the engine has started; None without one."""
        if not self._ready.wait(timeout_s):
            self.missing = f"{EXTRA} did not start within {timeout_s:.0f} s"
        return self.address if self.missing is None else None

    def begin(self, epoch) -> None:
        """The hub named exchange `epoch`: an older one in flight is given up (aborted)."""
        with self._lock:
            self._epoch = epoch
            if self._pg is not None and self._pg[0] != epoch:
                self._abort(self._pg[1])
                self._pg = None

    def communicator(self, spec: dict):
        """The Gloo communicator of exchange `spec`, formed once per epoch (its rendezvous waits
        for every member, at most the spec's timeout); RuntimeError once a newer one began."""
        import torch.distributed as dist

        epoch = spec["epoch"]
        with self._lock:
            if self._pg is not None and self._pg[0] == epoch:
                return self._pg[1]
        timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
        host, _, port = str(spec["store"]).rpartition(":")
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                              wait_for_workers=False, timeout=timeout)  # fmt: skip
        store = dist.PrefixStore(str(spec["prefix"]), store)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        pg = dist.ProcessGroupGloo(store, int(spec["rank"]), int(spec["world"]), opts)
        with self._lock:
            if self._epoch != epoch:  # given up meanwhile
                self._abort(pg)
                raise RuntimeError(f"exchange {epoch} was superseded")
            self._pg = (epoch, pg)
        return pg

    def close(self) -> None:
        """Give up the communicator and stop the store now, while the interpreter is whole: left
        to the interpreter's exit, their threads have been seen to abort the process (SIGABRT,
        "terminate called without an active exception") after a run that ended well."""
        with self._lock:
            self._epoch = None
            if self._pg is not None:
                self._abort(self._pg[1])
                self._pg = None
            self._store = None  # TCPStore's destructor stops its server thread

    @staticmethod
    def _abort(pg) -> None:
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - best effort: its threads end at their timeout
            pass

    def transfer(self, spec: dict, buffer: np.ndarray) -> None:
        """A state transfer peer to peer (`spec` from the hub: rank 0 the donor's process, the
        others the joining groups' processes holding the same shards): `buffer` (bytes) is sent
        from rank 0 into every other rank's, in a communicator of its own, dropped after."""
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
        host, _, port = str(spec["store"]).rpartition(":")
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                              wait_for_workers=False, timeout=timeout)  # fmt: skip
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(str(spec["prefix"]), store),
                                   int(spec["rank"]), int(spec["world"]), opts)  # fmt: skip
        try:
            flat = buffer.reshape(-1).view(np.uint8)
            for at in range(0, max(flat.size, 1), TRANSFER_CHUNK):
                pg.broadcast(torch.from_numpy(flat[at : at + TRANSFER_CHUNK]), 0).wait()
        finally:
            self._abort(pg)

    def sums(self, spec: dict, buffers: list[np.ndarray]) -> list[np.ndarray]:
        """Every buffer summed over exchange `spec`'s members, in place (a step's gradients are
        not copied again: `Plan.pack` made the buffers); returns `buffers`."""
        import torch

        pg = self.communicator(spec)
        for b in buffers:
            pg.allreduce([torch.from_numpy(b)]).wait()
        return buffers


class Plan:
    """How one process's held shards of a tree are summed: classes of (holders, dtype), each a
    list of (leaf, index) in canonical order; `digest` names it (equal across groups of the same
    layout: process k of each holds the same shards)."""

    def __init__(self, keys: list[list[tuple]], held_by: list[dict], dtypes: list[str],
                 shapes: list[tuple]):  # fmt: skip
        classes: dict[tuple, list[tuple[int, tuple]]] = {}
        for leaf, ks in enumerate(keys):
            for k in ks:
                classes.setdefault((held_by[leaf][k], dtypes[leaf]), []).append((leaf, k))
        self.classes = [(c, sorted(v)) for c, v in sorted(classes.items())]
        odd = sorted(set(dtypes) - SUMMED)
        self.usable = not odd
        self.why_not = f"leaves of dtype {', '.join(odd)}, which Gloo does not sum" if odd else ""
        body = json.dumps([[list(s) for s in shapes], dtypes,
                           [[list(c[0]), c[1], [[leaf, list(k)] for leaf, k in v]]
                            for c, v in self.classes]])  # fmt: skip
        self.digest = hashlib.sha256(body.encode()).hexdigest()

    def pack(self, pieces: dict[tuple[int, tuple], np.ndarray]) -> list[np.ndarray]:
        """One flat buffer per class from this process's shards ((leaf, index) -> array)."""
        return [np.concatenate([pieces[p].reshape(-1) for p in members]) if members else
                np.zeros(0, dtype) for (_, dtype), members in self.classes]  # fmt: skip

    def unpack(self, buffers: list[np.ndarray], pieces: dict, divisor: int) -> dict:
        """(leaf, index) -> the mean (the sums in `buffers` over `divisor` groups, cast back as
        the hub's float64 mean is), shaped as `pieces`'s arrays: views of `buffers`, which the
        division overwrites.

        A floating class is divided in its own dtype, in place: the quotient of two floats
        correctly rounded to p bits, then to q bits with p >= 2q + 2 (float64's 53 against
        float32's 24, float32's 24 against float16's 11), equals the quotient rounded to q bits
        once, so this is bitwise the float64 division cast back, without a float64 copy of the
        gradients. Integer classes go through float64 (truncated back as the hub's are)."""
        out = {}
        for ((_, dtype), members), buf in zip(self.classes, buffers, strict=True):
            if np.dtype(dtype).kind == "f":
                mean = np.divide(buf, buf.dtype.type(divisor), out=buf)
            else:
                mean = (buf.astype(np.float64) / divisor).astype(dtype)
            at = 0
            for p in members:
                n = pieces[p].size
                out[p] = mean[at : at + n].reshape(pieces[p].shape)
                at += n
        return out


def screen(pieces: list[tuple[int, np.ndarray]], norm_of: range | None) -> tuple[list[int], float]:
    """This process's report for the hub's screen, from the shards it owns ((leaf, array)): the
    leaves holding a NaN or an infinity, and the sum of squares (float64) of the finite ones in
    `norm_of` (all when None), as the hub's own screen reads them."""
    return screen_pieces(pieces, norm_of)


__all__ = ["ENV_EXCHANGE", "EXTRA", "Engine", "Plan", "screen"]
