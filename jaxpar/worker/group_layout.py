"""Layouts on the replica groups' wire: which part of each leaf's global array a frame's arrays
are, so that groups of different layouts (meshes, devices per process) average together and hand
their state over. No jax.

A message carrying a tree's arrays names, per leaf, its global shape and dtype, the global index
of each array it sends ("pieces") and of each array it wants back ("need"). An index is a flat
list [start0, stop0, start1, stop1, ...] of the leaf's dimensions. For a step's average each
process sends the pieces it owns (the shards no device of lower id in its group holds too), so a
group's processes tile every leaf exactly once: the hub adds every group's pieces into the
global arrays, divides by the quorum's size, and cuts out what each process needs. For a state
transfer the donor's processes send every distinct shard they hold: the hub forwards them as
they are when a joining process needs exactly those (the layouts match), and otherwise puts the
leaves together and cuts out the joining process's shards (resharded).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpar.worker.group_wire import DTYPES, WireError

MAX_LEAVES = 1 << 16
MAX_PIECES = 1 << 20

Index = tuple[int, ...]  # [start0, stop0, start1, stop1, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A message's tree: per leaf its global shape and dtype, the indices of the arrays sent
    and of those wanted back."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    pieces: tuple[tuple[Index, ...], ...]
    need: tuple[tuple[Index, ...], ...]

    @property
    def model(self) -> tuple:
        """What must be the same in every group: the leaves' shapes and dtypes."""
        return self.shapes, self.dtypes


def fields(shapes, dtypes, pieces, need) -> dict:
    """A layout as header fields (worker side)."""
    return {"shapes": [list(s) for s in shapes], "dtypes": list(dtypes),
            "pieces": [[list(i) for i in p] for p in pieces],
            "need": [[list(i) for i in n] for n in need]}  # fmt: skip


def whole(arrays: list[np.ndarray], send: bool = True) -> dict:
    """Header fields for `arrays` as whole leaves (sent, when `send`, and wanted back)."""
    full = [tuple(x for d in np.shape(a) for x in (0, d)) for a in arrays]
    pieces = [[i] for i in full] if send else [[] for _ in full]
    return fields([np.shape(a) for a in arrays], [np.asarray(a).dtype.name for a in arrays],
                  pieces, [[i] for i in full])  # fmt: skip


def _index(raw: object, shape: tuple[int, ...]) -> Index:
    if not isinstance(raw, list) or len(raw) != 2 * len(shape):
        raise WireError(f"bad index {str(raw)[:60]} for a leaf of shape {list(shape)}")
    if not all(type(v) is int for v in raw):
        raise WireError(f"bad index {str(raw)[:60]}")
    for d, n in enumerate(shape):
        if not 0 <= raw[2 * d] <= raw[2 * d + 1] <= n:
            raise WireError(f"index {str(raw)[:60]} outside a leaf of shape {list(shape)}")
    return tuple(raw)


def extent(index: Index) -> tuple[int, ...]:
    return tuple(index[d + 1] - index[d] for d in range(0, len(index), 2))


def slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(index[d], index[d + 1]) for d in range(0, len(index), 2))


def parse(header: dict, arrays: list[np.ndarray]) -> Layout:
    """The layout a message's header gives, checked against its arrays; WireError if it is
    malformed or does not describe them."""
    shapes, dtypes = header.get("shapes"), header.get("dtypes")
    pieces, need = header.get("pieces"), header.get("need")
    if not all(isinstance(v, list) for v in (shapes, dtypes, pieces, need)):
        raise WireError("a tree's message needs 'shapes', 'dtypes', 'pieces' and 'need' lists")
    n = len(shapes)
    if n > MAX_LEAVES or not len(dtypes) == len(pieces) == len(need) == n:
        raise WireError("a layout's lists must have one entry per leaf")
    if sum(map(len, pieces)) + sum(map(len, need)) > MAX_PIECES:
        raise WireError(f"more than {MAX_PIECES} pieces")
    out_shapes, out_pieces, out_need = [], [], []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        ok = isinstance(shape, list) and len(shape) <= 16
        if not ok or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise WireError(f"bad leaf shape {str(shape)[:60]}")
        if dtype not in DTYPES:
            raise WireError(f"bad leaf dtype {str(dtype)[:40]}")
        out_shapes.append(tuple(shape))
    at = 0
    for shape, dtype, sent, wanted in zip(out_shapes, dtypes, pieces, need, strict=True):
        if not isinstance(sent, list) or not isinstance(wanted, list):
            raise WireError("a leaf's pieces must be a list of indices")
        idx = tuple(_index(i, shape) for i in sent)
        for i in idx:
            if at >= len(arrays):
                raise WireError("fewer arrays than the layout's pieces")
            a = arrays[at]
            if a.shape != extent(i) or a.dtype.name != dtype:
                raise WireError(f"an array {a.dtype.name}{list(a.shape)} for a piece "
                                f"{dtype}{list(extent(i))}")  # fmt: skip
            at += 1
        out_pieces.append(idx)
        out_need.append(tuple(_index(i, shape) for i in wanted))
    if at != len(arrays):
        raise WireError("more arrays than the layout's pieces")
    return Layout(tuple(out_shapes), tuple(dtypes), tuple(out_pieces), tuple(out_need))


