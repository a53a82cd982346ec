"""Pipeline parallelism over the `pipeline` mesh axis: GPipe and circular schedules.

    python -m train --recipe gpt_tiny --mesh dp2_pp4 --set pipeline.microbatches=8
    python -m train --recipe gpt_tiny --mesh dp4_pp2 --set pipeline.schedule=circular \\
        --set pipeline.repeats=2
    jaxpar inspect --recipe gpt_tiny --mesh dp2_pp4     (stages, bytes, FLOPs, ticks, bubble)

What a model provides (`PipelineModel`): `model.pipeline_parts()` returns `(embed, blocks, head)`:
`embed(tokens_BT, key) -> x_BTD`; `blocks`, the repeated blocks as one stacked submodule whose
parameters all carry a leading `layers` dimension (one layer's slice of its state, merged with its
graphdef, is a block called as `block(x_BTD, key)`); `head(x_BTD) -> logits_BTV`, applied position
by position. The model names no mesh axis; the `layers` rule shards the stack over `pipeline`.

Where each part runs. The blocks are split into p stages of contiguous layers (GPipe) or into
p·v groups dealt round the stages (circular). The embedding and the head are replicated over the
stages, like data parallelism. The embedding runs before the pipeline, automatically sharded (a
gather: cheap, and XLA CPU cannot partition it inside a shard_map whose fsdp and tensor axes are
both automatic); stage 0 feeds it in, and its gradient comes back out of the pipeline. The last
stage's outputs are reduce-scattered over `pipeline` along the sequence, so every stage runs the
head and the loss on T/p positions. The head is the heaviest single matmul of a large-vocabulary
model; split this way it loads all stages equally, so no stage needs fewer layers and the layer
split stays even (uneven splits are not supported: the stacked `layers` dimension is sharded
evenly over `pipeline`). The price: every stage holds the embedding and head (still sharded over
fsdp/tensor), and their gradients are all-reduced over (data, pipeline) once per step.

Schedules (one tick loop serves both). Stage s at tick t works on slot t − s = r·P + i: repeat r,
microbatch i, period P = m for GPipe (v = 1) and max(m, p) for circular, so a microbatch leaving
the last stage is back at stage 0 in time. Every tick each stage applies its layer group to its
slot and `ppermute`s the result one stage on (round the ring for circular, where stage 0 parks
returning activations until their next repeat). Invalid slots (the bubble) compute on stale data
whose results are discarded. Reverse-mode autodiff of the tick loop runs the backward ticks in
reverse with the inverse permutes: all forwards, then all backwards (GPipe).

    ticks  = (v − 1)·P + m + p − 1          GPipe: m + p − 1
    bubble = 1 − m·v / ticks                GPipe: (p − 1)/(m + p − 1); circular, m ≥ p:
                                            (p − 1)/(v·m + p − 1), one tick being 1/v as long.

Collectives. The step is one `shard_map` manual over `pipeline` and `data` (tensor and fsdp stay
automatic), so gradients are reduced once per step, not once per tick. XLA CPU aborts the
process partitioning a gather inside a shard_map whose fsdp and tensor axes are both automatic
(spmd_partitioner_util "Check failed"); so the embedding runs outside the shard_map and the loss
takes its targets with a one-hot product. A model whose blocks or head gather would meet that
abort with fsdp > 1 and tensor > 1 on CPU.

Dropout keys fold in the microbatch and the layer index: deterministic in (seed, step), but
not the same random bits as the unpipelined model (whose parity tests run without dropout).

Layouts. The train state and checkpoints keep the canonical layer-major order [L, ...]. GPipe's
stage s holds layers [s·L/p, (s+1)·L/p), which is exactly its shard, so nothing moves. Circular's
stage s needs groups s, s+p, ...: the step reorders the block weights to stage-major [p, v, k, ...]
on entry and the gradients back on exit (XLA moves the block bytes over `pipeline` twice a step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxpar.config import PipelineConfig, TrainConfig
from jaxpar.engine.mesh import DATA, batch_parallel_size
from jaxpar.engine.rules import activation_rules
from jaxpar.parallel.base import Context, Strategy, join_microbatches, merge, split_microbatches

SCHEDULES = ("gpipe", "circular")
AXIS = "pipeline"


class PipelineModel(Protocol):
    """A model that can be pipelined: see the module docstring for the contract."""

    def pipeline_parts(self) -> tuple[Callable, nnx.Module, Callable]: ...


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: p stages, m microbatches, v layer groups per stage."""

    kind: str
    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def period(self) -> int:
        """Ticks between a microbatch's visits to stage 0 (circular); m for GPipe."""
        m, p = self.microbatches, self.stages
        return max(m, p) if self.repeats > 1 else m

    @property
    def ticks(self) -> int:
        """Length of the tick loop: (v − 1)·P + m + p − 1 (GPipe: m + p − 1)."""
        return (self.repeats - 1) * self.period + self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Predicted idle fraction of each stage: 1 − m·v / ticks."""
        return 1.0 - self.microbatches * self.repeats / self.ticks

    def group_size(self, num_layers: int) -> int:
        """k: layers a stage applies per tick."""
        return num_layers // (self.stages * self.repeats)

    def stage_of(self, layer: int, num_layers: int) -> int:
        """The stage holding `layer`: groups of k layers are dealt round the stages."""
        return (layer // self.group_size(num_layers)) % self.stages


def make_schedule(cfg: PipelineConfig, stages: int, num_layers: int) -> Schedule:
    """Validated schedule for `stages` pipeline stages; ValueError names the fix."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule={cfg.schedule!r}: use one of {SCHEDULES}")
    if cfg.microbatches < 1 or cfg.repeats < 1:
        raise ValueError(
            f"pipeline.microbatches={cfg.microbatches}, pipeline.repeats={cfg.repeats}: both "
            f"must be >= 1"
        )
    if cfg.schedule == "gpipe" and cfg.repeats != 1:
        raise ValueError(
            f"pipeline.repeats={cfg.repeats} needs --set pipeline.schedule=circular (GPipe "
            f"gives each stage one contiguous group of layers)"
        )
    sched = Schedule(cfg.schedule, stages, cfg.microbatches, cfg.repeats)
    if num_layers % (stages * cfg.repeats):
        raise ValueError(
            f"{num_layers} layers are not divisible by pipeline stages ({stages}) x "
            f"pipeline.repeats ({cfg.repeats}); change the layer count, the `pipeline` mesh "
            f"axis or pipeline.repeats"
        )
    return sched


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


