"""Context layouts and checkpoints: a checkpoint saved by a run whose sequence is split over
`context` (a `python -m train` run on dp2_cp4) restores onto dp8 (no context) and onto
fsdp=2,context=2,tensor=2, and the next step's loss equals the loss the run that never moved
logged; `jaxpar sample` decodes (on one device, with its KV cache) from that run.

    python -m pytest tests/recovery/test_context_reshard.py -m slow
"""

from __future__ import annotations

import sys

import jax
import pytest

from jaxpar.config import apply_overrides, config_hash
from jaxpar.recovery.checkpoint import Checkpointer
from jaxpar.rundir.writer import RunDir
from tests.support.helpers import SMALL, cpu_env, losses, ok, run, train_cmd

pytestmark = pytest.mark.slow

SAVED_AT = 3
# The layouts' point is the sequence split and the restore, not the model: one block of width 64
# (helpers.SMALL), as the checkpoint tests' runs
SMALL_SETS = SMALL[1::2]


@pytest.fixture(scope="module")
def context_run(tmp_path_factory):
    """gpt_tiny made small (seq_len 32, one block of width 64) trained on dp2_cp4 by `python -m
    train` for SAVED_AT + 1 steps, saved at SAVED_AT (and at the end)."""
    run_dir = tmp_path_factory.mktemp("ctx") / "run"
    cmd = train_cmd(run_dir, "--recipe", "gpt_tiny", "--mesh", "dp2_cp4", "--set",
                    f"ckpt.every={SAVED_AT}", *SMALL, steps=SAVED_AT + 1)  # fmt: skip
    ok(run(cmd, cpu_env(devices=8)))
    return run_dir


@pytest.mark.parametrize("target", ["dp8", "fsdp2_cp2_tp2"])
def test_restore_across_context_layouts_gives_the_same_next_loss(jp, context_run, target):
    cfg = apply_overrides(jp.recipe("gpt_tiny", steps=SAVED_AT + 1), SMALL_SETS)
    built = jp.build(cfg, target)
    meta = {"config_hash": config_hash(cfg)}  # the run's: a restore refuses another config
    ckpt = Checkpointer(RunDir(str(context_run)), every=0, keep=2, meta=meta)
    state, meta = ckpt.restore(built.program.abstract_state, which=str(SAVED_AT))
    ckpt.close()
    assert meta["step"] == SAVED_AT
    _, got = jp.train_steps(built, state, SAVED_AT, 1)
    want = losses(context_run)[SAVED_AT + 1]
    print(f"\n[context reshard] dp2_cp4 -> {target}: next loss {got[0]!r} vs {want!r}")
    assert abs(got[0] - want) <= 1e-6 * abs(want)
    assert jax.tree.leaves(state)  # restored onto the target's shardings


def test_sample_from_a_run_trained_on_a_context_mesh(context_run):
    cmd = [sys.executable, "-m", "jaxpar.cli", "sample", str(context_run), "--prompt", "The ",
           "--max-new-tokens", "12", "--temperature", "0"]  # fmt: skip
    out = ok(run(cmd, cpu_env(devices=1))).stdout
    assert out.startswith("The") and len(out.rstrip("\n")) > len("The "), out
    assert ok(run(cmd, cpu_env(devices=1))).stdout == out  # greedy: deterministic
