"""Pipeline parallelism (jaxpar.parallel.pipeline): parity with the unpipelined model, tick counts read
from the compiled HLO, clear errors, inspect lines, checkpoints across pipelined/unpipelined meshes.

XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/parallel/test_pipeline.py

Every parity case runs the real AOT-compiled train step for 2 steps and reads the first step's
gradients back from Adam's first moment: one compile per case. The model is a 64-wide gpt_tiny
(4 layers; 8 where p·v = 8), batch 16 x 32 tokens. The fast tier runs one GPipe and one circular
case; `slow` holds the p x m x schedule grid, the combined layouts and the checkpoint round trip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.config import OptimConfig, PipelineConfig, TrainConfig
from jaxpar.engine import collectives
from jaxpar.models.gpt import GPTConfig
from jaxpar.parallel import pipeline
from tests.support import helpers

STEPS = 2
LOSS_RTOL = 2e-6  # first-step loss, relative
GRAD_ATOL = 2e-6  # first-step gradients (the largest is ~0.9)
LOSSES_RTOL = 1e-5  # later steps: Adam amplifies roundoff
# A folder with the parent's one-device references (ref{layers}.pkl): its child processes load
# them instead of training the reference again, each of them
REFERENCES = "JAXPAR_PIPELINE_REFERENCES"
# The tests that run in child processes: their own xdist group (tests/conftest.py)
CHILDREN = pytest.mark.xdist_group("parallel/test_pipeline.py:children")
# The tests that compile whole train steps of their own (memory, inspect, checkpoint chains), not
# the parity cases sharing the module's reference: a group of their own, on another worker
WHOLE_STEPS = pytest.mark.xdist_group("parallel/test_pipeline.py:whole_steps")
# The parity cases of one layout build the same init; the checkpoint chains' runs the same
# checksum and snapshot programs: each is compiled once (conftest)
pytestmark = pytest.mark.usefixtures("cache_every_program")


def tiny(layers=4, schedule="gpipe", m=4, v=1, steps=STEPS, batch=16, split="", **train
         ) -> TrainConfig:  # fmt: skip
    from jaxpar.train.recipes import gpt_tiny

    cfg = gpt_tiny()
    model = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=layers, d_mlp=128)
    return dataclasses.replace(
        cfg,
        model=model,
        data=dataclasses.replace(cfg.data, global_batch=batch, seq_len=32),
        # A fixed decay horizon: runs of different lengths share one learning-rate schedule.
        optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=100),
        train=dataclasses.replace(cfg.train, steps=steps, eval_every=0, **train),
        pipeline=PipelineConfig(schedule, m, v, split),
    )


@dataclasses.dataclass
class Result:
    losses: np.ndarray  # per step, from the real (AOT-compiled) train step
    grads: dict  # first-step gradients, read back from Adam's first moment
    compiled: object  # conftest.Compiled: program, compiled step, collective audit


def train(jp, cfg: TrainConfig, layout: str) -> Result:
    """cfg.train.steps steps of the compiled train step (the pipeline's, where pipeline > 1)."""
    c = jp.compile_layout(cfg, layout)
    run = jp.train(c)  # first-step gradients read back from Adam's mu (conftest)
    return Result(run.losses, run.grads, c)


@pytest.fixture(scope="module")
def reference(jp):
    """The unpipelined model on one device, per layer count (in a child process: the parent's)."""
    cache = {}

    def get(layers: int) -> Result:
        if layers not in cache:
            shared = os.path.join(os.environ.get(REFERENCES, ""), f"ref{layers}.pkl")
            if os.environ.get(REFERENCES) and os.path.exists(shared):
                with open(shared, "rb") as f:
                    cache[layers] = Result(*pickle.load(f), compiled=None)
            else:
                cache[layers] = train(jp, tiny(layers), "cpu1")
        return cache[layers]

    return get


def check_parity(jp, reference, layout, schedule, m, v, layers, split="") -> Result:
    """Assert loss and gradient parity with one device, and the tick count read from the HLO
    (`split`: pipeline.stage_layers)."""
    cfg = tiny(layers, schedule, m, v, split=split)
    ref, got = reference(layers), train(jp, cfg, layout)
    loss_err = jp.max_rel(got.losses[0], ref.losses[0])
    grad_err = jp.max_abs_tree(got.grads, ref.grads)
    print(f"{layout} {schedule} m={m} v={v} {split}: loss {loss_err:.1e}, grad {grad_err:.1e}")
    assert loss_err < LOSS_RTOL, (got.losses, ref.losses)
    assert grad_err < GRAD_ATOL
    assert jp.max_rel(got.losses, ref.losses) < LOSSES_RTOL, (got.losses, ref.losses)
    mesh, colls = got.compiled.mesh, got.compiled.colls
    sched = pipeline.make_schedule(cfg.pipeline, mesh.shape["pipeline"], layers)
    # The activations' forward and backward permutes sit in the tick loops: trip count = ticks.
    perms = [c for c in colls if c.kind == "collective-permute" and c.in_loop]
    assert [c.trip_count for c in perms] == [sched.ticks] * 2, (perms, sched)
    assert not [c for c in colls if c.in_loop and "data" in c.mesh_axes], "DP reduce per tick"
    return got


# ---- the fast tier -------------------------------------------------------------------------------


def test_schedule_formulas():
    """Schedule reads its ticks and bubble off the engine's table (F, B, W one tick each)."""
    gpipe = [pipeline.Schedule("gpipe", p, m) for p in (2, 4) for m in (1, 2, 4, 8)]
    assert [s.ticks for s in gpipe] == [3 * (m + p - 1) for p in (2, 4) for m in (1, 2, 4, 8)]
    assert all(
        np.isclose(s.bubble, (s.stages - 1) / (s.microbatches + s.stages - 1)) for s in gpipe
    )
    circ = pipeline.Schedule("circular", 4, 8, 2)  # m >= p: (p − 1)/(v·m + p − 1)
    assert circ.ticks == 3 * 19 and np.isclose(circ.bubble, 3 / 19)
    stages = [pipeline.Schedule("circular", 2, 4, 2).stage_of(i, 8) for i in range(8)]
    assert stages == [0, 0, 1, 1, 0, 0, 1, 1]


def test_balanced_split_counts_embedding_and_head():
    assert pipeline.balanced_split(8, 4, 1.0, 0.0, 0.0) == [2, 2, 2, 2]
    # A head worth a layer and a half: the last stage gets one layer, the busiest stage costs 3.
    split = pipeline.balanced_split(8, 4, 1.0, 0.0, 1.5)
    assert split[-1] == 1 and sum(split) == 8
    assert max(k + 1.5 * (s == 3) for s, k in enumerate(split)) == 3.0
    assert pipeline.balanced_split(10, 4, 1.0, 0.1, 0.9) == [2, 3, 3, 2]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        pipeline.balanced_split(3, 4, 1.0, 0.0, 0.0)


def test_stage_major_layout_round_trips():
    a = np.arange(8 * 3).reshape(8, 3)  # 8 layers, p = v = 2, so k = 2
    sm = np.asarray(pipeline.to_stage_major(a, 2, 2))  # [p, v, k, ...]
    assert sm.shape == (2, 2, 2, 3)
    assert sm[1, 0, :, 0].tolist() == [6, 9] and sm[0, 1, :, 0].tolist() == [12, 15]
    np.testing.assert_array_equal(pipeline.to_layer_major(sm), a)


@pytest.mark.parametrize(
    "change, match",
    [
        # Caught first by the `layers` rule's divisibility check (jaxpar.engine.rules).
        (dict(layers=3), r"logical 'layers', size 3.* not divisible by mesh axes \('pipeline',\)"),
        (dict(schedule="circular", v=3), r"not divisible by pipeline stages \(2\) x pipeline.rep"),
        (dict(m=3), "cannot be split into pipeline.microbatches=3"),
        (dict(v=2), "needs --set pipeline.schedule=circular or interleaved_1f1b"),
        (dict(schedule="pipedream"), "use one of gpipe, circular, 1f1b, interleaved_1f1b, zero"),
        (dict(schedule="1f1b", m=1, batch=16), r"microbatches=1 is fewer than the 2 pipeline st"),
        (dict(schedule="interleaved_1f1b", m=4, v=3), r"not divisible by pipeline stages \(2\) x"),
        (dict(schedule="interleaved_1f1b", m=3, v=2, batch=12), "a multiple of 2"),
        (dict(microbatches=2), "set train.microbatches=1"),
    ],
)
def test_clear_errors(jp, change, match):
    with pytest.raises(ValueError, match=match):
        jp.build(tiny(**change), "pp2")


def test_model_without_pipeline_parts_is_a_clear_error(jp):
    cfg = dataclasses.replace(jp.recipe("digits_mlp"), data=tiny().data)
    with pytest.raises(ValueError, match="no pipeline_parts"):
        jp.build(cfg, "pp2")


def test_gpipe_parity_and_ticks(jp, reference):
    check_parity(jp, reference, "pp2", "gpipe", 4, 1, 4)


def test_circular_parity_ticks_and_inspect_lines(jp, reference):
    c = check_parity(jp, reference, "pp2", "circular", 2, 2, 4).compiled
    text = "\n".join(pipeline.inspect_lines(c.built.cfg, c.program, c.colls))
    assert "circular, p=2 stages, m=2 microbatches, v=2 repeats" in text
    assert "tick count 15 (1 layer(s) per stage per tick); predicted bubble 20.0%" in text
    assert "block -> stage: 0->0, 1->1, 2->0, 3->1" in text
    # The head (last stage) outweighs the embedding (stage 0): the even split is not balanced.
    assert float(re.search(r"max/mean FLOPs ([\d.]+)", text).group(1)) > 1.0
    assert "collective-permutes: 2 in tick loops (trip counts [15])" in text


@pytest.mark.parametrize(
    "schedule, m, v", [("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("zero_bubble", 2, 1)]
)
def test_bounded_memory_schedules_parity(jp, reference, schedule, m, v):
    """1F1B, interleaved 1F1B and ZB-H1 (split backward): the unpipelined losses and grads."""
    check_parity(jp, reference, "pp2", schedule, m, v, 4)


# ---- the grid, combined layouts, inspect, checkpoints (slow) ------------------------------------


@pytest.mark.slow
# Corners of the (schedule, p, m) grid: m = 1 and m = 8, both p, both schedules (the tick formula
# is checked on the whole grid by test_schedule_formulas; the two tests above add pp2 m=2 and m=4).
@pytest.mark.parametrize(
    "schedule, v, p, m",
    [
        ("gpipe", 1, 2, 1),
        ("gpipe", 1, 4, 8),
        ("circular", 2, 2, 8),
        ("circular", 2, 4, 4),
        ("1f1b", 1, 4, 8),
        ("interleaved_1f1b", 2, 4, 4),
        ("zero_bubble", 1, 4, 4),
    ],
)
def test_parity_grid(jp, reference, schedule, v, p, m):
    check_parity(jp, reference, f"pp{p}", schedule, m, v, 8 if p * v > 4 else 4)


@pytest.mark.slow
# Remat changes what F stores and B and W recompute, the same for every table: zero_bubble m=2
# (W apart from B) is gpipe m=2's program on pp2 (the same p, m, buffer slots and branches; only
# the table's order differs, whose parity without remat test_gpipe_parity_and_ticks shows);
# 1f1b m=4 adds slots reused within the step (m > p).
@pytest.mark.parametrize("schedule, m", [("1f1b", 4), ("zero_bubble", 2)])
def test_parity_with_remat(jp, reference, schedule, m):
    """Per-block remat: the residuals F stores are the blocks' inputs; the values are the same as
    the unpipelined model's without remat."""
    cfg = tiny(4, schedule, m)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="block"))
    ref, got = reference(4), train(jp, cfg, "pp2")
    assert jp.max_rel(got.losses[0], ref.losses[0]) < LOSS_RTOL, (got.losses, ref.losses)
    assert jp.max_abs_tree(got.grads, ref.grads) < GRAD_ATOL


def _temps(jp, schedule: str, m: int) -> int:
    """Per-device temporaries of the compiled train step (XLA's memory analysis): gpt_tiny
    (4 layers, one per stage) on pipeline=4, four rows per microbatch (the batch grows with m)."""
    from train.recipes import gpt_tiny

    base = gpt_tiny()
    cfg = dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, global_batch=4 * m),
        pipeline=PipelineConfig(schedule, m, 1),
    )
    return collectives.memory(jp.compile_train_step(jp.build(cfg, "pp4")))["temps"]  # no audit