def tiles(layouts: list[Layout]) -> bool:
    """Whether the pieces of `layouts` (one group's processes) cover every leaf exactly once:
    distinct, and adding up to the leaf's size (distinct shards of one sharding never overlap)."""
    for leaf, shape in enumerate(layouts[0].shapes):
        seen = [i for lay in layouts for i in lay.pieces[leaf]]
        if len(set(seen)) != len(seen) or sum(math.prod(extent(i)) for i in seen) != math.prod(
            shape
        ):
            return False
    return True


def covers(layouts: list[Layout]) -> bool:
    """Whether the distinct pieces of `layouts` (a donor group's processes) cover every leaf."""
    for leaf, shape in enumerate(layouts[0].shapes):
        seen = {i for lay in layouts for i in lay.pieces[leaf]}
        if sum(math.prod(extent(i)) for i in seen) != math.prod(shape):
            return False
    return True


def mean(parts: list[tuple[Layout, list[np.ndarray]]], groups: int) -> list[np.ndarray]:
    """The leaves' global means over `groups` groups of the pieces in `parts` (every process of
    each group: each group tiles every leaf once), in float64 and cast back to each leaf's dtype."""
    lay0 = parts[0][0]
    totals = [np.zeros(s, np.float64) for s in lay0.shapes]
    for lay, arrays in parts:
        at = 0
        for leaf, idx in enumerate(lay.pieces):
            for i in idx:
                totals[leaf][slices(i)] += arrays[at]
                at += 1
    return [(t / groups).astype(d) for t, d in zip(totals, lay0.dtypes, strict=True)]


def nbytes(shapes, dtypes) -> int:
    """The bytes of whole leaves of these shapes and dtypes."""
    return sum(math.prod(s) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes, strict=True))


SCREEN_CHUNK = 1 << 20  # elements widened to float64 at a time by the screen


def screen_pieces(pieces, norm_of=None) -> tuple[list[int], float]:
    """The screen of (leaf, array) pieces: the leaves holding a NaN or an infinity, and the sum
    of squares (float64) of the finite floating pieces of the leaves in `norm_of` (all when
    None).

    One pass per piece, a chunk at a time through one float64 buffer (a whole float64 copy of a
    step's gradients would cost twice their memory, and its page faults most of the screen's
    time). A chunk's sum of squares is not finite exactly when it holds a NaN or an infinity:
    squares of float32 or narrower values cannot overflow float64; only a float64 piece whose
    sum overflows is checked element by element."""
    bad: set[int] = set()
    squares = 0.0
    work = np.empty(SCREEN_CHUNK, np.float64)  # pages touched only as far as a piece needs
    for leaf, a in pieces:
        if a.dtype.kind != "f" or leaf in bad:
            continue
        flat = a.reshape(-1)
        total = 0.0
        for at in range(0, flat.size, SCREEN_CHUNK):
            chunk = flat[at : at + SCREEN_CHUNK]
            x = work[: chunk.size]
            x[...] = chunk
            with np.errstate(over="ignore", invalid="ignore"):  # said by the check below
                part = float(x @ x)
            if not math.isfinite(part) and (a.dtype.itemsize < 8 or not np.isfinite(chunk).all()):
                bad.add(leaf)
                break
            total += part
        if leaf not in bad and (norm_of is None or leaf in norm_of):
            squares += total
    return sorted(bad), squares


def screen(parts: list[tuple[Layout, list[np.ndarray]]], norm_of=None) -> tuple[list[int], float]:
    """One group's pieces (its processes' `parts`, which tile each leaf once): the leaves holding
    a NaN or an infinity, and the L2 norm (float64) of the finite leaves in `norm_of` (all when
    None)."""

    def pieces():
        for lay, arrays in parts:
            at = 0
            for leaf, idx in enumerate(lay.pieces):
                for a in arrays[at : at + len(idx)]:
                    yield leaf, a
                at += len(idx)

    bad, squares = screen_pieces(pieces(), norm_of)
    return bad, math.sqrt(squares)


def assemble(parts: list[tuple[Layout, list[np.ndarray]]]) -> list[np.ndarray]:
    """The leaves put together from the pieces in `parts` (which cover them)."""
    lay0 = parts[0][0]
    out = [np.empty(s, d) for s, d in zip(lay0.shapes, lay0.dtypes, strict=True)]
    for lay, arrays in parts:
        at = 0
        for leaf, idx in enumerate(lay.pieces):
            for i in idx:
                out[leaf][slices(i)] = arrays[at]
                at += 1
    return out


def cut(leaves: list[np.ndarray], layout: Layout) -> list[np.ndarray]:
    """The arrays `layout` needs, cut from the global `leaves`, in its order."""
    return [np.ascontiguousarray(leaves[leaf][slices(i)]).reshape(extent(i))
            for leaf, idx in enumerate(layout.need) for i in idx]  # fmt: skip


__all__ = ["Layout", "assemble", "covers", "cut", "fields", "mean", "nbytes", "parse", "screen",
           "tiles", "whole"]  # fmt: skip
