"""Collective audit: which collectives XLA put into a compiled program, and over which mesh axes.

    colls = audit(jax.jit(step).lower(state, batch).compile(), mesh)
    print(format_audit(colls))

Reading the optimised HLO (device numbering, replica groups, async pairs): docs/design.md, "The engine".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from jax.sharding import AbstractMesh, Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Element types whose width is not the number in their name (f8e4m3fn, bf16, s4 are).
_ELEMENT_BITS = {"pred": 8, "token": 0}


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program (async start/done pairs count once)."""

    kind: str  # one of KINDS
    dtype: str  # HLO element type of the result; mixed tuples: sorted unique, comma-joined
    bytes: int  # bytes of the result per device, summed over tuple elements
    mesh_axes: tuple[str, ...]  # mesh axes the groups span, in mesh axis order; () if trivial
    group_size: int
    computation: str  # HLO computation the instruction sits in
    in_loop: bool  # inside a while body (directly or through calls)
    trip_count: int | None  # executions per program run, product over enclosing loops

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per execution with ring / pairwise algorithms (n = group size):
        all-reduce 2(n-1)/n x size; all-gather and all-to-all (n-1)/n x result; reduce-scatter
        (n-1) x result; collective-permute the result."""
        n = max(self.group_size, 1)
        factor = {
            "all-reduce": 2 * (n - 1) / n,
            "all-gather": (n - 1) / n,
            "all-to-all": (n - 1) / n,
            "reduce-scatter": float(n - 1),
            "collective-permute": 1.0,
        }[self.kind]
        return self.bytes * factor

    @property
    def executions(self) -> int:
        """How many times the op runs per program run (1 when a loop's trip count is unknown)."""
        return self.trip_count if self.in_loop and self.trip_count is not None else 1


@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: str
    attrs: str


# --------------------------------------------------------------------------- HLO text parsing

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([^\]]*)\]")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start : start + 120]!r}")


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    # Tuple shapes contain spaces and /*index=N*/ comments, so they are cut by bracket depth.
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end <= 0:
        return None
    shape, tail = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", tail)
    if not op:
        return None
    close = _balanced(tail, op.end() - 1)
    return _Instr(name, shape, op.group(1), tail[op.end() : close - 1], tail[close:])


def _parse_module(hlo_text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Computations of an HLO module (name -> instructions) and the entry computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header and " = " not in line.split("(", 1)[0]:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            instr = _parse_instr(line)
            if instr is not None:
                comps[current].append(instr)
    return comps, entry


def _shape_info(shape: str) -> tuple[str, int]:
    """(dtype, bytes) of an HLO shape; tuples sum their elements, dtypes are sorted unique."""
    dtypes, total = set(), 0
    for dtype, dims in _ARRAY.findall(shape):
        width = re.search(r"\d+", dtype)
        bits = _ELEMENT_BITS.get(dtype, int(width.group()) if width else None)
        if bits is None:
            continue
        # Dynamic dimensions print as "<=N"; their bound is what the buffer holds.
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
        total += (int(np.prod(sizes, dtype=np.int64)) * bits + 7) // 8
        if dtype != "token":
            dtypes.add(dtype)
    return ",".join(sorted(dtypes)), total


# --------------------------------------------------------------------------- replica groups


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text)]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    arr = np.arange(int(np.prod(reshape, dtype=np.int64))).reshape(reshape)
    return arr.transpose(perm) if perm else arr


def _parse_iota(text: str) -> tuple[np.ndarray, int]:
    """``[dims]<=[reshape]T(perm)`` (or without ``[dims]<=``) -> (array, chars consumed)."""
    m = re.match(r"\s*(?:\[([\d,]*)\]<=)?\[([\d,]*)\](?:T\(([\d,]*)\))?", text)
    if not m:
        raise ValueError(f"cannot parse iota device list {text[:80]!r}")
    arr = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
    if m.group(1) is not None:
        arr = arr.reshape(_ints(m.group(1)))
    return arr, m.end()