@pytest.mark.slow
@WHOLE_STEPS
def test_1f1b_memory_does_not_grow_with_microbatches(jp):
    """m 4 -> 16: GPipe keeps every microbatch's residuals (temps x 2.5 measured), 1F1B at most
    p (x 1.07)."""
    gpipe = _temps(jp, "gpipe", 16) / _temps(jp, "gpipe", 4)
    one = _temps(jp, "1f1b", 16) / _temps(jp, "1f1b", 4)
    print(f"temps m=16 / m=4: gpipe {gpipe:.3f}, 1f1b {one:.3f}")
    assert gpipe >= 2.25 and one <= 1.25


CHILD_DEVICES = 16  # the child process of the tests marked CHILDREN


@pytest.fixture(scope="module")
def child_session(request, reference, tmp_path_factory):
    """The parent's side of the CHILDREN tests: one pytest subprocess with 16 devices runs them
    all (XLA CPU may abort a process for some layouts; the 16-device layout needs 16 devices;
    the 8-device layouts take the first 8), handed the one-device reference (REFERENCES), so
    the child starts jax, and builds the shared initial state, once. Returns its output, in
    which each test finds its own `PASSED` line. In the child: None."""
    if jax.device_count() == CHILD_DEVICES:
        return None
    folder = tmp_path_factory.mktemp("pipeline-references")
    ref = reference(4)
    with open(folder / "ref4.pkl", "wb") as f:
        pickle.dump((ref.losses, ref.grads), f)
    env = {k: v for k, v in helpers.START_ENV.items() if not k.startswith("PYTEST_")}
    env.update({k: os.environ[k] for k in (helpers.CACHE_ENV,) if k in os.environ})
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update({REFERENCES: str(folder), "JAXPAR_TEST_DEVICES": str(CHILD_DEVICES),
                "XLA_FLAGS": " ".join([f"--xla_force_host_platform_device_count={CHILD_DEVICES}",
                                       *flags]), "COLUMNS": "400"})  # fmt: skip
    module = request.node.nodeid.split("::")[0]
    tests = [f"{module}::{name}" for name in
             ("test_combined_layouts", "test_data_fsdp_tensor_pipeline_on_16_devices")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-s", "-n", "0", "-p", "no:cacheprovider",
         *tests],
        cwd=str(request.config.rootpath), env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return f"(rc {proc.returncode}; negative = killed by a signal, e.g. an XLA abort)\n" + (
        proc.stdout + proc.stderr
    )


