"""Accelerators compiled for on this host: `--target NAME` of `jaxpar inspect` and `jaxpar tune`.

XLA's own TPU and CUDA compilers run without the device: a compile-only topology of the
target's devices (`jax.experimental.topologies`) gives a mesh of devices that exist only for the
compiler, and the train step is lowered and compiled for it as it would be on the real machine.
What comes back is the target's optimised program: its per-device memory (the TPU compiler
refuses a program over its HBM; for CUDA jaxpar compares the peak with the card's memory),
FLOPs, the collectives it scheduled, and the SPMD partitioner's warnings.

The compilers are optional packages: `pip install "jaxpar[tpu-aot]"` (libtpu) and
`pip install "jaxpar[cuda-aot]"` (the CUDA PJRT plugin and ptxas), pinned in constraints.txt.
Installed next to jax, jax probes for the devices they serve at every start-up (and prints
what it did not find); a folder of their own (`pip install --target DIR`) named by
`JAXPAR_TARGET_PACKAGES=DIR` keeps jax's start-up as it was, and jaxpar loads them from there.

    jaxpar inspect --recipe gpt_350m --mesh fsdp8 --target h100x8
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from functools import partial

from jaxpar.engine import collectives

ENV_PACKAGES = "JAXPAR_TARGET_PACKAGES"
TPU_LOG_LEVEL = "TPU_STDERR_LOG_LEVEL"  # 1: libtpu's warnings reach stderr (0 info, 2 errors)
EXTRA = {"tpu": "tpu-aot", "cuda": "cuda-aot"}
GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class Target:
    """One accelerator system: its devices, hosts, per-device memory and how to describe its
    topology to its compiler (TPU: `get_topology_desc` arguments; CUDA: the "slices x hosts x
    GPUs" shape and a GpuTargetConfigProto, the card as XLA's autotuner-free compiler sees it)."""

    name: str
    family: str  # "tpu" or "cuda"
    device: str  # the device, in words
    devices: int
    hosts: int
    memory_bytes: int  # per device
    topology: dict = field(default_factory=dict)
    config: str = ""  # CUDA: GpuTargetConfigProto text
    source: str = ""

    @property
    def extra(self) -> str:
        return EXTRA[self.family]

    # What the doctor asks of a target (it compiles through these, importing nothing of here)
    def compile_devices(self) -> list:
        return devices(self)

    def options(self) -> dict:
        return compiler_options(self)

    def failure(self, error: BaseException) -> TargetError:
        return failure(self, error)


def _gpu_config(
    name: str, major: int, minor: int, feature: str, cores: int, fpus: int, memory: int,
    bandwidth: int, l2: int, clock: float, smem_core: int, smem_optin: int,
) -> str:  # fmt: skip
    """A GpuTargetConfigProto in text form, with only the fields this XLA's proto holds (the
    device description of XLA's backends/gpu/target_config/specs/ files)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {smem_core}
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {memory}
  shared_memory_per_block_optin: {smem_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {feature} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{name}"
"""


H100_BYTES = 84_942_979_072  # what the driver reports usable of the 80 GB (XLA's h100_sxm spec)
H200_BYTES = 151_397_597_184
A100_BYTES = 85_100_068_864
_H100 = _gpu_config("NVIDIA H100 80GB HBM3", 9, 0, "ACCELERATED_FEATURES", 132, 128, H100_BYTES,
                    3_352_320_000_000, 52_428_800, 1.98, 233_472, 232_448)  # fmt: skip
_H200 = _gpu_config("NVIDIA H200 141GB HBM3e", 9, 0, "ACCELERATED_FEATURES", 132, 128, H200_BYTES,
                    4_800_000_000_000, 52_428_800, 1.98, 233_472, 232_448)  # fmt: skip
_A100 = _gpu_config("NVIDIA A100-SXM4-80GB", 8, 0, "NONE", 108, 64, A100_BYTES,
                    2_039_040_000_000, 41_943_040, 1.41, 167_936, 166_912)  # fmt: skip
_NO_WRAP = (False, False, False)


def _tpu(name: str, chip: str, per_host: tuple, wrap: tuple = _NO_WRAP) -> dict:
    return {
        "topology_name": name, "chip_config_name": chip, "chips_per_host_bounds": per_host,
        "num_slices": 1, "wrap": wrap,
    }  # fmt: skip


_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense "
    "BF16, NVLink 4 at 900 GB/s; DGX H100: 8 GPUs per host, one 400 Gb/s InfiniBand NIC per GPU. "
    "Compiler's card: XLA's specs/h100_sxm.txtpb (sm_90a, 132 SMs, 84,942,979,072 bytes)"
)
_V5E_SOURCE = (
    "Cloud TPU v5e documentation: 197 TFLOP/s BF16 and 16 GiB HBM2 (819 GB/s) per chip, ICI "
    "1,600 Gbps per chip"
)
_V5P_SOURCE = (
    "Cloud TPU v5p documentation: 459 TFLOP/s BF16 and 95 GB HBM2e (2,765 GB/s) per chip, ICI "
    "4,800 Gbps per chip, 4 chips per host, one device per chip (megacore)"
)
# fmt: off
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("h100x8", "cuda", "NVIDIA H100 SXM 80GB", devices=8, hosts=1, memory_bytes=H100_BYTES,
           topology={"topology": "1x1x8"}, config=_H100, source=_H100_SOURCE),
    Target("h100x16", "cuda", "NVIDIA H100 SXM 80GB", devices=16, hosts=2, memory_bytes=H100_BYTES,
           topology={"topology": "1x2x8"}, config=_H100, source=_H100_SOURCE + "; two hosts"),
    Target("h200x8", "cuda", "NVIDIA H200 SXM 141GB", devices=8, hosts=1, memory_bytes=H200_BYTES,
           topology={"topology": "1x1x8"}, config=_H200,
           source="NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense "
           "BF16, NVLink 4 at 900 GB/s; DGX H200: 8 GPUs per host. Compiler's card: XLA's "
           "specs/h200.txtpb (sm_90a, 132 SMs, 151,397,597,184 bytes)"),
    Target("a100x8", "cuda", "NVIDIA A100 SXM4 80GB", devices=8, hosts=1, memory_bytes=A100_BYTES,
           topology={"topology": "1x1x8"}, config=_A100,
           source="NVIDIA A100 datasheet (SXM4 80GB): 80 GB HBM2e at 2,039 GB/s, 312 TFLOP/s "
           "dense BF16, NVLink 3 at 600 GB/s; DGX A100: 8 GPUs per host. Compiler's card: XLA's "
           "specs/a100_sxm_80.txtpb (sm_80, 108 SMs, 85,100,068,864 bytes)"),
    Target("v5e-8", "tpu", "TPU v5e", devices=8, hosts=1, memory_bytes=16 * GIB,
           topology=_tpu("v5e:2x4", "default", (2, 4, 1)),
           source=_V5E_SOURCE + "; v5litepod-8 is one host of 8 chips (2x4)"),
    Target("v5e-256", "tpu", "TPU v5e", devices=256, hosts=64, memory_bytes=16 * GIB,
           topology=_tpu("v5e:16x16", "default", (2, 2, 1), (True, True, False)),
           source=_V5E_SOURCE + "; v5litepod-256 is a full pod, 16x16 chips (a 2D torus) on 64 "
           "hosts of 4"),
    Target("v5p-32", "tpu", "TPU v5p", devices=16, hosts=4, memory_bytes=95 * GB,
           topology=_tpu("v5:2x2x4", "megacore", (2, 2, 1)),
           source=_V5P_SOURCE + "; v5p-32 is 2x2x4 chips (32 TensorCores) on 4 hosts"),
    Target("v5p-128", "tpu", "TPU v5p", devices=64, hosts=16, memory_bytes=95 * GB,
           topology=_tpu("v5:4x4x4", "megacore", (2, 2, 1), (True, True, True)),
           source=_V5P_SOURCE + "; v5p-128 is 4x4x4 chips (a 3D torus) on 16 hosts"),
    Target("v6e-8", "tpu", "TPU v6e", devices=8, hosts=1, memory_bytes=32 * GIB,
           topology=_tpu("v6e:2x4", "default", (2, 4, 1)),
           source="Cloud TPU v6e (Trillium) documentation: 918 TFLOP/s BF16 and 32 GiB HBM "
           "(1,640 GB/s) per chip, ICI 3,584 Gbps per chip; v6e-8 is one host of 8 chips (2x4)"),
)}
# fmt: on


