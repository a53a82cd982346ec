"""Pipeline parallelism over the `pipeline` mesh axis: one engine runs every schedule.

    python -m train --recipe gpt_tiny --mesh dp2_pp4 --set pipeline.microbatches=8
    python -m train --recipe gpt_tiny --mesh dp2_pp4 --set pipeline.schedule=1f1b
    python -m train --recipe gpt_tiny --mesh dp4_pp2 --set pipeline.schedule=interleaved_1f1b \\
        --set pipeline.repeats=2
    python -m train --recipe gpt_tiny --mesh dp2_pp4 --set pipeline.stage_layers=2,1,1,2 \\
        --set model.n_layers=6                       (uneven stages: gpipe, 1f1b, zero_bubble)
    jaxpar inspect --recipe gpt_tiny --mesh dp2_pp4     (stages, bytes, FLOPs, ticks, bubble)

What a model provides (`PipelineModel`): `model.pipeline_parts()` returns `(embed, blocks, head)`:
`embed(tokens_BT, key) -> x_BTD`; `blocks`, the repeated blocks as one stacked submodule whose
parameters all carry a leading `layers` dimension (one layer's slice of its state, merged with its
graphdef, is a block called as `block(x_BTD, key)`); `head(x_BTD) -> logits_BTV`, applied position
by position. The model names no mesh axis; the `layers` rule shards the stack over `pipeline`.

Schedules (jaxpar.parallel.schedules): `gpipe`, `circular`, `1f1b`, `interleaved_1f1b`,
`zero_bubble` (ZB-H1). Each is a table of (tick, stage) -> work item: the forward (F) of a
microbatch through one of the stage's layer groups, its input-gradient backward (B), its
weight-gradient backward (W), or idle. The p·v layer groups are dealt round the stages (group
g = c·p + s is chunk c of stage s; v = pipeline.repeats, 1 but for circular and interleaved).

The executor is one `lax.scan` over the table's ticks inside one `shard_map`: each tick every stage
`lax.switch`es on its table entry, then `ppermute`s its forward output one stage on and its input
gradient one stage back. The switch has five branches: idle, F, the last stage's F (with the head
and the loss), B and W. The first stage's F input (the embedded microbatch) is chosen, and its B
output kept, outside the switch, so its F and B are the others' (with a branch each, compiling a
step for the CPU took about 1.2x as long). The backward is written per microbatch, not taken by
autodiff of the loop: F runs `jax.vjp` of the group and stores the pullback's residuals; B and W
call the pullback from them (B keeps the input gradient, W the weight gradient, which it adds up).
Residuals, received activations and received gradients live in buffers of `slots` entries per layer
group, indexed by microbatch mod slots, where `slots` (from the table) is the most microbatches ever
live at once: m for gpipe and circular, p for 1f1b and zero_bubble, whatever m is. That bound is the
point of 1F1B: activation memory no longer grows with m, the number that shrinks the bubble.

The embedding runs before the loop, outside the shard_map, automatically sharded; stage 0's F
takes its microbatch of the embedded batch and its B keeps the gradient of it, which goes back
through the embedding after the loop. The last stage's F runs the head and the loss (its
gradient is the B's input). The gradients, and the loss, are summed over the stages and data
replicas once per step, after the loop.

Collectives. The step is one `shard_map` manual over `pipeline` and `data` (tensor and fsdp stay
automatic), so gradients are reduced once per step, not once per tick. XLA's SPMD partitioner
aborts the process (a failed check in spmd_partitioner_util.cc, with its default flags) on a
gather inside a shard_map whose fsdp and tensor axes are both automatic, as on fsdp2_tp2_pp2:
so the embedding's lookup (and its scatter-add gradient) stays outside the shard_map, and the
loss takes its targets with a one-hot product. The price: every stage receives the embedded
batch and keeps one buffer of its gradient (B x T x D per data replica each, whatever the
schedule).

Dropout keys fold in the microbatch and the layer index: deterministic in (seed, step), but
not the same random bits as the unpipelined model (whose parity tests run without dropout).

Layouts. The train state and checkpoints keep the canonical layer-major order [L, ...], so a
checkpoint moves between schedules and stage counts. GPipe/1F1B/ZB's stage s holds layers
[s·L/p, (s+1)·L/p), which is exactly its shard, so nothing moves. With v > 1 stage s needs groups
s, s+p, ...: the step reorders the block weights to stage-major [p, v, k, ...] on entry and the
gradients back on exit (XLA moves the block bytes over `pipeline` twice a step).

Uneven stages (`pipeline.stage_layers=3,3,2,2`; gpipe, 1f1b and zero_bubble): stage s holds its
contiguous count of layers, padded to k = the largest count ([p, 1, k, ...], built on entry by
a gather, the padded slots repeating the stage's last layer). A padded slot is a `lax.cond` on the
stage's count: it costs no compute and its weight gradient is zero; the gradients go back to
layer-major by a gather that drops those slots, and layer keys use the real layer index. Where
`pipeline` divides L the `layers` rule still shards [L, ...] into L/p rows per stage; XLA
all-gathers the blocks over `pipeline` on entry (a transient copy of all L layers per device) and
all-reduces their gradients over `pipeline`, once per step each. Where it does not, no rule
shards the layers over `pipeline`: every stage keeps all L layers' parameters and optimizer state
(p times the even split's block memory, the optimizer update repeated on every stage) and slices
its own locally; the block gradients are all-reduced over `pipeline` once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxpar.config import PipelineConfig, TrainConfig, stage_split
from jaxpar.engine.mesh import DATA, batch_parallel_size
from jaxpar.engine.rules import Rules, activation_rules
from jaxpar.parallel import schedules
from jaxpar.parallel.base import (
    Context,
    Strategy,
    join_microbatches,
    merge,
    split_microbatches,
)
from jaxpar.parallel.schedules import SCHEDULES

AXIS = "pipeline"


class PipelineModel(Protocol):
    """A model that can be pipelined: see the module docstring for the contract."""

    def pipeline_parts(self) -> tuple[Callable, nnx.Module, Callable]: ...


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: p stages, m microbatches, v layer groups per stage; `split`, when the
    stages hold different layer counts (pipeline.stage_layers, v = 1), the count per stage."""

    kind: str
    stages: int
    microbatches: int
    repeats: int = 1
    split: tuple[int, ...] = ()

    @property
    def table(self) -> schedules.Table:
        return schedules.table(self.kind, self.stages, self.microbatches, self.repeats)

    @property
    def ticks(self) -> int:
        """Length of the tick loop: the table's ticks (F, B and W one tick each)."""
        return self.table.ticks

    @property
    def bubble(self) -> float:
        """The table's idle fraction."""
        return self.table.bubble

    def group_size(self, num_layers: int) -> int:
        """k: layers a stage applies per work item (uneven stages: the most any stage holds, the
        padded size of every stage's slice)."""
        if self.split:
            return max(self.split)
        return num_layers // (self.stages * self.repeats)

    def starts(self) -> tuple[int, ...]:
        """Uneven stages: the index of each stage's first layer."""
        return first_layers(self.split)

    def stage_of(self, layer: int, num_layers: int) -> int:
        """The stage holding `layer`: groups of k layers are dealt round the stages."""
        if self.split:
            return int(np.searchsorted(np.cumsum(self.split), layer, side="right"))
        return (layer // self.group_size(num_layers)) % self.stages


def make_schedule(cfg: PipelineConfig, stages: int, num_layers: int) -> Schedule:
    """Validated schedule for `stages` pipeline stages; ValueError names the fix."""
    kind, m, v = cfg.schedule, cfg.microbatches, cfg.repeats
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline.schedule={kind!r}: use one of {', '.join(SCHEDULES)}")
    if m < 1 or v < 1:
        raise ValueError(f"pipeline.microbatches={m}, pipeline.repeats={v}: both must be >= 1")
    if kind not in schedules.MULTI_GROUP and v != 1:
        raise ValueError(
            f"pipeline.repeats={v} needs --set pipeline.schedule=circular or interleaved_1f1b "
            f"({kind} gives each stage one contiguous group of layers)"
        )
    if kind in ("1f1b", "interleaved_1f1b", "zero_bubble") and m < stages:
        raise ValueError(
            f"pipeline.microbatches={m} is fewer than the {stages} pipeline stages: {kind} needs "
            f"at least one microbatch per stage; set pipeline.microbatches >= {stages}"
        )
    if kind == "interleaved_1f1b" and m % stages:
        raise ValueError(
            f"pipeline.microbatches={m}: interleaved_1f1b takes microbatches in groups of the "
            f"{stages} stages; set pipeline.microbatches to a multiple of {stages}"
        )
    split = stage_split(cfg)
    if split:
        text = ",".join(map(str, split))
        if len(split) != stages:
            raise ValueError(
                f"pipeline.stage_layers={text} has {len(split)} entries but the mesh has "
                f"pipeline={stages}: give one layer count per stage"
            )
        if sum(split) != num_layers:
            raise ValueError(
                f"pipeline.stage_layers={text} sums to {sum(split)} but the model has "
                f"{num_layers} layers: make the counts add up to {num_layers}"
            )
        # An even split runs as one: same layout, no skipped slots.
        return Schedule(kind, stages, m, v, split if len(set(split)) > 1 else ())
    if num_layers % (stages * v):
        raise ValueError(
            f"{num_layers} layers are not divisible by pipeline stages ({stages}) x "
            f"pipeline.repeats ({v}); change the layer count, the `pipeline` mesh "
            f"axis or pipeline.repeats, or split them with --set pipeline.stage_layers=..."
        )
    return Schedule(kind, stages, m, v)


def stage_rules(cfg: TrainConfig, mesh: Mesh, graphdef: Any, template: nnx.State, rules: Rules
                ) -> Rules:  # fmt: skip
    """The parameter rules for the pipeline's stage split (before shardings are built).

    With pipeline.stage_layers set, the split is checked against the mesh and the model first
    (one-line errors). A layer count the stages do not divide cannot be sharded over `pipeline`:
    the layers dimension then stays whole on every stage (no rule maps it to `pipeline`), and
    each stage slices its own layers locally inside the step."""
    split = stage_split(cfg.pipeline)
    if not split:
        return rules
    p = mesh.shape[AXIS]
    n = model_parts(graphdef, template).num_layers
    make_schedule(cfg.pipeline, p, n)
    if n % p == 0:
        return rules
    return tuple((name, tuple(a for a in _axes(axes) if a != AXIS) or None)
                 for name, axes in rules)  # fmt: skip


def _axes(axes: Any) -> tuple:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


# ---- the model's parts ---------------------------------------------------------------------------


def _blocks_path(model: Any) -> tuple:
    """Path of the stacked blocks inside the model (and so inside its parameter dict)."""
    if not callable(getattr(model, "pipeline_parts", None)):
        raise ValueError(
            f"{type(model).__name__} has no pipeline_parts(): a model trained with pipeline > 1 "
            f"must return (embed, stacked blocks, head) from it (see jaxpar.parallel.pipeline); use a "
            f"mesh with pipeline=1 for this model"
        )
    _, blocks, _ = model.pipeline_parts()
    for path, node in nnx.iter_graph(model):
        if node is blocks:
            return tuple(path)
    raise ValueError("pipeline_parts() returned blocks that are not a submodule of the model")


def _get(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _put(tree: dict, path: tuple, value: Any) -> dict:
    """A copy of `tree` with the subtree at `path` replaced (None leaves it out of the pytree)."""
    if not path:
        return value
    return {**tree, path[0]: _put(tree[path[0]], path[1:], value)}


@dataclass(frozen=True)
class Parts:
    """The model split for the pipeline (all abstract, found once at build time)."""

    graphdef: Any
    template: nnx.State
    path: tuple  # where the stacked blocks sit in the parameter dict
    block_graphdef: Any
    block_template: nnx.State  # one layer's state (leading dim kept, values unused)
    num_layers: int


def model_parts(graphdef, template: nnx.State) -> Parts:
    """Find the stacked blocks of an abstract model and check the `layers` contract."""
    model = nnx.merge(graphdef, template)
    path = _blocks_path(model)
    _, blocks, _ = model.pipeline_parts()
    block_graphdef, block_template = nnx.split(blocks)
    sizes = {v.shape[0] if v.ndim else None for v in jax.tree.leaves(block_template)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"the stacked blocks at {'.'.join(map(str, path))} must all have one leading layers "
            f"dimension; found leading sizes {sorted(map(str, sizes))}"
        )
    return Parts(graphdef, template, path, block_graphdef, block_template, sizes.pop())


# ---- layouts ------------------------------------------------------------------------------------


def to_stage_major(a: jax.Array, stages: int, repeats: int) -> jax.Array:
    """[L, ...] layer-major -> [p, v, k, ...]: stage s holds groups s, s+p, ... (group g = r·p+s)."""
    k = a.shape[0] // (stages * repeats)
    return a.reshape(repeats, stages, k, *a.shape[1:]).swapaxes(0, 1)


def to_layer_major(a: jax.Array) -> jax.Array:
    """Inverse of to_stage_major: [p, v, k, ...] -> [L, ...]."""
    p, v, k = a.shape[:3]
    return a.swapaxes(0, 1).reshape(p * v * k, *a.shape[3:])


def first_layers(split: tuple[int, ...]) -> tuple[int, ...]:
    """The index of each stage's first layer, for `split` layers per stage."""
    return tuple(int(x) for x in np.cumsum((0, *split[:-1])))


def split_index(split: tuple[int, ...]) -> np.ndarray:
    """Uneven stages: [p, k] layer indices of each stage's padded slice (k = max(split)); a
    padded slot repeats the stage's last layer (its values are never used)."""
    k, starts = max(split), first_layers(split)
    return np.array([[a + min(j, n - 1) for j in range(k)]
                     for a, n in zip(starts, split, strict=True)])  # fmt: skip


def to_uneven_stages(a: jax.Array, split: tuple[int, ...]) -> jax.Array:
    """[L, ...] layer-major -> [p, 1, k, ...]: stage s's layers, padded to k = max(split)."""
    return a[split_index(split)][:, None]


def from_uneven_stages(a: jax.Array, split: tuple[int, ...]) -> jax.Array:
    """Inverse of to_uneven_stages: [p, 1, k, ...] -> [L, ...]; the padded slots are dropped."""
    k = a.shape[2]
    rows = [s * k + j for s, n in enumerate(split) for j in range(n)]
    return a.reshape(-1, *a.shape[3:])[np.array(rows)]


# The pipeline's shard_map is manual over these; fsdp and tensor stay automatic. `data` is manual
# so that gradients are reduced once per step, not once per tick (a size-1 axis costs nothing).
MANUAL = (DATA, AXIS)


# ---- the executor -------------------------------------------------------------------------------

# The table's work items: what a stage does at a tick (F_FIRST takes an embedded microbatch, F_LAST
# runs the head and the loss, B_FIRST keeps the gradient of the embedded microbatch).
IDLE, F, F_FIRST, F_LAST, B, B_FIRST, W = range(7)
# The switch's branch of each work item: F_FIRST runs F on the embedded microbatch and B_FIRST
# runs B keeping the input gradient (the input chosen, the output routed, outside the switch),
# so the group's forward and backward are compiled twice each (F, F_LAST; B, W), not three times.
# The last stage's head and loss stay a branch of their own (F_LAST), not a cond inside F: a
# conditional is costed by its costliest branch (collectives.hlo_cost, for tune), which would
# charge every stage's F with the head.
BRANCH_OF = (0, 1, 1, 2, 3, 3, 4)


def loop_branches(sched: Schedule) -> np.ndarray:
    """[ticks, stages]: the branch of the loop's switch each stage runs at each tick."""
    return np.asarray(BRANCH_OF, np.int32)[loop_tables(sched)["op"][:, :, 0]]


def loop_tables(sched: Schedule) -> dict[str, np.ndarray]:
    """The table as int32 arrays the compiled loop indexes by (tick, stage).

    op [T, p, 4]: branch, group, buffer slot, microbatch. recv_f / recv_b [T, p, 3]: whether the
    activation (gradient) arriving after tick t is kept, and its group and slot.
    """
    tab = sched.table
    p, v, slots = sched.stages, sched.repeats, tab.slots
    last = p * v - 1
    op = np.zeros((tab.ticks, p, 4), np.int32)
    recv_f = np.zeros((tab.ticks, p, 3), np.int32)
    recv_b = np.zeros((tab.ticks, p, 3), np.int32)
    for t, row in enumerate(tab.grid):
        for s, it in enumerate(row):
            if it is None:
                continue
            g, slot = it.chunk * p + s, it.mb % slots
            if it.kind == schedules.F:
                branch = F_FIRST if g == 0 else F_LAST if g == last else F
                if g < last:
                    recv_f[t, (s + 1) % p] = (1, (g + 1) // p, slot)
            elif it.kind == schedules.B:
                branch = B_FIRST if g == 0 else B
                if g > 0:
                    recv_b[t, (s - 1) % p] = (1, (g - 1) // p, slot)
            else:
                branch = W
            op[t, s] = (branch, it.chunk, slot, it.mb)
    return {"op": op, "recv_f": recv_f, "recv_b": recv_b}


def _execute(
    sched: Schedule, parts: Parts, prec: Any, rest: dict, w_VK: dict, x_MBTD, targets_MBT, key
) -> tuple:
    """The schedule's table on one stage, as one loop: returns (loss share, head grads, block
    grads [v, k, ...], gradient of the embedded microbatches [m, B, T, D]), this stage's and data
    replica's parts of the sums (the last only on stage 0).

    Every tick the stage runs its work item (a `lax.switch` on the table), then passes its
    forward output one stage on and its input gradient one stage back (two `ppermute`s).
    Activations, gradients and the forward's residuals (`jax.vjp`) wait in buffers of
    `table.slots` per layer group, indexed by microbatch mod slots: their size follows from the
    schedule, not from m (1f1b: p).
    """  # fmt: skip
    p, v = sched.stages, sched.repeats
    tab = sched.table
    slots = tab.slots
    tables = {name: jnp.asarray(a) for name, a in loop_tables(sched).items()}
    k = jax.tree.leaves(w_VK)[0].shape[1]
    stage = lax.axis_index(AXIS)
    m, b, t = targets_MBT.shape
    norm = b * m * t  # this data replica's tokens: the loss is their mean
    fwd_ring = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]
    bwd_ring = [(s, (s - 1) % p) for s in range(p)] if v > 1 else [(s, s - 1) for s in range(1, p)]

    def model_of(r):
        return merge(parts.graphdef, parts.template, _put(prec.cast(r), parts.path, w_VK))

    def head_loss(r, y_BTD, i):
        logits_BTV = model_of(r).pipeline_parts()[2](y_BTD).astype(jnp.float32)
        return _cross_entropy(logits_BTV, targets_MBT[i]).sum() / norm

    if sched.split:  # uneven stages: k = the most layers a stage holds, padded slots skipped
        first_of = jnp.asarray(sched.starts(), jnp.int32)[stage]
        count = jnp.asarray(sched.split, jnp.int32)[stage]

    def layers_of(w_K):
        """The group's weights in the compute dtype, a tree per layer."""
        w_K = prec.cast(w_K)
        return [jax.tree.map(lambda a, j=j: a[j], w_K) for j in range(k)]

    def group(layers, x_BTD, c, i):
        # index of the group's first layer in the model
        first = first_of if sched.split else (c * p + stage) * k
        # Unrolled (k is small): an inner while loop slicing the weights ran about 2x slower
        # per layer on CPU than straight-line code.
        for j in range(k):

            def apply(x_BTD, j=j):
                block = merge(parts.block_graphdef, parts.block_template, layers[j])
                kj = jax.random.fold_in(jax.random.fold_in(key, i), first + j)
                return block(x_BTD, kj)

            if sched.split and j >= min(sched.split):
                # A padded slot on a shorter stage: no compute, and a zero weight gradient.
                x_BTD = lax.cond(j < count, apply, lambda x_BTD: x_BTD, x_BTD)
            else:
                x_BTD = apply(x_BTD)
        return x_BTD

    # Per trace: the pullback's structure, and for each of its leaves the index of the group
    # weight it is (-1: a residual the forward computed).
    structure = []

    def forward(w_K, x_BTD, c, i):
        """The group's output and the residuals its backward needs, less the group's own
        weights: those are taken from w_K again at the backward, so a buffer slot does not hold
        a copy of the stage's weights."""
        layers = layers_of(w_K)
        y_BTD, pullback = jax.vjp(lambda ls, x: group(ls, x, c, i), layers, x_BTD)
        leaves, treedef = jax.tree.flatten(pullback)
        weights = {id(a): n for n, a in enumerate(jax.tree.leaves(layers))}
        where = tuple(weights.get(id(a), -1) for a in leaves)
        structure.append((treedef, where))
        if structure[0][1] != where:
            raise AssertionError("the pipeline's forward traced to another residual structure")
        return y_BTD, [a for a, n in zip(leaves, where, strict=True) if n < 0]

    w0 = jax.tree.map(lambda a: a[0], w_VK)
    x0 = jax.ShapeDtypeStruct(x_MBTD.shape[1:], x_MBTD.dtype)
    # Traced once with a traced group and microbatch, as in the loop; filled per work item.
    _, res0 = jax.eval_shape(forward, w0, x0, jnp.int32(0), jnp.int32(0))
    treedef, where = structure[0]

    def pullback(w_K, res):
        weights, saved = jax.tree.leaves(layers_of(w_K)), iter(res)
        return jax.tree.unflatten(treedef, [weights[n] if n >= 0 else next(saved) for n in where])

    def buf(shape, dtype):
        return jnp.zeros((v, slots, *shape), dtype)

    def f32_zeros(tree):
        return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)

    state0 = {
        "x": buf(x0.shape, x0.dtype),  # received activations
        "g": buf(x0.shape, x0.dtype),  # received gradients (the loss's, on the last group)
        "res": [buf(r.shape, r.dtype) for r in res0],
        "gw": f32_zeros(w_VK),
        "grest": f32_zeros(rest),
        "gx": jnp.zeros(x_MBTD.shape, x_MBTD.dtype),  # stage 0: the embedding output's gradient
        "loss": jnp.zeros((), jnp.float32),
    }
    zero_x = jnp.zeros(x0.shape, x0.dtype)
    zero_res = [jnp.zeros(r.shape, r.dtype) for r in res0]
    zero_gw = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], jnp.float32), w_VK)
    zero_rest = f32_zeros(rest)
    zero_loss = jnp.zeros((), jnp.float32)

    def put(a, c, slot, value):
        """a[c, slot] = value, in place (one slot written, not the group's buffer copied)."""
        start = (c, slot, *(jnp.zeros((), c.dtype) for _ in range(value.ndim)))
        return lax.dynamic_update_slice(a, value.astype(a.dtype)[None, None], start)

    def f32(tree):
        return jax.tree.map(lambda a: a.astype(jnp.float32), tree)

    # A work item maps one slot's inputs to its outputs: (residuals, activation sent on, loss
    # gradient kept, gradient sent back (kept instead on the first group), loss, head gradients,
    # group weight gradients). The buffers are read before the switch and written after it: a
    # switch that carried them through copied every buffer at every tick (time per tick growing
    # with the slots, so with m for gpipe).
    def out(res=None, send_f=zero_x, g=zero_x, send_b=zero_x, loss=zero_loss, grest=None,
            gw=None):  # fmt: skip
        return (zero_res if res is None else res, send_f, g, send_b, loss,
                zero_rest if grest is None else f32(grest), zero_gw if gw is None else f32(gw))  # fmt: skip

    # The switch's branches (BRANCH_OF maps the table's work items onto them).
    def idle(w_K, c, i, x_in, res, g_slot):
        return out()

    def f_mid(w_K, c, i, x_in, res, g_slot):
        y_BTD, res = forward(w_K, x_in, c, i)
        return out(res=res, send_f=y_BTD)

    def f_last(w_K, c, i, x_in, res, g_slot):
        y_BTD, res = forward(w_K, x_in, c, i)
        loss, (g_rest, g_BTD) = jax.value_and_grad(head_loss, argnums=(0, 1))(rest, y_BTD, i)
        return out(res=res, g=g_BTD, loss=loss, grest=g_rest)

    def b_mid(w_K, c, i, x_in, res, g_slot):
        return out(send_b=pullback(w_K, res)(g_slot)[1])

    def weight_grad(w_K, c, i, x_in, res, g_slot):
        per_layer = pullback(w_K, res)(g_slot)[0]
        return out(gw=jax.tree.map(lambda *g: jnp.stack(g), *per_layer))

    branches = [idle, f_mid, f_last, b_mid, weight_grad]
    branch_of = jnp.asarray(BRANCH_OF, jnp.int32)
    assert len(branches) == max(BRANCH_OF) + 1

    def tick(st, t):
        branch, c, slot, i = (tables["op"][t, stage, j] for j in range(4))
        res_slot = [r[c, slot] for r in st["res"]]
        g_slot, gx_i = st["g"][c, slot], st["gx"][i]
        w_K = jax.tree.map(lambda a: a[c], w_VK)
        x_in = jnp.where(branch == F_FIRST, x_MBTD[i], st["x"][c, slot])
        res, send_f, g_new, send_b, loss, grest, gw = lax.switch(
            branch_of[branch], branches, w_K, c, i, x_in, res_slot, g_slot
        )
        ran_f = (branch == F) | (branch == F_FIRST) | (branch == F_LAST)
        st = {
            **st,
            "res": [put(a, c, slot, jnp.where(ran_f, r, old))
                    for a, r, old in zip(st["res"], res, res_slot, strict=True)],
            "g": put(st["g"], c, slot, jnp.where(branch == F_LAST, g_new, g_slot)),
            "gx": lax.dynamic_update_index_in_dim(
                st["gx"], jnp.where(branch == B_FIRST, send_b, gx_i), i, 0),
            "loss": st["loss"] + loss,
            "grest": jax.tree.map(jnp.add, st["grest"], grest),
            "gw": jax.tree.map(lambda a, g: a.at[c].add(g), st["gw"], gw),
        }  # fmt: skip
        recv_f = lax.ppermute(send_f, AXIS, fwd_ring)
        recv_b = lax.ppermute(send_b, AXIS, bwd_ring)
        for name, recv, table in (("x", recv_f, "recv_f"), ("g", recv_b, "recv_b")):
            keep, c, slot = (tables[table][t, stage, j] for j in range(3))
            old = st[name][c, slot]
            st = {**st, name: put(st[name], c, slot, jnp.where(keep > 0, recv, old))}
        return st, None

    st, _ = lax.scan(tick, state0, jnp.arange(tab.ticks))
    return st["loss"], st["grest"], st["gw"], st["gx"]


