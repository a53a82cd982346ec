"""Checkpointer and fault harness pieces, in process on the 8 simulated devices (no training).

python -m pytest tests/recovery/test_checkpoint_unit.py
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore
from jax.sharding import NamedSharding, PartitionSpec
from orbax.checkpoint._src import asyncio_utils  # patched by jaxpar._compat (checkpoint import)

from jaxpar.engine.mesh import make_mesh
from jaxpar.recovery.checkpoint import (
    CORRUPT_SUFFIX,
    TMP_SUFFIX,
    Checkpointer,
    CheckpointMismatch,
    NonFiniteState,
    array_hash,
    checksums,
    replica_mismatches,
)
from jaxpar.rundir.writer import RunDir
from jaxpar.worker.faults import (
    Faults,
    FaultSpec,
    array_data_files,
    corrupt_newest,
    parse_all,
    perturb_local_replicas,
    zstd_raw_blocks,
)

# An exception raised where nothing can catch it (a callback on a closed event loop) fails the test.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


def host_state(seed: int = 0) -> dict:
    """A small training-state-like tree; `w` and `mu` are random bits, which zstd cannot
    compress, so orbax stores them as raw blocks (a flipped byte there decodes silently); the
    top exponent bit is clear, so every value is finite (a state of NaNs is never saved)."""
    k = jax.random.split(jax.random.key(seed), 4)
    bits = lambda key: np.array(jax.random.bits(key, (64, 32), np.uint32)) & np.uint32(0xBFFFFFFF)  # noqa: E731
    noise = lambda key: bits(key).view(np.float32)  # noqa: E731
    return {
        "step": np.int32(seed),
        "params": {
            "w": noise(k[0]),
            "b": np.array(jax.random.normal(k[1], (32,)), np.float32),
            "e": np.array(jax.random.normal(k[2], (16, 8)), jnp.bfloat16),
        },
        "opt": {"mu": noise(k[3])},
        "rng": np.asarray([seed, 7], np.uint32),
    }


SPECS = {"step": PartitionSpec(), "params": {"w": PartitionSpec("fsdp", "tensor"), "b": PartitionSpec(), "e": PartitionSpec(None, "tensor")},
         "opt": {"mu": PartitionSpec("fsdp", "tensor")}, "rng": PartitionSpec()}  # fmt: skip


def place(tree: dict, mesh) -> dict:
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, SPECS)


def abstract(tree: dict, mesh) -> dict:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        SPECS,
    )


def host(tree) -> dict:
    return jax.tree.map(np.asarray, jax.device_get(tree))


def bits_equal(a: dict, b: dict) -> bool:
    return all(
        x.dtype == y.dtype and x.tobytes() == y.tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def checkpointer(tmp_path, config_hash="cfg-a", **kw) -> Checkpointer:
    run = RunDir(str(tmp_path / "run"))
    return Checkpointer(run, every=1, keep=5, meta={"config_hash": config_hash}, **kw)


def events(tmp_path, name) -> list[dict]:
    return [e for e in RunDir(str(tmp_path / "run")).events() if e["event"] == name]


@pytest.fixture(scope="module")
def meshes8(devices8):
    return {
        "dp8": make_mesh("data=8"),
        "fsdp8": make_mesh("data=1,fsdp=8"),
        "dp2_fsdp2_tp2": make_mesh("data=2,fsdp=2,tensor=2"),
        "one": make_mesh("data=1", jax.devices()[:1]),
    }


# ---- checksums and the replica check ----------------------------------------------------------


def test_checksums_are_the_same_on_every_layout(meshes8):
    state = host_state()
    want = {
        jax.tree_util.keystr(p): int(array_hash(jnp.asarray(x)))
        for p, x in jax.tree_util.tree_leaves_with_path(state)
    }
    for name, mesh in meshes8.items():
        assert checksums(place(state, mesh)) == want, name
    changed = host_state()
    changed["params"]["w"].view(np.uint32)[3, 5] ^= 1  # one bit
    got = checksums(place(changed, meshes8["dp2_fsdp2_tp2"]))
    assert [k for k in want if got[k] != want[k]] == ["['params']['w']"]


def test_replica_check_finds_a_perturbed_replica_only(meshes8):
    mesh = meshes8["dp2_fsdp2_tp2"]
    state = place(host_state(), mesh)
    assert replica_mismatches(state, mesh) == []
    state["params"] = perturb_local_replicas(state["params"])  # devices off data index 0
    bad = replica_mismatches(state, mesh)
    assert bad == ["['params']['b']", "['params']['e']", "['params']['w']"]
    data_sharded = jax.device_put(
        np.zeros((8, 4), np.float32), NamedSharding(mesh, PartitionSpec("data"))
    )
    assert replica_mismatches({"x": data_sharded}, mesh) == []  # different by design
    assert replica_mismatches(state, meshes8["fsdp8"]) == []  # no data replicas to compare


# ---- save, restore, integrity ------------------------------------------------------------------


def saved_twice(tmp_path, mesh) -> tuple[dict, dict]:
    ckpt = checkpointer(tmp_path)
    s1, s2 = host_state(1), host_state(2)
    ckpt.save(1, place(s1, mesh))
    ckpt.save(2, place(s2, mesh))
    ckpt.close()
    return s1, s2


def test_resharded_restore_is_bitwise_and_keeps_target_shardings(tmp_path, meshes8):
    _, s2 = saved_twice(tmp_path, meshes8["dp8"])
    for name in ("fsdp8", "dp2_fsdp2_tp2", "one"):
        target = abstract(s2, meshes8[name])
        ckpt = checkpointer(tmp_path)
        state, meta = ckpt.restore(target)
        ckpt.close()
        assert meta["step"] == 2 and meta["skipped"] == []
        assert bits_equal(host(state), s2), name
        for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
            assert x.sharding == t.sharding, name


def test_flipped_byte_is_caught_by_checksums_and_falls_back(tmp_path, meshes8):
    mesh = meshes8["dp8"]
    s1, _ = saved_twice(tmp_path, mesh)
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    target = array_data_files(f"{ckpt_dir}/2")[0]
    with open(target, "rb") as f:
        before = f.read()
    assert zstd_raw_blocks(before)  # noise is stored verbatim inside its zstd frame
    damaged = corrupt_newest(ckpt_dir)
    with open(damaged, "rb") as f:
        after = f.read()
    assert damaged == target and len(after) == len(before) and after != before
    ckpt = checkpointer(tmp_path)
    state, meta = ckpt.restore(abstract(s1, mesh))
    ckpt.close()
    assert meta["step"] == 1 and meta["skipped"] == [2]
    assert bits_equal(host(state), s1)
    (bad,) = events(tmp_path, "checkpoint_corrupt")
    assert (bad["step"], bad["reason"]) == (2, "checksum mismatch")
    assert glob.glob(f"{ckpt_dir}/2{CORRUPT_SUFFIX}-*") and not os.path.exists(f"{ckpt_dir}/2")


def test_truncated_file_is_a_read_error_and_falls_back(tmp_path, meshes8):
    mesh = meshes8["dp8"]
    s1, _ = saved_twice(tmp_path, mesh)
    corrupt_newest(str(tmp_path / "run" / "checkpoints"), mode="truncate")
    ckpt = checkpointer(tmp_path)
    state, meta = ckpt.restore(abstract(s1, mesh))
    ckpt.close()
    assert meta["step"] == 1 and bits_equal(host(state), s1)
    (bad,) = events(tmp_path, "checkpoint_corrupt")
    assert bad["step"] == 2 and bad["reason"].startswith(("read", "checksum")), bad


def test_every_checkpoint_corrupt_and_set_aside_are_on_the_console(tmp_path, meshes8, capsys):
    mesh = meshes8["dp8"]
    s1, _ = saved_twice(tmp_path, mesh)
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    for step in (1, 2):
        target = array_data_files(f"{ckpt_dir}/{step}")[0]
        os.truncate(target, os.path.getsize(target) // 2)
    ckpt = checkpointer(tmp_path)
    assert ckpt.restore(abstract(s1, mesh)) is None
    ckpt.close()
    err = capsys.readouterr().err
    for step in (1, 2):
        assert f"checkpoint step {step} is damaged" in err and "set aside as" in err, err
    assert "every checkpoint is corrupt (steps [2, 1]), starting from step 0" in err, err


def test_garbage_metadata_is_named_and_the_restore_falls_back(tmp_path, meshes8, capsys):
    mesh = meshes8["dp8"]
    s1, _ = saved_twice(tmp_path, mesh)
    step2 = tmp_path / "run" / "checkpoints" / "2"
    meta_file, sums_file = step2 / "meta" / "metadata", step2 / "checksums.json"
    good_meta, good_sums = meta_file.read_bytes(), sums_file.read_bytes()
    ckpt = checkpointer(tmp_path)
    bad = {
        meta_file: [b"\x00\xff garbage", b"[1, 2]", b'{"step": 3}', b'{"step": 2, "mesh": 8}'],
        sums_file: [b"{not json", b'"a string"', b'{"[\'step\']": "1234"}'],
    }
    for path, blobs in bad.items():
        for blob in blobs:
            path.write_bytes(blob)
            with pytest.raises(
                ValueError, match=f"^{re.escape(str(path))}: .*not written by jaxpar"
            ):
                ckpt.read_meta(2)
        path.write_bytes(good_meta if path == meta_file else good_sums)
    assert ckpt.read_meta(2)["step"] == 2
    meta_file.write_bytes(b"\x89PNG garbage")
    state, meta = ckpt.restore(abstract(s1, mesh))
    ckpt.close()
    assert meta["step"] == 1 and meta["skipped"] == [2] and bits_equal(host(state), s1)
    (corrupt,) = events(tmp_path, "checkpoint_corrupt")
    assert corrupt["reason"].startswith(f"metadata: {meta_file}: unreadable"), corrupt
    assert f"checkpoint step 2 is damaged (metadata: {meta_file}" in capsys.readouterr().err


def test_restore_which_config_refusal_and_force(tmp_path, meshes8):
    mesh = meshes8["dp8"]
    s1, s2 = saved_twice(tmp_path, mesh)
    ckpt = checkpointer(tmp_path)
    assert ckpt.restore(abstract(s1, mesh), which="none") is None
    state, meta = ckpt.restore(abstract(s1, mesh), which="1")
    assert meta["step"] == 1 and bits_equal(host(state), s1)
    with pytest.raises(ValueError, match=r"ckpt.restore=5.*\[1, 2\]"):
        ckpt.restore(abstract(s1, mesh), which="5")
    ckpt.close()
    other = checkpointer(tmp_path, config_hash="cfg-b")
    with pytest.raises(CheckpointMismatch, match="ckpt.force=true"):
        other.restore(abstract(s1, mesh))
    state, meta = other.restore(abstract(s1, mesh), force=True)
    other.close()
    assert meta["step"] == 2 and bits_equal(host(state), s2)
    (forced,) = events(tmp_path, "restore_forced")
    assert (forced["from_config"], forced["to_config"]) == ("cfg-a", "cfg-b")


def test_uncommitted_folder_is_ignored_and_logged(tmp_path, meshes8):
    mesh = meshes8["dp8"]
    s1, _ = saved_twice(tmp_path, mesh)
    tmp = tmp_path / "run" / "checkpoints" / f"3{TMP_SUFFIX}"
    (tmp / "state").mkdir(parents=True)
    ckpt = checkpointer(tmp_path)
    state, meta = ckpt.restore(abstract(s1, mesh))
    ckpt.close()
    assert meta["step"] == 2
    (ignored,) = events(tmp_path, "uncommitted_ignored")
    assert ignored["dirs"] == [f"3{TMP_SUFFIX}"] and not tmp.exists()


def test_commit_hook_sync_mode_and_replaced_step(tmp_path, meshes8):
    mesh = meshes8["dp8"]
    hooked = []
    ckpt = checkpointer(tmp_path, use_async=False, before_commit=hooked.append)
    ckpt.save(1, place(host_state(1), mesh))
    assert hooked == [1] and os.path.isdir(tmp_path / "run" / "checkpoints" / "1")  # committed
    ckpt.save(2, place(host_state(2), mesh))
    poisoned = host_state(3)
    poisoned["opt"]["mu"][5, 7] = np.nan  # the optimizer state too: nothing is saved from it
    with pytest.raises(NonFiniteState, match=r"state of step 3 holds non-finite values \(1 in 1"):
        ckpt.save(3, place(poisoned, mesh))
    ckpt.close()
    assert hooked == [1, 2] and not os.path.exists(tmp_path / "run" / "checkpoints" / "3")
    (refused,) = events(tmp_path, "nonfinite")
    assert refused["step"] == 3 and list(refused["arrays"]) == ["['opt']['mu']"], refused
    again = checkpointer(tmp_path)
    again.restore(abstract(host_state(1), mesh), which="1")
    again.save(2, place(host_state(3), mesh))  # a step left by an older timeline is replaced
    again.close()
    assert [e["step"] for e in events(tmp_path, "checkpoint_replaced")] == [2]
    ends = events(tmp_path, "save_end")
    assert [e["use_async"] for e in ends] == [False, False, True]


def test_sigterm_sets_the_preemption_flag_when_alone(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    ckpt = checkpointer(tmp_path)
    assert signal.getsignal(signal.SIGTERM) == ckpt._on_sigterm
    assert not ckpt.reached_preemption(0)
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckpt.reached_preemption(1)
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_failed_batch_closes_its_event_loop_only_after_its_other_operations(monkeypatch):
    """One of two concurrent TensorStore operations fails (a full disk, a damaged file) while the
    other is still running: orbax's event loop must outlive it, or the late completion calls a
    closed loop from a TensorStore thread ("Event loop is closed", an unraisable exception)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    promise, late = (
        tensorstore.Promise.new()
    )  # completed by another thread once the failure is raised

    async def fails():
        await asyncio.sleep(0)
        raise OSError(28, "No space left on device")

    async def batch():
        await asyncio.gather(late, fails())

    timer = threading.Timer(0.5, promise.set_result, (1,))
    timer.start()
    with pytest.raises(OSError, match="No space"):
        asyncio_utils.run_sync(batch())  # orbax's entry to every synchronous batch
    timer.join()
    assert late.result() == 1 and late.done()
    assert [repr(u.exc_value) for u in unraisable] == []