class TargetError(ValueError):
    """A target that cannot be compiled for: one line for the user (exit 2)."""


class DoesNotFit(TargetError):
    """The program needs more memory per device than the target has."""


def names() -> list[str]:
    return list(TARGETS)


def get(name: str) -> Target:
    """A target by name; one line listing the known ones for any other."""
    if name not in TARGETS:
        raise TargetError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]


# --------------------------------------------------------------------------- the compilers


_PACKAGES = {  # family -> (distribution, file inside it) the compiler needs
    "tpu": ("libtpu", "libtpu/libtpu.so"),
    "cuda": ("jax-cuda12-pjrt", "jax_plugins/xla_cuda12/xla_cuda_plugin.so"),
}
_PTXAS = ("nvidia-cuda-nvcc-cu12", "nvidia/cuda_nvcc")


def locate(dist: str, inside: str) -> str | None:
    """A file of an installed distribution: from `$JAXPAR_TARGET_PACKAGES` first, then from the
    interpreter's own packages; None when neither holds it."""
    folders = [os.environ[ENV_PACKAGES]] if os.environ.get(ENV_PACKAGES) else []
    for path in (folders, sys.path) if folders else (sys.path,):
        for d in importlib.metadata.distributions(name=dist, path=path):
            found = os.fspath(d.locate_file(inside))
            if os.path.exists(found):
                return found
    return None