def _cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    # One-hot rather than a gather: XLA CPU aborts partitioning a gather inside a shard_map
    # whose fsdp and tensor axes are both automatic.
    onehot_BSV = jax.nn.one_hot(targets_BS, logits_BSV.shape[-1], dtype=logits_BSV.dtype)
    return jax.nn.logsumexp(logits_BSV, axis=-1) - (logits_BSV * onehot_BSV).sum(-1)


class Pipeline(Strategy):
    """Gradients through the pipeline schedule (the mesh has pipeline > 1), then the update."""

    name = "pipeline"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.model.has_state or ctx.model.has_streams:
            raise ValueError(
                f"pipeline > 1 trains models whose variables are all nnx.Param (and that take "
                f"their key explicitly); this one also holds {ctx.model.state_paths()[:3] or 'rng streams'}: "
                f"use a mesh with pipeline=1"
            )
        if ctx.custom_loss:
            raise ValueError(
                "pipeline > 1 computes the causal-LM loss itself, stage by stage; a recipe's "
                "TrainConfig.loss needs a mesh with pipeline=1"
            )
        self._grads = pipeline_grads(ctx)

    @classmethod
    def param_rules(cls, cfg: TrainConfig, mesh: Mesh, graphdef: Any, template: nnx.State,
                    rules: Rules) -> Rules:  # fmt: skip
        return stage_rules(cfg, mesh, graphdef, template, rules)

    def gradients(self, params, batch, key, extra):
        loss, aux, grads = self._grads(params, batch, key)
        return loss, aux, grads, extra


