"""Logical axis names -> mesh axes: the rules resolver, presets, validation and activation constraints.

How a rule is picked: docs/design.md, "The engine"; the logical vocabulary: docs/model_contract.md,
"The model".
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.engine.mesh import AXES, MeshSpec

VOCAB: tuple[str, ...] = (
    "batch", "seq", "embed", "mlp", "heads", "kv", "head_dim", "vocab", "layers", "stage",
    "conv_in", "conv_out", "classes", "height", "width", "norm", "expert",
)  # fmt: skip

Rule = tuple[str, str | tuple[str, ...] | None]
Rules = tuple[Rule, ...]

# One table serves DP, FSDP, TP, PP and their mixes: unused strategies are size-1 mesh axes.
PARAM_RULES: Rules = (
    ("layers", "pipeline"),
    ("expert", "expert"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("vocab", "tensor"),
    ("conv_out", "tensor"),
    ("mlp", "fsdp"),
    ("vocab", "fsdp"),
    ("conv_in", "fsdp"),
)
ACT_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", "context"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("vocab", "tensor"),
    ("conv_out", "tensor"),
)


@dataclass(frozen=True)
class Preset:
    """A named layout: a mesh spec plus parameter and activation rules tables."""

    mesh: MeshSpec
    params: Rules = PARAM_RULES
    acts: Rules = ACT_RULES
    description: str = ""
    num_processes: int = 1  # hosts the layout is meant for (informational; meshes span them)
    extra: dict = field(default_factory=dict, compare=False)


def validate_rules(rules: Rules, *, new_names: bool = False) -> None:
    """Raise ValueError for an unknown logical name or mesh axis in a rules table.

    `new_names`: the table may introduce logical names outside VOCAB (a recipe's rules for its
    own model's names); its mesh axes are still checked.
    """
    for logical, axes in rules:
        if not isinstance(logical, str):
            raise ValueError(f"rule ({logical!r}, {axes!r}): the logical name must be a string")
        if logical not in VOCAB and not new_names:
            raise ValueError(
                f"rule ({logical!r}, {axes!r}): unknown logical axis; use one of {VOCAB}"
            )
        for ax in _as_tuple(axes):
            if ax not in AXES:
                raise ValueError(
                    f"rule ({logical!r}, {axes!r}): unknown mesh axis {ax!r}; use {AXES}"
                )


def _as_tuple(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    logical: Sequence[str | None], rules: Rules, mesh: Mesh, *, exclude: Sequence[str] = ()
) -> PartitionSpec:
    """Resolve logical axis names to a PartitionSpec ("first rule with unused mesh axes wins").

    `exclude` lists mesh axes that must not appear (e.g. manual axes inside a shard_map).
    """
    used: set[str] = set(exclude)
    out: list[str | tuple[str, ...] | None] = []
    for name in logical:
        if name is not None and name not in VOCAB and all(r[0] != name for r in rules):
            raise ValueError(
                f"unknown logical axis {name!r}; the vocabulary is {VOCAB}, or give the recipe a "
                f"rule for it (TrainConfig.rules, e.g. ({name!r}, 'tensor'))"
            )
        chosen: tuple[str, ...] = ()
        for rule_name, axes in rules:
            if rule_name != name:
                continue
            live = tuple(a for a in _as_tuple(axes) if mesh.shape[a] > 1)
            if live and not (set(live) & used):
                chosen = live
                break
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*out)


def check_spec(spec: PartitionSpec) -> None:
    """Raise if one mesh axis appears twice in a spec (an internal or hand-written mistake)."""
    seen: list[str] = []
    for entry in spec:
        for ax in _as_tuple(entry):
            if ax in seen:
                raise ValueError(f"PartitionSpec {spec} uses mesh axis {ax!r} twice; give it once")
            seen.append(ax)


def check_divisible(
    path: str, shape: Sequence[int], logical: Sequence[str | None], spec: PartitionSpec, mesh: Mesh
) -> None:
    """Raise ValueError naming parameter, shape, logical and mesh axes if a dim does not divide."""
    for dim, (size, name) in enumerate(zip(shape, logical, strict=True)):
        entry = spec[dim] if dim < len(spec) else None
        axes = _as_tuple(entry)
        ways = math.prod(mesh.shape[a] for a in axes)
        if ways > 1 and size % ways:
            raise ValueError(
                f"parameter {path} of shape {tuple(shape)}: dimension {dim} (logical {name!r}, "
                f"size {size}) is not divisible by mesh axes {axes} of size {ways}; change the "
                f"model size, the mesh, or the rule for {name!r}"
            )


def named_sharding(
    path: str, shape: Sequence[int], logical: Sequence[str | None] | None, rules: Rules, mesh: Mesh
) -> NamedSharding:
    """Validated NamedSharding for one array (replicated when it has no logical names)."""
    if logical is None:
        return NamedSharding(mesh, PartitionSpec())
    if len(logical) > len(shape):
        raise ValueError(
            f"parameter {path}: {len(logical)} logical names {tuple(logical)} for shape "
            f"{tuple(shape)}; give one name (or None) per dimension"
        )
    # Fewer names than dimensions: the rest are unnamed, as in a PartitionSpec (Flax's
    # sharding guide writes P(None, 'model') for 3-D attention kernels).
    logical = (*logical, *(None,) * (len(shape) - len(logical)))
    spec = logical_to_spec(logical, rules, mesh)
    check_spec(spec)
    check_divisible(path, shape, logical, spec, mesh)
    return NamedSharding(mesh, spec)


# ---- activation constraints -------------------------------------------------------------------


@dataclass(frozen=True)
class _ActContext:
    mesh: Mesh
    rules: Rules
    manual: tuple[str, ...] = ()


_ACT: contextvars.ContextVar[_ActContext | None] = contextvars.ContextVar(
    "jaxpar_act", default=None
)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules, manual: Sequence[str] = ()) -> Iterator[None]:
    """Within this context (while tracing), `constrain` shards activations by `rules` on `mesh`.

    `manual` names mesh axes that are manual (inside a shard_map) and so must not be constrained.
    """
    token = _ACT.set(_ActContext(mesh, tuple(rules), tuple(manual)))
    try:
        yield
    finally:
        _ACT.reset(token)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names; identity outside activation_rules."""
    ctx = _ACT.get()
    if ctx is None:
        return x
    if len(logical) != x.ndim:
        raise ValueError(f"constrain: {len(logical)} names {tuple(logical)} for shape {x.shape}")
    spec = logical_to_spec(logical, ctx.rules, ctx.mesh, exclude=ctx.manual)
    if ctx.manual:
        # Inside a shard_map: the current abstract mesh knows which axes are manual.
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(jax.sharding.get_abstract_mesh(), spec)
        )
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))