def _missing(t: Target, what: str) -> TargetError:
    where = (
        f" (nor in {ENV_PACKAGES}={os.environ[ENV_PACKAGES]})"
        if os.environ.get(ENV_PACKAGES)
        else ""
    )
    return TargetError(
        f"target {t.name} needs {what}, which is not installed{where}: "
        f'pip install "jaxpar[{t.extra}]" -c constraints.txt'
    )


def _first_error(text: str) -> str:
    """The first line of a compiler's error that says something (not a stack frame)."""
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    for line in lines:
        if re.search(r"(RESOURCE_EXHAUSTED|INVALID_ARGUMENT|INTERNAL|FAILED_PRECONDITION|"
                      r"UNIMPLEMENTED|NOT_FOUND|Error|error)", line):  # fmt: skip
            return line
    return lines[0] if lines else "(no message)"


def installed(family: str) -> bool:
    """Whether the compiler of a target family ("tpu", "cuda") can be loaded here."""
    found = locate(*_PACKAGES[family]) is not None
    if family == "cuda":
        found = found and (locate(*_PTXAS) is not None or shutil.which("ptxas") is not None)
    return found


def _loaded(platform: str) -> bool:
    from jaxlib import xla_client  # noqa: PLC0415

    return bool(xla_client.pjrt_plugin_loaded(platform))


_TOPOLOGIES: dict[str, list] = {}


def devices(t: Target) -> list:
    """The compile-only devices of the target's topology (its compiler loaded on first use)."""
    if t.name not in _TOPOLOGIES:
        _TOPOLOGIES[t.name] = _tpu_devices(t) if t.family == "tpu" else _cuda_devices(t)
    return _TOPOLOGIES[t.name]


def _tpu_devices(t: Target) -> list:
    import jax  # noqa: PLC0415 - the table above needs no jax
    from jax.experimental import topologies  # noqa: PLC0415
    from jaxlib import xla_client  # noqa: PLC0415

    from jaxpar.tools.doctor import captured_stderr  # noqa: PLC0415

    jax.devices()  # this host's own backends come up as they would without the target
    if not _loaded("tpu"):
        path = locate(*_PACKAGES["tpu"])
        if path is None:
            raise _missing(t, "XLA's TPU compiler (libtpu)")
        # libtpu logs only errors to stderr unless told otherwise, and the SPMD partitioner's
        # involuntary rematerializations (what the doctor reads) are warnings. libtpu reads this
        # from the environment once, as it loads; a level the user set is left as it is.
        os.environ.setdefault(TPU_LOG_LEVEL, "1")
        xla_client.load_pjrt_plugin_dynamically("tpu", path)
    # libtpu looks for TPU chips and hosts when it starts and logs what it does not find here
    try:
        with captured_stderr(echo=False) as err:
            topo = topologies.get_topology_desc(platform="tpu", **t.topology)
    except Exception as e:  # noqa: BLE001 - the compiler's own words, one line
        raise TargetError(f"target {t.name}: libtpu could not describe the topology: "
                          f"{_libtpu_error(e, err)}") from None  # fmt: skip
    return list(topo.devices)


