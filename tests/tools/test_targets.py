"""`--target NAME`: the train step compiled here by XLA's own TPU and CUDA compilers for an
accelerator's devices (jaxpar.tools.targets), and the one-line refusals of bad input.

One compile per compiler family of a 3-layer MLP (shared by the module's tests), one program
the TPU compiler refuses for memory, one small `jaxpar tune --target`. Where the compilers are
not installed the tests skip, except under CI (JAXPAR_REQUIRE_TARGETS=1, set by .ci/run), where
they fail: CI must compile for both families.
"""

from __future__ import annotations

import json
import os

import pytest

import jaxpar
from jaxpar import cli
from jaxpar.config import apply_overrides, resolve_recipe, validate
from jaxpar.engine import collectives
from jaxpar.tools import targets
from tests.support.hardening_util import call

pytestmark = pytest.mark.targets
REQUIRE = "JAXPAR_REQUIRE_TARGETS"
MESH = "data=4,tensor=2"  # gradients over data, the hidden layer over tensor
BATCH = 64


def _need(family: str) -> None:
    if targets.installed(family):
        return
    reason = f"XLA's {family} compiler is not installed (jaxpar[{targets.EXTRA[family]}])"
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{reason}; {REQUIRE}=1: the target tests must run here")
    pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def _libtpu_beside_others():
    """libtpu takes a lockfile when it loads; compile-only use beside another process (an xdist
    worker, a second run) needs it shared."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        yield


def _mlp(*overrides: str):
    return validate(apply_overrides(resolve_recipe("digits_mlp"), list(overrides)))


@pytest.fixture(scope="module")
def tpu(tmp_path_factory):
    """digits_mlp on v5e-8 (dp4 x tp2), by the TPU compiler: `jaxpar inspect --json`."""
    _need("tpu")
    tmp = str(tmp_path_factory.mktemp("tpu"))
    from jaxpar.tools.inspect import inspect_json

    return inspect_json(_mlp(), jaxpar.preset(MESH), tmp, target="v5e-8")


@pytest.fixture(scope="module")
def cuda(tmp_path_factory):
    """digits_mlp on h100x8 (dp4 x tp2), by the CUDA compiler: the inspect report, doctor too."""
    _need("cuda")
    tmp = str(tmp_path_factory.mktemp("cuda"))
    from jaxpar.tools.inspect import inspect

    return inspect(_mlp(), jaxpar.preset(MESH), tmp, target="h100x8", with_doctor=True)


def _one_line(capsys, argv: list[str]) -> str:
    """A command line that stops with one line on stderr and exit 2: that line."""
    code = call(cli.main, argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, f"{argv}: {code}\n{err}"
    return lines[0]


def _dot_flops() -> float:
    """The MLP's matmul FLOPs per step per device: forward, and backward's weight and input
    gradients but the first layer's input gradient (the batch is data, not a parameter). The
    two hidden layers split 8 ways (rows over data, `mlp` over tensor); the classifier's
    `embed` x `classes` weight has no tensor rule: it splits 4 ways, over data only."""
    i, h, c = 64, 256, 10
    hidden = 2 * i * h * 2 + 2 * h * h * 3  # per row: forward, weight grad (, input grad)
    return hidden * BATCH / 8 + 2 * h * c * 3 * BATCH / 4


def test_tpu_compile_reports_memory_flops_and_collectives(tpu):
    t = tpu["target"]
    assert (t["name"], t["devices"], t["hosts"], t["family"]) == ("v5e-8", 8, 1, "tpu")
    assert "Cloud TPU v5e" in t["source"]
    mem = tpu["memory"]
    assert mem["arguments"] > tpu["parameters"]["bytes_per_device"] > 0
    assert mem["peak"] >= mem["arguments"] and tpu["fits"] is True
    assert tpu["platform"] == "tpu" and tpu["precision_compute"] == "float32"
    assert tpu["flops_per_device"] >= _dot_flops() * 0.99
    kinds = {(r["kind"], tuple(r["mesh_axes"])) for r in tpu["collectives"]}
    assert ("all-reduce", ("data",)) in kinds  # the gradients of the replicated layers
    assert any("tensor" in axes for _, axes in kinds)
    assert tpu["involuntary_remats"] == 0


def test_cuda_compile_reports_memory_flops_collectives_and_the_doctor(cuda):
    assert "target h100x8: 8 x NVIDIA H100 SXM 80GB on 1 host(s)" in cuda
    assert "ptxas for sm_90" in cuda
    line = next(x for x in cuda.splitlines() if x.startswith("per-device memory of the h100x8"))
    assert "fits in 79.11 GiB: yes (jaxpar's comparison)" in line
    flops = next(x for x in cuda.splitlines() if x.startswith("FLOPs per device per step"))
    assert float(flops.split(":")[1].split("(")[0].replace(",", "")) == pytest.approx(_dot_flops())
    assert "kernel autotuning skipped" in cuda
    assert "| all-reduce | data | f32 |" in cuda  # the async all-reduce-start pairs, counted once
    assert "## doctor: SPMD partitioner warnings" in cuda and "no involuntary" in cuda


def test_the_doctor_reads_the_tpu_partitioners_rematerializations(tmp_path):
    """gpt_tiny's token table split over fsdp by its `embed` columns while fsdp also splits the
    batch: the TPU compiler's own partitioner warns (libtpu logs it only at warning level), and
    the doctor maps it to the array, the model's line and the rules."""
    _need("tpu")
    from jaxpar.tools import doctor

    cfg = validate(apply_overrides(resolve_recipe("gpt_tiny"), ["model.n_layers=1"]))
    found = doctor.doctor(cfg, jaxpar.preset("data=2,fsdp=2,tensor=2"), str(tmp_path),
                          propose_fixes=False, target=targets.get("v5e-8"))  # fmt: skip
    remats = found["remats"]
    assert remats, "the TPU partitioner's warnings were not read"
    first = remats[0]
    assert first.arrays[0][0] == "['params']['tok_emb']" and "models/gpt.py" in first.source
    assert any("('embed', 'fsdp')" in rule for rule in first.rules)


