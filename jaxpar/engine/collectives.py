"""Collective audit: which collectives XLA put into a compiled program, and over which mesh axes.

    colls = audit(jax.jit(step).lower(state, batch).compile(), mesh)
    print(format_audit(colls))

Reading the optimised HLO (device numbering, replica groups, async pairs): docs/design.md, "The engine".
"""

from __future__ import annotations

import math
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
    # scheduled to overlap with computation: an async start/done pair the backend did not mark
    # synchronous, or a TPU collective wrapped in an AsyncCollectiveStart fusion
    overlapped: bool = False

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
    root: bool = False  # its computation's ROOT


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
    root = line.lstrip().startswith("ROOT ")
    return _Instr(name, shape, op.group(1), tail[op.end() : close - 1], tail[close:], root)


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


def _trip_count(
    instr: _Instr, comps: dict[str, list[_Instr]], names: dict[str, _Instr] | None = None
) -> int | None:
    """Trip count of a while op: XLA's ``known_trip_count``; else its counter's start, step and
    ``i < N`` bound read from the init tuple, the body and the condition (the TPU compiler's
    windowed loops step by 2); else a ``i < N`` constant bound counted from 0 by 1."""
    # backend_config is JSON, printed bare or as an escaped string depending on the version.
    m = re.search(r"known_trip_count\W*n\W*(\d+)", instr.attrs)
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", instr.attrs)
    if not cond:
        return None
    counted = _counted_loop(instr, cond.group(1), comps, names)
    if counted is not None:
        return counted
    # Fallback for HLO without the analysis: a condition holding exactly one integer scalar
    # constant and one "<" compare is a counter from 0 stepping by 1 (what lax.scan lowers to).
    body = _reachable(cond.group(1), comps)
    consts = [
        i
        for i in body
        if i.opcode == "constant" and re.fullmatch(r"[su]\d+\[\](\{[^}]*\})?", i.shape)
    ]
    compares = [i for i in body if i.opcode == "compare"]
    if len(consts) == 1 and len(compares) == 1 and "direction=LT" in compares[0].attrs:
        return int(_ints(consts[0].operands)[0])
    return None


def _scalar(instr: _Instr | None) -> int | None:
    """The value of an integer scalar constant."""
    if instr is None or instr.opcode != "constant" or not re.match(r"[su]\d+\[\]", instr.shape):
        return None
    values = _ints(instr.operands)
    return values[0] if len(values) == 1 else None


def _tuple_index(instr: _Instr | None) -> int | None:
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    m = re.search(r"\bindex=(\d+)", instr.attrs)
    return int(m.group(1)) if m else None


def _through_copies(instr: _Instr | None, names: dict[str, _Instr]) -> _Instr | None:
    """The instruction a chain of copies, converts and bitcasts starts from."""
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast"):
        instr = names.get(_last_name(instr.operands))
    return instr


