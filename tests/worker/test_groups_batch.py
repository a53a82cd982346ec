"""A replica group's share of the global batch: refused in the job's terms before any group builds
its program."""

from __future__ import annotations

import jax
import pytest

from jaxpar.config import apply_overrides, resolve_recipe, validate
from jaxpar.engine.mesh import make_mesh
from jaxpar.worker import group_wire, groups


@pytest.fixture
def two_groups(monkeypatch):
    for env, value in ((group_wire.ENV_GROUPS, "2"), (group_wire.ENV_GROUP, "0"),
                       (group_wire.ENV_HUB, "127.0.0.1:1"), (group_wire.ENV_KEY, "00" * 32)):  # fmt: skip
        monkeypatch.setenv(env, value)


@pytest.mark.parametrize(
    ("batch", "needle"),
    [
        (31, "data.global_batch=31 is not divisible by --groups 2"),
        (30, "data.global_batch=30 over --groups 2 is 15 rows per group, not divisible by a "
             "group's data-parallel size 2; set --set data.global_batch to a multiple of 4"),
    ],
)  # fmt: skip
def test_a_batch_that_does_not_split_over_groups_and_their_mesh_is_named(two_groups, batch, needle):
    cfg = validate(apply_overrides(resolve_recipe("gpt_tiny"), [f"data.global_batch={batch}"]))
    with pytest.raises(ValueError) as e:
        groups.group_cfg(cfg, make_mesh("data=2", jax.devices()[:2]))
    assert needle in str(e.value)
    if batch % 2 == 0:  # the same share on a group mesh it splits over
        assert groups.group_cfg(cfg, make_mesh("data=1", jax.devices()[:1])).data.global_batch == 15
