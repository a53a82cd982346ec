"""Run by tests/supervisor/test_replicas_exchange.py with jaxpar[gloo] on PYTHONPATH: three
replica groups' process k played by three threads of this process, each with its own engine
(jaxpar/worker/group_exchange.py), summing over Gloo as the hub names the exchanges. Prints one
JSON object of what happened."""

import json
import socket
import sys
import threading
import time

import numpy as np

from jaxpar.worker.group_exchange import Engine, Plan

out: dict = {}
engines = [Engine("127.0.0.1") for _ in range(3)]
out["stores"] = [e.ready() for e in engines]
store = out["stores"][0]
host, _, port = store.rpartition(":")

# a stranger at the rendezvous: garbage, then a client of its own under a prefix it guessed
with socket.create_connection((host, int(port)), timeout=5) as s:
    s.sendall(b"\xff" * 65536)
import torch.distributed as dist  # noqa: E402 - the extra, after the engines started it

guess = dist.PrefixStore("jaxpar/1/guess/0", dist.TCPStore(host, int(port), is_master=False))
guess.set("rank_0", b"stranger")

# two leaves: a float32 vector and an int32 matrix, held whole by process k (one holder)
keys = [[(0, 4)], [(0, 2, 0, 3)]]
plan = Plan(keys, [{(0, 4): (0,)}, {(0, 2, 0, 3): (0,)}], ["float32", "int32"], [(4,), (2, 3)])
pieces = [{(0, (0, 4)): np.arange(4, dtype=np.float32) * (g + 1),
           (1, (0, 2, 0, 3)): np.full((2, 3), g + 1, np.int32)} for g in range(3)]  # fmt: skip


def run(members: list[int], epoch: int, timeout_s: float) -> dict:
    results: dict = {}

    def one(g: int) -> None:
        spec = {
            "epoch": epoch,
            "rank": members.index(g),
            "world": len(members) + (epoch == 2),
            "store": store,
            "prefix": f"jaxpar/{epoch}/secret/0",
            "timeout_s": timeout_s,
        }
        engines[g].begin(epoch)
        t0 = time.time()
        try:
            sums = engines[g].sums(spec, plan.pack(pieces[g]))
            means = plan.unpack(sums, pieces[g], len(members))
            results[g] = {k[0]: v.tolist() for k, v in means.items()}
        except Exception as e:  # noqa: BLE001
            results[g] = {"error": type(e).__name__, "seconds": round(time.time() - t0, 1)}

    threads = [threading.Thread(target=one, args=(g,)) for g in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


out["all"] = run([0, 1, 2], 1, 20.0)
# exchange 2 names three members but group 2 never comes (killed inside it): the others fail at
# its timeout, not later; exchange 3 over the two left succeeds
out["missing"] = run([0, 1], 2, 3.0)
out["left"] = run([0, 1], 3, 20.0)
out["digest_equal"] = (
    plan.digest
    == Plan(
        keys, [{(0, 4): (0,)}, {(0, 2, 0, 3): (0,)}], ["float32", "int32"], [(4,), (2, 3)]
    ).digest
)
print(json.dumps(out))
sys.stdout.flush()
for e in engines:  # as a worker's group link does when it closes
    e.close()