# The pipeline's shard_map is manual over these; fsdp and tensor stay automatic. `data` is manual
# so that gradients are reduced once per step, not once per tick (a size-1 axis costs nothing).
MANUAL = (DATA, AXIS)


# ---- the schedule -------------------------------------------------------------------------------


def _run_stages(
    sched: Schedule, parts: Parts, w_VK: dict, x_MBTD: jax.Array, key: jax.Array | None
) -> jax.Array:
    """The tick loop on one stage; returns the final activations (valid on the last stage).

    w_VK: this stage's block parameters, leaves [v, k, ...] (group r = repeat r).
    x_MBTD: the embedded microbatches (used by stage 0).
    """
    p, m, v, period = sched.stages, sched.microbatches, sched.repeats, sched.period
    k = jax.tree.leaves(w_VK)[0].shape[1]
    stage = lax.axis_index(AXIS)
    ring = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]

    def apply_group(w_K, x_BTD, r, i):
        first = (r * p + stage) * k  # index of the group's first layer in the model
        # Unrolled (k is small): an inner while loop slicing the weights ran about 2x slower
        # per layer on CPU than straight-line code.
        for j in range(k):
            block = merge(parts.block_graphdef, parts.block_template,
                           jax.tree.map(lambda a, j=j: a[j], w_K))  # fmt: skip
            kj = None if key is None else jax.random.fold_in(jax.random.fold_in(key, i), first + j)
            x_BTD = block(x_BTD, kj)
        return x_BTD

    def tick(carry, t):
        recv_BTD, park_MBTD, out_MBTD = carry
        slot = t - stage
        r, i = slot // period, slot % period
        valid = (slot >= 0) & (r < v) & (i < m)
        r, i = jnp.clip(r, 0, v - 1), jnp.clip(i, 0, m - 1)
        first_in = jnp.where(r == 0, x_MBTD[i], park_MBTD[i]) if v > 1 else x_MBTD[i]
        x_BTD = jnp.where(stage == 0, first_in, recv_BTD)
        y_BTD = apply_group(jax.tree.map(lambda a: a[r], w_VK), x_BTD, r, i)
        done = valid & (stage == p - 1) & (r == v - 1)
        out_MBTD = out_MBTD.at[i].set(jnp.where(done, y_BTD, out_MBTD[i]))
        recv_BTD = lax.ppermute(y_BTD, AXIS, ring)
        if v > 1:  # stage 0 parks what the last stage finished at tick t for its next repeat
            back = t - (p - 1)
            rb, ib = back // period, back % period
            keep = (stage == 0) & (back >= 0) & (rb < v - 1) & (ib < m)
            ib = jnp.clip(ib, 0, m - 1)
            park_MBTD = park_MBTD.at[ib].set(jnp.where(keep, recv_BTD, park_MBTD[ib]))
        return (recv_BTD, park_MBTD, out_MBTD), None

    zeros = jnp.zeros_like(x_MBTD)
    init = (zeros[0], zeros if v > 1 else zeros[:0], zeros)
    (_, _, out_MBTD), _ = lax.scan(tick, init, jnp.arange(sched.ticks))
    return out_MBTD