def pipeline_grads(ctx: Context) -> Callable:
    """(params, batch, key) -> (loss, aux, grads) through the pipeline schedule.

    Called inside the jitted train step (jaxpar.parallel.program) when the mesh has pipeline > 1; `params`
    and `grads` are canonical (layer-major) parameter dicts.
    """
    cfg, mesh, graphdef, template = ctx.cfg, ctx.mesh, ctx.graphdef, ctx.template
    parts = model_parts(graphdef, template)
    sched = make_schedule(cfg.pipeline, mesh.shape[AXIS], parts.num_layers)
    check_config(cfg, mesh, sched, ctx.task)
    check_stage_call(parts, getattr(cfg.model, "seq_len", cfg.data.seq_len))
    d, p, v = mesh.shape[DATA], sched.stages, sched.repeats
    prec = ctx.prec  # casts inside the differentiated functions: float32 gradients

    def local(rest, w_sm, x_BTD, targets_BT, key):
        # rest: embedding/head, replicated over stages; w_sm leaves [1, v, k, ...]: this stage;
        # x_BTD (embedded), targets_BT: this data replica's rows.
        key = jax.random.fold_in(key, lax.axis_index(DATA))
        w_VK = jax.tree.map(lambda a: a[0], w_sm)
        # Microbatch i takes rows i, i+m, ...: each fsdp shard keeps an equal share of every one.
        x_MBTD, targets_MBT = split_microbatches((x_BTD, targets_BT), sched.microbatches)
        with activation_rules(mesh, ctx.act_rules, manual=MANUAL):
            loss, g_rest, g_VK, g_MBTD = _execute(
                sched, parts, prec, rest, w_VK, x_MBTD, targets_MBT, key
            )
        # The head's gradient is on the last stage, the embedded input's on stage 0, each a
        # partial sum per data replica: one reduction each per step, none inside the tick loop
        # (the input's in float32).
        loss, g_rest = lax.psum((loss, g_rest), MANUAL)
        g_VK = lax.psum(g_VK, DATA)
        g_BTD = lax.psum(join_microbatches(g_MBTD).astype(jnp.float32), AXIS)
        loss, g_rest, g_VK, g_BTD = jax.tree.map(lambda x: x / d, (loss, g_rest, g_VK, g_BTD))
        return loss, g_rest, jax.tree.map(lambda a: a[None], g_VK), g_BTD

    rows, stage = PartitionSpec(DATA), PartitionSpec(AXIS)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(), stage, rows, rows, PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec(), stage, rows),
        axis_names=set(MANUAL),
        check_vma=False,
    )

    def grads_fn(params, batch, key):
        blocks = _get(params, parts.path)
        rest = _put(params, parts.path, None)
        k_embed, k_blocks = jax.random.split(key)

        def embed(rest):
            model = merge(graphdef, template, prec.cast(_put(rest, parts.path, blocks)))
            return model.pipeline_parts()[0](batch["inputs"], k_embed)

        # The embedding (a gather; its gradient a scatter) runs outside the shard_map,
        # automatically sharded: XLA's SPMD partitioner aborts the process partitioning it
        # inside one whose fsdp and tensor axes are both automatic.
        x_BTD, embed_vjp = jax.vjp(embed, rest)
        if sched.split:
            w_sm = jax.tree.map(lambda a: to_uneven_stages(a, sched.split), blocks)
        else:
            w_sm = jax.tree.map(lambda a: to_stage_major(a, p, v), blocks)
        loss, g_rest, g_sm, g_BTD = mapped(rest, w_sm, x_BTD, batch["targets"], k_blocks)
        g_rest = jax.tree.map(jnp.add, g_rest, embed_vjp(g_BTD.astype(x_BTD.dtype))[0])
        if sched.split:
            g_blocks = jax.tree.map(lambda a: from_uneven_stages(a, sched.split), g_sm)
        else:
            g_blocks = jax.tree.map(to_layer_major, g_sm)
        grads = _put(g_rest, parts.path, g_blocks)
        return loss, {}, grads

    return grads_fn


