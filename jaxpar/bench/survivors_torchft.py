"""The torchft side of `jaxpar bench survivors`: one process of one replica group.

    torchrun --nproc-per-node 2 -m ... survivors_torchft.py --group G --groups R --out DIR

Run by `torchrun` (one per replica group) inside the benchmark's own virtual environment, which
has torch (CPU) and torchft and no jaxpar: this file imports the standard library, torch and
torchft only. Inside a group the processes average their gradients with torch.distributed (gloo);
across groups torchft's Manager averages them over the quorum its Lighthouse decides each step,
and a restarted group receives the live state from a peer group (torchft's checkpoint transport).

The model is a GPT of the same shape as jaxpar's gpt_tiny (learned positions, pre-norm blocks,
fused QKV, untied head; the same parameter count), trained with AdamW on synthetic tokens.

Each process writes its PID to DIR/pid-gG-rR (replaced atomically, read by the benchmark to kill
and to count restarts); group rank 0 appends one JSON line per step to DIR/steps-gG.jsonl:
time, step, whether the step committed, the quorum's size, whether this group took part, PID.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8, help="examples per process per step")
    p.add_argument("--min-groups", type=int, default=2)
    model_args(p)
    return p.parse_args(argv)


def model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape (gpt_tiny's) and learning rate (recovery_torchrun.py's too)."""
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-mlp", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)


def _write_pid(out: str, group: int, rank: int) -> None:
    path = os.path.join(out, f"pid-g{group}-r{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def _model(a: argparse.Namespace):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = a.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc_in, self.fc_out = nn.Linear(d, a.d_mlp), nn.Linear(a.d_mlp, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, a.heads, d // a.heads).unbind(2)
            o = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(o.transpose(1, 2).reshape(b, t, d))
            return x + self.fc_out(nn.functional.gelu(self.fc_in(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(a.vocab, a.d_model)
            self.pos = nn.Embedding(a.seq, a.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.ln = nn.LayerNorm(a.d_model)
            self.head = nn.Linear(a.d_model, a.vocab, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    return GPT()


def main(argv=None) -> None:
    a = _args(argv)
    import logging
    import warnings
    from datetime import timedelta

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _write_pid(a.out, a.group, rank)
    # torchrun's store outlives a restart of the group and the keys of a process group and of
    # the Manager are not per restart, so a restarted process could read a dead peer's address:
    # each incarnation of the group gets a store of its own, announced under its restart count.
    from torch.distributed import PrefixStore, TCPStore

    base = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key = f"survivors/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/store_port"
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        base.set(key, str(store.port))
    port = int(base.get(key))
    if rank != 0:
        store = TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(  # inside the group
        "gloo",
        store=PrefixStore("group", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    model = _model(a)
    params = [p for p in model.parameters()]
    inner = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        store_addr="127.0.0.1",
        store_port=port,
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=a.min_groups,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"survivors_{a.group}",
        timeout=timedelta(seconds=30),
        rank=rank,
        world_size=world,
    )
    log = open(os.path.join(a.out, f"steps-g{a.group}.jsonl"), "a") if rank == 0 else None
    gen = torch.Generator().manual_seed(1000 * a.group + rank)
    while True:
        manager.start_quorum()  # this step's quorum (and a restarted group's recovery)
        inner.zero_grad()
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, a.vocab), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)  # the group's processes: sum, then mean
        flat /= world
        manager.allreduce(flat).wait()  # across the quorum's groups: mean
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        committed = manager.should_commit()
        if committed:
            inner.step()
        if log is not None:
            rec = {
                "t": time.time(),
                "step": manager.current_step(),
                "committed": bool(committed),
                "participants": manager.num_participants(),
                "participating": bool(manager.is_participating()),
                "pid": os.getpid(),
                "loss": float(loss),
            }
            log.write(json.dumps(rec) + "\n")
            log.flush()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # the benchmark reports the last error of each process
        import traceback

        with open(os.environ.get("SURVIVORS_ERRORS", os.devnull), "a") as f:
            f.write(f"pid {os.getpid()}:\n{traceback.format_exc()}\n")
        raise