def _stage_loss(sched: Schedule, parts: Parts, rest: dict, w_VK: dict, x_BTD, targets_BT, key):
    """This stage's share of the mean loss (the sum over stages and data replicas is the loss)."""
    p = sched.stages
    stage = lax.axis_index(AXIS)
    model = merge(parts.graphdef, parts.template, _put(rest, parts.path, w_VK))
    _, _, head = model.pipeline_parts()
    b, t = targets_BT.shape
    # Microbatch i takes rows i, i+m, ...: each fsdp shard keeps an equal share of every one.
    x_MBTD = split_microbatches(x_BTD, sched.microbatches)
    out_BTD = join_microbatches(_run_stages(sched, parts, w_VK, x_MBTD, key))
    out_BTD = jnp.where(stage == p - 1, out_BTD, 0)
    # Each stage gets T/p positions of the last stage's output and runs the head on them. In
    # float32 whatever the compute dtype: XLA CPU aborts compiling a bf16 reduce-scatter here,
    # and only the last stage contributes, so the sum is exact (once per step, B x T x D).
    part_BSD = lax.psum_scatter(out_BTD.astype(jnp.float32), AXIS, scatter_dimension=1, tiled=True)
    part_BSD = part_BSD.astype(out_BTD.dtype)
    logits_BSV = head(part_BSD).astype(jnp.float32)
    targets_BS = lax.dynamic_slice_in_dim(targets_BT, stage * (t // p), t // p, axis=1)
    return _cross_entropy(logits_BSV, targets_BS).sum() / (b * t)


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
    d, p, v = mesh.shape[DATA], sched.stages, sched.repeats
    prec = ctx.prec  # casts inside the differentiated functions: float32 gradients

    def local(rest, w_sm, x_BTD, targets_BT, key):
        # rest: embedding/head, replicated over stages; w_sm leaves [1, v, k, ...]: this stage;
        # x_BTD, targets_BT: this data replica's rows.
        key = jax.random.fold_in(key, lax.axis_index(DATA))
        w_VK = jax.tree.map(lambda a: a[0], w_sm)
        with activation_rules(mesh, ctx.act_rules, manual=MANUAL):
            loss, (g_rest, g_VK, g_BTD) = jax.value_and_grad(
                lambda r, w, x: _stage_loss(
                    sched, parts, prec.cast(r), prec.cast(w), x, targets_BT, key
                ),
                argnums=(0, 1, 2),
            )(rest, w_VK, x_BTD)
        # The head got partial gradients on every stage and data replica; the input only on
        # stage 0. One reduction each per step, none inside the tick loop. All in float32.
        loss, g_rest = lax.psum((loss, g_rest), MANUAL)
        g_VK = lax.psum(g_VK, DATA)
        g_BTD = lax.psum(g_BTD.astype(jnp.float32), AXIS)
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

        # The embedding runs outside the shard_map, automatically sharded (XLA CPU cannot
        # partition its gather inside one when fsdp and tensor are both automatic).
        x_BTD, embed_vjp = jax.vjp(embed, rest)
        w_sm = jax.tree.map(lambda a: to_stage_major(a, p, v), blocks)
        loss, g_rest, g_sm, g_BTD = mapped(rest, w_sm, x_BTD, batch["targets"], k_blocks)
        g_rest = jax.tree.map(jnp.add, g_rest, embed_vjp(g_BTD.astype(x_BTD.dtype))[0])
        grads = _put(g_rest, parts.path, jax.tree.map(to_layer_major, g_sm))
        return loss, {}, grads

    return grads_fn


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
    seq = getattr(cfg.model, "seq_len", cfg.data.seq_len)
    if seq % sched.stages:
        raise ValueError(
            f"sequence length {seq} is not divisible by the {sched.stages} pipeline stages: "
            f"each stage runs the output head on seq_len/stages positions; change seq_len or "
            f"the `pipeline` mesh axis"
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
    block, the embedding and the head, x3 for forward + backward) include the stage's 1/p share
    of the head and the embedding.
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
        fwd = len(layers) * flops["block"] + (flops["embed"] + flops["head"]) / p
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
    out = [
        "",
        f"## pipeline: {sched.kind}, p={p} stages, m={m} microbatches, v={sched.repeats} "
        f"repeats; shard_map manual over {', '.join(MANUAL)}",
        "",
        f"tick count {sched.ticks} ({n // (p * sched.repeats)} layer(s) per stage per tick); "
        f"predicted bubble {sched.bubble:.1%} (GPipe (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%})",
        "block -> stage: " + ", ".join(f"{i}->{sched.stage_of(i, n)}" for i in range(n)),
        "embedding and head: on every stage; the head runs on seq_len/p positions per stage",
        "",
        "| stage | blocks | parameter bytes | per device | training FLOPs/step |",
        "|---|---|---:|---:|---:|",
    ]
    for r in table:
        out.append(
            f"| {r['stage']} | {r['layers']} | {r['param_bytes']:,} | "
            f"{r['param_bytes_per_device']:,} | {r['train_flops']:.3g} |"
        )
    # For comparison: the embedding on the first stage and the head on the last (torchtitan's
    # placement), which an uneven split of the layers would then have to rebalance.
    ends = [len(r["layers"]) * f["block"] for r in table]
    ends[0] += f["embed"]
    ends[-1] += f["head"]
    out.append(
        f"\nstage balance: max/mean FLOPs {max(flops) / (sum(flops) / p):.3f} (embedding and "
        f"head split over the stages; {max(ends) / (sum(ends) / p):.3f} were they on the first "
        f"and last stage). The split is even; uneven splits are not supported."
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
