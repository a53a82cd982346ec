"""Peak host memory of loading a Hugging Face checkpoint with jaxpar.hf, per process.

    python -m tests.support.hf_memory [--procs 2] [--layout fsdp8] [--dtype bf16] [--keep DIR]

Writes a random Llama checkpoint (d_model 1024, 8 layers, 32,000-entry vocabulary: 191M
parameters, 765 MB as float32, 382 MB as bfloat16) in a child process, then loads it in
`--procs` fresh processes (jax.distributed on this host, the layout's devices split between
them; CPU devices are host memory) and prints, per process: its resident memory before the load
(jax started, mesh built), its peak (getrusage's ru_maxrss) after it, the bytes of parameters its
devices hold, and the largest tensor. Without streaming, a process would hold the whole model
(plus its float32 copy when the file is bfloat16) before placing its shards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = dict(vocab_size=32000, seq_len=256, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8,
             d_mlp=4096)  # fmt: skip


def write_checkpoint(folder: str, dtype: str) -> None:
    """The random checkpoint, one tensor in memory at a time (float32, or bfloat16 bits)."""
    import math

    import numpy as np

    from jaxpar.hf import config as hf_config
    from jaxpar.hf import save as hf_save
    from jaxpar.models.llama import LlamaConfig

    model = LlamaConfig(**MODEL)
    layout, _ = hf_save.hf_layout(model)
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    shards = hf_save.plan_shards(layout, 200 << 20)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        obj, offset = {}, 0
        item = 2 if dtype == "bf16" else 4
        for t, shape in shard:
            n = math.prod(shape) * item
            obj[t] = {"dtype": "BF16" if dtype == "bf16" else "F32", "shape": list(shape),
                      "data_offsets": [offset, offset + n]}  # fmt: skip
            offset += n
            weight_map[t] = name
        head = json.dumps(obj).encode()
        head += b" " * (-len(head) % 8)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            for _, shape in shard:
                a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype("<f4")
                f.write((a.view(np.uint32) >> 16).astype("<u2").tobytes() if dtype == "bf16"
                        else a.tobytes())  # fmt: skip
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config.hf_config(model), f)


def load_one(folder: str, layout: str, procs: int, index: int, port: int,
             host_bytes: int | None) -> dict:  # fmt: skip
    """In a fresh process: the load's memory figures."""
    import math
    import resource

    import psutil

    devices = 8 // procs
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax

    if procs > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", procs, index)
    from jaxpar import meshes
    from jaxpar.engine import model as model_lib
    from jaxpar.engine.mesh import make_mesh
    from jaxpar.hf import load as hf_load
    from jaxpar.hf import names as hf_names
    from jaxpar.parallel.program import param_shardings

    p = meshes.resolve(layout)
    mesh = make_mesh(p.mesh)
    with hf_load.open_folder(folder) as f:
        sh = param_shardings(model_lib.abstract(f.model, 0).params, p.params, mesh)
        before = psutil.Process().memory_info().rss
        params = hf_load.load_params(f, sh, host_bytes=host_bytes)
        jax.block_until_ready(params)
        read = f.reader.bytes_read
        largest = max(4 * s.hf_shape[0] * (s.hf_shape[1] if len(s.hf_shape) > 1 else 1)
                      for s in hf_names.specs(f.model).values())  # fmt: skip
        model_bytes = 4 * sum(math.prod(s.shape) for s in hf_names.specs(f.model).values())
    held = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"process": index, "rss_before": before, "peak": peak, "held": held,
            "largest_tensor": largest, "model_float32": model_bytes, "file_bytes_read": read}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, choices=(1, 2, 4, 8))
    ap.add_argument("--layout", default="fsdp8")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--keep", default=None, help="write the checkpoint here and keep it")
    ap.add_argument("--host-bytes", type=int, default=None,
                    help="jaxpar.hf.load.load_params's host_bytes (default HOST_BLOCK_BYTES; 0: "
                    "every stacked parameter layer by layer)")  # fmt: skip
    ap.add_argument("--child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        folder, layout, procs, index, port, host = args.child
        host_bytes = None if host == "default" else int(host)
        print(json.dumps(load_one(folder, layout, int(procs), int(index), int(port), host_bytes)))
        return
    tmp = tempfile.mkdtemp(prefix="jaxpar-hf-memory-")
    folder = args.keep or os.path.join(tmp, "ckpt")
    env = {**os.environ, "PYTHONPATH": REPO}
    try:
        if not os.path.exists(folder):
            code = f"from tests.support.hf_memory import write_checkpoint; write_checkpoint({folder!r}, {args.dtype!r})"
            subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        host = "default" if args.host_bytes is None else str(args.host_bytes)
        child = [sys.executable, "-m", "tests.support.hf_memory", "--child", folder, args.layout,
                 str(args.procs)]  # fmt: skip
        children = [
            subprocess.Popen(
                [*child, str(i), str(port), host],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for i in range(args.procs)
        ]
        results = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in children]
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    mb = 1 << 20
    for r in results:
        print(
            f"process {r['process']}: RSS before {r['rss_before'] / mb:.0f} MiB, peak "
            f"{r['peak'] / mb:.0f} MiB (+{(r['peak'] - r['rss_before']) / mb:.0f}); its devices "
            f"hold {r['held'] / mb:.0f} MiB of the model's {r['model_float32'] / mb:.0f} MiB; "
            f"largest tensor {r['largest_tensor'] / mb:.0f} MiB (float32); read "
            f"{r['file_bytes_read'] / mb:.0f} MiB of the files"
        )


if __name__ == "__main__":
    main()
