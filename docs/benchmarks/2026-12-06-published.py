"""Predicted against published: each published configuration's one layout, compiled by the
target's compiler and predicted on its profile by `jaxpar tune --target`'s own code
(jaxpar.tools.tune.compile_layout and predict), its figures written as JSON lines.

    JAXPAR_TARGET_PACKAGES=/tmp/aot python docs/benchmarks/2026-12-06-published.py NAME... > out.jsonl

NAME: a key of CONFIGS (see 2026-12-06-published.md), or `KEY+flags` for a TPU one compiled with
the libtpu flags of MaxText's scripts (one such NAME per process: libtpu reads them when it loads).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.config import apply_overrides, resolve_recipe, validate  # noqa: E402
from jaxpar.tools import hardware, targets, tune  # noqa: E402

# name: (target, recipe, --set, mesh sizes, the layout's settings)
CONFIGS = {
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama 3.1 8B, 8 H100,
    # FSDP 8, local batch 2 (global 16), seq 8192 (train_configs/llama3_8b.toml), bf16. At two
    # sequences per GPU jaxpar's CUDA program needs 129.6 GiB (its attention keeps the scores);
    # `_fit` is the same step as two accumulated microbatches of one sequence per GPU.
    "torchtitan_llama3_8b": (
        "h100x8",
        "llama3_8b",
        ["data.global_batch=16"],
        {"fsdp": 8},
        {"model.remat": "block", "train.microbatches": 1},
    ),
    "torchtitan_llama3_8b_fit": (
        "h100x8",
        "llama3_8b",
        ["data.global_batch=16"],
        {"fsdp": 8},
        {"model.remat": "block", "train.microbatches": 2},
    ),
    # Megatron-LM README images/model_table.png, row 1.7B: 24 layers, hidden 2048, 16 heads,
    # TP 1, PP 1, DP 48, batch 192 (4 sequences per GPU), seq 4096, vocabulary 131,072
    "megatron_gpt_1p7b": (
        "h100x8",
        "gpt_350m",
        [
            "model.vocab_size=131072",
            "model.seq_len=4096",
            "model.d_model=2048",
            "model.n_heads=16",
            "model.n_layers=24",
            "model.d_mlp=8192",
            "data.seq_len=4096",
            "data.global_batch=32",
        ],
        {"data": 8},
        {"model.remat": "dots", "train.microbatches": 1},
    ),
    # MaxText configs/v5e/README.md and configs/v5e/16b.sh as of 2023-12-15 (76bd53b0f):
    # global_parameter_scale=16 of that base.yml (emb 5120, 32 heads of 256, mlp 32768 relu,
    # 32 layers, vocabulary 32,768, logits via the embedding), per_device_batch_size=6 on
    # v5e-256 (1,536 sequences), max_target_length=2048, remat_policy=full, FSDP over the slice,
    # bf16. jaxpar's Llama has a SwiGLU MLP: d_mlp 21,760 (x3 matmuls) has the FLOPs of 32,768 x2.
    "maxtext_v5e_16b": (
        "v5e-256",
        "llama3_8b",
        [
            "model.vocab_size=32768",
            "model.seq_len=2048",
            "model.d_model=5120",
            "model.n_heads=32",
            "model.n_kv_heads=32",
            "model.head_dim=256",
            "model.d_mlp=21760",
            "model.n_layers=32",
            "model.tie_embeddings=true",
            "data.seq_len=2048",
            "data.global_batch=1536",
        ],
        {"fsdp": 256},
        {"model.remat": "block", "train.microbatches": 1},
    ),
}
# The same README's 32B row: configs/v5e/32b.sh, global_parameter_scale=32 of that base.yml (emb
# 10240, 32 heads of 256, mlp 32768 relu, 32 layers; 32.56 B parameters), per_device_batch_size=4
# on v5e-256 (1,024 sequences), everything else as the 16B run.
CONFIGS["maxtext_v5e_32b"] = (
    "v5e-256",
    "llama3_8b",
    [s.replace("model.d_model=5120", "model.d_model=10240").replace(
        "data.global_batch=1536", "data.global_batch=1024") for s in CONFIGS["maxtext_v5e_16b"][2]],
    {"fsdp": 256},
    {"model.remat": "block", "train.microbatches": 1},
)
# jaxpar's program of that step needs 16.05 GB of temporaries on the compiler's 15.75 GB (its
# attention keeps the scores MaxText's flash kernel never writes): `_fit` is the same step as two
# accumulated microbatches of two sequences per chip.
CONFIGS["maxtext_v5e_32b_fit"] = (*CONFIGS["maxtext_v5e_32b"][:4],
                                  {"model.remat": "block", "train.microbatches": 2})
# MaxText configs/v5p/README.md, 32B on one v5p-128 (328 TFLOP/s per chip, MFU 71.47 %) with
# configs/v5p/32b.sh: global_parameter_scale=32 as above, per_device_batch_size=7 (448
# sequences), remat_policy=minimal (the matmul outputs kept: jaxpar's `dots`), fsdp 16 x tensor 4.
CONFIGS["maxtext_v5p_32b"] = (
    "v5p-128",
    "llama3_8b",
    [s.replace("data.global_batch=1024", "data.global_batch=448")
     for s in CONFIGS["maxtext_v5e_32b"][2]],
    {"fsdp": 16, "tensor": 4},
    {"model.remat": "dots", "train.microbatches": 1},
)
# With `dots` jaxpar's program keeps the attention scores too (a matmul's output; MaxText's flash
# kernel never writes them): 139.91 GB of temporaries on the compiler's 95.74 GB. `_fit`
# recomputes each block in the backward pass instead (jaxpar's `block`, MaxText's `full`).
CONFIGS["maxtext_v5p_32b_fit"] = (*CONFIGS["maxtext_v5p_32b"][:4],
                                  {"model.remat": "block", "train.microbatches": 1})
# MaxText's scripts for those rows (v5e/16b.sh, 32b.sh; v5p/32b.sh) compile with these libtpu
# flags: collectives fused into asynchronous ones and overlapped with the matmuls. `NAME+flags`
# compiles NAME with them, as the published runs did (libtpu reads them once, when it loads: one
# process per set).
_V5E_FLAGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
)
MAXTEXT_LIBTPU_FLAGS = {
    "v5e": _V5E_FLAGS,
    "v5p": "--xla_tpu_megacore_fusion_allow_ags=false --xla_enable_async_collective_permute=true "
    "--xla_tpu_enable_ag_backward_pipelining=true " + _V5E_FLAGS,
}


def run(name: str) -> dict:
    base, _, flags = name.partition("+")
    target_name, recipe, sets, sizes, settings = CONFIGS[base]
    if flags:
        assert flags == "flags" and targets.get(target_name).family == "tpu", name
        os.environ["LIBTPU_INIT_ARGS"] = MAXTEXT_LIBTPU_FLAGS[target_name[:3]]
    t = targets.get(target_name)
    cfg = validate(apply_overrides(resolve_recipe(recipe), sets))
    prof = hardware.get(t.name, t.devices)
    lay = tune.Layout(sizes, settings)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            tune.compile_layout(cfg, lay, targets.devices(t), tmp, t)
            tune.predict(lay, prof, t.memory_bytes if t.family == "cuda" else float("inf"))
        except targets.DoesNotFit as e:
            lay.fits, lay.reason = False, str(e)
    tokens = cfg.data.global_batch * cfg.model.seq_len
    model_flops = cfg.model.flops_per_token() * tokens
    out = {
        "name": name, "target": t.name, "recipe": recipe, "set": sets, "mesh": lay.mesh,
        "settings": settings, "fits": lay.fits, "reason": lay.reason,
        "peak_gib": (lay.memory.get("peak") or 0) / 2**30, "compile_s": lay.compile_s,
        "wall_s": time.perf_counter() - t0, "program_flops_per_device": lay.flops,
        "model_flops_per_token": cfg.model.flops_per_token(),
        "model_params": cfg.model.num_params(), "predicted_step_s": lay.predicted_step_s,
        "split_s": lay.split, "bottleneck": lay.bottleneck,
        "predicted_tokens_per_s_per_device": tokens / lay.predicted_step_s / t.devices,
        "predicted_model_tflops_per_device": model_flops / lay.predicted_step_s / t.devices / 1e12,
        "profile": prof.as_dict(), "load_average": os.getloadavg()[0],
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
    }  # fmt: skip
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(run(arg)), flush=True)
