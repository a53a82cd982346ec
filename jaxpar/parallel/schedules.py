"""Pipeline schedules as tables: (tick, stage) -> work item, generated per schedule.

A work item is the forward (F) of microbatch i through one of the stage's layer groups, the
input-gradient backward (B) of microbatch j, the weight-gradient backward (W) of microbatch k, or
idle. The p stages hold p·v layer groups ("virtual stages"), dealt round the stages: virtual stage
g = c·p + s is group c ("chunk") of stage s. Every work item takes one tick; a result computed at
tick t reaches the neighbouring stage (one `ppermute`) for tick t + 1.

Each schedule is an order of work items per stage; `table()` plays the orders against their
dependencies (F of g after F of g − 1; B of g after F of g and the backward of g + 1; W after B)
and a stage idles whenever its next item is not ready. Schedules that do not split the backward
(all but `zero_bubble`) run W right after its B, and the stage before them waits for both: the
backward is one 2-tick item, B + W, as in the literature's t_b = 2·t_f. With F = B = W = 1 tick:

    gpipe              all forwards, then all backwards      bubble (p − 1)/(m + p − 1)
    circular           gpipe over v groups per stage         (p − 1)/(v·m + p − 1), m >= p
    1f1b               p − s − 1 warm-up forwards, then one forward / one backward
                                                              (p − 1)/(m + p − 1), at most p
                                                              microbatches in flight per stage
    interleaved_1f1b   1f1b over v groups per stage (Megatron's order; m a multiple of p)
                                                              (p − 1)/(v·m + p − 1)
    zero_bubble        ZB-H1: 1f1b's order of F and B, the W postponed to fill the idle ticks;
                       in flight as 1f1b                     idle ticks (p − 1), a third of 1f1b's

The idle fraction is idle slots / (ticks · p). The executor (jaxpar.parallel.pipeline) runs the
table as one compiled loop; `slots` is the size of its per-group buffers (activations, residuals,
gradients), indexed by microbatch mod slots, found from the table so that no two live microbatches
share one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_GROUP = ("circular", "interleaved_1f1b")  # take pipeline.repeats = v > 1
IDLE, F, B, W = 0, 1, 2, 3
LETTERS = {IDLE: ".", F: "F", B: "B", W: "W"}


@dataclass(frozen=True)
class Item:
    kind: int  # F, B or W
    mb: int  # microbatch
    chunk: int  # the stage's layer group (virtual stage chunk·p + stage)


def _orders(kind: str, p: int, m: int, v: int) -> list[list[Item]]:
    """Per stage, the order of its work items."""
    orders = []
    for s in range(p):
        if kind in ("gpipe", "circular"):
            fwd = [Item(F, i, c) for c in range(v) for i in range(m)]
            bwd = [it for c in reversed(range(v)) for i in range(m)
                   for it in (Item(B, i, c), Item(W, i, c))]  # fmt: skip
            orders.append(fwd + bwd)
        elif kind in ("1f1b", "interleaved_1f1b"):
            orders.append(_one_f_one_b(s, p, m, v))
        elif kind == "zero_bubble":
            orders.append(_zb_h1(s, p, m))
        else:
            raise ValueError(f"pipeline.schedule={kind!r}: use one of {SCHEDULES}")
    return orders


def _one_f_one_b(s: int, p: int, m: int, v: int) -> list[Item]:
    """1F1B (v = 1) and Megatron's interleaved 1F1B: warm-up forwards, then alternate."""

    def fwd(k: int) -> Item:  # the stage's k-th forward: microbatches in groups of p per chunk
        return Item(F, (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Item:
        return Item(B, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    total = m * v
    warm = min((p - s - 1) * 2 + (v - 1) * p if v > 1 else p - s - 1, total)
    out = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        b = bwd(k)
        out += [fwd(warm + k), b, Item(W, b.mb, b.chunk)]
    for k in range(total - warm, total):
        b = bwd(k)
        out += [b, Item(W, b.mb, b.chunk)]
    return out


def _zb_h1(s: int, p: int, m: int) -> list[Item]:
    """ZB-H1: 1F1B's F and B; stage s holds back its first s W and runs them where 1F1B idles
    (in the cool-down), so in flight stays at p − s − 1 + 1 + s = p, 1F1B's first stage's."""
    warm = min(p - s - 1, m)
    out = [Item(F, i, 0) for i in range(warm)]
    held = 0  # W held back: the stage runs them in the cool-down
    pending: list[int] = []
    for k in range(m - warm):
        out += [Item(F, warm + k, 0), Item(B, k, 0)]
        pending.append(k)
        if held < s:
            held += 1
        else:
            out.append(Item(W, pending.pop(0), 0))
    for k in range(m - warm, m):
        out.append(Item(B, k, 0))
        pending.append(k)
        out.append(Item(W, pending.pop(0), 0))
    out += [Item(W, k, 0) for k in pending]
    return out


@dataclass(frozen=True)
class Table:
    """The played schedule: `grid[t][s]` is stage s's item at tick t (None: idle)."""

    kind: str
    stages: int
    microbatches: int
    repeats: int
    grid: tuple

    @property
    def ticks(self) -> int:
        return len(self.grid)

    @property
    def idle(self) -> int:
        """Idle (tick, stage) slots."""
        return sum(it is None for row in self.grid for it in row)

    @property
    def bubble(self) -> float:
        """Idle fraction of the stages' ticks."""
        return self.idle / (self.ticks * self.stages)

    def done_at(self) -> dict:
        """(kind, mb, virtual stage) -> tick it runs."""
        p = self.stages
        return {(it.kind, it.mb, it.chunk * p + s): t
                for t, row in enumerate(self.grid) for s, it in enumerate(row) if it}  # fmt: skip

    @cached_property
    def slots(self) -> int:
        """Buffer slots per layer group: the fewest S such that microbatch mod S never names
        two live microbatches (live: from its input's arrival to its W)."""
        p, done = self.stages, self.done_at()
        groups = p * self.repeats
        spans = {}
        for (kind, mb, g), t in done.items():
            if kind == F:
                start = t if g == 0 else done[(F, mb, g - 1)] + 1
                spans[(g, mb)] = (start, done[(W, mb, g)])
        for size in range(1, self.microbatches + 1):
            if all(
                spans[(g, a)][1] < spans[(g, b)][0] or spans[(g, b)][1] < spans[(g, a)][0]
                for g in range(groups)
                for a in range(self.microbatches)
                for b in range(a + size, self.microbatches, size)
            ):
                return size
        return self.microbatches

    def in_flight(self) -> int:
        """Most microbatches whose forward ran and whose W did not, on any stage at any tick."""
        live = [[0] * self.stages for _ in range(self.ticks + 1)]
        done = self.done_at()
        for (kind, mb, g), t in done.items():
            if kind == F:
                end = done[(W, mb, g)]
                for u in range(t, end + 1):
                    live[u][g % self.stages] += 1
        return max(max(r) for r in live)

    def draw(self) -> str:
        """One line per stage: F3 is the forward of microbatch 3 (a letter per group for v > 1:
        F, B, W on group 0; f, b, w on group 1; ...), `.` idle."""
        width = len(str(self.microbatches - 1)) + 1
        lines = []
        for s in range(self.stages):
            cells = []
            for row in self.grid:
                it = row[s]
                if it is None:
                    cells.append(".".ljust(width))
                    continue
                letter = LETTERS[it.kind]
                letter = letter.lower() if it.chunk % 2 else letter
                cells.append(f"{letter}{it.mb}".ljust(width) + ("'" * (it.chunk // 2)))
            lines.append(f"stage {s}: " + " ".join(cells).rstrip())
        return "\n".join(lines)


@functools.lru_cache(maxsize=64)
def table(kind: str, stages: int, microbatches: int, repeats: int = 1) -> Table:
    """Play schedule `kind` for p stages, m microbatches and v layer groups per stage."""
    p, m, v = stages, microbatches, repeats
    orders = _orders(kind, p, m, v)
    fused = kind != "zero_bubble"  # the stage before waits for B and W
    done: dict = {}  # (kind, mb, virtual stage) -> tick it ran
    nxt = [0] * p
    grid = []
    t = 0
    limit = 10 * (len(orders[0]) + p) * max(v, 1) + 10
    while any(n < len(o) for n, o in zip(nxt, orders, strict=True)):
        row = []
        for s in range(p):
            it = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
            if it is not None and _ready(it, s, p, v, fused, done, t):
                nxt[s] += 1
                row.append(it)
            else:
                row.append(None)
        for s, it in enumerate(row):
            if it is not None:
                done[(it.kind, it.mb, it.chunk * p + s)] = t
        grid.append(tuple(row))
        t += 1
        if t > limit:
            raise RuntimeError(f"schedule {kind} p={p} m={m} v={v} deadlocks")
    return Table(kind, p, m, v, tuple(grid))


def _ready(it: Item, s: int, p: int, v: int, fused: bool, done: dict, t: int) -> bool:
    g = it.chunk * p + s

    def before(key) -> bool:
        return key in done and done[key] < t

    if it.kind == F:
        return g == 0 or before((F, it.mb, g - 1))
    if it.kind == B:
        if not before((F, it.mb, g)):
            return False
        return g == p * v - 1 or before(((W if fused else B), it.mb, g + 1))
    return before((B, it.mb, g))


def markdown(stages: int = 4, microbatches: int = 8) -> str:
    """Every schedule's table for p stages and m microbatches, drawn by `Table.draw` (the
    pictures in docs/parallelism.md are this text)."""
    out = []
    for kind in SCHEDULES:
        v = 2 if kind in MULTI_GROUP else 1
        tab = table(kind, stages, microbatches, v)
        groups = f", v={v} (lower case: group 1)" if v > 1 else ""
        out += [
            f"`{kind}`{groups}: {tab.ticks} ticks, bubble {tab.bubble:.1%}, buffers of "
            f"{tab.slots} microbatches per layer group",
            "",
            "```",
            tab.draw(),
            "```",
            "",
        ]
    return "\n".join(out)
