"""Schedule tables (jaxpar.parallel.schedules): idle fractions equal theory exactly, dependencies
hold, and the 1F1B family's buffers do not grow with the number of microbatches."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest

from jaxpar.parallel import schedules
from jaxpar.parallel.schedules import B, F, W, table

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


def exact_bubble(tab) -> Fraction:
    return Fraction(tab.idle, tab.ticks * tab.stages)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(kind):
    for p, m in GRID:
        if kind == "1f1b" and m < p:
            continue
        tab = table(kind, p, m)
        assert exact_bubble(tab) == Fraction(p - 1, m + p - 1), (p, m)
        assert tab.ticks == 3 * (m + p - 1)


@pytest.mark.parametrize("kind", ["circular", "interleaved_1f1b"])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(kind):
    for p, m in GRID:
        for v in (2, 3):
            if m < p or (kind == "interleaved_1f1b" and m % p):
                continue
            assert exact_bubble(table(kind, p, m, v)) == Fraction(p - 1, v * m + p - 1), (p, m, v)


def test_zero_bubble_idles_a_third_of_1f1b():
    """ZB-H1's idle ticks are a third of 1F1B's (F = B = W = 1 tick; 1F1B's backward is B + W)."""
    for p, m in GRID:
        if m < p:
            continue
        zb, one = table("zero_bubble", p, m), table("1f1b", p, m)
        assert 3 * zb.idle == one.idle == 3 * p * (p - 1), (p, m)
        assert exact_bubble(zb) == Fraction(p - 1, 3 * m + p - 1)


def test_in_flight_bounded_by_p_for_1f1b_family_and_m_for_gpipe():
    for p in (2, 4):
        for m in (p, 2 * p, 4 * p):
            for kind in ("1f1b", "zero_bubble"):
                tab = table(kind, p, m)
                assert tab.in_flight() <= p and tab.slots <= p, (kind, p, m)
            assert table("gpipe", p, m).slots == m
            # interleaved: bounded by the warm-up, not by m
            assert table("interleaved_1f1b", p, m, 2).slots <= 2 * p


@pytest.mark.parametrize("kind, v", [(k, 2 if k in schedules.MULTI_GROUP else 1)
                                     for k in schedules.SCHEDULES])  # fmt: skip
def test_every_item_once_and_after_its_dependencies(kind, v):
    p, m = 4, 8
    tab = table(kind, p, m, v)
    done = tab.done_at()
    groups = p * v
    assert len(done) == 3 * m * groups  # every F, B and W exactly once
    assert sum(it is not None for row in tab.grid for it in row) == len(done)
    for i in range(m):
        for g in range(groups):
            assert g == 0 or done[(F, i, g - 1)] < done[(F, i, g)]
            assert done[(F, i, g)] < done[(B, i, g)] < done[(W, i, g)]
            assert g == groups - 1 or done[(B, i, g + 1)] < done[(B, i, g)]
    # Buffers: two microbatches sharing a slot are never live at once.
    for g in range(groups):
        for a in range(m):
            for b in range(a + tab.slots, m, tab.slots):
                assert done[(W, a, g)] < done[(F, b, g)]


def test_draw_1f1b():
    assert table("1f1b", 2, 2).draw().splitlines() == [
        "stage 0: F0 F1 .  .  B0 W0 .  B1 W1",
        "stage 1: .  F0 B0 W0 F1 B1 W1 .  .",
    ]


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="use one of"):
        table("pipedream", 2, 2)


def test_docs_draw_the_tables_from_the_engine():
    """docs/parallelism.md shows every schedule's p=4, m=8 table as schedules.markdown draws it."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "parallelism.md")
    with open(path) as f:
        assert schedules.markdown(4, 8) in f.read()
