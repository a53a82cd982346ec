"""Where each jaxpar Llama parameter comes from in a Hugging Face checkpoint, both ways.

One `Spec` per parameter of models/llama.py / models/llama_moe.py (a path of the model's
`nnx.to_pure_dict` parameter state): its shape, the Hugging Face tensors it is made of and how.
A parameter is, from its leading axes on:

    [L]       one tensor per layer (`{i}` in the names), when `layers`
    [E]       one tensor per expert (`{j}`), when `experts`
    rest      one Hugging Face tensor, transposed when `transpose` (torch's Linear keeps
              [out, in]; jaxpar multiplies x @ W), each of its axes split into the sub-axes
              of `groups` (q_proj's N*H rows become [N, H]); with `slot` an axis inside rest
              picks among several tensors (w_kv's [2] = k_proj, v_proj)

`blocks(spec, indices, read)` assembles rectangular slices of a parameter (the blocks a
process's devices hold) from the Hugging Face tensors, reading each tensor once and only if a
block needs it, and in it only the rows of its first axis the blocks need; `to_hf(spec, value)`
is the inverse, per Hugging Face tensor.

The rotary embedding of models/llama.py is Hugging Face's half-split one (`rotate_half`), so
q_proj and k_proj load as they are, with no permutation of their rows (Meta's original
consolidated.*.pth layout, interleaved, is not an input).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

LAYER = "model.layers.{i}."


@dataclass(frozen=True)
class Spec:
    path: tuple[str, ...]  # the parameter's path in the model's pure dict
    shape: tuple[int, ...]  # the parameter's shape
    names: tuple[str, ...]  # Hugging Face tensor names (templates with {i} layer, {j} expert)
    groups: tuple[tuple[int, ...], ...]  # per tensor axis (in jaxpar's order): its sub-axes
    layers: bool = False  # a leading [L] axis, one tensor per layer
    experts: bool = False  # then an [E] axis, one tensor per expert
    transpose: bool = False  # jaxpar's rest = the tensor transposed
    slot: int | None = None  # the axis of `shape` that picks among `names`

    @property
    def lead(self) -> int:
        return int(self.layers) + int(self.experts)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        dims = tuple(math.prod(g) for g in self.groups)
        return dims[::-1] if self.transpose else dims

    def hf_names(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """((layer, expert, slot) indices present, name) of every tensor of the parameter."""
        n_layers = self.shape[0] if self.layers else 1
        n_experts = self.shape[int(self.layers)] if self.experts else 1
        for i in range(n_layers):
            for j in range(n_experts):
                for s, template in enumerate(self.names):
                    yield (i, j, s), template.format(i=i, j=j)


def specs(model: Any) -> dict[tuple[str, ...], Spec]:
    """Every parameter of a LlamaConfig / LlamaMoEConfig model, by path."""
    from jaxpar.models.llama_moe import LlamaMoEConfig

    c = model
    v, d, n, k, h, f, nl = (
        c.vocab_size,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.hd,
        c.d_mlp,
        c.n_layers,
    )
    attn = LAYER + "self_attn."
    out = [
        Spec(("tok_emb",), (v, d), ("model.embed_tokens.weight",), ((v,), (d,))),
        Spec(("final_norm", "scale"), (d,), ("model.norm.weight",), ((d,),)),
        Spec(("blocks", "attn_norm", "scale"), (nl, d), (LAYER + "input_layernorm.weight",),
             ((d,),), layers=True),
        Spec(("blocks", "mlp_norm", "scale"), (nl, d),
             (LAYER + "post_attention_layernorm.weight",), ((d,),), layers=True),
        Spec(("blocks", "w_q"), (nl, d, n, h), (attn + "q_proj.weight",), ((d,), (n, h)),
             layers=True, transpose=True),
        Spec(("blocks", "w_kv"), (nl, d, 2, k, h), (attn + "k_proj.weight", attn + "v_proj.weight"),
             ((d,), (k, h)), layers=True, transpose=True, slot=2),
        Spec(("blocks", "w_o"), (nl, n, h, d), (attn + "o_proj.weight",), ((n, h), (d,)),
             layers=True, transpose=True),
    ]  # fmt: skip
    if not c.tie_embeddings:
        out.append(Spec(("head",), (d, v), ("lm_head.weight",), ((d,), (v,)), transpose=True))
    if c.qk_norm:
        out += [
            Spec(("blocks", "q_norm", "scale"), (nl, h), (attn + "q_norm.weight",), ((h,),),
                 layers=True),
            Spec(("blocks", "k_norm", "scale"), (nl, h), (attn + "k_norm.weight",), ((h,),),
                 layers=True),
        ]  # fmt: skip
    if not isinstance(c, LlamaMoEConfig):
        mlp = LAYER + "mlp."
        return _by_path([
            *out,
            Spec(("blocks", "w_gate_up"), (nl, d, 2, f), (mlp + "gate_proj.weight",
                 mlp + "up_proj.weight"), ((d,), (f,)), layers=True, transpose=True, slot=2),
            Spec(("blocks", "w_down"), (nl, f, d), (mlp + "down_proj.weight",), ((f,), (d,)),
                 layers=True, transpose=True),
        ])  # fmt: skip
    e, fe = c.n_experts, c.d_expert
    if c.qk_norm:  # Qwen3-MoE
        router, expert = LAYER + "mlp.gate.weight", LAYER + "mlp.experts.{j}."
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    else:  # Mixtral
        router, expert = (
            LAYER + "block_sparse_moe.gate.weight",
            LAYER + "block_sparse_moe.experts.{j}.",
        )
        gate, up, down = "w1", "w3", "w2"
    out += [
        Spec(("blocks", "router"), (nl, d, e), (router,), ((d,), (e,)), layers=True,
             transpose=True),
        Spec(("blocks", "w_gate"), (nl, e, d, fe), (expert + gate + ".weight",), ((d,), (fe,)),
             layers=True, experts=True, transpose=True),
        Spec(("blocks", "w_up"), (nl, e, d, fe), (expert + up + ".weight",), ((d,), (fe,)),
             layers=True, experts=True, transpose=True),
        Spec(("blocks", "w_down"), (nl, e, fe, d), (expert + down + ".weight",), ((fe,), (d,)),
             layers=True, experts=True, transpose=True),
    ]  # fmt: skip
    if c.shared_expert_mlp:  # Qwen2-MoE's names
        fs, shared = c.shared_expert_mlp, LAYER + "mlp.shared_expert."
        out += [
            Spec(("blocks", "shared_gate_up"), (nl, d, 2, fs), (shared + "gate_proj.weight",
                 shared + "up_proj.weight"), ((d,), (fs,)), layers=True, transpose=True, slot=2),
            Spec(("blocks", "shared_down"), (nl, fs, d), (shared + "down_proj.weight",),
                 ((fs,), (d,)), layers=True, transpose=True),
            Spec(("blocks", "shared_gate"), (nl, d, 1), (LAYER + "mlp.shared_expert_gate.weight",),
                 ((d,), (1,)), layers=True, transpose=True),
        ]  # fmt: skip
    return _by_path(out)


def _by_path(items: list[Spec]) -> dict[tuple[str, ...], Spec]:
    return {s.path: s for s in items}


def hf_tensors(model: Any) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: shape} of every tensor a checkpoint of `model` holds."""
    return {name: s.hf_shape for s in specs(model).values() for _, name in s.hf_names()}


