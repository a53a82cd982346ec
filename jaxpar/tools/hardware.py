"""Hardware profiles for `jaxpar tune`: what one device computes and what its links carry.

Each profile is data: per-device peak FLOP/s (dense, the dtype training uses), the fraction a
real step reaches, memory per device, the bandwidth each device sends at over the fast links of
its island (NVLink inside an 8-GPU host; ICI inside a TPU slice) and over the links between
islands (InfiniBand / data-centre network), a per-collective latency, and how many devices one
island holds. `SOURCES` names where each number comes from. `cpu` is measured on the spot by
micro-benchmarks (`measure_cpu`): the simulated devices of one host share its cores, so its peak
is what each device reaches while all of them compute at once.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    peak_flops: float  # per device, dense
    efficiency: float  # fraction of peak a training step's matmuls reach
    memory_bytes: float  # per device
    intra_bw: float  # bytes/s each device sends over its island's links
    inter_bw: float  # bytes/s each device sends across islands
    latency_s: float  # per collective (launch + synchronisation)
    island: int  # devices per island (host or slice)
    overlap: float  # fraction of batch-axis gradient traffic hidden under the backward pass
    op_s: float = 0.0  # per kernel the step launches (launch and scheduling overhead)
    step_s: float = 0.0  # per step (dispatch of one program)

    def as_dict(self) -> dict:
        return asdict(self)


GB = 1e9
PROFILES: dict[str, Profile] = {
    "h100x8": Profile("h100x8", 989e12, 0.51, 80 * GB, 450 * GB, 50 * GB, 15e-6, 8, 0.8, 4e-6),
    "h200x8": Profile("h200x8", 989e12, 0.51, 141 * GB, 450 * GB, 50 * GB, 15e-6, 8, 0.8, 4e-6),
    "v5e-8": Profile("v5e-8", 197e12, 0.71, 16 * GB, 200 * GB, 25 * GB, 10e-6, 8, 0.8, 1e-6),
    "v5p-32": Profile("v5p-32", 459e12, 0.71, 95 * GB, 600 * GB, 25 * GB, 10e-6, 16, 0.8, 1e-6),
    "h100x16": Profile("h100x16", 989e12, 0.51, 80 * GB, 450 * GB, 50 * GB, 15e-6, 8, 0.8, 4e-6),
    "a100x8": Profile("a100x8", 312e12, 0.45, 80 * GB, 300 * GB, 25 * GB, 15e-6, 8, 0.8, 4e-6),
    "v5e-256": Profile("v5e-256", 197e12, 0.71, 16 * GB, 200 * GB, 25 * GB, 10e-6, 256, 0.8, 1e-6),
    "v5p-128": Profile("v5p-128", 459e12, 0.71, 95 * GB, 600 * GB, 25 * GB, 10e-6, 64, 0.8, 1e-6),
    "v6e-8": Profile("v6e-8", 918e12, 0.5, 32 * GB, 448 * GB, 25 * GB, 10e-6, 8, 0.8, 1e-6),
}
SOURCES: dict[str, str] = {
    "h100x8": "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 80 GB HBM3, NVLink 4 "
    "900 GB/s bidirectional (450 GB/s each way); one 400 Gb/s NDR InfiniBand NIC per GPU "
    "(50 GB/s) across hosts (DGX H100 reference design). Collective latency 15 us and kernel "
    "launch 4 us: typical CUDA figures (a small NCCL all-reduce inside a node; cudaLaunchKernel). "
    "Efficiency 0.51: calibrated on Megatron-LM's published 1.7B GPT (its README's H100 table: "
    "408.8 TFLOP/s per GPU, data parallel, 4 x 4,096 tokens per GPU) reproduced by jaxpar tune "
    "--target h100x8; torchtitan's Llama 3.1 8B on 8 H100 held out "
    "(docs/benchmarks/2026-12-06-published.md).",
    "h200x8": "NVIDIA H200 SXM datasheet: same compute as H100 SXM (989 TFLOP/s dense BF16), "
    "141 GB HBM3e, NVLink 4 900 GB/s bidirectional; DGX H200: one 400 Gb/s InfiniBand NIC per "
    "GPU. Latency, launch and efficiency: as h100x8.",
    "v5e-8": "Google Cloud TPU v5e documentation: 197 TFLOP/s BF16 per chip, 16 GB HBM2, ICI "
    "1,600 Gbps per chip (200 GB/s); v5litepod-8 is one host of 8 chips; data-centre network "
    "across slices ~200 Gbps per host. Latency 10 us and 1 us per kernel: estimates. "
    "Efficiency 0.71: calibrated on v5p (below) and held out here: MaxText's published 16B on "
    "v5e-256 is predicted at 0.79 of its throughput (0.58 at the earlier estimate, 0.5) "
    "(docs/benchmarks/2026-12-06-published.md).",
    "v5p-32": "Google Cloud TPU v5p documentation: 459 TFLOP/s BF16 per chip, 95 GB HBM2e, ICI "
    "4,800 Gbps per chip (600 GB/s); v5p-32 is 16 chips (32 TensorCores) on 4 hosts joined by "
    "ICI (one island); data-centre network across slices. Latency and per-kernel: as v5e. "
    "Efficiency 0.71: MaxText's published 32B on v5p-128 (71.47 % MFU; its minimal remat "
    "recomputes little, so that is about the fraction of peak its matmuls reach); the TPU "
    "profiles share it (docs/benchmarks/2026-12-06-published.md).",
    "h100x16": "two h100x8 hosts (DGX H100): per GPU as h100x8; across the hosts one 400 Gb/s "
    "InfiniBand NIC per GPU (50 GB/s).",
    "a100x8": "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense BF16, 80 GB HBM2e, NVLink 3 "
    "600 GB/s bidirectional (300 GB/s each way); DGX A100: one 200 Gb/s HDR InfiniBand NIC per "
    "GPU (25 GB/s). Latency and launch: as h100x8; efficiency 0.45: not calibrated (no "
    "published A100 run reproduced).",
    "v5e-256": "Google Cloud TPU v5e documentation: a full v5e pod, 256 chips joined by ICI (one "
    "island, 16x16 torus); per chip as v5e-8.",
    "v5p-128": "Google Cloud TPU v5p documentation: 64 chips (128 TensorCores, one device per "
    "chip) on 16 hosts joined by ICI (one island, 4x4x4 torus); per chip as v5p-32.",
    "v6e-8": "Google Cloud TPU v6e (Trillium) documentation: 918 TFLOP/s BF16 per chip, 32 GB "
    "HBM, ICI 3,584 Gbps per chip (448 GB/s); v6e-8 is one host of 8 chips. Latency and "
    "per-kernel: as v5e.",
    "cpu": "measured here by jaxpar tune: a sharded matmul on every device at once (peak), an "
    "all-reduce of 4 MiB and of 4 bytes over all devices (bandwidth, latency), a chain of small "
    "matmuls (per-kernel time) and an empty program (per-step dispatch); efficiency 1 (the "
    "peak is already what the step's matmul sizes reach).",
}


def names() -> list[str]:
    return [*PROFILES, "cpu"]


def get(name: str, devices: int) -> Profile:
    """A profile by name (`cpu`: measured now over `devices` devices); one line for a bad name."""
    if name == "cpu":
        return measure_cpu(devices)
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; use one of {', '.join(names())}")
    return PROFILES[name]


def _best_time(fn, *args, reps: int = 7) -> float:
    import jax  # noqa: PLC0415 - the table above needs no jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 4]  # a low quantile: the machine's speed, not its noise


def cpu_peak(devices: int) -> float:
    """FLOP/s each of the first `devices` devices reaches on a sharded matmul while all of them
    compute at once (the `cpu` profile's peak; measured again, it says whether the machine's
    speed changed)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = Mesh(np.asarray(jax.devices()[:devices]), ("d",))
    n, k = 256, 512
    a = jax.device_put(jnp.ones((devices * n, k), jnp.float32), NamedSharding(mesh, P("d")))
    w = jax.device_put(jnp.ones((k, k), jnp.float32), NamedSharding(mesh, P()))
    mm = jax.jit(lambda a, w: jnp.tanh(a @ w) @ w)
    return 2 * 2 * n * k * k / _best_time(mm, a, w)