def _mesh_axes_groups(text: str) -> np.ndarray:
    """Groups of ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` (sub-axes ``'a':(1)2`` too)."""
    m = re.match(r"mesh\[([^\]]*)\]", text)
    if not m:
        raise ValueError(f"cannot parse mesh replica groups {text[:120]!r}")
    axes = [a.split("=") for a in m.group(1).split(",") if a]
    names = [n.strip().strip("'\"") for n, _ in axes]
    sizes = [int(s) for _, s in axes]
    rest = text[m.end() :]
    devices = np.arange(int(np.prod(sizes, dtype=np.int64)))
    ids = re.match(r",\s*device_ids=\(", rest)
    if ids:
        close = _balanced(rest, ids.end() - 1)
        inner = rest[ids.end() : close - 1]
        devices = _device_ids(inner)
        rest = rest[close:]
    grouped = re.match(r"\s*\{([^}]*)\}", rest)
    if not grouped:
        raise ValueError(f"mesh replica groups without axes: {text[:120]!r}")
    refs: dict[int, list[tuple[int, int]]] = {}
    for ref in filter(None, (r.strip() for r in grouped.group(1).split(","))):
        sub = re.match(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?$", ref)
        if not sub or sub.group(1) not in names:
            raise ValueError(f"unknown mesh axis {ref!r} in replica groups {text[:120]!r}")
        dim = names.index(sub.group(1))
        pre, size = (int(sub.group(2)), int(sub.group(3))) if sub.group(2) else (1, sizes[dim])
        refs.setdefault(dim, []).append((pre, size))
    return _group_by_axes(np.asarray(devices).reshape(sizes), sizes, refs)


def _device_ids(text: str) -> np.ndarray:
    """A mesh's ``device_ids=(...)``: an iota (``[4,2]T(1,0)``) or a plain list of ids."""
    if re.fullmatch(r"[\d,\s]+", text):
        return np.asarray(_ints(text))
    arr, used = _parse_iota(text)
    if text[used:].strip():  # an unknown spelling must not be misread as a plain iota
        raise ValueError(f"cannot parse mesh device_ids ({text[:120]})")
    return arr


def _group_by_axes(devices: np.ndarray, sizes: list[int], refs: dict) -> np.ndarray:
    """Split each mesh dim into its (sub-)axes, move grouped ones last, one row per group."""
    dims, grouped = [], []
    for dim, full in enumerate(sizes):
        done = 1  # product of the sub-axis sizes laid out so far, major to minor
        for pre, size in sorted(refs.get(dim, [])):
            if pre != done:  # an ungrouped stretch of this axis before the sub-axis
                dims.append(pre // done)
            grouped.append(len(dims))
            dims.append(size)
            done = pre * size
        if done != full:
            dims.append(full // done)
    kept = [d for d in range(len(dims)) if d not in grouped]
    group_size = int(np.prod([dims[d] for d in grouped], dtype=np.int64))
    return devices.reshape(dims).transpose(kept + grouped).reshape(-1, group_size)


def _replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """Device groups of a collective's attributes (empty list when none are given)."""
    m = re.search(r"\breplica_groups=", attrs)
    if m:
        text = attrs[m.end() :]
        if text.startswith("{"):
            inner = text[1 : _balanced(text, 0) - 1]
            groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
            # "{}" is XLA's spelling of "every device in one group".
            return groups or [list(range(num_devices))]
        if text.startswith("mesh["):
            return _mesh_axes_groups(text).tolist()
        if text.startswith("["):
            return _parse_iota(text)[0].tolist()
        raise ValueError(f"unknown replica_groups syntax: {text[:120]!r}")
    m = re.search(r"\bsource_target_pairs=", attrs)
    if m:
        text = attrs[m.end() :]
        pairs = [_ints(p) for p in re.findall(r"\{([^{}]*)\}", text[: _balanced(text, 0)])]
        return _connected(pairs)
    return []


def _connected(pairs: list[list[int]]) -> list[list[int]]:
    """Connected components of source->target pairs: the devices a permute cycles through."""
    parent: dict[int, int] = {}

    def find(a: int) -> int:
        while parent.setdefault(a, a) != a:
            a = parent[a]
        return a

    for src, dst in pairs:
        parent[find(src)] = find(dst)
    comps: dict[int, list[int]] = {}
    for dev in sorted(parent):
        comps.setdefault(find(dev), []).append(dev)
    return list(comps.values())


def _axes_of(groups: list[list[int]], mesh: Mesh | AbstractMesh) -> tuple[tuple[str, ...], int]:
    """Mesh axes along which members of a group differ, and the (largest) group size."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.shape[n] for n in mesh.axis_names)
    size = int(np.prod(shape, dtype=np.int64))
    varies = np.zeros(len(shape), dtype=bool)
    for group in groups:
        bad = [d for d in group if not 0 <= d < size]
        if bad:
            raise ValueError(
                f"HLO names device {bad[0]} but the mesh {dict(mesh.shape)} has {size} devices; "
                "audit the program with the mesh it was compiled for"
            )
        coords = np.array(np.unravel_index(np.asarray(group, dtype=np.int64), shape))
        varies |= (coords != coords[:, :1]).any(axis=1)
    axes = tuple(n for n, v in zip(names, varies, strict=True) if v)
    return axes, max((len(g) for g in groups), default=1)


# --------------------------------------------------------------------------- loops


def _trip_count(instr: _Instr, comps: dict[str, list[_Instr]]) -> int | None:
    """Trip count of a while op: XLA's ``known_trip_count``, else a ``i < N`` constant bound."""
    # backend_config is JSON, printed bare or as an escaped string depending on the version.
    m = re.search(r"known_trip_count\W*n\W*(\d+)", instr.attrs)
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", instr.attrs)
    if not cond:
        return None
    # Fallback for HLO without the analysis: a condition holding exactly one integer scalar
    # constant and one "<" compare is a counter from 0 stepping by 1 (what lax.scan lowers to).
    body = _reachable(cond.group(1), comps)
    consts = [i for i in body if i.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", i.shape)]
    compares = [i for i in body if i.opcode == "compare"]
    if len(consts) == 1 and len(compares) == 1 and "direction=LT" in compares[0].attrs:
        return int(_ints(consts[0].operands)[0])
    return None


def _callees(instr: _Instr) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction calls."""
    out = []
    for attr, value in _CALLED.findall(instr.attrs):
        out += [(attr, name) for name in re.findall(r"%?([\w.\-]+)", value)]
    return out


def _reachable(root: str, comps: dict[str, list[_Instr]]) -> list[_Instr]:
    seen, todo, out = set(), [root], []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        out += comps[name]
        todo += [callee for instr in comps[name] for _, callee in _callees(instr)]
    return out


def _loop_context(comps: dict[str, list[_Instr]], entry: str | None) -> dict[str, tuple]:
    """computation -> (in_loop, executions per run or None, computation to report it under)."""
    ctx: dict[str, tuple] = {}
    todo = [(entry, False, 1, entry)] if entry else []
    while todo:
        name, in_loop, trips, report = todo.pop()
        if name in ctx and (ctx[name][0] or not in_loop):
            continue
        ctx[name] = (in_loop, trips, report)
        for instr in comps.get(name, []):
            for attr, callee in _callees(instr):
                if instr.opcode == "while" and attr in ("body", "condition"):
                    n = _trip_count(instr, comps)
                    total = None if n is None or trips is None else trips * n
                    todo.append((callee, True, total, callee))
                else:
                    # A collective wrapped in async-start belongs to the computation starting it.
                    owner = report if instr.opcode.startswith("async-") else callee
                    todo.append((callee, in_loop, trips, owner))
    return ctx


# --------------------------------------------------------------------------- public API


def _last_name(operands: str) -> str:
    # Older printers put the operand's shape before its name: "f32[8]{0} %start".
    return operands.split()[-1].lstrip("%") if operands.strip() else ""


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start").removeprefix("ragged-")
    return base if base in KINDS else None


def audit_hlo(hlo_text: str, mesh: Mesh | AbstractMesh) -> list[Collective]:
    """Collectives of an optimised HLO module, in program text order.

    Args:
      hlo_text: ``compiled.as_text()`` of a program compiled for ``mesh``.
      mesh: the mesh it was compiled for; partition ids are positions in ``mesh.devices.flat``.
    """
    comps, entry = _parse_module(hlo_text)
    ctx = _loop_context(comps, entry)
    num_devices = int(np.prod([mesh.shape[n] for n in mesh.axis_names], dtype=np.int64))
    out = []
    for comp, instrs in comps.items():
        # The result of an async collective is the shape of its "-done", found by operand.
        done = {_last_name(i.operands): i for i in instrs if i.opcode.endswith("-done")}
        for instr in instrs:
            kind = _kind(instr.opcode)
            if kind is None:
                continue
            result = done.get(instr.name, instr) if instr.opcode.endswith("-start") else instr
            dtype, nbytes = _shape_info(result.shape)
            axes, group_size = _axes_of(_replica_groups(instr.attrs, num_devices), mesh)
            in_loop, trips, report = ctx.get(comp, (False, 1, comp))
            trip_count = trips if in_loop else None
            out.append(
                Collective(kind, dtype, nbytes, axes, group_size, report, in_loop, trip_count)
            )
    return out


def audit(compiled, mesh: Mesh | AbstractMesh) -> list[Collective]:
    """Collectives of ``jax.jit(f).lower(...).compile()`` (see ``audit_hlo``)."""
    return audit_hlo(compiled.as_text(), mesh)


MEMORY_KEYS = ("arguments", "outputs", "aliased", "temps", "code", "peak")


def memory(compiled) -> dict[str, int | None]:
    """Per-device bytes of a compiled SPMD program, from XLA's memory analysis: `arguments`,
    `outputs`, `aliased` (outputs sharing a donated argument's buffer), `temps` (the buffers
    live inside the program: activations, gradients, collective buffers), `code` and `peak`:
    the larger of XLA's peak and arguments + outputs - aliased + temps (an upper bound: XLA's
    CPU backend reports only the arguments as its peak). Every value is None when the backend
    has no memory analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return dict.fromkeys(MEMORY_KEYS)
    out = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
        "temps": int(stats.temp_size_in_bytes),
        "code": int(stats.generated_code_size_in_bytes),
    }
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    out["peak"] = max(peak, out["arguments"] + out["outputs"] - out["aliased"] + out["temps"])
    return out


def tally(colls: Iterable[Collective]) -> list[dict]:
    """Totals per (kind, mesh_axes, dtype), largest bytes first.

    Loop ops count ``trip_count`` times when it is known, once otherwise.
    """
    rows: dict[tuple, dict] = {}
    for c in colls:
        row = rows.setdefault(
            (c.kind, c.mesh_axes, c.dtype),
            {"kind": c.kind, "mesh_axes": c.mesh_axes, "dtype": c.dtype, "count": 0, "bytes": 0,
             "wire_bytes": 0},
        )  # fmt: skip
        row["count"] += c.executions
        row["bytes"] += c.bytes * c.executions
        row["wire_bytes"] += round(c.wire_bytes * c.executions)
    return sorted(
        rows.values(), key=lambda r: (-r["bytes"], KINDS.index(r["kind"]), r["mesh_axes"])
    )


def total_bytes(
    colls: Iterable[Collective], kind: str | None = None, axes: tuple[str, ...] | None = None
) -> int:
    """Bytes per device moved by ``colls`` (loop ops x trip count), filtered by kind / mesh axes."""
    return sum(
        c.bytes * c.executions
        for c in colls
        if (kind is None or c.kind == kind) and (axes is None or c.mesh_axes == tuple(axes))
    )


def total_wire_bytes(colls: Iterable[Collective], axes: tuple[str, ...] | None = None) -> int:
    """Bytes each device sends per program run (see Collective.wire_bytes)."""
    return round(
        sum(c.wire_bytes * c.executions for c in colls if axes is None or c.mesh_axes == axes)
    )


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def format_audit(colls: Iterable[Collective]) -> str:
    """Markdown table of ``tally(colls)`` and a total-bytes line."""
    colls = list(colls)
    lines = [
        "| kind | mesh axes | dtype | count | bytes | wire bytes sent |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in tally(colls):
        axes = ",".join(r["mesh_axes"]) or "-"
        lines.append(
            f"| {r['kind']} | {axes} | {r['dtype']} | {r['count']} | {r['bytes']:,} | "
            f"{r['wire_bytes']:,} |"
        )
    total = total_bytes(colls)
    wire = total_wire_bytes(colls)
    lines.append(f"\nTotal: {_human(total)} per device ({total:,} bytes).")
    lines.append(f"Sent per device (ring/pairwise algorithms): {wire:,} bytes.")
    unknown = sum(1 for c in colls if c.in_loop and c.trip_count is None)
    if unknown:
        lines.append(f"{unknown} op(s) in loops of unknown trip count are counted once.")
    return "\n".join(lines)
