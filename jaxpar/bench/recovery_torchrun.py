"""The torchrun side of `jaxpar bench recovery`: one process of a torchrun + DDP + DCP job.

    torchrun --standalone --nproc-per-node 4 --max-restarts K recovery_torchrun.py --out DIR ...

Run by `torchrun` inside the benchmark's peer environment (torch for the CPU, the one
`jaxpar bench survivors` installs), which has no jaxpar: this file imports the standard library,
torch and its sibling `survivors_torchft.py` (for the model) only. The job: the GPT of jaxpar's
gpt_tiny shape, DistributedDataParallel over gloo, AdamW, a torch.distributed.checkpoint (DCP)
save every `--every` steps; a start restores the newest complete checkpoint. The process of rank
R SIGKILLs itself before step `--kill-at` of restart N (the pairs given as `--kills N:STEP:R`);
torchrun then stops the others and restarts the whole group.

Records, in DIR: `kills.jsonl` (the time of each SIGKILL), `steps.jsonl` (rank 0: one line per
completed step: time, step, restart count), `starts.jsonl` (rank 0: per start, the time the
interpreter began, jax's phases' counterparts: imports done, process group formed, model and
optimizer built, checkpoint restored, and the step restored).
"""

from __future__ import annotations

import time

T_BEGIN = time.time()  # before torch is imported: the start of the init phase

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, run as a script
from survivors_torchft import _model, model_args  # noqa: E402


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True, help="DCP checkpoint every N steps")
    p.add_argument("--kills", default="", help="RESTART:STEP:RANK,... SIGKILLs")
    p.add_argument("--batch", type=int, default=8, help="examples per process per step")
    model_args(p)
    return p.parse_args(argv)


def _append(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _newest(ckpt: str) -> int | None:
    """The newest step whose DCP checkpoint is complete (its .metadata is written last)."""
    steps = []
    for name in os.listdir(ckpt) if os.path.isdir(ckpt) else []:
        if name.startswith("step-") and os.path.exists(os.path.join(ckpt, name, ".metadata")):
            steps.append(int(name.removeprefix("step-")))
    return max(steps, default=None)


def main(argv=None) -> None:
    a = _args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    t_imported = time.time()
    torch.set_num_threads(1)
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # torchrun's store outlives a restart and the process group's keys are not per restart (a
    # restarted process read a dead peer's gloo address): a store per restart, as
    # survivors_torchft.py does, announced in torchrun's under the restart count
    from torch.distributed import TCPStore

    base = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key = f"recovery/{restart}/store_port"
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        base.set(key, str(store.port))
    else:
        store = TCPStore("127.0.0.1", int(base.get(key)), is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"])
    )
    t_pg = time.time()
    model = DistributedDataParallel(_model(a))
    optim = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    t_built = time.time()
    ckpt = os.path.join(a.out, "ckpt")
    start = _newest(ckpt) or 0
    if start:
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(ckpt, f"step-{start}"))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    t_restored = time.time()
    if rank == 0:
        _append(os.path.join(a.out, "starts.jsonl"), {
            "restart": restart, "begin": T_BEGIN, "imported": t_imported, "pg": t_pg,
            "built": t_built, "restored": t_restored, "step": start, "pid": os.getpid()})  # fmt: skip
    kills = {}
    for k in filter(None, a.kills.split(",")):
        r, s, who = (int(x) for x in k.split(":"))
        kills[r] = (s, who)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(start, a.steps):
        if kills.get(restart) == (step, rank):
            _append(os.path.join(a.out, "kills.jsonl"), {"time": time.time(), "step": step,
                                                          "restart": restart, "rank": rank})  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step * 1000 + rank)
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        logits = model(tokens[:, :-1])
        loss = loss_fn(logits.reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        value = loss.item()
        if rank == 0:
            _append(os.path.join(a.out, "steps.jsonl"), {"time": time.time(), "step": step + 1,
                                                          "restart": restart, "loss": value})  # fmt: skip
        if (step + 1) % a.every == 0:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd},
                     checkpoint_id=os.path.join(ckpt, f"step-{step + 1}"))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