# ---- fault specs -------------------------------------------------------------------------------


def test_fault_specs_parse_and_reject(monkeypatch):
    spec = FaultSpec.parse("slow@7:process=1:seconds=0.5")
    assert (spec.kind, spec.step, spec.process, spec.seconds) == ("slow", 7, 1, 0.5)
    assert FaultSpec.parse("kill@3:permanent:repeat").permanent
    for bad in ("boom@3", "kill@x", "kill", "kill@3:when=now", "slow@3"):
        with pytest.raises(ValueError, match="bad fault spec"):
            FaultSpec.parse(bad)
    monkeypatch.setenv("JAXPAR_FAULTS", "nan@4;kill@2")
    assert [s.text for s in parse_all(["kill@2", "corrupt@9"])] == ["kill@2", "corrupt@9", "nan@4"]


def _poisoned(faults: Faults, step: int) -> bool:
    """Whether the state step `step` (0-based) runs on has NaN parameters (a nan fault fired)."""
    state = {"step": jnp.zeros((), jnp.int32), "params": {"w": jnp.ones(4), "n": jnp.arange(2)}}
    out = faults.on_state(step, state)
    assert int(out["step"]) == 0 and np.array_equal(out["params"]["n"], [0, 1])
    return bool(np.isnan(np.asarray(out["params"]["w"])).all())