def test_the_tpu_compiler_refuses_a_program_over_hbm_in_one_line(capsys):
    """A replicated 64k x 64k layer (16 GiB of float32 before its gradient and Adam moments):
    the compiler's own line and the bytes it needed, exit 2, no traceback."""
    _need("tpu")
    line = _one_line(capsys, ["inspect", "--recipe", "digits_mlp", "--mesh", "data=8", "--set",
                              "model.hidden=65536", "--target", "v5e-8"])  # fmt: skip
    assert line.startswith("error: does not fit on v5e-8 (TPU v5e): RESOURCE_EXHAUSTED")
    assert targets.oom_bytes(line) > 16 * 2**30


def test_a_cuda_program_over_the_cards_memory_is_refused_in_one_line(capsys):
    """The CUDA compiler does not check memory: jaxpar compares the peak with the card's."""
    _need("cuda")
    line = _one_line(capsys, ["inspect", "--recipe", "digits_mlp", "--mesh", "data=8", "--set",
                              "model.hidden=131072", "--target", "h100x8"])  # fmt: skip
    assert line.startswith("error: does not fit on h100x8 (NVIDIA H100 SXM 80GB): peak ")
    assert "> 79.11 GiB of device memory (jaxpar's comparison" in line


def test_tune_on_a_target_ranks_the_targets_programs(tmp_path):
    _need("tpu")
    out = str(tmp_path / "tune.json")
    res = __import__("jaxpar.tools.tune", fromlist=["tune"]).tune(
        _mlp(), None, None, top=3, out=out, log=lambda *_: None, axes=["data"], target="v5e-8"
    )
    assert res["hardware"]["name"] == "v5e-8" and res["target"]["devices"] == 8
    assert res["layouts"] and all(x["fits"] for x in res["layouts"])
    assert all(0 < x["predicted_step_s"] < 1 for x in res["layouts"])
    assert res["layouts"][0]["flops_per_device"] >= _dot_flops() * 0.99
    assert json.load(open(out))["target"]["name"] == "v5e-8"