def _libtpu_error(e: Exception, err: list) -> str:
    text = f"{e}\n{err[0] if err else ''}"
    if "lockfile" in text or "TPU in use" in text:
        return (
            "another process holds libtpu's lockfile (/tmp/libtpu_lockfile); to compile beside "
            "it on a host without TPU chips, set ALLOW_MULTIPLE_LIBTPU_LOAD=1"
        )
    return _first_error(str(e))


def _no_client():
    raise RuntimeError("compile-only: this host has no such device")


def _cuda_devices(t: Target) -> list:
    import jax  # noqa: PLC0415
    import jax.extend.backend  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415
    from jaxlib import xla_client  # noqa: PLC0415

    from jaxpar.tools.doctor import captured_stderr  # noqa: PLC0415

    jax.devices()  # this host's own backends first: the plugin below only describes topologies
    cuda_data_dir(t)  # ptxas must be there before anything is compiled
    if not _loaded("cuda"):
        path = locate(*_PACKAGES["cuda"])
        if path is None:
            raise _missing(t, "XLA's CUDA compiler (the jax-cuda12-pjrt plugin)")
        # it logs that this host has no CUDA driver as it loads: true, and not needed here
        with captured_stderr(echo=False):
            c_api = xla_client.load_pjrt_plugin_dynamically("cuda", path)
        jax.extend.backend.register_backend_factory(
            "cuda", _no_client, priority=-1, fail_quietly=True, c_api=c_api,
            make_topology=partial(xla_client.make_c_api_device_topology, c_api),
        )  # fmt: skip
    try:
        with captured_stderr(echo=False):
            topo = topologies.get_topology_desc(
                platform="cuda", topology=t.topology["topology"], target_config=t.config
            )
    except Exception as e:  # noqa: BLE001 - the plugin's own words, one line
        raise TargetError(
            f"target {t.name}: the CUDA plugin could not describe the topology: "
            f"{_first_error(str(e))}"
        ) from None
    return list(topo.devices)


def cuda_data_dir(t: Target) -> str | None:
    """The CUDA folder whose bin/ptxas and nvvm/libdevice XLA uses: the nvidia-cuda-nvcc
    package's; None where only a ptxas on PATH serves."""
    found = locate(*_PTXAS)
    if found is None and shutil.which("ptxas") is None:
        raise _missing(t, "ptxas (nvidia-cuda-nvcc-cu12)")
    return found


def compiler_options(t: Target) -> dict:
    """Per-compilation XLA options of a target (nothing global changes)."""
    if t.family == "cuda":
        folder = cuda_data_dir(t)
        return {"xla_gpu_cuda_data_dir": folder} if folder else {}
    return {}


# --------------------------------------------------------------------------- a compiled step


@dataclass
class Result:
    """The train step compiled for a target, and what its compiler said about it."""

    target: Target
    compiled: object
    hlo: str
    seconds: float
    memory: dict  # collectives.memory: per-device bytes
    flops: float  # per device per step
    flops_source: str
    colls: list = field(default_factory=list)  # collectives.Collective of the optimised program
    remats: list = field(default_factory=list)  # the partitioner's warnings (doctor.parse_warnings)

    @property
    def fits(self) -> bool:
        """Whether the program fits the device: on TPU the compiler refuses any program that
        does not; for CUDA its peak against the card's memory."""
        if self.target.family == "tpu":
            return True
        return (self.memory.get("peak") or 0) <= self.target.memory_bytes


