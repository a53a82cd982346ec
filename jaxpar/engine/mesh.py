"""Device meshes: the mesh axes, mesh specs ("data=2,fsdp=2,tensor=2") and the jax Mesh.

Every mesh jaxpar builds has all the axes of `AXIS_INFO` (data, fsdp, tensor, pipeline, context,
expert), with size 1 for the strategies not in use, so one rules table serves every layout and only the mesh shape
changes. `AXIS_INFO` is the one place the axes are declared: their order, what each is for and
the facts other modules derive from it (which axes split the batch, which hold replicas, which
processes are laid along). This module imports jax only where a Mesh is built, so the
supervisor can use the specs and facts without it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax
    import numpy as np
    from jax.sharding import Mesh


@dataclass(frozen=True)
class AxisInfo:
    """What jaxpar knows about one mesh axis."""

    name: str
    splits_batch: bool  # the global batch is split over it (rows per device shrink with it)
    replicas: bool  # the same parameters are held by every position (the replica check)
    hosts: bool  # multi-process meshes lay processes along it (in AXIS_INFO order)
    doc: str
    # Written in mesh texts ("data=2,fsdp=1,...") even at size 1. The axes added after the first
    # four are written only when > 1, so the texts (and the config hashes) of the layouts that
    # do not use them are what they were before those axes existed.
    always_written: bool = True


AXIS_INFO: tuple[AxisInfo, ...] = (
    AxisInfo("data", True, True, True, "data-parallel replicas (gradients all-reduced)"),
    AxisInfo("fsdp", True, False, True, "ZeRO-3: parameters and optimizer state sharded"),
    AxisInfo("tensor", False, False, False, "Megatron tensor parallelism inside a layer"),
    AxisInfo("pipeline", False, False, False, "pipeline stages over stacked layers"),
    # The sequence split into blocks (ring / all-gather / all-to-all attention): every position
    # holds the same parameters. Rings and all-to-alls want the fast links: inside a host.
    AxisInfo("context", False, True, False, "context parallelism: the sequence split", False),
    # Experts split over it; outside the MoE layers it is one more way of splitting the batch
    # (tokens reach their experts by all-to-all). Inside a host, like `context`.
    AxisInfo("expert", True, False, False, "expert parallelism: MoE experts split", False),
)
AXES: tuple[str, ...] = tuple(a.name for a in AXIS_INFO)
# Axes over which the batch is split (data parallelism, incl. ZeRO-3 sharding over fsdp).
BATCH_AXES: tuple[str, ...] = tuple(a.name for a in AXIS_INFO if a.splits_batch)
# Axes whose positions hold identical parameters (compared by the replica check).
REPLICA_AXES: tuple[str, ...] = tuple(a.name for a in AXIS_INFO if a.replicas)
# Axes that processes are laid along, outermost first (cross-host links carry only their traffic).
HOST_AXES: tuple[str, ...] = tuple(a.name for a in AXIS_INFO if a.hosts)
# The axis of data-parallel replicas: manual in the data-parallel strategies (jaxpar.parallel).
DATA = "data"


def batch_ways(sizes: dict[str, int]) -> int:
    """Ways the global batch is split for axis sizes `sizes` (absent axes count as 1)."""
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def mesh_text(sizes: dict[str, int]) -> str:
    """ "data=2,fsdp=1,..." for the axes present in `sizes`, in mesh order (MeshSpec.parse's form)."""
    shown = {a.name for a in AXIS_INFO if a.always_written}
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a in sizes and (a in shown or sizes[a] != 1))


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the mesh axes; at most one may be -1 ("the rest of the devices").

    Its fields are the axes of AXIS_INFO, in order (checked at import).
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1

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
        return mesh_text(self.sizes())


if tuple(f.name for f in dataclasses.fields(MeshSpec)) != AXES:
    raise AssertionError(f"MeshSpec's fields must be the mesh axes {AXES}, in order")


def batch_parallel_size(mesh: Mesh) -> int:
    """Number of ways the global batch is split (data x fsdp x expert)."""
    return batch_ways(dict(mesh.shape))


def make_mesh(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the mesh of every axis in AXES (size 1 where unused) with Auto axis types.

    Multi-process: processes are laid out along HOST_AXES (data first, then fsdp), so the
    slow cross-host links (DCN) carry only the data-parallel gradient reduction.
    """
    import jax  # noqa: PLC0415 - the specs and axis facts above need no jax
    import numpy as np  # noqa: PLC0415
    from jax.sharding import AxisType, Mesh  # noqa: PLC0415

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
    """Device array for a multi-process mesh: processes split HOST_AXES in order (data, then
    fsdp): each takes the largest share of the remaining processes that divides it."""
    import numpy as np  # noqa: PLC0415

    sizes, left = spec.sizes(), nproc
    dcn_sizes = dict.fromkeys(AXES, 1)
    for a in HOST_AXES:
        dcn_sizes[a] = math.gcd(sizes[a], left)
        left //= dcn_sizes[a]
    if left != 1:
        axes = " x ".join(f"{a}={sizes[a]}" for a in HOST_AXES)
        raise ValueError(
            f"mesh {spec} over {nproc} processes: the batch axes {axes} cannot be split across "
            f"{nproc} processes; make data (or data x fsdp) a multiple of the process count"
        )
    dcn = tuple(dcn_sizes[a] for a in AXES)
    ici = tuple(sizes[a] // dcn_sizes[a] for a in AXES)
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