def index_ranges(index: tuple, shape: tuple[int, ...]) -> list[range]:
    """The range along each axis of `index` (slices, as jax passes them) into `shape`."""
    return _ranges(index, shape)


def _ranges(index: tuple, shape: tuple[int, ...]) -> list[range]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for sl, n in zip(index, shape, strict=True):
        r = range(*sl.indices(n))
        if r.step != 1:
            raise ValueError(f"strided slice {sl} of a parameter")
        out.append(r)
    return out


# read(name, ranges) -> the float32 block of tensor `name` over one range per tensor axis
Reader = Callable[[str, list[range]], np.ndarray]


@dataclass
class _Plan:
    """How one block of a parameter is assembled: its ranges per axis, the rows (per tensor
    axis) it needs of each tensor, and how a tensor's rows become its part of the block."""

    out: np.ndarray
    ranges: list[range]
    read_ranges: list[range]  # per tensor axis, in the tensor's order
    shaped: list[int]  # the tensor's block (transposed) reshaped into sub-axes
    inner: tuple  # then sliced by these


def _plan(spec: Spec, index: tuple) -> _Plan:
    ranges = _ranges(index, spec.shape)
    rest = [a for a in range(spec.lead, len(spec.shape)) if a != spec.slot]
    per_group, pos = [], 0
    for g in spec.groups:  # each tensor axis's sub-axes (jaxpar's order) and their ranges
        per_group.append(list(zip(g, (ranges[a] for a in rest[pos : pos + len(g)]), strict=True)))
        pos += len(g)
    tensor_ranges, shaped, inner = [], [], []
    for subs in per_group:  # the rows of the outer sub-axis; inner sub-axes sliced after
        size = math.prod(n for n, _ in subs[1:])
        outer = subs[0][1]
        tensor_ranges.append(range(outer.start * size, outer.stop * size))
        shaped += [len(outer)] + [n for n, _ in subs[1:]]
        inner += [slice(None)] + [slice(r.start, r.stop) for _, r in subs[1:]]
    read_ranges = tensor_ranges[::-1] if spec.transpose else tensor_ranges
    out = np.empty([len(r) for r in ranges], np.float32)
    return _Plan(out, ranges, read_ranges, shaped, tuple(inner))


