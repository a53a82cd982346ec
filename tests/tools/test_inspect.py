"""`jaxpar inspect` lists the non-parameter state (BatchNorm statistics, counters) beside the
parameters, with its type, sharding and size."""

from __future__ import annotations

import jaxpar
from jaxpar.tools.inspect import inspect
from tests.support import export_models as em


def test_inspect_lists_the_non_parameter_state(tmp_path):
    cfg = em.digits_config(em.BNNetConfig(), "bn")
    text = inspect(cfg, jaxpar.preset("data=8"), str(tmp_path), audit=False)
    assert "| ['norm']['scale'] | None | () | (4,) | 16 B |" in text  # a parameter
    assert "| ['norm']['mean'] | BatchStat | () | (4,) | 16 B |" in text
    assert "| ['norm']['var'] | BatchStat | () | (4,) | 16 B |" in text
    assert "| ['calls'] | Variable | () | () | 4 B |" in text
    assert "non-parameter state: 36 bytes global, 3 arrays" in text


def test_inspect_of_a_model_without_state_has_no_state_table(tmp_path):
    cfg = em.digits_config(em.ViTConfig(), "vit")
    text = inspect(cfg, jaxpar.preset("data=4,tensor=2"), str(tmp_path), audit=False)
    assert "['mlp1']['kernel'] | (None, 'mlp') | (None, 'tensor')" in text
    assert "non-parameter state" not in text