def _in_child(request, child_session) -> bool:
    """True in the child process; in the parent, assert the child passed this test."""
    if child_session is None:
        return True
    nodeid = helpers.plain_nodeid(request.node)
    assert f"PASSED {nodeid}" in child_session, (
        f"{nodeid} in a subprocess:\n{child_session[-6000:]}"
    )
    return False


@pytest.mark.slow
@CHILDREN
@pytest.mark.parametrize(
    "layout, schedule, m, v",
    [
        # The bounded-memory schedules, each with another axis (gpipe on data x fsdp x tensor x
        # pipeline: the 16-device test below; circular with data: the checkpoint test across
        # pipelined and unpipelined layouts; every schedule on pipeline=2 and 4 alone:
        # test_bounded_memory_schedules_*). One engine runs every table: a layout crossed with
        # one schedule is crossed with the loop every schedule runs in.
        ("dp2_pp4", "zero_bubble", 8, 1),
        ("dp2_tp2_pp2", "interleaved_1f1b", 2, 2),
        ("fsdp2_tp2_pp2", "1f1b", 4, 1),
    ],
)
def test_combined_layouts(request, jp, reference, child_session, layout, schedule, m, v):
    """In the 16-device child (child_session), on the first 8 devices."""
    if _in_child(request, child_session):
        check_parity(jp, reference, layout, schedule, m, v, 4)