def blocks(
    spec: Spec, indices: list[tuple], read: Reader, widen: Callable | None = None
) -> list[np.ndarray]:
    """The float32 blocks `indices` (tuples of slices, as jax's `make_array_from_callback`
    passes) of the parameter, from its Hugging Face tensors. Each tensor that any block needs
    is read once, over the rows of its first axis that the blocks need (a bounding range: at most
    the whole tensor), and each block takes its part: the layers/experts outside every block are
    never read, and one tensor at a time is held besides the blocks. `widen(name, part)`, when
    given, turns each part of what `read` returned into float32 (so a bfloat16 tensor is held
    as read, not widened whole)."""
    plans = [_plan(spec, index) for index in indices]
    needed: dict[tuple[int, int, int], list] = {}
    for plan in plans:
        if plan.out.size == 0:
            continue
        layers = plan.ranges[0] if spec.layers else range(1)
        experts = plan.ranges[int(spec.layers)] if spec.experts else range(1)
        slots = plan.ranges[spec.slot] if spec.slot is not None else range(1)
        for li, i in enumerate(layers):
            for ei, j in enumerate(experts):
                for si, s in enumerate(slots):
                    needed.setdefault((i, j, s), []).append((plan, li, ei, si))
    for (i, j, s), users in sorted(needed.items()):
        axes = len(users[0][0].read_ranges)
        bound = [
            range(min(u[0].read_ranges[k].start for u in users),
                  max(u[0].read_ranges[k].stop for u in users))
            for k in range(axes)
        ]  # fmt: skip
        name = spec.names[s].format(i=i, j=j)
        tensor = read(name, bound)
        for plan, li, ei, si in users:
            part = tensor[tuple(slice(r.start - b.start, r.stop - b.start)
                                for r, b in zip(plan.read_ranges, bound, strict=True))]  # fmt: skip
            if widen is not None:
                part = widen(name, part)
            if spec.transpose:
                part = part.T
            part = part.reshape(plan.shaped)[plan.inner]
            where: list[Any] = [li] if spec.layers else []
            where += [ei] if spec.experts else []
            where += [slice(None)] * (len(spec.shape) - spec.lead)
            if spec.slot is not None:
                where[spec.slot] = si
            plan.out[tuple(where)] = part
        del tensor
    return [plan.out for plan in plans]


def block(spec: Spec, index: tuple, read: Reader) -> np.ndarray:
    """One block of the parameter (see `blocks`)."""
    return blocks(spec, [index], read)[0]


def hf_tensor(spec: Spec, value: np.ndarray, idx: tuple[int, int, int]) -> np.ndarray:
    """The Hugging Face tensor (layer, expert, slot) = `idx` of a parameter's whole value."""
    i, j, s = idx
    a = np.asarray(value)
    if spec.layers:
        a = a[i]
    if spec.experts:
        a = a[j]
    if spec.slot is not None:
        a = np.take(a, s, axis=spec.slot - spec.lead)
    a = a.reshape(tuple(math.prod(g) for g in spec.groups))
    return np.ascontiguousarray(a.T if spec.transpose else a, dtype=np.float32)


def to_hf(spec: Spec, value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) of every Hugging Face tensor of one parameter (its whole value)."""
    if tuple(value.shape) != spec.shape:
        raise ValueError(
            f"{'.'.join(spec.path)} is {list(value.shape)}, expected {list(spec.shape)}"
        )
    for idx, name in spec.hf_names():
        yield name, hf_tensor(spec, value, idx)
