"""HLO collective audit (jaxpar.engine.collectives): real programs on 8 CPU devices + hand-written HLO.

XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/engine/test_audit.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from jaxpar.engine.collectives import Collective, audit, audit_hlo, format_audit, tally, total_bytes

AXES = ("data", "fsdp", "tensor", "pipeline")


def make_mesh(data=1, fsdp=1, tensor=1, pipeline=1, devices=None) -> jax.sharding.Mesh:
    shape = (data, fsdp, tensor, pipeline)
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    auto = (AxisType.Auto,) * 4
    if devices is None:
        return jax.make_mesh(shape, AXES, axis_types=auto)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=auto)


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def audit_jit(f, mesh, *args):
    return audit(jax.jit(f).lower(*args).compile(), mesh)


def shard_map(f, mesh, in_specs, out_specs):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


# --------------------------------------------------------------------------- compiled programs


def test_data_parallel_sum_is_one_all_reduce_over_data():
    mesh = make_mesh(data=8)
    x_BD = put(jnp.ones((64, 16)), mesh, PartitionSpec("data"))
    (c,) = audit_jit(lambda x: jnp.sum(x, axis=0), mesh, x_BD)
    assert (c.kind, c.mesh_axes, c.group_size, c.dtype) == ("all-reduce", ("data",), 8, "f32")
    assert c.bytes == 16 * 4 and not c.in_loop and c.trip_count is None


def test_grad_all_reduce_is_combined_into_one_tuple():
    mesh = make_mesh(data=8)
    x_BD = put(jnp.ones((16, 8)), mesh, PartitionSpec("data"))
    params = (
        put(jnp.ones((8, 32)), mesh, PartitionSpec()),
        put(jnp.ones((32, 4)), mesh, PartitionSpec()),
    )

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p[0]) @ p[1])

    colls = audit_jit(jax.grad(loss), mesh, params, x_BD)
    # XLA's all-reduce combiner merges the two gradients into one tuple-shaped all-reduce.
    assert [(c.kind, c.mesh_axes) for c in colls] == [("all-reduce", ("data",))]
    assert colls[0].bytes == (8 * 32 + 32 * 4) * 4


def _tp_step(x, w):
    return jnp.sum(x @ w, axis=0)


def _tp_audit(mesh):
    x_BD = put(jnp.ones((8, 16)), mesh, PartitionSpec("data", "tensor"))
    w_DF = put(jnp.ones((16, 32)), mesh, PartitionSpec("tensor", None))
    return audit_jit(_tp_step, mesh, x_BD, w_DF)


def test_tensor_parallel_matmul_and_batch_reduction():
    colls = _tp_audit(make_mesh(data=2, tensor=4))
    got = {c.mesh_axes: c for c in colls}
    assert set(got) == {("tensor",), ("data",)} and all(c.kind == "all-reduce" for c in colls)
    assert got[("tensor",)].group_size == 4 and got[("tensor",)].bytes == 4 * 32 * 4
    assert got[("data",)].group_size == 2 and got[("data",)].bytes == 32 * 4


def test_device_ids_are_mesh_positions_not_device_ids():
    # Were HLO ids jax device ids, the groups of a permuted mesh would span both axes.
    perm = [jax.devices()[i] for i in (7, 3, 5, 1, 6, 2, 4, 0)]
    permuted = _tp_audit(make_mesh(data=2, tensor=4, devices=perm))
    assert permuted == _tp_audit(make_mesh(data=2, tensor=4))


def test_all_gather_over_fsdp():
    mesh = make_mesh(data=2, fsdp=4)
    w = put(jnp.ones((32, 8)), mesh, PartitionSpec("fsdp"))
    replicated = NamedSharding(mesh, PartitionSpec())
    (c,) = audit_jit(lambda w: lax.with_sharding_constraint(w * 2, replicated), mesh, w)
    assert (c.kind, c.mesh_axes, c.group_size, c.bytes) == ("all-gather", ("fsdp",), 4, 32 * 8 * 4)


def test_ppermute_is_collective_permute_on_its_axis():
    mesh = make_mesh(data=2, pipeline=4)
    x = put(jnp.ones((8, 16)), mesh, PartitionSpec("pipeline"))
    ring = [(i, (i + 1) % 4) for i in range(4)]
    f = shard_map(
        lambda a: lax.ppermute(a, "pipeline", ring),
        mesh,
        PartitionSpec("pipeline"),
        PartitionSpec("pipeline"),
    )
    (c,) = audit_jit(f, mesh, x)
    assert (c.kind, c.mesh_axes, c.group_size, c.bytes) == (
        "collective-permute",
        ("pipeline",),
        4,
        2 * 16 * 4,
    )


def _psum_data(mesh, dtype):
    x = put(jnp.ones((8, 16), dtype), mesh, PartitionSpec("data"))
    (c,) = audit_jit(
        shard_map(lambda a: lax.psum(a, "data"), mesh, PartitionSpec("data"), PartitionSpec()),
        mesh,
        x,
    )
    return c


def test_int8_psum_stays_s8_at_a_quarter_of_the_bytes():
    mesh = make_mesh(data=8)
    f32, s8 = _psum_data(mesh, jnp.float32), _psum_data(mesh, jnp.int8)
    assert (f32.dtype, s8.dtype) == ("f32", "s8") and s8.bytes * 4 == f32.bytes == 16 * 4


def test_cpu_xla_promotes_bf16_all_reduce_to_f32():
    if jax.default_backend() != "cpu":
        pytest.skip("documents CPU XLA behaviour only")
    c = _psum_data(make_mesh(data=8), jnp.bfloat16)
    assert (c.dtype, c.bytes) == ("f32", 16 * 4)


def test_reduce_scatter_and_all_to_all_from_shard_map():
    mesh = make_mesh(data=8)
    x = put(jnp.ones((8, 16)), mesh, PartitionSpec("data"))
    rs = shard_map(
        lambda a: lax.psum_scatter(a, "data", scatter_dimension=1, tiled=True),
        mesh,
        PartitionSpec("data"),
        PartitionSpec("data"),
    )
    a2a = shard_map(
        lambda a: lax.all_to_all(a, "data", 1, 1, tiled=True),
        mesh,
        PartitionSpec("data"),
        PartitionSpec("data"),
    )
    ((c1,), (c2,)) = audit_jit(rs, mesh, x), audit_jit(a2a, mesh, x)
    assert (c1.kind, c1.mesh_axes, c1.bytes) == ("reduce-scatter", ("data",), 2 * 4)
    # CPU lowers all-to-all to a tuple of 8 pieces; their sum is the per-device result.
    assert (c2.kind, c2.mesh_axes, c2.bytes) == ("all-to-all", ("data",), 16 * 4)


def test_collective_inside_scan_is_in_loop_with_trip_count():
    mesh = make_mesh(data=8)
    x = put(jnp.ones((8, 16)), mesh, PartitionSpec("data"))

    def scanned(a):
        def body(c, _):
            return c + 0.1 * lax.psum(c, "data"), None

        return lax.scan(body, a, None, length=5)[0]

    (c,) = audit_jit(
        shard_map(scanned, mesh, PartitionSpec("data"), PartitionSpec("data")), mesh, x
    )
    assert (c.kind, c.mesh_axes, c.in_loop, c.trip_count) == ("all-reduce", ("data",), True, 5)
    assert "main" not in c.computation
    assert tally([c]) == [
        {
            "kind": "all-reduce",
            "mesh_axes": ("data",),
            "dtype": "f32",
            "count": 5,
            "bytes": 5 * 64,
            "wire_bytes": 5 * 64 * 2 * 7 // 8,  # ring all-reduce over 8 devices
        }
    ]
    assert total_bytes([c]) == 5 * 64


# --------------------------------------------------------------------------- hand-written HLO

MESH_2x4 = AbstractMesh((2, 1, 4, 1), AXES)  # data=2, tensor=4
MESH_8 = AbstractMesh((1, 8, 1, 1), AXES)  # fsdp=8


def hlo(*body: str, extra: str = "") -> str:
    lines = "\n".join(f"  {b}" for b in body)
    return (
        "HloModule m, num_partitions=8\n\n"
        "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n"
        "  %y = f32[] parameter(1)\n  ROOT %a = f32[] add(%x, %y)\n}\n\n"
        f"{extra}ENTRY %main (p: f32[8,16]) -> f32[8,16] {{\n"
        "  %p = f32[8,16]{1,0} parameter(0)\n"
        f"{lines}\n}}\n"
    )


def one(text, mesh=MESH_2x4) -> Collective:
    (c,) = audit_hlo(hlo(text), mesh)
    return c


@pytest.mark.parametrize(
    "groups, axes, size",
    [
        ("{{0,1,2,3},{4,5,6,7}}", ("tensor",), 4),
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",), 2),
        ("{}", ("data", "tensor"), 8),
        ("{{0},{1},{2},{3},{4},{5},{6},{7}}", (), 1),
        ("[2,4]<=[8]", ("tensor",), 4),
        ("[4,2]<=[2,4]T(1,0)", ("data",), 2),
        ("[1,8]<=[8]", ("data", "tensor"), 8),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ("tensor",), 4),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ("data",), 2),
        ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", ("data",), 2),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1':(1)2}", ("tensor",), 2),
        ("mesh['x'=8] {'x':(2)4}", ("tensor",), 4),
        ("mesh['x'=8] {'x':(1)2,'x':(4)2}", ("data", "tensor"), 4),
    ],
)
def test_replica_group_syntaxes(groups, axes, size):
    c = one(
        f"ROOT %ar = f32[8,16]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        "use_global_device_ids=true, to_apply=%add"
    )
    assert (c.kind, c.mesh_axes, c.group_size, c.bytes) == ("all-reduce", axes, size, 8 * 16 * 4)


def test_sub_axis_groups_members():
    # 'x':(2)4 of x=8: reshape [2,4,1] and group over the middle: {0,1,2,3} and {4,5,6,7}.
    c = one(
        "ROOT %ar = f32[1]{0} all-reduce(%p), replica_groups=mesh['x'=8] {'x':(2)4}, to_apply=%add",
        mesh=AbstractMesh((2, 4, 1, 1), AXES),
    )
    assert c.mesh_axes == ("fsdp",)


def test_tuple_result_sums_bytes_and_joins_dtypes():
    c = one(
        "%ar = (f32[8,16]{1,0}, bf16[4]{0}, /*index=2*/f32[2]{0}) all-reduce(%p, %q, %r), "
        'replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="all-gather {{0}}"}'
    )
    assert (c.dtype, c.bytes, c.mesh_axes) == ("bf16,f32", 8 * 16 * 4 + 4 * 2 + 2 * 4, ("tensor",))


def test_async_pairs_count_once_with_done_shape():
    colls = audit_hlo(
        hlo(
            "%ars = f32[8,16]{1,0} all-reduce-start(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, "
            "to_apply=%add",
            "%ard = f32[8,16]{1,0} all-reduce-done(%ars)",
            "%ags = (f32[1,16]{1,0}, f32[8,16]{1,0}) all-gather-start(%s), dimensions={0}, "
            "replica_groups=[1,8]<=[8]",
            "%agd = f32[8,16]{1,0} all-gather-done(f32[1,16]{1,0} %ags)",
            "%cps = (s8[4]{0}, s8[4]{0}, u32[], u32[]) collective-permute-start(%t), "
            "source_target_pairs={{0,4},{4,0},{1,5},{5,1}}",
            "ROOT %cpd = s8[4]{0} collective-permute-done(%cps)",
        ),
        MESH_2x4,
    )
    got = [(c.kind, c.bytes, c.dtype, c.mesh_axes, c.group_size) for c in colls]
    assert got == [
        ("all-reduce", 512, "f32", ("tensor",), 4),
        ("all-gather", 512, "f32", ("data", "tensor"), 8),
        ("collective-permute", 4, "s8", ("data",), 2),
    ]


def test_async_wrapped_collective_belongs_to_its_caller():
    wrapped = (
        "%wrapped (a: f32[8,4]) -> f32[8,4] {\n  %a = f32[8,4]{1,0} parameter(0)\n"
        "  ROOT %rs = f32[8,4]{1,0} reduce-scatter(%a), replica_groups=[2,4]<=[8], "
        "dimensions={1}, to_apply=%add\n}\n\n"
    )
    text = hlo(
        "%st = ((f32[8,16]{1,0}), f32[8,4]{1,0}) async-start(%p), calls=%wrapped",
        "ROOT %dn = f32[8,4]{1,0} async-done(%st), calls=%wrapped",
        extra=wrapped,
    )
    (c,) = audit_hlo(text, MESH_2x4)
    assert (c.kind, c.bytes, c.computation, c.in_loop) == ("reduce-scatter", 128, "main", False)


def _loop(name: str, body: str) -> str:
    return (
        f"%cond_{name} (c: (s32[], f32[8])) -> pred[] {{\n"
        "  %c = (s32[], f32[8]{0}) parameter(0)\n"
        "  %n = s32[] constant(3)\n  %i = s32[] get-tuple-element(%c), index=0\n"
        "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}\n\n"
        f"%body_{name} (b: (s32[], f32[8])) -> (s32[], f32[8]) {{\n"
        f"  %b = (s32[], f32[8]{{0}}) parameter(0)\n{body}\n"
        "  ROOT %r = (s32[], f32[8]{0}) tuple()\n}\n\n"
    )


def test_nested_loops_multiply_trip_counts_and_unknown_stays_none():
    inner = _loop("in", "  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add")
    outer = _loop(
        "out",
        "  %w = (s32[], f32[8]{0}) while(%b), condition=%cond_in, body=%body_in, "
        'backend_config={"known_trip_count":{"n":"4"}}',
    )
    # An unbounded loop: two constants in the condition, so no trip count can be read.
    odd = _loop("odd", "  %ag = f32[8]{0} all-gather(%x), replica_groups={{0,4}}, dimensions={0}")
    odd = odd.replace("%n = s32[] constant(3)", "%n = s32[] constant(3)\n  %m = s32[] constant(9)")
    text = hlo(
        "%t = (s32[], f32[8]{0}) tuple()",
        "%w1 = (s32[], f32[8]{0}) while(%t), condition=%cond_out, body=%body_out",
        "ROOT %w2 = (s32[], f32[8]{0}) while(%t), condition=%cond_odd, body=%body_odd",
        extra=inner + outer + odd,
    )
    ar, ag = audit_hlo(text, MESH_2x4)
    # Outer bound 3 from its condition's constant, inner 4 from known_trip_count: 12 runs.
    assert (ar.computation, ar.in_loop, ar.trip_count) == ("body_in", True, 12)
    assert (ag.computation, ag.in_loop, ag.trip_count) == ("body_odd", True, None)
    assert total_bytes([ar, ag]) == 12 * 32 + 32
    assert total_bytes([ar, ag], kind="all-gather", axes=("data",)) == 32
    assert "counted once" in format_audit([ar, ag])


def test_metadata_mentioning_collectives_is_not_an_op():
    text = hlo(
        'ROOT %f = f32[8,16]{1,0} copy(%p), metadata={op_name="all-reduce(x) replica_groups={}"}'
    )
    assert audit_hlo(text, MESH_2x4) == []


def test_device_outside_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="compiled for"):
        one("ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,8}}, to_apply=%add")


def test_tally_groups_and_format_table():
    colls = [
        Collective("all-reduce", "f32", 100, ("data",), 2, "main", False, None),
        Collective("all-reduce", "f32", 50, ("data",), 2, "body", True, 3),
        Collective("all-gather", "bf16", 10, ("fsdp", "tensor"), 8, "main", False, None),
        Collective("all-reduce", "f32", 7, (), 1, "main", False, None),
    ]
    rows = tally(colls)
    assert rows[0] == {
        "kind": "all-reduce",
        "mesh_axes": ("data",),
        "dtype": "f32",
        "count": 4,
        "bytes": 250,
        "wire_bytes": 250,  # 2 (n-1)/n = 1 for a group of 2
    }
    assert rows[1]["wire_bytes"] == 9  # all-gather over 8: 10 bytes x 7/8
    assert [r["bytes"] for r in rows] == [250, 10, 7]
    table = format_audit(colls)
    assert "| all-reduce | data | f32 | 4 | 250 |" in table
    assert "| all-gather | fsdp,tensor | bf16 | 1 | 10 |" in table
    assert "| all-reduce | - | f32 | 1 | 7 |" in table and "Total: 267 B" in table
    assert total_bytes(colls, kind="all-reduce") == 257
    assert total_bytes(colls, axes=("fsdp", "tensor")) == 10


def test_fsdp_tp_train_step_audits_every_collective():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    w1 = put(jnp.ones((16, 32)), mesh, PartitionSpec("fsdp", "tensor"))
    w2 = put(jnp.ones((32, 16)), mesh, PartitionSpec("tensor", "fsdp"))
    x_BD = put(jnp.ones((16, 16)), mesh, PartitionSpec(("data", "fsdp")))

    def step(p, x):
        g = jax.grad(lambda p: jnp.mean((jax.nn.relu(x @ p[0]) @ p[1]) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    compiled = jax.jit(step).lower((w1, w2), x_BD).compile()
    colls = audit(compiled, mesh)
    text = compiled.as_text()
    # Iota replica groups over a 3-axis mesh show up here; every op must be found and mapped.
    assert len(colls) == len(re.findall(r" (?:all-reduce|all-gather|reduce-scatter)\(", text))
    assert {c.mesh_axes for c in colls if c.kind == "all-gather"} == {("fsdp",)}
    assert {c.mesh_axes for c in colls} <= {("data",), ("fsdp",), ("tensor",), ("data", "fsdp")}
    assert total_bytes(colls) == sum(r["bytes"] for r in tally(colls)) > 0
