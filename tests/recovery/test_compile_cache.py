"""The per-process compiled-program cache (jaxpar/recovery/compile_cache.py) and the spare worker's
decisions (jaxpar/worker/spare.py): a hit returns a program that computes bit-identical results, a
changed program or a torn file is never served, and a spare runs a command in-process only when
that equals a cold start."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.recovery import compile_cache
from jaxpar.worker import spare


@pytest.fixture
def cache(tmp_path):
    compile_cache.configure(str(tmp_path / "compiled"))
    yield tmp_path / "compiled"
    compile_cache.configure(None)


def _lowered(mesh, scale: float = 2.0):
    sharded = NamedSharding(mesh, PartitionSpec("data"))

    def f(x, w):
        return jnp.tanh(x @ w).sum(axis=0) * scale  # a cross-device reduction over `data`

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=sharded)
    w = jax.ShapeDtypeStruct((32, 8), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    return jax.jit(f).lower(x, w), sharded


@pytest.fixture
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _inputs(mesh, sharded):
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(16, 32)).astype(np.float32), sharded)
    w = jax.device_put(
        rng.normal(size=(32, 8)).astype(np.float32), NamedSharding(mesh, PartitionSpec())
    )
    return x, w


def test_hit_is_bitwise_identical(cache, mesh):
    lowered, sharded = _lowered(mesh)
    first, hit1 = compile_cache.compile(lowered, "f")
    again, hit2 = compile_cache.compile(_lowered(mesh)[0], "f")
    assert (hit1, hit2) == (False, True)
    assert len(os.listdir(cache)) == 1 and os.listdir(cache)[0].endswith("-p0.bin")
    x, w = _inputs(mesh, sharded)
    np.testing.assert_array_equal(np.asarray(first(x, w)), np.asarray(again(x, w)))
    assert compile_cache.stats()["hits"] >= 1


def test_another_program_is_not_served(cache, mesh):
    compile_cache.compile(_lowered(mesh, 2.0)[0], "f")
    other, hit = compile_cache.compile(_lowered(mesh, 3.0)[0], "f")  # same name, other HLO
    assert not hit and len(os.listdir(cache)) == 2
    x, w = _inputs(mesh, _lowered(mesh)[1])
    ref = np.tanh(np.asarray(x) @ np.asarray(w)).sum(axis=0) * 3.0
    np.testing.assert_allclose(np.asarray(other(x, w)), ref, rtol=1e-5)


def test_torn_file_is_dropped_and_recompiled(cache, mesh):
    compile_cache.compile(_lowered(mesh)[0], "f")
    (path,) = [cache / n for n in os.listdir(cache)]
    path.write_bytes(path.read_bytes()[:100])  # a write cut short
    with pytest.warns(UserWarning, match="dropping"):
        compiled, hit = compile_cache.compile(_lowered(mesh)[0], "f")
    assert not hit and path.stat().st_size > 100  # written again, whole
    x, w = _inputs(mesh, _lowered(mesh)[1])
    assert np.isfinite(np.asarray(compiled(x, w))).all()


def test_off_writes_nothing(tmp_path, mesh):
    compile_cache.configure(None)
    _, hit = compile_cache.compile(_lowered(mesh)[0], "f")
    assert not hit and not any(tmp_path.iterdir())


def test_shared_tier_serves_another_run_and_copies_the_entry_in(tmp_path, mesh):
    shared = tmp_path / "shared"
    try:
        compile_cache.configure(str(tmp_path / "a"), shared=str(shared))
        first, hit1 = compile_cache.compile(_lowered(mesh)[0], "f")
        compile_cache.configure(str(tmp_path / "b"), shared=str(shared))
        again, hit2 = compile_cache.compile(_lowered(mesh)[0], "f")
        assert (hit1, hit2) == (False, True)
        (name,) = os.listdir(shared)
        # the second run has its own copy: its restarts never need the shared folder
        assert (tmp_path / "b" / name).read_bytes() == (shared / name).read_bytes()
        assert compile_cache.stats()["shared_hits"] >= 1
        x, w = _inputs(mesh, _lowered(mesh)[1])
        np.testing.assert_array_equal(np.asarray(first(x, w)), np.asarray(again(x, w)))
        # a tampered shared entry is never loaded: compiled again and replaced
        data = bytearray((shared / name).read_bytes())
        data[-1] ^= 1
        (shared / name).write_bytes(bytes(data))
        compile_cache.configure(str(tmp_path / "c"), shared=str(shared))
        with pytest.warns(UserWarning, match="dropping"):
            _, hit3 = compile_cache.compile(_lowered(mesh)[0], "f")
        assert not hit3 and (shared / name).read_bytes() != bytes(data)
        # a shared folder that cannot be made: a warning, and the run directory alone
        (tmp_path / "file").write_text("")
        with pytest.warns(UserWarning, match="not using"):
            compile_cache.configure(str(tmp_path / "d"), shared=str(tmp_path / "file"))
        _, hit4 = compile_cache.compile(_lowered(mesh)[0], "f")
        assert not hit4 and os.listdir(tmp_path / "d")
    finally:
        compile_cache.configure(None)


def test_shared_tier_comes_from_the_config_else_the_environment(monkeypatch):
    monkeypatch.setenv(compile_cache.ENV_SHARED, "/from/env")
    assert compile_cache.shared_directory("") == "/from/env"
    assert compile_cache.shared_directory("/from/config") == "/from/config"
    monkeypatch.delenv(compile_cache.ENV_SHARED)
    assert compile_cache.shared_directory("") is None


def test_spare_runs_only_commands_equal_to_a_cold_start():
    me = [sys.executable, "-m", "train", "--steps", "3"]
    assert spare.module_of(me) == "train"
    assert spare.module_of([sys.executable, "script.py"]) is None
    assert spare.module_of(["/nonexistent/python", "-m", "train"]) is None
    env = dict(os.environ)
    # jax's backend is initialised in this test process, so running here would not be a cold start
    assert spare.backend_initialised() and not spare.can_run_here(env, me)


def test_spare_refuses_changed_import_time_environment(monkeypatch):
    monkeypatch.setattr(spare, "backend_initialised", lambda: False)
    me = [sys.executable, "-m", "train"]
    env = dict(os.environ)
    assert spare.can_run_here(env, me)
    assert not spare.can_run_here({**env, "JAX_ENABLE_X64": "1"}, me)
    assert not spare.can_run_here({**env, "XLA_FLAGS": env.get("XLA_FLAGS", "") + " --x"}, me)
    assert spare.can_run_here({**env, "JAXPAR_PROCESS_ID": "3"}, me)  # read at run time


def test_keyed_hit_skips_lowering(cache, mesh):
    calls = []

    def lower():
        calls.append(1)
        return _lowered(mesh)[0]

    first, hit1 = compile_cache.compile_by_key("g", ("shape", 1), lower)
    again, hit2 = compile_cache.compile_by_key("g", ("shape", 1), lower)
    other, hit3 = compile_cache.compile_by_key("g", ("shape", 2), lower)
    assert (hit1, hit2, hit3) == (False, True, False) and len(calls) == 2
    x, w = _inputs(mesh, _lowered(mesh)[1])
    np.testing.assert_array_equal(np.asarray(first(x, w)), np.asarray(again(x, w)))


SCRIPT = """
import sys, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from jaxpar.recovery import compile_cache
compile_cache.configure(sys.argv[2] if sys.argv[2] != "-" else None)
def f(x):
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) ^ jnp.uint32(12345)
    return jnp.sum(jnp.tanh(x) * bits.astype(jnp.float32))