def check_stage_call(parts: Parts, seq_len: int) -> None:
    """Trace the embedding and one block abstractly, called as a stage calls them
    (`block(x_BTD, key)`; nothing is computed or compiled): a model that refuses to run as a
    pipeline stage raises its ValueError here, while the program is built and before the run
    writes anything, not when the step compiles (e.g. MoE blocks whose auxiliary losses a
    pipeline could not add to its loss)."""
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(parts.template)
    )
    layer = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), _get(params, parts.path)
    )

    def stage(p, w, tokens_BT):
        k_embed, k_block = jax.random.split(jax.random.key(0))
        x_BTD = merge(parts.graphdef, parts.template, p).pipeline_parts()[0](tokens_BT, k_embed)
        block = merge(parts.block_graphdef, parts.block_template, w)
        return block(x_BTD, k_block)

    jax.eval_shape(stage, params, layer, jax.ShapeDtypeStruct((1, seq_len), jnp.int32))


def check_config(cfg: TrainConfig, mesh: Mesh, sched: Schedule, task: str) -> None:
    """ValueErrors for batches and configs the pipeline cannot split."""
    if task != "lm":
        raise ValueError(
            f"pipeline > 1 supports language models (task 'lm'), not {task!r}; use pipeline=1"
        )
    if cfg.train.microbatches != 1:
        raise ValueError(
            f"train.microbatches={cfg.train.microbatches} with pipeline={sched.stages}: the "
            f"pipeline splits the batch itself; set train.microbatches=1 and "
            f"pipeline.microbatches={cfg.train.microbatches * sched.microbatches}"
        )
    ways, m = batch_parallel_size(mesh), sched.microbatches
    if cfg.data.global_batch % (ways * m):
        raise ValueError(
            f"global batch {cfg.data.global_batch} cannot be split into pipeline.microbatches="
            f"{m} on each of the {ways} data-parallel shards (data x fsdp): make the global "
            f"batch a multiple of {ways * m} or change pipeline.microbatches"
        )