def failure(t: Target, error: BaseException) -> TargetError:
    """A target compilation's exception as one line: DoesNotFit with the compiler's words when
    it ran out of memory, else the first line of the error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text:
        return DoesNotFit(f"does not fit on {t.name} ({t.device}): {_oom_line(text)}")
    return TargetError(f"the {t.name} compiler failed: {_first_error(text)}")


def _oom_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    first = next((x for x in lines if "RESOURCE_EXHAUSTED" in x), lines[0])
    more = [
        x for x in lines[lines.index(first) + 1 :] if re.search(r"\b(Used|Exceeded|Total hbm)\b", x)
    ]
    return " ".join(dict.fromkeys([first, *more[:2]]))


def oom_bytes(line: str) -> int | None:
    """Bytes per device a TPU out-of-memory line says the program needs ("... required for HLO
    temporaries (64.08G) exceeds available HBM (15.75G)", "Used 20.5G of 15.75G hbm")."""
    m = re.search(r"required for [^(]*\(([\d.]+)([KMGT])?\)", line) or re.search(
        r"Used ([\d.]+)([KMGT])? of", line
    )
    if not m:
        return None
    scale = {None: 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def compile_lowered(t: Target, lowered, mesh, switch=None) -> Result:
    """Compile `lowered` (lowered for `devices(t)`) with the target's compiler. Raises
    DoesNotFit or TargetError (`failure`). `switch`: collectives.hlo_cost's (a pipeline's
    schedule table)."""
    from jaxpar.tools import doctor  # noqa: PLC0415 - doctor's users import this module

    t0 = time.perf_counter()
    try:
        compiled, err = doctor.compile_warned(lowered, compiler_options(t), echo=False)
    except Exception as e:  # noqa: BLE001 - XLA's errors are RuntimeErrors of its own
        raise failure(t, e) from None
    return result(t, compiled, compiled.as_text(), time.perf_counter() - t0,
                  doctor.parse_warnings(err), mesh, switch)  # fmt: skip


def result(t: Target, compiled, hlo: str, seconds: float, remats: list, mesh,
           switch=None) -> Result:  # fmt: skip
    """The figures of a program compiled for `t` (memory, FLOPs, collectives)."""
    flops, source = step_flops(compiled, hlo, switch)
    mem = collectives.memory(compiled)
    live = mem["arguments"] + mem["outputs"] - mem["aliased"]
    if not mem["temps"] and (mem["peak"] or 0) > live:
        mem["temps"] = mem["peak"] - live  # the TPU compiler reports its peak, not temporaries
    return Result(t, compiled, hlo, seconds, mem, flops, source,
                  collectives.audit_hlo(hlo, mesh), remats)  # fmt: skip


def step_flops(compiled, hlo: str, switch=None) -> tuple[float, str]:
    """FLOPs per device of one run: the dots and convolutions of the optimised module with loop
    bodies counted by their trip count (collectives.hlo_flops), or XLA's cost analysis where it
    counts more (it adds elementwise work, but counts a loop body once)."""
    counted = collectives.hlo_flops(hlo, switch)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    xla = float(cost.get("flops", 0.0))
    if xla > counted:
        return xla, "XLA's cost analysis"
    return counted, "the optimised program's dots and convolutions, loops x trip count"


def check_mesh(t: Target, spec) -> None:
    """A mesh whose device count is not the target's: one line."""
    from jaxpar.engine.mesh import mesh_text  # noqa: PLC0415

    sizes = spec.sizes()
    known = math.prod(v for v in sizes.values() if v != -1)
    ok = t.devices % known == 0 if -1 in sizes.values() else known == t.devices
    if not ok:
        shown = mesh_text({a: n for a, n in sizes.items() if n != 1} or {"data": 1})
        raise TargetError(
            f"mesh {shown} has {known} devices but target {t.name} has {t.devices} "
            f"({t.hosts} host(s)); give a mesh of {t.devices} devices, e.g. --mesh "
            f"data={t.devices} or --mesh fsdp={t.devices}"
        )


def describe(t: Target) -> str:
    return (
        f"{t.name}: {t.devices} x {t.device} on {t.hosts} host(s), "
        f"{t.memory_bytes / GIB:.1f} GiB per device; compiled by XLA's "
        f"{'TPU compiler (libtpu)' if t.family == 'tpu' else 'CUDA compiler (ptxas for sm_' + _sm(t) + ')'}"
    )


def _sm(t: Target) -> str:
    m = re.search(r"major: (\d+) minor: (\d+)", t.config)
    return f"{m.group(1)}{m.group(2)}" if m else "?"


def as_dict(t: Target) -> dict:
    return {
        "name": t.name, "family": t.family, "device": t.device, "devices": t.devices,
        "hosts": t.hosts, "memory_bytes_per_device": t.memory_bytes, "source": t.source,
    }  # fmt: skip