@pytest.mark.slow
@CHILDREN
def test_data_fsdp_tensor_pipeline_on_16_devices(request, jp, reference, child_session):
    """data=2·fsdp=2·tensor=2·pipeline=2 in a 16-device subprocess: exact, one DP reduction."""
    if _in_child(request, child_session):
        assert jax.device_count() == 16
        check_parity(jp, reference, "data=2,fsdp=2,tensor=2,pipeline=2", "gpipe", 4, 1, 4)


@pytest.mark.slow
@WHOLE_STEPS
def test_jaxpar_inspect_shows_the_pipeline(jp, tmp_path):
    from jaxpar.tools.inspect import inspect

    text = inspect(tiny(8, "circular", 4, 2), jp.preset("dp4_pp2"), str(tmp_path), audit=True)
    assert "circular, p=2 stages, m=4 microbatches, v=2 repeats" in text
    # 3 (v·m + p − 1) ticks (F, B and W one tick each); bubble (p − 1)/(v·m + p − 1) = 1/9.
    assert "tick count 27 (2 layer(s) per stage per tick); predicted bubble 11.1%" in text
    assert "block -> stage: 0->0, 1->0, 2->1, 3->1, 4->0, 5->0, 6->1, 7->1" in text
    assert "collective-permutes: 2 in tick loops (trip counts [27])" in text
    assert "| collective-permute | pipeline |" in text