# ---- reporting ----------------------------------------------------------------------------------


def _nbytes(tree: Any, per_device: bool = False) -> int:
    def one(x) -> int:
        shape = x.sharding.shard_shape(x.shape) if per_device else x.shape
        return math.prod(shape) * x.dtype.itemsize

    return sum(one(x) for x in jax.tree.leaves(tree))


def stage_table(cfg: TrainConfig, program: Any, flops: dict | None = None) -> list[dict]:
    """Per stage: its blocks, parameter bytes (global and per device) and training FLOPs/step.

    Bytes include the embedding and head every stage holds; FLOPs (XLA's cost analysis of one
    block, the embedding and the head, x3 for forward + backward) include the embedding on stage
    0 and the head on the last stage, where they run.
    """
    parts = model_parts(program.graphdef, program.param_template)
    sched = make_schedule(cfg.pipeline, program.mesh.shape[AXIS], parts.num_layers)
    params = program.abstract_state["params"]
    blocks, rest = _get(params, parts.path), _put(params, parts.path, None)
    n, p = parts.num_layers, sched.stages
    flops = flops or _flops(cfg, parts)
    tokens = cfg.data.global_batch * getattr(cfg.model, "seq_len", cfg.data.seq_len)
    rows = []
    for s in range(p):
        layers = [i for i in range(n) if sched.stage_of(i, n) == s]
        fwd = (
            len(layers) * flops["block"] + flops["embed"] * (s == 0) + flops["head"] * (s == p - 1)
        )
        rows.append({
            "stage": s,
            "layers": layers,
            "param_bytes": len(layers) * _nbytes(blocks) // n + _nbytes(rest),
            # A device of a stage holds its shard of that stage's blocks.
            "param_bytes_per_device": _nbytes(blocks, True) + _nbytes(rest, True),
            "train_flops": 3.0 * fwd * tokens,
        })  # fmt: skip
    return rows


