"""The collectives XLA puts into the compiled gpt_tiny train step, per layout, from the HLO audit.

Each expectation is derived from the layout (not read off a previous run): which arrays are
sharded how, and so which partial results must be summed. The compiled steps are cached for the
session (shared with test_parity.py when run together).

gpt_tiny: vocab V=256, seq T=64, d_model D=128, 4 heads, d_mlp F=512, L=4 layers, global batch 32.
"""

import math

import jax
import pytest

from jaxpar.engine import collectives
from jaxpar.parallel.program import param_bytes

F32 = 4
# the programs test_parity trains (3 steps: the same step as 5, compiled once for both modules)
STEPS = 3


def _spec_axes(spec) -> set[str]:
    return {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}


def _params(c):
    return jax.tree.leaves(c.program.abstract_state["params"])


def _shard_bytes(c) -> int:
    """Bytes of one device's shard of every parameter (= its local gradient)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in _params(c))


def _show(layout, c):
    print(f"\n[audit] gpt_tiny {layout}\n{collectives.format_audit(c.colls)}")


def _of(c, kind=None, axes=None):
    return [
        x
        for x in c.colls
        if (kind is None or x.kind == kind) and (axes is None or x.mesh_axes == axes)
    ]


def test_dp8_one_gradient_all_reduce_over_data(compiled):
    c = compiled("gpt_tiny", "dp8", steps=STEPS)
    _show("dp8", c)
    (grad,) = c.colls  # nothing else: parameters are replicated, only gradients meet
    assert (grad.kind, grad.mesh_axes, grad.group_size, grad.executions) == (
        "all-reduce", ("data",), 8, 1,
    )  # fmt: skip
    # All gradients combined into one tuple, plus the loss (and at most a few more scalars).
    pb = param_bytes(c.program.abstract_state["params"])
    assert pb + F32 <= grad.bytes <= pb + 4 * F32, (grad.bytes, pb)


def test_dp2_tp4_megatron_all_reduces(compiled):
    """Tensor parallel 4 (Megatron) x data parallel 2.

    Per device the batch is 16 rows, so an activation all-reduce moves BTD = 16*64*128 f32.
    Activation all-reduces over `tensor` (each a sum of partial matmul results):
      16 = 4 layers x (2 forward: after the row-parallel w_o and w_out;
                       2 backward: input gradients of the column-parallel fused w_qkv and w_in)
      +1 forward: vocab-parallel embedding lookup (each shard holds 64 of 256 token rows)
      +1 backward: input gradient of the vocab-parallel output head
      = 18 of BTD bytes.
    Vocab-parallel cross-entropy, 3 of [B, T] (BT bytes): the row max, the sum of exponentials
    and the target's logit, each partial over the vocab shards.
    Scalars: squared-norm partial sums of the tensor-sharded gradients (global-norm clipping
    and the grad_norm metric): at most 2 per tensor-sharded parameter.
    XLA's combiner may merge independent all-reduces into one tuple op, so counts are taken in
    units of BTD and BT rather than as ops.
    """
    c = compiled("gpt_tiny", "dp2_tp4", steps=STEPS)
    _show("dp2_tp4", c)
    btd, bt = 16 * 64 * 128 * F32, 16 * 64 * F32
    tp = _of(c, "all-reduce", ("tensor",))
    assert all(x.executions == 1 for x in tp)
    assert sum(x.bytes // btd for x in tp) == 18
    assert sum(x.bytes >= btd for x in tp) == 18, "each activation all-reduce is its own op"
    rest = sum(x.bytes % btd for x in tp)
    tensor_sharded = sum("tensor" in _spec_axes(x.sharding.spec) for x in _params(c))
    scalars = rest - 3 * bt
    assert 0 < scalars <= 2 * tensor_sharded * F32 and scalars % F32 == 0, rest
    assert 18 <= len(tp) <= 18 + 3 + 1

    # Gradients: one all-reduce over data of each device's parameter shards, + the loss.
    # Tensor-sharded parameters contribute 1/4 of their bytes, replicated ones all of them.
    (grad,) = _of(c, axes=("data",))
    assert (grad.kind, grad.executions) == ("all-reduce", 1)
    sharded = sum(x.size * F32 for x in _params(c) if "tensor" in _spec_axes(x.sharding.spec))
    replicated = param_bytes(c.program.abstract_state["params"]) - sharded
    assert _shard_bytes(c) == sharded // 4 + replicated
    assert grad.bytes == _shard_bytes(c) + F32
    assert {x.mesh_axes for x in c.colls} == {("tensor",), ("data",)}


def test_fsdp8_gathers_params_once_and_reduces_gradients(compiled):
    """ZeRO-3 over 8: each fsdp-sharded parameter is all-gathered once (the backward pass reuses
    the gathered copy), every gradient is reduced over fsdp; nothing else moves."""
    c = compiled("gpt_tiny", "fsdp8", steps=STEPS)
    _show("fsdp8", c)
    assert {x.mesh_axes for x in c.colls} == {("fsdp",)}
    assert all(x.executions == 1 for x in c.colls)
    fsdp_params = [x for x in _params(c) if "fsdp" in _spec_axes(x.sharding.spec)]
    gathered = sum(x.size * x.dtype.itemsize for x in fsdp_params)
    ag = _of(c, "all-gather", ("fsdp",))
    assert collectives.total_bytes(ag) == gathered
    # Stacked parameters (leading `layers` dim) are gathered one layer at a time: 3 + 7 x 4.
    assert len(ag) <= _gathered_slices(c) == 31
    # Gradient reduction: an all-reduce (CPU) or reduce-scatter (GPU/TPU; its result is the
    # 1/8 shard) of all parameter bytes, plus a few scalars (loss, squared-norm partials).
    pb = param_bytes(c.program.abstract_state["params"])
    ar = collectives.total_bytes(_of(c, "all-reduce", ("fsdp",)))
    rs = collectives.total_bytes(_of(c, "reduce-scatter", ("fsdp",)))
    grad_reduce = ar + 8 * rs
    assert pb <= grad_reduce <= pb + 32 * F32, (grad_reduce, pb)
    assert set(x.kind for x in c.colls) <= {"all-gather", "all-reduce", "reduce-scatter"}


def _gathered_slices(c) -> int:
    """All-gathers of a step that gathers each fsdp-sharded parameter (per layer) once."""
    n = 0
    logical = dict(
        jax.tree_util.tree_leaves_with_path(
            c.program.param_logical, is_leaf=lambda x: x is None or isinstance(x, tuple)
        )
    )
    for path, x in jax.tree_util.tree_leaves_with_path(c.program.abstract_state["params"]):
        if "fsdp" in _spec_axes(x.sharding.spec):
            names = logical[path] or ()
            n += x.shape[0] if names and names[0] == "layers" else 1
    return n


@pytest.mark.parametrize("layout", ["dp8", "fsdp8", "dp2_tp4"])
def test_no_collective_runs_in_a_loop_without_microbatches(layout, compiled):
    c = compiled("gpt_tiny", layout, steps=STEPS)
    assert not [x for x in c.colls if x.in_loop]
