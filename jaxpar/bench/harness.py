"""`jaxpar bench SUITE`: the suites' registry, the runner, and `Bench`, the one writer of results.

    jaxpar bench SUITE [--quick] [--recipe gpt_tiny] [--set key=value ...] [--out bench-results]

Adding a suite: a function of one `Bench` that ends with `b.write(...)`, and one `register(...)`
line below; this module imports no jax. Design: docs/design.md, "Benchmarks".
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxpar import _compat

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
    schedules: tuple[str, ...] = ()  # `bench pipeline --schedules`: the schedules measured (all)
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
        """Print the table, write OUT/SUITE.json (with the --set overrides measured under) and
        the dated record OUT/YYYY-MM-DD-SUITE.md, print where; returns `result`."""
        result.setdefault("overrides", list(self.overrides))
        path = self.path(f"{suite}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        record = self.path(f"{datetime.date.today().isoformat()}-{suite}.md")
        with open(record, "w") as f:
            f.write(self.record(suite, table))
        print(table)
        print(f"\nwrote {path}")
        print(f"wrote {record}")
        return result

    def command(self, suite: str) -> str:
        """The `jaxpar bench ...` command line of this run: sys.argv when it is that command,
        else rebuilt from the options this Bench was created with."""
        argv = sys.argv[1:]
        if argv[:2] != ["bench", suite]:
            argv = ["bench", suite]
            argv += ["--recipe", self.recipe] if self.recipe != DEFAULT_RECIPE else []
            argv += ["--quick"] if self.quick else []
            argv += ["--paths", ",".join(self.paths)] if self.paths else []
            argv += ["--schedules", ",".join(self.schedules)] if self.schedules else []
            argv += [a for o in self.overrides for a in ("--set", o)]
            argv += ["--out", self.out_dir]
        return shlex.join(["jaxpar", *argv])

    def record(self, suite: str, table: str) -> str:
        """The dated record's markdown: command, machine, versions, the table."""
        lines = [
            f"# jaxpar bench {suite}, {datetime.date.today().isoformat()}",
            "",
            f"- command: `{self.command(suite)}`",
            f"- machine: {machine()}",
            f"- jax: {jax_devices()}",
            f"- versions: {versions()}",
            f"- results: {suite}.json (next to this file)",
            "",
            "```text",
            table.rstrip("\n"),
            "```",
            "",
        ]
        return "\n".join(lines)


def machine() -> str:
    """OS, architecture, CPU count and physical memory of this host."""
    parts = [platform.platform(), platform.machine() or "unknown architecture"]
    parts.append(f"{os.cpu_count() or '?'} CPUs")
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        parts.append(f"{memory / 2**30:.1f} GiB memory")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        parts.append("memory not known")
    return ", ".join(parts)


def jax_devices() -> str:
    """The jax backend and its devices, if this process already uses jax (never imports it)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return "not imported by this process"
    try:
        if not _compat.xla_backends_initialized():
            return "imported, no backend initialized"
    except _compat.InternalChanged:
        pass  # another jax version: ask jax itself
    try:
        devices = jax.devices()
        kinds: dict[str, int] = {}
        for d in devices:
            kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
        each = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
        return f"backend {jax.default_backend()}, {len(devices)} devices ({each})"
    except Exception as e:  # a broken backend must not lose the measurement
        return f"devices not known ({type(e).__name__})"


def versions() -> str:
    """The installed jax, jaxlib and flax versions."""
    found = []
    for name in ("jax", "jaxlib", "flax"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


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
register("pipeline", "jaxpar.bench.pipeline:run", "every pipeline schedule: step time and bubble vs the table's, per-stage time and a split", "~10 min (quick ~2 min)")
register("comm", "jaxpar.bench.comm:run", "gradient all-reduce fp32 / bf16 / int8 / DiLoCo: bytes and loss", "~5 min (quick ~1 min)")
register("precision", "jaxpar.bench.precision:run", "fp32 vs bf16 compute, remat off vs on: time, memory, loss", "~3 min (quick ~1 min)")
register("data", "jaxpar.bench.data:run", "tokens source: prepare speed, examples/s per process vs what a step consumes", "~5 min (quick ~1 min)")
register("context", "jaxpar.bench.context:run", "context parallelism: memory, step time and bytes vs theory by seq_len x ring size, ring vs all-gather", "~15 min (quick ~2 min)")
register("moe", "jaxpar.bench.moe:run", "mixture of experts vs dense of the same active parameters: tokens/s, all-to-all bytes vs theory, drops by capacity", "~5 min (quick ~2 min)")
register("survivors", "jaxpar.bench.survivors:run", "replica groups through SIGKILLs vs torchft: throughput kept, healthy restarts, rejoin", "~25 min (quick ~1 min)")
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