@pytest.mark.slow
def test_fsdp_tensor_pipeline_compiles_with_the_default_xla_flags():
    """`jaxpar inspect` on fsdp2_tp2_pp2 as a user runs it: XLA's default flags (not the tests'
    quicker ones) and no compilation cache, in a subprocess, since XLA's SPMD partitioner aborted
    the process when the embedding's gather ran inside the pipeline's shard_map (one layer per
    stage: the embedding and the loss are what that abort was about)."""
    env = {k: v for k, v in helpers.cpu_env(cache=False).items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(helpers.REPO)
    cmd = [sys.executable, "-m", "jaxpar.cli", "inspect", "--recipe", "gpt_tiny",
           "--mesh", "fsdp2_tp2_pp2", "--set", "model.n_layers=2"]  # fmt: skip
    proc = helpers.ok(helpers.run(cmd, env=env, timeout=900))
    assert "p=2 stages" in proc.stdout


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def _restores(run_dir) -> list[tuple]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    return [(e["step"], e["from_mesh"], e["to_mesh"]) for e in events if e["event"] == "restore"]


def _shared_programs(cfg: TrainConfig, tmp_path) -> object:
    """cfg.run with a compiled-program cache shared by the test's runs (run.compile_cache_dir)."""
    return dataclasses.replace(cfg.run, compile_cache_dir=str(tmp_path / "programs"))


@pytest.mark.slow
@WHOLE_STEPS
def test_checkpoints_cross_pipelined_and_unpipelined(jp, tmp_path):
    """Checkpoints hold the layer-major layout: pipelined -> unpipelined -> pipelined resumes."""
    from jaxpar.worker.training import run

    def go(layout, steps, run_dir, every=50):
        # a run saves its last step only, the reference nothing; no RAM snapshots; the runs
        # share their compiled steps (a layout's runs differ in length and saves only)
        cfg = tiny(4, "circular", 2, 2, steps=steps)
        ckpt = dataclasses.replace(cfg.ckpt, every=every, local_every=0)
        cfg = dataclasses.replace(cfg, ckpt=ckpt, run=_shared_programs(cfg, tmp_path))
        run(cfg, jp.preset(layout), str(run_dir), progress=False)

    shared, ref = tmp_path / "shared", tmp_path / "ref"
    go("dp4_pp2", 2, shared)  # pipelined (circular: stage-major inside the step) writes step 2
    go("dp8", 4, shared)  # unpipelined restores it and writes step 4
    go("dp4_pp2", 5, shared)  # pipelined restores that
    go("dp8", 5, ref, every=0)  # uninterrupted and unpipelined
    pp, dp = "data=4,fsdp=1,tensor=1,pipeline=2", "data=8,fsdp=1,tensor=1,pipeline=1"
    assert _restores(shared) == [(2, pp, dp), (4, dp, pp)]
    got, want = _losses(shared), _losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    assert jp.max_rel([got[s] for s in range(1, 6)], [want[s] for s in range(1, 6)]) < LOSSES_RTOL


@pytest.mark.slow
@WHOLE_STEPS
def test_checkpoints_cross_schedules_and_stage_counts(jp, tmp_path):
    """One chain of resumes against an uninterrupted gpipe run of 6 layers: gpipe resumed under
    gpipe is bitwise; then under zero_bubble on 4 uneven stages (2,1,1,2: the layers whole on
    every stage where the 2 even stages sharded them), the resumed step's loss within 1e-6.
    (The train state's layout follows the mesh and the split, not the schedule: on the same
    even stages gpipe's, 1f1b's and zero_bubble's states are the same arrays, so a resume under
    another schedule there restores as gpipe -> gpipe does; each schedule's step is exact:
    the parity tests.)"""
    from jaxpar.worker.training import run

    def go(layout, schedule, steps, run_dir, split="", every=50):
        # each run of the chain saves its last step only (all the next one restores), the
        # reference nothing; no RAM snapshots (the chain crosses layouts: restores are persistent)
        cfg = tiny(6, schedule, 4, steps=steps, split=split)
        ckpt = dataclasses.replace(cfg.ckpt, every=every, local_every=0)
        cfg = dataclasses.replace(cfg, ckpt=ckpt, run=_shared_programs(cfg, tmp_path))
        run(cfg, jp.preset(layout), str(run_dir), progress=False)
        return _losses(run_dir)

    ref = go("dp4_pp2", "gpipe", 4, tmp_path / "ref", every=0)  # uninterrupted
    chain = tmp_path / "chain"
    go("dp4_pp2", "gpipe", 2, chain)
    assert go("dp4_pp2", "gpipe", 3, chain)[3] == ref[3]  # restores step 2: the same schedule
    got = go("dp2_pp4", "zero_bubble", 4, chain, split="2,1,1,2")  # restores step 3
    assert [s for s, *_ in _restores(chain)] == [2, 3]
    assert abs(got[4] - ref[4]) <= 1e-6 * abs(ref[4]), (got, ref)