def _flops(cfg: TrainConfig, parts: Parts) -> dict:
    """Forward FLOPs per token of one block, the embedding and the head (XLA cost analysis)."""
    seq = getattr(cfg.model, "seq_len", cfg.data.seq_len)
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(parts.template)
    )
    layer = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), _get(params, parts.path)
    )

    def part(i: int) -> Callable:
        return lambda p, x: merge(parts.graphdef, parts.template, p).pipeline_parts()[i](x)

    def block(w, x_BTD):
        return merge(parts.block_graphdef, parts.block_template, w)(x_BTD)

    def cost(fn, *args) -> float:
        analysis = jax.jit(fn).lower(*args).cost_analysis() or {}
        return float(analysis.get("flops", 0.0)) / seq

    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    x = jax.eval_shape(part(0), params, tokens)
    return {
        "embed": cost(part(0), params, tokens),
        "block": cost(block, layer, x),
        "head": cost(part(2), params, x),
    }


def balanced_split(num_layers: int, stages: int, block: float, embed: float, head: float
                   ) -> list[int]:  # fmt: skip
    """Layers per stage (contiguous, each >= 1) minimising the busiest stage's cost, where stage
    0 also pays `embed` and the last stage `head` (costs in any one unit, e.g. FLOPs)."""
    n, p = num_layers, stages
    if n < p:
        raise ValueError(f"{n} layers cannot fill {p} pipeline stages")
    extra = [embed * (s == 0) + head * (s == p - 1) for s in range(p)]
    # best[s][j]: (the busiest cost, the split) of stages s.. holding the last j layers
    best: dict[tuple[int, int], tuple[float, list[int]]] = {}
    for s in reversed(range(p)):
        for j in range(p - s, n - s + 1):
            if s == p - 1:
                best[(s, j)] = (j * block + extra[s], [j])
                continue
            options = []
            for k in range(1, j - (p - s - 1) + 1):
                cost, rest = best[(s + 1, j - k)]
                options.append((max(k * block + extra[s], cost), [k, *rest]))
            best[(s, j)] = min(options)
    return best[(0, n)][1]


