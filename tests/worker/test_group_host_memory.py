"""The replica groups' peer-to-peer step on the host: the screen and the mean hold no whole-size
copy of a step's gradients beyond the one buffer `Plan.pack` makes (at 100M parameters each
float64 copy was 800 MB per process), and the results stay bitwise what they were."""

from __future__ import annotations

import tracemalloc

import numpy as np

from jaxpar.worker import group_layout
from jaxpar.worker.group_exchange import Plan

N = 4 << 20  # elements: a 16 MB float32 piece, whose float64 copy would take 32 MB


def _peak(fn):
    """fn() and the most memory it allocated at once (numpy's buffers included), in bytes."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _wide(rng, n, dtype):
    """Values over a wide range of exponents, finite in `dtype`."""
    scale = rng.choice(np.array([1e-30, 1e-6, 1.0, 1e5, 1e30]), n)
    x = rng.standard_normal(n) * scale
    return np.clip(x, -np.finfo(dtype).max, np.finfo(dtype).max).astype(dtype)


def test_the_screen_widens_a_chunk_at_a_time():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(N).astype(np.float32)
    (bad, squares), peak = _peak(lambda: group_layout.screen_pieces([(0, a)], None))
    wide = a.astype(np.float64)
    assert bad == [] and abs(squares - float(wide @ wide)) <= 1e-12 * squares
    # one chunk's float64 buffer (8 MB) where a float64 copy of the piece took 32 MB
    assert peak <= group_layout.SCREEN_CHUNK * 8 + (1 << 16), f"the screen held {peak:,} bytes"

    # a NaN or an infinity anywhere marks its leaf (and only it) bad, out of the norm;
    # `norm_of` keeps the norm to its leaves (the gradients) while every leaf is checked
    nan, inf = a.copy(), a[:1000].copy()
    nan[N - 3], inf[7] = np.nan, -np.inf
    small = np.arange(5, dtype=np.float16)
    bad, squares = group_layout.screen_pieces(
        [(0, nan), (1, small), (2, inf), (3, np.arange(4, dtype=np.int32))], None
    )
    assert bad == [0, 2] and squares == float(np.sum(small.astype(np.float64) ** 2))
    bad, squares = group_layout.screen_pieces([(0, small), (1, inf)], range(0, 1))
    assert bad == [1] and squares == 30.0
    # float64 squares can overflow without a non-finite value: not bad, an infinite norm
    assert group_layout.screen_pieces([(0, np.full(3, 1e200))], None) == ([], float("inf"))


def test_the_mean_divides_each_floating_class_in_place_bitwise_as_float64():
    rng = np.random.default_rng(1)
    dtypes = ["float32", "float16", "float64", "int32"]
    shapes = [(N,), (1000,), (3, 500), (7,)]
    keys = [[(0, s[0])] if len(s) == 1 else [(0, s[0], 0, s[1])] for s in shapes]
    plan = Plan(keys, [{k[0]: (0,)} for k in keys], dtypes, shapes)
    pieces = {(leaf, keys[leaf][0]): np.zeros(shapes[leaf], d) for leaf, d in enumerate(dtypes)}
    sums = [_wide(rng, N, np.float32), _wide(rng, 1000, np.float16),
            _wide(rng, 1500, np.float64), rng.integers(-1000, 1000, 7).astype(np.int32)]  # fmt: skip
    order = [dtypes.index(d) for (_, d), _ in plan.classes]  # the plan's classes, sorted
    for groups in (3, 6, 7):
        want = {i: (sums[i].astype(np.float64) / groups).astype(dtypes[i]) for i in range(4)}
        buffers = [sums[i].copy() for i in order]
        means, peak = _peak(lambda: plan.unpack(buffers, pieces, groups))  # noqa: B023
        assert peak < sums[0].nbytes // 4, f"the mean held {peak:,} bytes at once"
        for i in range(4):
            got = means[(i, keys[i][0])]
            assert got.shape == shapes[i] and got.dtype == np.dtype(dtypes[i])
            assert np.array_equal(got.reshape(-1).view(np.uint8), want[i].view(np.uint8)), (
                dtypes[i],
                groups,
            )
        assert np.shares_memory(means[(0, keys[0][0])], buffers[order.index(0)])
