"""The layers of docs/design.md's table are the imports of jaxpar/: nothing imports upward, no
module cycle (under TYPE_CHECKING too), no import circle inside a package (through imports inside
functions too), no private name taken from another package."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
USER_SIDE = ("jaxpar.models", "jaxpar.meshes", "jaxpar.train")  # models/, meshes/, train/


@functools.cache
def parse(source: str) -> ast.Module:
    return ast.parse(source)


def layer_table() -> list[tuple[list[str], set[str]]]:
    """[(row's names, names it may import)], bottom row first, from docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers and who may import whom", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`jaxpar"):
            continue
        names = re.findall(r"`(jaxpar[\w.]*)`", cells[0])
        rows.append((names, set(re.findall(r"`(jaxpar[\w.]*)`", cells[2]))))
    return rows


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (ROOT / "jaxpar").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def unit_of(module: str, units: list[str]) -> str | None:
    """The table row (longest matching name) a module belongs to."""
    best = None
    for u in units:
        if (module == u or module.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best


def imports(path: pathlib.Path) -> list[tuple[str, list[str], bool]]:
    """(module, names imported from it, at module level?) for every jaxpar import in `path`:
    inside functions too; module level includes `if TYPE_CHECKING:` and `try:` blocks."""
    tree = parse(path.read_text())
    top: set[int] = set()
    stack = list(tree.body)
    while stack:  # statements that run at import time (or only for the type checker)
        node = stack.pop()
        top.add(id(node))
        if isinstance(node, ast.If | ast.Try):
            stack += node.body + node.orelse + getattr(node, "finalbody", [])
            stack += [s for h in getattr(node, "handlers", []) for s in h.body]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxpar"):
            names = [a.name for a in node.names]
            if node.module == "jaxpar":  # `from jaxpar import x`: x may be a module
                out += [(f"jaxpar.{n}", [], id(node) in top) for n in names if n != "__version__"]
            else:
                out.append((node.module, names, id(node) in top))
        elif isinstance(node, ast.Import):
            out += [
                (a.name, [], id(node) in top) for a in node.names if a.name.startswith("jaxpar")
            ]
    return out


def module_aliases(path: pathlib.Path, mods: dict[str, pathlib.Path]) -> dict[str, str]:
    """Local name -> jaxpar module, for names bound to modules (`from jaxpar.x import mod`)."""
    out = {}
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxpar"):
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in mods:
                    out[a.asname] = a.name
    return out


def test_the_table_lists_every_module_once_and_imports_only_downward():
    rows = layer_table()
    assert len(rows) >= 10, "docs/design.md's layer table was not found"
    names = [n for row, _ in rows for n in row]
    assert len(names) == len(set(names)), "a package is listed twice"
    below: set[str] = set(USER_SIDE)
    for row, allowed in rows:
        upward = allowed - below
        assert not upward, f"{row} may import {sorted(upward)}, which is not below it"
        below |= set(row)
    missing = [m for m in modules() if unit_of(m, names) is None]
    assert not missing, f"modules with no row in docs/design.md's layer table: {missing}"
    top_level = [p.name for p in (ROOT / "jaxpar").glob("*.py") if p.name != "__init__.py"]
    assert len(top_level) <= 8, f"jaxpar/ keeps the public surface only: {sorted(top_level)}"


def test_every_import_follows_the_table():
    rows = layer_table()
    units = [n for row, _ in rows for n in row] + list(USER_SIDE)
    allowed = {n: deps for row, deps in rows for n in row}
    mods = modules()
    broken = []
    for name, path in sorted(mods.items()):
        here = unit_of(name, units)
        for mod, _names, _top in imports(path):
            there = unit_of(mod, units)
            assert there is not None, f"{name} imports {mod}, which the table does not know"
            if there != here and there not in allowed[here]:
                broken.append(f"{name} imports {mod} ({here} may not import {there})")
    assert not broken, "imports that break docs/design.md's layers:\n" + "\n".join(broken)


def test_no_private_name_is_taken_from_another_package():
    units = [n for row, _ in layer_table() for n in row] + list(USER_SIDE)
    mods = modules()
    private = []
    for name, path in sorted(mods.items()):
        here = unit_of(name, units)
        for mod, names, _top in imports(path):
            if unit_of(mod, units) != here:
                private += [f"{name}: from {mod} import {n}" for n in names if n.startswith("_")]
        aliases = module_aliases(path, mods)
        for node in ast.walk(parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and unit_of(aliases[node.value.id], units) != here
            ):
                private.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    assert not private, f"private names used across packages: {private}"


def test_no_import_cycle_between_modules():
    """Module-level imports, `if TYPE_CHECKING:` blocks included, form no cycle."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for mod, names, top in imports(path):
            if not top:
                continue
            # `from jaxpar.pkg import mod` depends on the module; `from jaxpar.m import X` on m
            targets = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods] or [mod]
            deps |= {t for t in targets if t in mods and t != "jaxpar" and t != name}
        graph[name] = deps
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def import_graph(mods: dict[str, pathlib.Path], units: list[str]) -> dict[str, set[str]]:
    """Module -> the modules of its own package (its row of the table) that it imports: at any
    depth, inside functions and under `if TYPE_CHECKING:` too."""
    graph = {}
    for name, path in mods.items():
        here = unit_of(name, units)
        deps = set()
        for mod, names, _top in imports(path):
            targets = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods] or [mod]
            deps |= {t for t in targets if t in mods and t != name and unit_of(t, units) == here}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: for each strongly connected set of modules (Tarjan's
    algorithm), one circle through its first module, as a path that ends where it starts."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(_circle(graph, scc))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _circle(graph: dict[str, set[str]], scc: set[str]) -> list[str]:
    """A shortest circle through the first module of `scc` (breadth first, inside `scc`)."""
    first = min(scc)
    paths = {first: [first]}
    todo = [first]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & scc):
            if w == first:
                return [*paths[v], first]
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    raise AssertionError(f"no circle in {sorted(scc)}")


def test_no_import_circle_inside_a_package():
    """Imports inside functions and for the type checker only still tie modules together: a
    circle of them inside one package means a piece is in the wrong module (move what both
    sides need to a module below them)."""
    units = [n for row, _ in layer_table() for n in row] + list(USER_SIDE)
    found = cycles(import_graph(modules(), units))
    assert not found, "import circles inside a package:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


@pytest.mark.parametrize(
    "source, problem",
    [
        ("from jaxpar.worker import training\n", "may not import"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxpar.tools import report\n",
         "may not import"),
        ("def f():\n    from jaxpar.supervisor import loop\n", "may not import"),
    ],
)  # fmt: skip
def test_the_check_catches_an_upward_import(tmp_path, monkeypatch, source, problem):
    """The checker itself fails on the kinds of violation it is meant to find."""
    planted = ROOT / "jaxpar" / "engine" / "_planted_for_test.py"
    mods = {**modules(), "jaxpar.engine._planted_for_test": planted}
    monkeypatch.setattr(pathlib.Path, "read_text", _reader(planted, source))
    monkeypatch.setitem(globals(), "modules", lambda: mods)
    with pytest.raises(AssertionError, match=problem):
        test_every_import_follows_the_table()


def test_the_check_catches_a_circle_through_function_and_type_checking_imports(monkeypatch):
    """Two modules of one package that import each other only inside a function and under
    TYPE_CHECKING are a circle."""
    a = ROOT / "jaxpar" / "engine" / "_planted_a.py"
    b = ROOT / "jaxpar" / "engine" / "_planted_b.py"
    sources = {
        a: "def f():\n    from jaxpar.engine import _planted_b\n",
        b: "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxpar.engine._planted_a import f\n",
    }
    mods = {**modules(), "jaxpar.engine._planted_a": a, "jaxpar.engine._planted_b": b}
    original = pathlib.Path.read_text
    monkeypatch.setattr(pathlib.Path, "read_text",
                        lambda self, *x, **k: sources.get(self) or original(self, *x, **k))  # fmt: skip
    monkeypatch.setitem(globals(), "modules", lambda: mods)
    with pytest.raises(
        AssertionError,
        match=r"jaxpar\.engine\._planted_a -> jaxpar\.engine\._planted_b -> jaxpar\.engine\._planted_a",
    ):
        test_no_import_circle_inside_a_package()


def _reader(planted: pathlib.Path, source: str):
    original = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        return source if self == planted else original(self, *args, **kwargs)

    return read_text
