"""Context layouts and checkpoints: a checkpoint saved by a run whose sequence is split over
`context` restores onto dp8 (no context) and onto fsdp=2,context=2,tensor=2, and the next
step's loss equals the loss of the run that never moved; `jaxpar sample` decodes (on one
device, with its KV cache) from a run trained on a context mesh.

    python -m pytest tests/recovery/test_context_reshard.py -m slow
"""

from __future__ import annotations

import sys

import jax
import pytest

from jaxpar.config import apply_overrides
from jaxpar.recovery.checkpoint import Checkpointer
from jaxpar.rundir.writer import RunDir
from tests.support.helpers import SMALL, cpu_env, ok, run, train_cmd

pytestmark = pytest.mark.slow

SAVED_AT = 3
# The layouts' point is the sequence split and the restore, not the model: one block of width 64
# (helpers.SMALL), as the checkpoint tests' runs
SMALL_SETS = SMALL[1::2]


@pytest.fixture(scope="module")
def saved_on_context(jp, tmp_path_factory):
    """gpt_tiny made small (seq_len 64, one block of width 64) trained 3 steps on dp2_cp4, saved,
    and its next step's loss."""
    cfg = apply_overrides(jp.recipe("gpt_tiny", steps=10), SMALL_SETS)
    built = jp.build(cfg, "dp2_cp4")
    state, _ = jp.train_steps(built, built.program.init(), 0, SAVED_AT)
    rundir = RunDir(str(tmp_path_factory.mktemp("ctx") / "run"))
    ckpt = Checkpointer(rundir, every=SAVED_AT, keep=2, meta={"config_hash": "gpt_tiny"})
    ckpt.save(SAVED_AT, state)
    ckpt.close()
    _, nxt = jp.train_steps(built, state, SAVED_AT, 1)
    return rundir, nxt[0], cfg


@pytest.mark.parametrize("target", ["dp8", "fsdp2_cp2_tp2"])
def test_restore_across_context_layouts_gives_the_same_next_loss(jp, saved_on_context, target):
    rundir, want, cfg = saved_on_context
    built = jp.build(cfg, target)
    ckpt = Checkpointer(RunDir(rundir.path), every=0, keep=2, meta={"config_hash": "gpt_tiny"})
    state, meta = ckpt.restore(built.program.abstract_state)
    ckpt.close()
    assert meta["step"] == SAVED_AT
    _, got = jp.train_steps(built, state, SAVED_AT, 1)
    print(f"\n[context reshard] dp2_cp4 -> {target}: next loss {got[0]!r} vs {want!r}")
    assert abs(got[0] - want) <= 1e-6 * abs(want)
    assert jax.tree.leaves(state)  # restored onto the target's shardings


def test_sample_from_a_run_trained_on_a_context_mesh(tmp_path):
    run_dir = tmp_path / "run"
    ok(run(train_cmd(run_dir, "--recipe", "gpt_tiny", "--mesh", "dp2_cp4", "--set",
                     "ckpt.every=2", *SMALL, steps=2), cpu_env(devices=8)))  # fmt: skip
    cmd = [sys.executable, "-m", "jaxpar.cli", "sample", str(run_dir), "--prompt", "The ",
           "--max-new-tokens", "12", "--temperature", "0"]  # fmt: skip
    out = ok(run(cmd, cpu_env(devices=1))).stdout
    assert out.startswith("The") and len(out.rstrip("\n")) > len("The "), out
    assert ok(run(cmd, cpu_env(devices=1))).stdout == out  # greedy: deterministic