# --------------------------------------------------------------------------- bad input


def test_an_unknown_target_lists_the_known_ones(capsys):
    line = _one_line(capsys, ["inspect", "--recipe", "digits_mlp", "--target", "tpu-v9"])
    assert "unknown target 'tpu-v9'" in line
    assert all(name in line for name in targets.TARGETS)
    line = _one_line(capsys, ["tune", "--recipe", "digits_mlp", "--target", "h100x9"])
    assert "unknown target 'h100x9'" in line


def test_a_mesh_of_another_device_count_is_refused(capsys):
    line = _one_line(capsys, ["inspect", "--recipe", "digits_mlp", "--mesh", "data=4",
                              "--target", "v5p-32"])  # fmt: skip
    assert "mesh data=4 has 4 devices but target v5p-32 has 16 (4 host(s))" in line
    line = _one_line(capsys, ["tune", "--recipe", "digits_mlp", "--devices", "8",
                              "--target", "v5p-32"])  # fmt: skip
    assert "--devices 8: target v5p-32 has 16 devices" in line


def test_a_missing_compiler_names_the_extra(capsys, monkeypatch):
    monkeypatch.setattr(targets, "_TOPOLOGIES", {})
    monkeypatch.setattr(targets, "_loaded", lambda platform: False)
    monkeypatch.setattr(targets, "locate", lambda dist, inside: None)
    monkeypatch.setattr(targets.shutil, "which", lambda name: None)
    for name, extra in (("v6e-8", "tpu-aot"), ("a100x8", "cuda-aot")):
        line = _one_line(capsys, ["inspect", "--recipe", "digits_mlp", "--target", name])
        assert f'pip install "jaxpar[{extra}]" -c constraints.txt' in line, line
        assert f"target {name} needs" in line


def test_a_failed_target_compile_is_its_first_error_line(capsys, monkeypatch):
    _need("tpu")
    from jaxpar.tools import doctor

    def fail(lowered, options=None, echo=True):
        raise RuntimeError(
            "INTERNAL: Mosaic failed to compile TPU kernel: unsupported layout\n\n"
            "at location: loc(...)\nThe MLIR operation involved:\n  %0 = ..."
        )

    monkeypatch.setattr(doctor, "compile_warned", fail)
    line = _one_line(capsys, ["inspect", "--recipe", "digits_mlp", "--target", "v5e-8"])
    assert line == (
        "error: the v5e-8 compiler failed: INTERNAL: Mosaic failed to compile TPU kernel: "
        "unsupported layout"
    )


# --------------------------------------------------------------------------- the HLO reading


def test_flops_count_loops_by_their_trip_count_and_tpu_convolutions():
    """A while body's dot counts trip-count times (XLA's cost analysis counts it once); a TPU
    matmul written as a convolution with a base-dilated window counts only the window
    positions that read an input element; a cuBLAS GEMM custom call by its dimension numbers."""
    hlo = """HloModule m

%body (p: (s32[], f32[128,512])) -> (s32[], f32[128,512]) {
  %p = (s32[], f32[128,512]) parameter(0)
  %x = f32[128,512]{1,0} get-tuple-element(%p), index=1
  %w = f32[512,512]{1,0} constant({...})
  %d = f32[128,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[128,512]) tuple(%i, %d)
}

%cond (q: (s32[], f32[128,512])) -> pred[] {
  %q = (s32[], f32[128,512]) parameter(0)
  %n = s32[]{:T(128)} constant(10)
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: f32[128,512], l: f32[8,64,2], r: f32[8,2,64], g: f32[32,16], h: f32[16,8]) -> f32[128,512] {
  %a = f32[128,512]{1,0} parameter(0)
  %l = f32[8,64,2]{2,1,0} parameter(1)
  %r = f32[8,2,64]{2,1,0} parameter(2)
  %c = f32[8,64,64]{2,1,0} convolution(%l, %r), window={size=8 stride=7 lhs_dilate=8}, dim_labels=0bf_0io->0bf
  %g = f32[32,16]{1,0} parameter(3)
  %h = f32[16,8]{1,0} parameter(4)
  %gemm = (f32[32,8]{1,0}, s8[1024]{0}) custom-call(%g, %h), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %z = s32[] constant(0)
  %init = (s32[], f32[128,512]) tuple(%z, %a)
  %w = (s32[], f32[128,512]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[128,512]{1,0} get-tuple-element(%w), index=1
}
"""
    loop = 10 * 2 * 128 * 512 * 512
    conv = 2 * 2 * 64 * 64 * 8  # a batched matmul over 8: each output reads one kernel position
    gemm = 2 * 32 * 8 * 16
    assert collectives.hlo_flops(hlo) == loop + conv + gemm