def inspect_dict(cfg: TrainConfig, program: Any) -> dict:
    """`jaxpar inspect --json`'s pipeline section: the schedule as it runs (kind, stages p,
    microbatches m, repeats v, ticks, predicted bubble) and each stage's layers and FLOPs."""
    parts = model_parts(program.graphdef, program.param_template)
    sched = make_schedule(cfg.pipeline, program.mesh.shape[AXIS], parts.num_layers)
    table = stage_table(cfg, program, _flops(cfg, parts))
    return {
        "schedule": sched.kind,
        "stages": sched.stages,
        "microbatches": sched.microbatches,
        "repeats": sched.repeats,
        "ticks": sched.ticks,
        "bubble": round(sched.bubble, 6),
        "stage_layers": [len(r["layers"]) for r in table],
        "stage_train_flops": [r["train_flops"] for r in table],
    }


def inspect_lines(cfg: TrainConfig, program: Any, colls: Iterable | None = None) -> list[str]:
    """Markdown lines for `jaxpar inspect`: stages, bytes, FLOPs, ticks, bubble, permutes.

    `program` is the jaxpar.parallel.program.Program; `colls` the collective audit of its train step.
    """
    mesh = program.mesh
    parts = model_parts(program.graphdef, program.param_template)
    n = parts.num_layers
    sched = make_schedule(cfg.pipeline, mesh.shape[AXIS], n)
    p, m = sched.stages, sched.microbatches
    f = _flops(cfg, parts)
    table = stage_table(cfg, program, f)
    flops = [r["train_flops"] for r in table]
    counts = ",".join(str(len(r["layers"])) for r in table)
    per_tick = f"up to {sched.group_size(n)}" if sched.split else n // (p * sched.repeats)
    out = [
        "",
        f"## pipeline: {sched.kind}, p={p} stages, m={m} microbatches, v={sched.repeats} "
        f"repeats; shard_map manual over {', '.join(MANUAL)}",
        "",
        f"tick count {sched.ticks} ({per_tick} layer(s) per stage per tick); "
        f"predicted bubble {sched.bubble:.1%} (GPipe (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}); "
        f"buffers of {sched.table.slots} microbatch(es) per layer group",
        f"layers per stage {counts} "
        + ("(pipeline.stage_layers)" if sched.split else "(even; set pipeline.stage_layers)"),
        "block -> stage: " + ", ".join(f"{i}->{sched.stage_of(i, n)}" for i in range(n)),
        "embedding: on stage 0; head and loss: on the last stage (every stage holds both)",
        "",
        "| stage | layers | blocks | parameter bytes | per device | training FLOPs/step |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in table:
        out.append(
            f"| {r['stage']} | {len(r['layers'])} | {r['layers']} | {r['param_bytes']:,} | "
            f"{r['param_bytes_per_device']:,} | {r['train_flops']:.3g} |"
        )
    out.append(
        f"\nstage balance: max/mean FLOPs {max(flops) / (sum(flops) / p):.3f} (the embedding on "
        f"the first stage, the head on the last)"
    )
    split = balanced_split(n, p, f["block"], f["embed"], f["head"])
    cost = [k * f["block"] + f["embed"] * (s == 0) + f["head"] * (s == p - 1)
            for s, k in enumerate(split)]  # fmt: skip
    out.append(
        f"split by cost (layers per stage, embedding and head counted): "
        f"{','.join(map(str, split))}, max/mean FLOPs {max(cost) / (sum(cost) / p):.3f} "
        f"(--set pipeline.stage_layers={','.join(map(str, split))})"
    )
    if colls is not None:
        perms = [c for c in colls if c.kind == "collective-permute"]
        ticking = [c for c in perms if c.in_loop]
        total = sum(c.bytes * c.executions for c in perms)
        out.append(
            f"collective-permutes: {len(ticking)} in tick loops (trip counts "
            f"{sorted({c.trip_count for c in ticking})}), {len(perms) - len(ticking)} outside; "
            f"{total:,} bytes per device per step"
        )
    return out
