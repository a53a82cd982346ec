"""Device meshes: parse a mesh spec ("data=2,fsdp=2,tensor=2") and build the 4-D jax Mesh.

Every mesh jaxpar builds has the four axes (data, fsdp, tensor, pipeline), with size 1 for the
strategies not in use, so one rules table serves every layout and only the mesh shape changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "pipeline")
# Axes over which the batch is split (data parallelism, incl. ZeRO-3 sharding over fsdp).
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the four mesh axes; at most one may be -1 ("the rest of the devices")."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """Parse "data=2,fsdp=2,tensor=2" (unnamed axes default to 1; "" means data=-1)."""
        text = text.strip()
        if not text:
            return cls()
        sizes = dict.fromkeys(AXES, 1)
        seen: set[str] = set()
        for part in text.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if name in seen:
                raise ValueError(f"bad mesh spec {text!r}: axis {name!r} is given twice")
            seen.add(name)
            if not sep or name not in AXES:
                raise ValueError(
                    f"bad mesh spec {text!r}: {part!r} is not AXIS=SIZE with AXIS one of {AXES} "
                    f"(example: 'data=2,fsdp=2,tensor=2', or a preset name)"
                )
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(
                    f"bad mesh spec {text!r}: size of {name!r} must be an int"
                ) from None
        spec = cls(**sizes)
        spec._check_sizes()
        return spec

    def _check_sizes(self) -> None:
        sizes = self.sizes()
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ValueError(f"mesh spec {self}: only one axis may be -1 (the rest)")
        for name, v in sizes.items():
            if v == 0 or v < -1:
                raise ValueError(f"mesh spec {self}: axis {name!r} has size {v}; use >= 1 or -1")

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def resolve(self, num_devices: int) -> MeshSpec:
        """Return the spec with -1 filled in; raise if the product does not equal num_devices."""
        self._check_sizes()
        sizes = self.sizes()
        known = math.prod(v for v in sizes.values() if v != -1)
        free = [a for a, v in sizes.items() if v == -1]
        if free:
            if num_devices % known:
                raise ValueError(
                    f"mesh {self} cannot use {num_devices} devices: the fixed axes multiply to "
                    f"{known}, which does not divide {num_devices}; change the sizes"
                )
            sizes[free[0]] = num_devices // known
        elif known != num_devices:
            raise ValueError(
                f"mesh {self} has {known} positions but there are {num_devices} devices; "
                f"make the axis sizes multiply to {num_devices} (or set one axis to -1)"
            )
        return MeshSpec(**sizes)

    @property
    def size(self) -> int:
        return math.prod(self.sizes().values())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes().values())

    def __str__(self) -> str:
        return ",".join(f"{a}={v}" for a, v in self.sizes().items())


def batch_parallel_size(mesh: Mesh) -> int:
    """Number of ways the global batch is split (data x fsdp)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def make_mesh(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the 4-D (data, fsdp, tensor, pipeline) mesh with Auto axis types.

    Multi-process: processes are laid out along the batch axes (data first, then fsdp), so the
    slow cross-host links (DCN) carry only the data-parallel gradient reduction.
    """
    if isinstance(spec, str):
        spec = MeshSpec.parse(spec)
    devices = list(jax.devices() if devices is None else devices)
    spec = spec.resolve(len(devices))
    axis_types = (AxisType.Auto,) * len(AXES)
    nproc = len({d.process_index for d in devices})
    if nproc == 1:
        arr = np.asarray(devices, dtype=object).reshape(spec.shape)
        return Mesh(arr, AXES, axis_types=axis_types)
    return Mesh(_hybrid_devices(spec, devices, nproc), AXES, axis_types=axis_types)


def _hybrid_devices(spec: MeshSpec, devices: Sequence[jax.Device], nproc: int) -> np.ndarray:
    """Device array for a multi-process mesh: processes split the data axis, then fsdp."""
    dcn_data = math.gcd(spec.data, nproc)
    dcn_fsdp = nproc // dcn_data
    if spec.fsdp % dcn_fsdp:
        raise ValueError(
            f"mesh {spec} over {nproc} processes: the batch axes data={spec.data} x "
            f"fsdp={spec.fsdp} cannot be split across {nproc} processes; make data (or "
            f"data x fsdp) a multiple of the process count"
        )
    dcn = (dcn_data, dcn_fsdp, 1, 1)
    ici = (spec.data // dcn_data, spec.fsdp // dcn_fsdp, spec.tensor, spec.pipeline)
    by_proc: dict[int, list[jax.Device]] = {}
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        by_proc.setdefault(d.process_index, []).append(d)
    per_proc = {p: np.asarray(ds, dtype=object).reshape(ici) for p, ds in by_proc.items()}
    procs = np.asarray(sorted(per_proc), dtype=object).reshape(dcn)
    # Assemble [dcn_i * ici_i] per axis: block p of the grid holds process p's local devices.
    blocks = np.empty(dcn, dtype=object)
    for idx in np.ndindex(*dcn):
        blocks[idx] = per_proc[procs[idx]]
    return np.block(blocks.tolist())
