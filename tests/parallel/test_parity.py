"""Layout parity: every 8-device layout reproduces one device's losses and gradients.

    python -m pytest tests/parallel/test_parity.py -s   # -s prints the measured differences

Losses are compared over 3 Adam steps (max relative difference); gradients at the first step,
before any update has acted (Adam turns a roundoff-sized gradient difference into a full-size
update, so parameters after a step are not compared). The learning rate's warmup starts at 0, so
the third loss is the first after an update that moves the parameters (by Adam's moments of two
steps, each layout's optimizer state carried between them). A run of 3 steps is the first 3 of a
5-step run: with train.steps <= the warmup's 20 the step is the same program (the learning-rate
schedule, program.decay_horizon, is the one way a run's length reaches it), and the batches are
the step's; the one-device reference trains 5 (test_reference_run_is_a_real_training_run).
The gradients are the ones the compiled train step itself computed - read back from Adam's
first moment (conftest.first_step_grads) - so they go through each layout's shardings and, with
microbatches, its accumulation.
"""

import jax
import numpy as np
import pytest

from jaxpar.engine import collectives
from jaxpar.parallel.plan import uses_manual_data
from jaxpar.parallel.program import param_bytes

pytestmark = pytest.mark.slow

LAYOUTS = ["dp8", "fsdp8", "dp2_tp4", "dp4_tp2", "dp2_fsdp2_tp2"]
STEPS = 3
LOSS_RTOL = 1e-5
# fp32 roundoff of differently ordered reductions. gpt_tiny's first-step gradients reach ~1
# in magnitude; the measured differences are <= ~4e-7 (printed with -s).
GRAD_ATOL = 2e-6


def _report(what: str, loss_rel: float, grad_abs: float, ref_grads: dict, extra="") -> None:
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
    print(
        f"\n[parity] {what:<30} loss max rel diff {loss_rel:.2e}  "
        f"grad max abs diff {grad_abs:.2e} (max |grad| {scale:.2e}){extra}"
    )


def test_reference_run_is_a_real_training_run(reference_run):
    ref = reference_run
    assert ref.losses[-1] < ref.losses[0] - 0.5, ref.losses  # it learns: the steps differ
    norms = np.array([np.linalg.norm(g) for g in jax.tree.leaves(ref.grads)])
    assert np.all(np.isfinite(norms)) and norms.min() > 0, "a parameter gets no gradient"
    # The moment read-back recovers the gradient whose norm the step reported.
    total = float(np.sqrt(np.sum(norms**2)))
    assert total == pytest.approx(ref.grad_norms[0], rel=1e-5)


def test_initial_state_is_the_same_on_every_layout(compiled, jp):
    """The premise of programs.initial_state (one init per config, copied onto later layouts):
    the program's own init on a tensor-parallel and a pipelined layout is bitwise the
    one-device init."""
    one = jax.device_get(jp.initial_state(compiled("gpt_tiny", "cpu1").built))
    for layout in ("dp2_fsdp2_tp2", "dp4_pp2"):
        got = jax.device_get(jp.build(jp.recipe("gpt_tiny"), layout).program.init())
        assert jax.tree.structure(got) == jax.tree.structure(one), layout
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(one),
                                strict=True):  # fmt: skip
            assert a.dtype == b.dtype and np.array_equal(a, b), (layout, path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt_tiny_matches_one_device(layout, runs, reference_run, jp):
    got, ref = runs("gpt_tiny", layout, steps=STEPS), reference_run
    assert len(got.losses) == STEPS
    loss_rel = jp.max_rel(got.losses, ref.losses[:STEPS])
    grad_abs = jp.max_abs_tree(got.grads, ref.grads)
    _report(f"gpt_tiny {layout}", loss_rel, grad_abs, ref.grads)
    assert loss_rel <= LOSS_RTOL, (got.losses, ref.losses[:STEPS])
    assert grad_abs <= GRAD_ATOL


@pytest.mark.parametrize("layout", ["dp8", "dp2_fsdp2_tp2"])
def test_grad_accumulation_matches_one_microbatch(layout, runs, jp):
    one = runs("gpt_tiny", layout, steps=STEPS)
    four = runs("gpt_tiny", layout, microbatches=4, steps=STEPS)
    loss_rel = jp.max_rel(four.losses, one.losses)
    grad_abs = jp.max_abs_tree(four.grads, one.grads)
    _report(f"gpt_tiny {layout} microbatches=4", loss_rel, grad_abs, one.grads, " (vs 1)")
    assert loss_rel <= LOSS_RTOL, (four.losses, one.losses)
    assert grad_abs <= GRAD_ATOL


def _show(layout: str, c) -> None:
    manual = uses_manual_data(c.mesh, 4)
    print(f"\n[audit] gpt_tiny {layout} microbatches=4, accumulation manual over data: {manual}")
    print(collectives.format_audit(c.colls))


def test_dp8_accumulation_reduces_gradients_once(compiled):
    c = compiled("gpt_tiny", "dp8", microbatches=4, steps=STEPS)
    _show("dp8", c)
    over_data = [x for x in c.colls if "data" in x.mesh_axes]
    assert [x for x in over_data if x.in_loop] == [], "a collective over data runs per microbatch"
    assert [(x.kind, x.mesh_axes, x.executions) for x in c.colls] == [("all-reduce", ("data",), 1)]
    # That one reduction carries every gradient, plus the loss.
    grads = param_bytes(c.program.abstract_state["params"])
    assert grads <= over_data[0].bytes <= grads + 16


@pytest.mark.parametrize("layout", ["dp2_tp4", "dp2_fsdp2_tp2"])
def test_accumulation_audit_of_other_layouts(layout, compiled):
    """With data > 1, gradients are reduced over `data` once per step where accumulation runs
    manual over data (uses_manual_data), else once per microbatch. Tallies print with -s.

    (fsdp8, data=1, is not audited here: its plain scan reduces gradients over fsdp once per
    microbatch, 4x the bytes of microbatches=1.)
    """
    c = compiled("gpt_tiny", layout, microbatches=4, steps=STEPS)
    _show(layout, c)
    data_in_loop = [x for x in c.colls if "data" in x.mesh_axes and x.in_loop]
    if uses_manual_data(c.mesh, 4):  # accumulate per data replica, reduce once after the loop
        assert data_in_loop == []
        assert sum(x.executions for x in c.colls if "data" in x.mesh_axes) == 1
    else:
        # Plain scan (XLA CPU aborts on the shard_map with fsdp and tensor both automatic):
        # gradients are reduced over data inside the loop, once per microbatch.
        assert sum(x.executions for x in data_in_loop) >= 4


@pytest.mark.parametrize("layout", ["fsdp8", "dp2_tp4"])
@pytest.mark.parametrize("name", ["digits_mlp", "digits_cnn"])
def test_digits_models_match_one_device(name, layout, runs, jp):
    ref, got = runs(name, "cpu1", steps=2), runs(name, layout, steps=2)
    loss_rel = jp.max_rel(got.losses, ref.losses)
    grad_abs = jp.max_abs_tree(got.grads, ref.grads)
    _report(f"{name} {layout}", loss_rel, grad_abs, ref.grads)
    assert loss_rel <= LOSS_RTOL, (got.losses, ref.losses)
    assert grad_abs <= GRAD_ATOL
