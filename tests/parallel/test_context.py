"""Context parallelism: gpt_tiny with the sequence split over `context` (ring, all-gather and
all-to-all attention) reproduces the losses and gradients of the same model unsplit, and the
ring's collective-permutes match jaxpar.engine.attention.ring_permutes.

    python -m pytest tests/parallel/test_context.py -s   # -s prints the measured differences
"""

import dataclasses

import pytest

from jaxpar.engine import attention, collectives
from tests.support import programs

# Two steps: the first's loss and gradients, and a loss after an update (as test_pipeline.py)
STEPS = 2
# Parity: two blocks (every block attends alike; the second takes the first's output), not
# gpt_tiny's four: the same paths at half the compile and step time.
LAYERS = 2
LOSS_RTOL = 1e-5
GRAD_ATOL = (
    2e-6  # fp32 roundoff of differently ordered reductions (as tests/parallel/test_parity.py)
)


def config(seq_len: int, impl: str = "ring", steps: int = STEPS, layers: int = LAYERS):
    cfg = programs.recipe("gpt_tiny", steps)
    model = dataclasses.replace(cfg.model, seq_len=seq_len, attention=impl, n_layers=layers)
    data = dataclasses.replace(cfg.data, seq_len=seq_len, global_batch=BATCH.get(seq_len, 8))
    return dataclasses.replace(cfg, model=model, data=data)


# Parity: two rows (one per `data` or `fsdp` replica), against the model on one device;
# the steps' time grows with the sequence, the test's point does not grow with the batch.
BATCH = {256: 2, 1024: 2}
REFERENCE = {256: "cpu1", 1024: "cpu1"}

_RUNS: dict = {}


def run(
    seq_len: int, layout: str, impl: str = "ring"
) -> tuple[programs.Compiled, programs.RunResult]:
    key = (seq_len, layout, impl)
    if key not in _RUNS:
        c = programs.compile_layout(config(seq_len, impl), layout)
        # From the ring config's initial state (programs.initial_state keys it by the model's
        # config, the attention among it): the attention holds no parameters, so every variant
        # starts from the same values, and the init is computed once per sequence length.
        ring = dataclasses.replace(c.built, cfg=config(seq_len, "ring"))
        _RUNS[key] = c, programs.train(c, init=lambda: programs.initial_state(ring))
    return _RUNS[key]


def check_parity(seq_len: int, layout: str, impl: str) -> None:
    _, ref = run(seq_len, REFERENCE.get(seq_len, "dp8"))
    _, got = run(seq_len, layout, impl)
    loss_rel = programs.max_rel(got.losses, ref.losses)
    grad_abs = programs.max_abs_tree(got.grads, ref.grads)
    print(
        f"\n[context] seq {seq_len} {layout} {impl}: loss rel {loss_rel:.2e} grad abs {grad_abs:.2e}"
    )
    assert loss_rel <= LOSS_RTOL, (got.losses, ref.losses)
    assert grad_abs <= GRAD_ATOL


@pytest.mark.slow
def test_ring_matches_unsplit_and_audits_its_permutes():
    """The ring's parity and its permutes, on test_ring_matches_unsplit_at_seq_1024's run."""
    check_parity(1024, "dp2_cp4", "ring")
    c, _ = run(1024, "dp2_cp4", "ring")
    perms = [x for x in c.colls if x.kind == "collective-permute"]
    print(collectives.format_audit(c.colls))
    assert all(x.mesh_axes == ("context",) for x in perms)
    fwd, bwd = attention.ring_permutes(4)
    assert sum(x.executions for x in perms) == c.built.cfg.model.n_layers * (fwd + bwd)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2_cp4", "fsdp2_cp2_tp2"])
# The ring on these layouts: test_ring_matches_unsplit_at_seq_1024 (the same program but for the
# sequence's length, chunks of 128 tokens instead of 32)
@pytest.mark.parametrize("impl", ["allgather", "alltoall"])
def test_variants_match_unsplit(layout, impl):
    check_parity(256, layout, impl)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2_cp4", "fsdp2_cp2_tp2"])
def test_ring_matches_unsplit_at_seq_1024(layout):
    check_parity(1024, layout, "ring")


@pytest.mark.slow
def test_ring_temps_at_seq_2048_are_at_most_035_of_dp8():
    """The compiled step's temps (XLA's memory analysis: activations kept for the backward pass
    and everything else live inside the step) fall with the ring: data=2,context=4 holds the
    same tokens per device as data=8, but only 1/4 of each sequence's attention."""
    temps = {}
    for layout in ("dp8", "dp2_cp4"):
        b = programs.build(config(2048, "ring", steps=1, layers=4), layout)
        temps[layout] = collectives.memory(programs.compile_train_step(b))["temps"]
    ratio = temps["dp2_cp4"] / temps["dp8"]
    print(
        f"\n[context] seq 2048 temps: dp2_cp4 {temps['dp2_cp4']:,} / dp8 {temps['dp8']:,} = {ratio:.3f}"
    )
    assert ratio <= 0.35
