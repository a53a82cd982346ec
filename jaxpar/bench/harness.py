"""`jaxpar bench SUITE`: measured side by side in one run, reported as medians and ratios.

    jaxpar bench SUITE [--quick] [--recipe gpt_tiny] [--set key=value ...] [--out bench-results]

Each suite measures the recipe given with --recipe (default gpt_tiny) and --set, prints a markdown
table, writes OUT/SUITE.json and prints that path. `jaxpar bench --help` lists the suites.

Adding a suite. Write, in its own module, a function taking one `Bench` and returning the result
dict, which ends with `b.write(...)`:

    def run(b: Bench) -> dict:
        cfg = b.cfg                      # the recipe with --set applied; b.quick, b.out_dir
        ...
        return b.write("mysuite", result, table(["column", ...], rows))

then register it with one line below (the module is imported only when the suite runs, so this
module, and `jaxpar bench --help`, import no jax):

    register("mysuite", "jaxpar.bench_mine:run", "what it measures", "~1 min (quick ~10 s)")
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxpar.config import TrainConfig
    from jaxpar.engine.rules import Preset

DEFAULT_RECIPE = "gpt_tiny"


@dataclass(frozen=True)
class Bench:
    """What every suite gets: the recipe, quick or full, where to write, and mesh layouts."""

    cfg: TrainConfig  # the recipe with the --set overrides applied
    quick: bool = False
    out_dir: str = "bench-results"
    recipe: str = DEFAULT_RECIPE  # as given with --recipe (suites that start `python -m train`)
    overrides: tuple[str, ...] = ()  # as given with --set
    paths: tuple[str, ...] = ()  # `bench recovery --paths`: the restart paths measured (all)
    layout: Callable[[str], Preset] | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls, recipe: str = DEFAULT_RECIPE, overrides=(), quick: bool = False, **kw: Any
    ) -> Bench:
        from jaxpar.config import apply_overrides, resolve_recipe

        cfg = apply_overrides(resolve_recipe(recipe), list(overrides))
        return cls(cfg, quick, recipe=recipe, overrides=tuple(overrides), **kw)

    @property
    def default_recipe(self) -> bool:
        """The recipe is the default one, unchanged (suites may scale it to the device)."""
        return self.recipe == DEFAULT_RECIPE and not self.overrides

    def preset(self, spec: str) -> Preset:
        """The layout of a mesh spec (e.g. "data=-1") with the recipe's rules."""
        if self.layout is not None:
            return self.layout(spec)
        from jaxpar.engine.mesh import MeshSpec
        from jaxpar.engine.rules import Preset

        return Preset(MeshSpec.parse(spec))

    def path(self, name: str) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        return os.path.join(self.out_dir, name)

    def write(self, suite: str, result: dict, table: str) -> dict:
        """Print the table, write OUT/SUITE.json (with the --set overrides measured under),
        print where; returns `result`."""
        result.setdefault("overrides", list(self.overrides))
        path = self.path(f"{suite}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(table)
        print(f"\nwrote {path}")
        return result


def table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` is one markdown separator cell per column (default "---")."""
    cells = align.split("|") if align else ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "".join(f"{c}|" for c in cells)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Suite:
    target: str  # "module:function", the function taking a Bench
    help: str
    duration: str  # rough, full run (quick run) on a 2-core CPU host with 8 simulated devices


SUITES: dict[str, Suite] = {}


def register(name: str, target: str, help: str, duration: str) -> None:
    """Add a suite: `jaxpar bench NAME` calls `target` (module:function) with a Bench."""
    if name in SUITES:
        raise ValueError(f"bench suite {name!r} is registered twice")
    SUITES[name] = Suite(target, help, duration)


# fmt: off
register("overhead", "jaxpar.bench.step:overhead", "jaxpar's loop step vs a plain jax.jit step of the same GPT", "~1 min (quick ~30 s)")
register("meshes", "jaxpar.bench.step:meshes", "throughput and collective bytes per mesh layout on 1..8 devices", "~5 min (quick ~1 min)")
register("checkpoint", "jaxpar.bench.checkpoint:run", "async vs sync save blocking, and the throughput cost of saving", "~3 min (quick ~1 min)")
register("recovery", "jaxpar.bench.recovery:run", "restart time (spares + compile cache vs cold), goodput under kills", "~45 min (quick ~8 min)")
register("pipeline", "jaxpar.bench.pipeline:run", "GPipe and circular schedules: step time and bubble vs prediction", "~10 min (quick ~2 min)")
register("comm", "jaxpar.bench.comm:run", "gradient all-reduce fp32 / bf16 / int8 / DiLoCo: bytes and loss", "~5 min (quick ~1 min)")
register("precision", "jaxpar.bench.precision:run", "fp32 vs bf16 compute, remat off vs on: time, memory, loss", "~3 min (quick ~1 min)")
register("data", "jaxpar.bench.data:run", "tokens source: prepare speed, examples/s per process vs what a step consumes", "~5 min (quick ~1 min)")
# fmt: on


def describe() -> str:
    """One line per suite, for `jaxpar bench --help`."""
    width = max(map(len, SUITES))
    return "\n".join(
        f"  {name:<{width}}  {s.help} [{s.duration}]" for name, s in sorted(SUITES.items())
    )


def run_suite(name: str, b: Bench) -> dict:
    """Run one suite; ValueError for an unknown or unavailable one."""
    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; use one of {', '.join(sorted(SUITES))}")
    mod_name, fn_name = SUITES[name].target.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name != mod_name:
            raise
        raise ValueError(f"bench suite {name!r} is not available in this version") from None
    return getattr(mod, fn_name)(b)
