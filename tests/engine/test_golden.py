"""Golden files: every gpt_tiny parameter's PartitionSpec on every 8-device preset (and cpu1).

A change to the rules, a preset or the model's logical names shows up here as a diff to review.
After an intended change, regenerate and commit the files:

    JAXPAR_UPDATE_GOLDEN=1 python -m pytest tests/engine/test_golden.py
"""

import math
import os
from pathlib import Path

import jax
import pytest

from jaxpar import meshes
from jaxpar.engine.mesh import mesh_text

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("JAXPAR_UPDATE_GOLDEN") == "1"


def _fits_8_devices(p) -> bool:
    try:
        p.mesh.resolve(8)
    except ValueError:
        return False
    return p.num_processes == 1


PRESETS = sorted(n for n, p in meshes.PRESETS.items() if _fits_8_devices(p)) + ["cpu1"]


def _param_rows(b) -> list[tuple[str, tuple, tuple, jax.sharding.PartitionSpec]]:
    """(path, global shape, logical names, PartitionSpec) per parameter, in tree order."""
    logical = dict(
        jax.tree_util.tree_leaves_with_path(
            b.program.param_logical, is_leaf=lambda x: x is None or isinstance(x, tuple)
        )
    )
    return [
        (jax.tree_util.keystr(path), tuple(leaf.shape), logical[path], leaf.sharding.spec)
        for path, leaf in jax.tree_util.tree_leaves_with_path(b.program.abstract_state["params"])
    ]


def recipe_for(name: str) -> str:
    """gpt_tiny, or gpt_moe on the expert-parallel presets (a model without experts is refused
    on a mesh with expert > 1)."""
    return "gpt_moe" if meshes.PRESETS[name].mesh.expert > 1 else "gpt_tiny"


def render(name: str, b) -> str:
    mesh = mesh_text(dict(b.mesh.shape))
    lines = [
        f"# {recipe_for(name)} parameter shardings on preset {name} (mesh {mesh})",
        "# regenerate: JAXPAR_UPDATE_GOLDEN=1 python -m pytest tests/engine/test_golden.py",
    ]
    rows = [(p, str(s), str(lg), str(tuple(spec))) for p, s, lg, spec in _param_rows(b)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[3])
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", PRESETS)
def test_param_specs_match_golden(name, jp):
    b = jp.build(jp.recipe(recipe_for(name)), name)
    text = render(name, b)
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden file {path}; create it with JAXPAR_UPDATE_GOLDEN=1"
    expected = path.read_text()
    if text != expected:
        diff = "\n".join(
            f"- {e}\n+ {g}"
            for e, g in zip(expected.splitlines(), text.splitlines(), strict=False)
            if e != g
        )
        pytest.fail(
            f"shardings on {name} changed (if intended: JAXPAR_UPDATE_GOLDEN=1):\n{diff}",
            pytrace=False,
        )


def test_every_golden_file_belongs_to_a_preset():
    stale = sorted(p.stem for p in GOLDEN.glob("*.txt") if p.stem not in PRESETS)
    assert not stale, f"golden files for presets that no longer exist: {stale}; delete them"
    assert {"dp8", "fsdp8", "dp2_tp4", "dp4_tp2", "dp2_fsdp2_tp2"} <= set(PRESETS)


def test_fsdp8_shards_almost_all_parameter_bytes(jp):
    b = jp.build(jp.recipe("gpt_tiny"), "fsdp8")
    total = sharded = 0
    for _, shape, _, spec in _param_rows(b):
        nbytes = math.prod(shape) * 4
        total += nbytes
        axes = {
            a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)
        }
        sharded += nbytes if "fsdp" in axes else 0
    print(f"\n[fsdp8] {sharded:,} of {total:,} parameter bytes sharded over fsdp "
          f"({sharded / total:.2%})")  # fmt: skip
    assert sharded / total >= 0.95
