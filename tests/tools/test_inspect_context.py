"""`jaxpar inspect` on a mesh that splits the sequence: the context section names the attention
kernel and checks the compiled train step's ring collective-permutes against their theory."""

from __future__ import annotations

import pytest

import jaxpar
from jaxpar.config import apply_overrides, resolve_recipe
from jaxpar.engine.attention import ring_permutes
from jaxpar.tools.inspect import inspect


@pytest.mark.slow
def test_inspect_shows_the_rings_permutes_against_theory(tmp_path):
    # 2 layers (each one more is compiled again), seq_len 64: the count is per layer either way
    cfg = apply_overrides(resolve_recipe("gpt_tiny"), ["model.n_layers=2"])
    text = inspect(cfg, jaxpar.preset("dp2_cp4"), str(tmp_path))
    fwd, bwd = ring_permutes(4)
    total = 2 * (fwd + bwd)
    assert "## context: ring attention over a ring of 4, 2 attention call(s)" in text
    assert (
        f"ring collective-permutes: {total} executed per step; theory 2 layer(s) x ({fwd} "
        f"forward + {bwd} backward) = {total}: as expected"
    ) in text


def test_inspect_of_an_unsplit_sequence_has_no_context_section(tmp_path):
    text = inspect(resolve_recipe("gpt_tiny"), jaxpar.preset("dp8"), str(tmp_path), audit=False)
    assert "## context" not in text
