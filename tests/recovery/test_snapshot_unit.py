"""The local snapshot tier in one process on 8 simulated devices: exact round trip of a sharded
state, two slots at most, torn / corrupted / foreign snapshots rejected with an event.

    python -m pytest tests/recovery/test_snapshot_unit.py
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.recovery import local_tier
from jaxpar.rundir.writer import RunDir
from jaxpar.worker.faults import FaultSpec


def _mesh():
    return jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _abstract(mesh, w_spec=None):
    w_spec = PartitionSpec(None, "tensor") if w_spec is None else w_spec
    rep = NamedSharding(mesh, PartitionSpec())
    return {
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        "params": {
            "w": jax.ShapeDtypeStruct((6, 8), jnp.float32, sharding=NamedSharding(mesh, w_spec)),
            "h": jax.ShapeDtypeStruct(
                (4, 2), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("data"))
            ),
        },  # fmt: skip
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
    }


def _state(abstract, step: int):
    rng = np.random.default_rng(step)

    def one(x):
        val = rng.standard_normal(x.shape).astype(x.dtype) if x.shape else np.int32(step)
        if x.dtype == jnp.uint32:
            val = rng.integers(0, 2**32, x.shape, dtype=np.uint32)
        return jax.device_put(val, x.sharding)

    return jax.tree.map(one, abstract)


def _tier(run, abstract, root, **kw):
    return local_tier.LocalTier(run, abstract, every=1, root=str(root),
                              binding={"config_hash": "c0", "mesh": "data=4,tensor=2"}, **kw)  # fmt: skip


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.sharding == y.sharding and x.dtype == y.dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _events(run, name):
    return [e for e in run.events() if e["event"] == name]


@pytest.fixture
def saved(tmp_path):
    """A tier that snapshotted steps 1..3 (two slots left: 2 and 3), and the states."""
    run = RunDir(str(tmp_path / "run"))
    abstract = _abstract(_mesh())
    tier = _tier(run, abstract, tmp_path / "local")
    assert tier.restore(None) is None  # nothing yet
    states = {s: _state(abstract, s) for s in (1, 2, 3)}
    for s, st in states.items():
        tier.offer(s, st)
    tier.close()
    return run, abstract, tmp_path / "local", tier, states


def test_round_trip_is_bitwise_and_keeps_two_slots(saved):
    run, abstract, root, tier, states = saved
    steps = sorted(m["step"] for m in tier.own.committed().values())
    assert steps == [2, 3] and len(os.listdir(tier.own.root)) == local_tier.SLOTS
    assert tier.stats.snapshots == 3 and tier.stats.max_held <= 2
    again = _tier(run, abstract, root)
    got, info = again.restore(None)
    assert (info["step"], info["tier"], info["fetched"]) == (3, "local", [])
    _same(got, states[3])
    assert again.own.find(2) is None  # other steps are dropped after a restore


def test_newer_persistent_checkpoint_wins(saved):
    run, abstract, root, _, _ = saved
    assert _tier(run, abstract, root).restore(4) is None
    assert _tier(run, abstract, root).restore(3) is not None  # a tie: the faster local copy


def test_corrupted_newest_falls_back_to_previous(saved):
    run, abstract, root, tier, states = saved
    k = tier.own.find(3)
    path = os.path.join(tier.own.dirs[k], local_tier.DATA)
    with open(path, "r+b") as f:  # one flipped byte, size unchanged
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0x01]))
    got, info = _tier(run, abstract, root).restore(None)
    assert info["step"] == 2 and info["skipped"] == [3]
    _same(got, states[2])
    (bad,) = _events(run, "snapshot_rejected")
    assert bad["step"] == 3 and "CRC" in bad["processes"]["0"]


def test_torn_newest_is_reported_and_skipped(saved):
    run, abstract, root, tier, states = saved
    os.remove(os.path.join(tier.own.dirs[tier.own.find(3)], local_tier.MARKER))
    got, info = _tier(run, abstract, root).restore(None)
    assert info["step"] == 2
    _same(got, states[2])
    assert len(_events(run, "snapshot_torn")) == 1


def test_snapshot_of_another_layout_or_config_is_never_used(saved):
    run, _, root, _, _ = saved
    other = _abstract(_mesh(), w_spec=PartitionSpec(None, None))
    assert _tier(run, other, root).restore(None) is None
    reasons = [e["reason"] for e in _events(run, "snapshot_rejected")]
    assert len(reasons) == 2 and all("layout" in r for r in reasons)
    tier = local_tier.LocalTier(run, _abstract(_mesh()), every=1, root=str(root),
                              binding={"config_hash": "c1", "mesh": "data=4,tensor=2"})  # fmt: skip
    assert tier.restore(None) is None
    assert "config_hash" in _events(run, "snapshot_rejected")[-1]["reason"]


def test_marker_lying_about_sizes_is_rejected(saved):
    run, abstract, root, tier, _ = saved
    d = tier.own.dirs[tier.own.find(3)]
    with open(os.path.join(d, local_tier.MARKER)) as f:
        marker = json.load(f)
    marker["blocks"][0]["nbytes"] += 4
    with open(os.path.join(d, local_tier.MARKER), "w") as f:
        json.dump(marker, f)
    _, info = _tier(run, abstract, root).restore(None)
    assert info["step"] == 2


def test_the_loop_waits_rather_than_hold_a_third_snapshot(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    abstract = _abstract(_mesh())
    seen = []

    def slow_commit(step):  # the writer is slower than the loop
        seen.append(len(tier.own.committed()))
        import time

        time.sleep(0.2)

    tier = _tier(run, abstract, tmp_path / "local", before_commit=slow_commit)
    tier.restore(None)
    for s in range(1, 6):
        tier.offer(s, _state(abstract, s))
    tier.close()
    assert tier.stats.snapshots == 5 and tier.stats.wait_s > 0
    assert max(seen) <= 1  # while one is written, at most one other is committed
    assert tier.stats.max_held <= 2


def test_every_follows_state_size():
    assert local_tier.plan_every(-1, 10 * 2**20) == 1
    assert local_tier.plan_every(-1, 3 * local_tier.AUTO_BYTES) == 3
    assert local_tier.plan_every(0, 1) == 0 and local_tier.plan_every(5, 10**12) == 5


def test_losthost_spec_needs_a_node():
    assert FaultSpec.parse("losthost@7:node=1").node == 1
    for bad in ("losthost@7", "kill@3:node=1"):
        with pytest.raises(ValueError, match="node=N"):
            FaultSpec.parse(bad)


def test_a_state_holding_a_nan_is_never_snapshotted(tmp_path):
    """A state with a NaN (its step's loss was finite, its gradients were not) is not written:
    a `nonfinite` event, and the restore takes the snapshot before it."""
    run = RunDir(str(tmp_path / "run"))
    abstract = _abstract(_mesh())
    tier = _tier(run, abstract, tmp_path / "local")
    assert tier.restore(None) is None
    good = _state(abstract, 1)
    tier.offer(1, good)
    bad = _state(abstract, 2)
    bad["params"]["h"] = bad["params"]["h"].at[3, 1].set(jnp.nan)
    tier.offer(2, bad)
    tier.close()
    assert [(e["step"], e["where"]) for e in _events(run, "nonfinite")] == [(2, "snapshot")]
    again = _tier(run, abstract, tmp_path / "local")
    state, info = again.restore(None)
    again.close()
    assert info["step"] == 1
    _same(state, good)


def test_replicas_are_compared_by_the_crcs_each_process_recorded():
    """The restore's replica check: blocks of the same leaf and index on two processes are
    copies of one shard; their CRCs (recorded when the snapshot was written) must agree."""
    tier = local_tier.LocalTier.__new__(local_tier.LocalTier)
    tier.paths = ["['params']['w']", "['params']['b']", "['step']"]
    same = {"0:[[0, 4]]": 11, "1:[[0, 2]]": 22, "2:[]": 5}
    other_shard = {"0:[[4, 8]]": 99, "1:[[0, 2]]": 22, "2:[]": 5}  # w sharded: no copy of [0,4]
    assert tier._replicas_differ([{"crcs": same}, {"crcs": other_shard}]) == []
    diverged = {**same, "1:[[0, 2]]": 23}
    got = tier._replicas_differ([{"crcs": same}, {"crcs": other_shard}, {"crcs": diverged}])
    assert got == ["['params']['b']"]
    # what a peer sent that is not a map of CRCs compares nothing (its load said ok or not)
    assert tier._replicas_differ([{"crcs": same}, {"crcs": None}, {}]) == []