def test_a_loop_whose_counter_steps_by_two_runs_half_its_bound():
    """The TPU compiler's windowed matmul loops count i = 0, 2 while i < 4 (the counter through
    a copy, the start a copy of a constant): two trips (no known_trip_count in its backend
    config); the bound alone would say four."""
    hlo = """HloModule m

%body (p: (u32[], f32[64,64])) -> (u32[], f32[64,64]) {
  %p = (u32[], f32[64,64]) parameter(0)
  %x = f32[64,64]{1,0} get-tuple-element(%p), index=1
  %d = f32[64,64]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  %two = u32[]{:T(128)} constant(2)
  %ci = u32[]{:T(128)} copy(%i)
  %next = u32[]{:T(128)} add(%ci, %two)
  ROOT %t = (u32[], f32[64,64]) tuple(%next, %d)
}

%cond (q: (u32[], f32[64,64])) -> pred[] {
  %q = (u32[], f32[64,64]) parameter(0)
  %n = u32[]{:T(128)} constant(4)
  %j = u32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %z = u32[]{:T(128)} constant(0)
  %c = u32[]{:T(128)} copy(%z)
  %init = (u32[], f32[64,64]) tuple(%c, %a)
  %w = (u32[], f32[64,64]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,64]{1,0} get-tuple-element(%w), index=1
}
"""
    assert collectives.hlo_flops(hlo) == 2 * (2 * 64 * 64 * 64)


def test_tpu_async_collective_fusions_count_once_and_as_overlapped():
    """The TPU compiler wraps an async collective in a fusion whose root is an
    AsyncCollectiveStart custom call: the collective inside counts once, as overlapped."""
    hlo = """HloModule m

%fused (param_0: bf16[1,64,256]) -> (bf16[1,64,256], bf16[1,128,256], u32[]) {
  %param_0 = bf16[1,64,256]{2,1,0} parameter(0)
  %all-gather.1 = bf16[1,128,256]{2,1,0:T(8,128)(2,1)} all-gather(%param_0), channel_id=1, replica_groups=[4,2]<=[8], dimensions={1}, use_global_device_ids=true
  ROOT %custom-call.1 = (bf16[1,64,256]{2,1,0}, bf16[1,128,256]{2,1,0}, u32[]) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

ENTRY %main (x: bf16[1,64,256], y: f32[16]) -> f32[16] {
  %x = bf16[1,64,256]{2,1,0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %start = (bf16[1,64,256]{2,1,0}, bf16[1,128,256]{2,1,0}, u32[]) fusion(%x), kind=kCustom, calls=%fused
  ROOT %ar = f32[16]{0} all-reduce(%y), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%fused
}
"""
    mesh = jaxpar.preset("data=4,tensor=2").mesh
    from jax.sharding import AbstractMesh

    abstract = AbstractMesh(tuple(mesh.sizes().values()), tuple(mesh.sizes()))
    colls = collectives.audit_hlo(hlo, abstract)
    by_kind = {c.kind: c for c in colls}
    assert sorted(by_kind) == ["all-gather", "all-reduce"]
    assert by_kind["all-gather"].overlapped and by_kind["all-gather"].mesh_axes == ("tensor",)
    assert not by_kind["all-reduce"].overlapped