def _counted_loop(
    instr: _Instr, cond: str, comps: dict[str, list[_Instr]], names: dict[str, _Instr] | None
) -> int | None:
    """Trips of a loop whose condition is ``counter < N`` (or ``<=``) with a constant N, whose
    body adds a constant step to the counter, and whose init tuple starts it at a constant."""
    body = re.search(r"\bbody=%?([\w.\-]+)", instr.attrs)
    in_cond = {i.name: i for i in comps.get(cond, [])}
    compares = [i for i in in_cond.values() if i.opcode == "compare"]
    if not body or len(compares) != 1:
        return None
    direction = re.search(r"direction=(\w+)", compares[0].attrs)
    ops = [in_cond.get(n) for n in _names(compares[0].operands)]
    if len(ops) != 2 or not direction or direction.group(1) not in ("LT", "LE"):
        return None
    k, bound = _tuple_index(ops[0]), _scalar(ops[1])
    in_body = {i.name: i for i in comps.get(body.group(1), [])}
    root = next((i for i in in_body.values() if i.root), None)
    if k is None or bound is None or root is None or root.opcode != "tuple":
        return None
    elems = _names(root.operands)
    update = in_body.get(elems[k]) if k < len(elems) else None
    if update is None or update.opcode != "add":
        return None
    a, b = (_through_copies(in_body.get(n), in_body) for n in _names(update.operands))
    counter, step = (a, _scalar(b)) if _tuple_index(a) == k else (b, _scalar(a))
    if _tuple_index(counter) != k or not step or step < 0:
        return None
    if names is None:
        names = {i.name: i for c in comps.values() for i in c}
    init = names.get(_last_name(instr.operands))
    elems = _names(init.operands) if init is not None and init.opcode == "tuple" else []
    if k >= len(elems):
        return None
    first = _scalar(_through_copies(names.get(elems[k]), names))
    if first is None:
        return None
    last = bound if direction.group(1) == "LE" else bound - 1
    return max(0, (last - first) // step + 1)


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
    names = {i.name: i for c in comps.values() for i in c}
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
                    n = _trip_count(instr, comps, names)
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
        # TPU: a collective whose result feeds an AsyncCollectiveStart custom call runs async.
        started = {
            name
            for i in instrs
            if i.opcode == "custom-call" and '"AsyncCollectiveStart"' in i.attrs
            for name in _names(i.operands)
        }
        for instr in instrs:
            kind = _kind(instr.opcode)
            if kind is None:
                continue
            result = done.get(instr.name, instr) if instr.opcode.endswith("-start") else instr
            dtype, nbytes = _shape_info(result.shape)
            axes, group_size = _axes_of(_replica_groups(instr.attrs, num_devices), mesh)
            in_loop, trips, report = ctx.get(comp, (False, 1, comp))
            trip_count = trips if in_loop else None
            overlapped = instr.name in started or (
                instr.opcode.endswith("-start")
                and not re.search(r"is_sync\W*:\W*true", instr.attrs)
            )
            out.append(
                Collective(
                    kind, dtype, nbytes, axes, group_size, report, in_loop, trip_count, overlapped
                )  # fmt: skip
            )
    return out


def _names(operands: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", operands)


# --------------------------------------------------------------------------- FLOPs


def hlo_flops(hlo_text: str, switch=None) -> float:
    """FLOPs per device of one run of an optimised HLO module: its dots and convolutions (inside
    fusions too; cuBLAS GEMM custom calls), each times the trip count of the loops around it.
    XLA's own cost analysis counts a loop body once; elementwise work is not counted here
    (`hlo_cost` has it). `switch`: as for `hlo_cost`."""
    return hlo_cost(hlo_text, switch)["flops"]


# Elementwise opcodes XLA's cost analysis counts as one FLOP per result element.
_ELEMENTWISE = frozenset(
    "abs add and atan2 cbrt ceil clamp compare convert cosine divide erf exponential "
    "exponential-minus-one floor is-finite log log-plus-one logistic maximum minimum multiply "
    "negate not or power remainder round-nearest-afz round-nearest-even rsqrt select sign sine "
    "sqrt subtract tan tanh xor".split()
)
_NO_KERNEL = frozenset(
    {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
)
_COST_KEYS = ("flops", "elementwise", "kernels", "wait_flops", "wait_elementwise")


def hlo_cost(hlo_text: str, switch=None) -> dict[str, float]:
    """What one run of an optimised HLO module does per device, loops counted by trip count:

    - `flops`: its dots and convolutions (inside fusions too; cuBLAS GEMM custom calls);
    - `elementwise`: one per result element of its elementwise ops and per input element of its
      reductions (what XLA's cost analysis adds to the dots);
    - `kernels`: the instructions of the computations that run on their own (not fusion bodies,
      reducers or sort comparators);
    - `wait_flops`, `wait_elementwise`: the part of `flops` and `elementwise` a device spends
      waiting on the others (see `switch`).

    A conditional runs one branch per execution: its most expensive one is counted. `switch`
    ([ticks, devices] array of branch indices, e.g. a pipeline's schedule table) says which
    branch each device takes at each trip of a loop of that many trips around a conditional with
    more branches than the table names: each trip then costs what the slowest device's branch
    costs (the devices meet at every trip), and the `wait_` figures are that total minus the
    busiest device's own share."""
    comps, entry = _parse_module(hlo_text)
    names = {i.name: i for c in comps.values() for i in c}
    memo: dict[tuple[str, bool], np.ndarray] = {}
    table = None if switch is None else np.asarray(switch)

    def cost(name: str, top: bool, depth: int = 0) -> np.ndarray:
        key = (name, top)
        if key in memo:
            return memo[key]
        total = np.zeros(len(_COST_KEYS))
        memo[key] = total  # a cycle (never in XLA's output) counts zero, not forever
        if depth > 64:
            return total
        instrs = comps.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            op = instr.opcode
            own = np.zeros(len(_COST_KEYS))
            if op == "while":
                body = re.search(r"\bbody=%?([\w.\-]+)", instr.attrs)
                trips = _trip_count(instr, comps, names) or 1
                if body:
                    own += _loop_cost(body.group(1), trips, top, depth)
                own[2] += top
            elif op == "conditional":
                branches = [c for _, c in _callees(instr)]
                costs = [cost(b, top, depth + 1) for b in branches]
                if costs:
                    own += max(costs, key=lambda c: (c[0], c[1], c[2]))
                own[2] += top
            elif op in ("call", "async-start"):
                for _, callee in _callees(instr):
                    own += cost(callee, top, depth + 1)
            elif op in ("fusion", "custom-call"):  # one kernel; what it calls runs inside it
                for _, callee in _callees(instr):
                    own += cost(callee, False, depth + 1)
                if op == "custom-call" and ("$gemm" in instr.attrs or "$matmul" in instr.attrs):
                    own[0] += _gemm_flops(instr, shapes)
                own[2] = top
            else:
                if op == "dot":
                    own[0] = _dot_flops(instr, shapes)
                elif op == "convolution":
                    own[0] = _conv_flops(instr, shapes)
                elif op in _ELEMENTWISE:
                    own[1] = _elements(instr.shape)
                elif op in ("reduce", "reduce-window"):
                    ops = _names(instr.operands)
                    own[1] = _elements(shapes.get(ops[0], "")) if ops else 0
                own[2] = top and op not in _NO_KERNEL
            total += own
        memo[key] = total
        return total

    def _loop_cost(body: str, trips: int, top: bool, depth: int) -> np.ndarray:
        cond = None
        if table is not None and table.ndim == 2 and table.shape[0] == trips:
            cond = next((i for i in comps.get(body, []) if i.opcode == "conditional"
                         and len(_callees(i)) > int(table.max())), None)  # fmt: skip
        if cond is None:
            return trips * cost(body, top, depth + 1)
        branch = [cost(c, top, depth + 1) for _, c in _callees(cond)]
        rest = cost(body, top, depth + 1) - max(branch, key=lambda c: (c[0], c[1], c[2]))
        slowest = sum(max((branch[b] for b in row), key=lambda c: c[0] + c[1]) for row in table)
        busiest = max((sum(branch[b] for b in table[:, d]) for d in range(table.shape[1])),
                      key=lambda c: c[0] + c[1])  # fmt: skip
        out = trips * rest + slowest
        out[3:5] += slowest[:2] - busiest[:2]
        return out

    if entry is None:
        return dict.fromkeys(_COST_KEYS, 0.0)
    return {k: float(v) for k, v in zip(_COST_KEYS, cost(entry, True), strict=True)}


def _elements(shape: str) -> int:
    """Elements of an HLO shape (tuples: summed)."""
    return sum(
        int(np.prod([int(d.replace("<=", "")) for d in dims.split(",") if d.strip()],
                    dtype=np.int64))
        for _, dims in _ARRAY.findall(shape)
    )  # fmt: skip


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip()] if m else []


def _attr_ints(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return _ints(m.group(1)) if m else []


def _dot_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    """2 x result elements x contracted elements."""
    ops = _names(instr.operands)
    lhs = _dims(shapes.get(ops[0], "")) if ops else []
    contracted = int(np.prod([lhs[d] for d in _attr_ints(instr.attrs, "lhs_contracting_dims")
                              if d < len(lhs)], dtype=np.int64))  # fmt: skip
    return 2.0 * float(np.prod(_dims(instr.shape), dtype=np.float64)) * contracted


def _gemm_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    """A cuBLAS GEMM custom call: its dot dimension numbers are in the backend config."""
    ops = _names(instr.operands)
    lhs = _dims(shapes.get(ops[0], "")) if ops else []
    m = re.search(r"lhs_contracting_dimensions\W*\[([^\]]*)\]", instr.attrs)
    dims = _ints(m.group(1)) if m else []
    contracted = int(np.prod([lhs[d] for d in dims if d < len(lhs)], dtype=np.int64))
    result = instr.shape
    if result.startswith("("):  # (result, workspace)
        result = _ARRAY.search(result).group(0) if _ARRAY.search(result) else ""
    return 2.0 * float(np.prod(_dims(result), dtype=np.float64)) * contracted


def _conv_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    """XLA's convolution count: 2 x (input features / feature groups) x output features x
    (batch / batch groups) x, per spatial dimension, the (output, window) position pairs that
    read an input element (padding and dilation holes do not count). TPU programs express most
    matmuls as convolutions of this kind."""
    ops = _names(instr.operands)
    labels = re.search(r"dim_labels=([\w]+)_([\w]+)->([\w]+)", instr.attrs)
    if len(ops) < 2 or not labels:
        return 0.0
    lhs, out = _dims(shapes.get(ops[0], "")), _dims(instr.shape)
    lhs_l, _, out_l = labels.groups()
    if len(lhs) != len(lhs_l) or len(out) != len(out_l):
        return 0.0
    window = re.search(r"window=\{([^}]*)\}", instr.attrs)
    win = dict(kv.split("=", 1) for kv in window.group(1).split()) if window else {}
    spatial = sorted(c for c in lhs_l if c.isdigit())

    def per_dim(key: str, default: int) -> list[int]:
        if key not in win:
            return [default] * len(spatial)
        return [int(v) for v in win[key].split("x")]

    size, stride = per_dim("size", 1), per_dim("stride", 1)
    base, wdil = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    pads = (
        [int(p.split("_")[0]) for p in win["pad"].split("x")]
        if "pad" in win
        else [0] * len(spatial)
    )
    fma = 1.0
    for k, c in enumerate(spatial):
        fma *= _valid_positions(out[out_l.index(c)], size[k], lhs[lhs_l.index(c)], stride[k],
                                pads[k], base[k], wdil[k])  # fmt: skip
    groups = re.search(r"feature_group_count=(\d+)", instr.attrs)
    batch_groups = re.search(r"batch_group_count=(\d+)", instr.attrs)
    fma *= lhs[lhs_l.index("f")] / (int(groups.group(1)) if groups else 1)
    fma *= out[out_l.index("f")]
    fma *= lhs[lhs_l.index("b")] / (int(batch_groups.group(1)) if batch_groups else 1)
    return 2.0 * fma


def _valid_positions(out: int, size: int, inp: int, stride: int, pad: int, base: int,
                     wdil: int) -> int:  # fmt: skip
    """(output index, window index) pairs whose input index o*stride - pad + k*wdil lands on a
    real element of the base-dilated input."""
    k = np.arange(size, dtype=np.int64)
    c = k * wdil - pad  # the input position of output 0, per window index
    hi_u = (inp - 1) * base
    lo = np.maximum(0, -((c) // stride))  # the first o with o*stride + c >= 0
    hi = np.minimum(out - 1, (hi_u - c) // stride)
    if base == 1:
        return int(np.maximum(hi - lo + 1, 0).sum())
    # o*stride + c must also fall on a multiple of `base`: o = o0 (mod base / gcd)
    g = math.gcd(stride, base)
    period = base // g
    total = 0
    for ci, first, last in zip(c.tolist(), lo.tolist(), hi.tolist(), strict=True):
        if last < first or ci % g:
            continue
        o0 = (-ci // g) * pow(stride // g, -1, period) % period if period > 1 else 0
        total += (last - o0) // period - (first - 1 - o0) // period
    return total


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


# A row whose groups are single devices (mesh_axes ()): what it says, in the report and the JSON
TRIVIAL_NOTE = (
    "groups of one device: no data moves (a reduction over mesh axes of size 1 that XLA kept, "
    "e.g. from the transpose of a shard_map psum)"
)


def tally(colls: Iterable[Collective]) -> list[dict]:
    """Totals per (kind, mesh_axes, dtype), largest bytes first; a row of single-device groups
    carries ``note`` (TRIVIAL_NOTE).

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
        if not c.mesh_axes:
            row["note"] = TRIVIAL_NOTE
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
    if any(not c.mesh_axes for c in colls):
        lines.append(f"Mesh axes -: {TRIVIAL_NOTE}.")
    unknown = sum(1 for c in colls if c.in_loop and c.trip_count is None)
    if unknown:
        lines.append(f"{unknown} op(s) in loops of unknown trip count are counted once.")
    return "\n".join(lines)
