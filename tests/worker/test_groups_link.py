"""A replica group's worker side in one process (jaxpar/worker/groups.py): the group hub of
jaxpar/supervisor/replicas.py runs as a thread here, with the other group not running, so each
step's quorum is this group alone and the cross-group mean is this group's own values. The
group's step programs (its two halves; DiLoCo's inner step and outer step) must then give what
the one-program step gives, and a state sent over the wire comes back as it was."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.supervisor.replicas import Hub
from jaxpar.train.recipes import digits_mlp
from jaxpar.worker import group_layout, group_wire, groups

KEY = b"g" * 32


@pytest.fixture
def hub(monkeypatch):
    hub = Hub("127.0.0.1", KEY, 2, 1, 1, lambda name, **f: None, lambda g: None)
    hub.running(0)  # group 1 is not running: the quorum is group 0 alone
    for k, v in {group_wire.ENV_GROUP: "0", group_wire.ENV_GROUPS: "2",
                 group_wire.ENV_GLOBAL_PROCESS: "0", group_wire.ENV_HUB: hub.address,
                 group_wire.ENV_KEY: KEY.hex()}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    yield hub
    hub.close()


def _job(**comm):
    cfg = jaxpar.apply_overrides(digits_mlp(), ["model.hidden=32", "data.global_batch=32"])
    cfg = dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, **comm))
    return jaxpar.build(cfg, "data=2,fsdp=2", devices=jax.devices()[:4])


def _close(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("diloco", [0, 2])
def test_group_steps_match_the_one_program_step(hub, diloco):
    job = _job(diloco_inner_steps=diloco)
    assert job.cfg.data.global_batch == 32 and job.program.batch_shardings  # the job's batch
    batch0 = job.batch(0)
    assert batch0["image"].shape[0] == 16  # group 0 trains its half of it
    programs, _ = groups.compile_halves(job.program, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch0))  # fmt: skip
    link = groups.GroupLink(programs, job.program.sync_every)
    state = link.join(job.init())
    assert link.quorum == [0] and link.leads
    ref = job.init()
    for step in range(4):
        batch = job.batch(step)
        state, m = link.train_step(state, batch)
        ref, want = job.train_step(ref, batch)
        _close(m["loss"], want["loss"])
        assert link.quorum == [0]
    _close(state, ref)
    assert int(state["step"]) == 4 and hub.released == (2 if diloco else 4)
    # a state sent over the wire (every distinct shard, checksummed) comes back as it was
    fields, arrays = groups.tree_pieces(state, "held")
    back = groups.tree_from_pieces(job.init(), arrays)
    assert group_wire.checksum(groups.tree_pieces(back, "held")[1]) == group_wire.checksum(arrays)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        assert x.sharding == y.sharding and np.array_equal(np.asarray(x), np.asarray(y))
    link.close(complete=True)


def _as_parsed(fields: dict, arrays: list):
    return group_layout.parse(fields, arrays), arrays


@pytest.mark.slow
def test_groups_of_different_layouts_average_and_hand_over_their_state():
    """Two groups of different meshes (data x fsdp on four devices; fsdp x tensor on the other
    four): each group's owned shards tile every leaf once, so the hub's mean of both is the mean
    of the whole leaves; a state resharded by the hub from one group's distinct shards arrives in
    the other's layout with the same values."""
    cfg = jaxpar.apply_overrides(digits_mlp(), ["model.hidden=32", "data.global_batch=32"])
    a = jaxpar.build(cfg, "data=2,fsdp=2", devices=jax.devices()[:4])
    b = jaxpar.build(cfg, "fsdp=2,tensor=2", devices=jax.devices()[4:8])
    sa, sb = a.init(), b.init()
    sb = jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x, sb)
    assert any(x.sharding != y.sharding for x, y in
               zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True))  # fmt: skip
    # the average: owned shards of each group, the mean cut to each group's own shards
    parts = [_as_parsed(*groups.tree_pieces(s, "owned")) for s in (sa, sb)]
    assert all(group_layout.tiles([lay]) for lay, _ in parts)
    means = group_layout.mean(parts, 2)
    for s, (lay, _) in zip((sa, sb), parts, strict=True):
        back = groups.tree_from_pieces(s, group_layout.cut(means, lay))
        for x, y, z in zip(jax.tree.leaves(back), jax.tree.leaves(sa), jax.tree.leaves(sb),
                           strict=True):  # fmt: skip
            want = (np.asarray(y, np.float64) + np.asarray(z, np.float64)) / 2
            np.testing.assert_allclose(np.asarray(x), want.astype(x.dtype), rtol=1e-6)
    # the state: group a's distinct shards put together, cut to group b's layout
    held = _as_parsed(*groups.tree_pieces(sa, "held"))
    need = group_layout.parse(groups.tree_pieces(sb, "none")[0], [])
    assert group_layout.covers([held[0]]) and held[0].pieces != need.need
    got = groups.tree_from_pieces(sb, group_layout.cut(group_layout.assemble([held]), need))
    for x, y, z in zip(jax.tree.leaves(got), jax.tree.leaves(sa), jax.tree.leaves(sb),
                       strict=True):  # fmt: skip
        assert x.sharding == z.sharding and np.array_equal(np.asarray(x), np.asarray(y))