def test_faults_fire_once_per_run_dir_and_repeat_every_time(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    specs = parse_all(["nan@2", "nan@3:repeat", "diverge@2:process=1"])
    first = Faults(specs, run, process_index=0)
    assert [_poisoned(first, step) for step in range(3)] == [False, True, True]
    assert [s.kind for s in first.specs] == []  # diverge@2:process=1 is not process 0's
    again = Faults(specs, RunDir(str(tmp_path / "run")), process_index=0)
    assert [_poisoned(again, 1), _poisoned(again, 2)] == [False, True]
    fired = [e["spec"] for e in run.events() if e["event"] == "fault_injected"]
    assert fired == ["nan@2", "nan@3:repeat", "nan@3:repeat"]
    # nan poisons every process (each runs its part of the program); only process P logs it
    other = Faults(parse_all(["nan@5:process=1"]), run, process_index=0)
    assert _poisoned(other, 4)
    assert len([e for e in run.events() if e["event"] == "fault_injected"]) == 3


def test_nan_poisons_the_parameters_the_step_runs_on_in_place(tmp_path, meshes8):
    """Sharded parameters keep their shardings (the compiled step's inputs); DiLoCo's
    per-replica copies are poisoned, not its anchor."""
    mesh = meshes8["dp2_fsdp2_tp2"]
    sharding = NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    w = jax.device_put(np.ones((4, 4), np.float32), sharding)
    faults = Faults(parse_all(["nan@1"]), RunDir(str(tmp_path / "run")), process_index=0)
    out = faults.on_state(0, {"params": {"w": w}})
    assert out["params"]["w"].sharding == sharding and np.isnan(out["params"]["w"]).all()
    anchor = jax.device_put(np.ones((4, 4), np.float32), sharding)
    diloco = Faults(parse_all(["nan@1"]), RunDir(str(tmp_path / "dl")), process_index=0)
    out = diloco.on_state(0, {"params": {"w": anchor}, "replicas": {"w": jnp.ones((2, 4, 4))}})
    assert np.isnan(out["replicas"]["w"]).all() and not np.isnan(out["params"]["w"]).any()


def test_slow_sleeps_from_s_and_after_a_restore_past_s(tmp_path, monkeypatch):
    naps: list[float] = []
    monkeypatch.setattr("jaxpar.worker.faults.time.sleep", naps.append)
    for spec, again in (("slow@3:seconds=2:repeat", [2.0, 2.0]), ("slow@3:seconds=1", [])):
        run_dir = str(tmp_path / spec)
        first = Faults(parse_all([spec]), RunDir(run_dir), process_index=0)
        for step in range(5):  # 0-based: @3 is about to start the third step (index 2)
            first.before_step(step)
        assert naps == [naps[0]] * 3, spec
        naps.clear()
        resumed = Faults(parse_all([spec]), RunDir(run_dir), process_index=0)  # restored at 6
        resumed.before_step(6)
        resumed.before_step(7)
        assert naps == again, spec  # without :repeat the spec fired once, in the first run
        naps.clear()