compiled, hit = compile_cache.compile(jax.jit(f).lower(jax.ShapeDtypeStruct((64,), jnp.float32)), "f")
print(hit, float(compiled(jnp.arange(64.0))))
"""


def test_programs_from_jax_persistent_cache_are_not_stored(tmp_path):
    """jax's cache fills first (our cache off); with both on, the program jax loads from its
    cache is used but not serialised again (such a blob fails when run); later runs still work."""
    from tests.support.helpers import ok, run

    jax_dir, ours = str(tmp_path / "jax"), str(tmp_path / "ours")
    cmd = [sys.executable, "-c", SCRIPT, jax_dir]
    first = ok(run([*cmd, "-"], timeout=300)).stdout.split()
    assert first[0] == "False" and os.listdir(jax_dir)
    for _ in range(2):
        out = ok(run([*cmd, ours], timeout=300)).stdout.split()
        assert out == first  # not a hit of ours, the same value
        assert not os.path.exists(ours) or os.listdir(ours) == []


def test_train_step_key_covers_the_config_and_leaves_out_a_recipes_own_code():
    """The train step is keyed without lowering only when all of it is jaxpar's own code; any
    change of the config (here the learning rate) is another key."""
    import dataclasses

    import jaxpar
    from jaxpar.config import apply_overrides, resolve_recipe
    from jaxpar.worker import training

    cfg = apply_overrides(resolve_recipe("gpt_tiny"), ["model.n_layers=1", "model.d_model=64"])
    s = jaxpar.build(cfg, "data=8")._loop_session()
    batch = training._abstract_batch(s)
    parts = training.step_parts(s, batch)
    assert parts is not None and parts == training.step_parts(s, batch)
    other = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.optim.lr / 2))
    assert training.step_parts(dataclasses.replace(s, cfg=other), batch) != parts
    own_loss = dataclasses.replace(cfg, loss=lambda *a: 0.0)
    assert training.step_parts(dataclasses.replace(s, cfg=own_loss), batch) is None

    def key(*sets: str) -> tuple:
        return training.step_parts(dataclasses.replace(s, cfg=apply_overrides(cfg, sets)), batch)

    # what never reaches the step leaves the key as it is: checkpoint, log and evaluation
    # settings, and the run's length while the schedule's decay horizon stays (warmup + 1 here)
    assert cfg.optim.decay_steps == 0 and cfg.optim.warmup_steps == 20
    assert key("train.steps=7") == key("train.steps=21", "ckpt.every=3", "ckpt.local_every=0",
                                       "log.every=5", "train.eval_every=2", "name=other")  # fmt: skip
    # the run's length is the decay horizon past the warmup; an explicit horizon is not
    assert key("train.steps=100") != key("train.steps=200")
    assert key("train.steps=100", "optim.decay_steps=500") == key(
        "train.steps=200", "optim.decay_steps=500"
    )
    assert key("train.microbatches=2") != parts and key("train.seed=1") != parts
    assert key("train.steps=7") != key("train.steps=22")  # 22 > warmup + 1


def test_a_fresh_runs_init_loads_from_the_cache_bitwise(cache):
    """The first state of a fresh run (training.fresh_state): its init program stored at the
    first run and loaded, not lowered, at the next; the state bitwise the program's own init."""
    import jaxpar
    from jaxpar.config import apply_overrides, resolve_recipe
    from jaxpar.worker import training

    cfg = apply_overrides(resolve_recipe("gpt_tiny"), ["model.n_layers=1", "model.d_model=64"])
    s = jaxpar.build(cfg, "fsdp4_tp2")._loop_session()  # sharded parameters and moments
    expected = jax.device_get(s.program.init())
    before = compile_cache.stats()
    first = jax.device_get(training.fresh_state(s))
    stored = [n for n in os.listdir(cache) if n.startswith("init-")]
    assert len(stored) == 1 and compile_cache.stats()["misses"] == before["misses"] + 1
    lowered = []
    program = dataclasses.replace(s.program, init=_counting(s.program.init, lowered))
    again = jax.device_get(training.fresh_state(dataclasses.replace(s, program=program)))
    assert compile_cache.stats()["hits"] == before["hits"] + 1 and lowered == []
    for got in (first, again):
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _counting(jitted, calls: list):
    """`jitted` whose lower() is counted in `calls`."""

    class Counting:
        def lower(self, *args):
            calls.append(1)
            return jitted.lower(*args)

        def __call__(self, *args):
            return jitted(*args)

    return Counting()


def test_spare_prebuilds_the_runs_model_from_its_config_json(tmp_path):
    """A spare builds the model of the run's config.json abstractly; the worker's build of an
    equal config and seed takes that one, another config builds its own."""
    import dataclasses
    import json

    from jaxpar.config import apply_overrides, resolve_recipe, to_dict
    from jaxpar.engine import model as model_lib

    cfg = apply_overrides(resolve_recipe("gpt_tiny"), ["model.n_layers=1", "model.d_model=64"])
    (tmp_path / "config.json").write_text(json.dumps(to_dict(cfg)))
    spare.prebuild_model(str(tmp_path))
    prebuilt = model_lib._PREBUILT[-1][1]
    other = dataclasses.replace(cfg.model, n_layers=2)
    assert model_lib.abstract(other, cfg.train.seed) is not prebuilt
    assert model_lib.abstract(cfg.model, cfg.train.seed) is prebuilt
    assert all(m is not prebuilt for _, m in model_lib._PREBUILT)  # used once