def measure_cpu(devices: int) -> Profile:
    """The `cpu` profile of this machine over its first `devices` devices."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    devs = jax.devices()[:devices]
    mesh = Mesh(np.asarray(devs), ("d",))
    peak = cpu_peak(devices)

    def allreduce(x):
        return jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"),
                             out_specs=P("d"))(x)  # fmt: skip

    ar = jax.jit(allreduce)
    small = jax.device_put(jnp.ones((devices,), jnp.float32), NamedSharding(mesh, P("d")))
    latency = _best_time(ar, small) if devices > 1 else 0.0
    size = 1 << 20  # floats per device: 4 MiB
    big = jax.device_put(jnp.ones((devices * size,), jnp.float32), NamedSharding(mesh, P("d")))
    t_big = _best_time(ar, big, reps=5) if devices > 1 else 1.0
    wire = 2 * (devices - 1) / max(devices, 1) * size * 4
    bw = wire / max(t_big - latency, 1e-9) if devices > 1 else 1e12
    chain_len = 32

    def chain(x):
        for _ in range(chain_len):
            x = jnp.tanh(x @ x)
        return x

    tiny = jax.device_put(jnp.ones((devices * 8, 8), jnp.float32), NamedSharding(mesh, P("d")))
    sm = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    noop = jax.jit(jax.shard_map(lambda x: x + 1, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    step_s = _best_time(noop, tiny)
    op_s = max(_best_time(sm, tiny) - step_s, 0.0) / (2 * chain_len)
    try:
        import os  # noqa: PLC0415

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(devices, 1)
    except (ValueError, OSError, AttributeError):
        mem = 8 * GB
    return Profile("cpu", peak, 1.0, float(mem), bw, bw, latency, devices, 0.0, op_s, step_s)
