"""The `jaxpar` console script: inspect (shardings + collectives); further subcommands register here.

Recipes resolve as in `python -m train`: a name in `train.recipes` or `module:function`, with the
current directory on sys.path (run from the checkout).
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def _layout(name: str | None, default: str):
    import importlib

    from jaxpar.mesh import MeshSpec
    from jaxpar.rules import Preset

    text = name if name is not None else default
    try:
        meshes = importlib.import_module("meshes")
    except ModuleNotFoundError:
        return Preset(MeshSpec.parse(text))
    return meshes.resolve(text)


def cmd_inspect(args: argparse.Namespace) -> int:
    from jaxpar import launch

    launch.configure_devices()
    from jaxpar.config import apply_overrides, resolve_recipe
    from jaxpar.inspect_cmd import inspect

    cfg = apply_overrides(resolve_recipe(args.recipe), args.overrides)
    preset = _layout(args.mesh, cfg.mesh)
    with tempfile.TemporaryDirectory() as tmp:
        print(inspect(cfg, preset, tmp, audit=not args.no_audit))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from jaxpar import launch

    launch.configure_devices()
    from jaxpar.bench import run_suite
    from jaxpar.config import apply_overrides, resolve_recipe

    cfg = apply_overrides(resolve_recipe(args.recipe), args.overrides)
    run_suite(args.suite, cfg, args.quick, args.out, lambda text: _layout(text, cfg.mesh))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="parameter shardings and the compiled step's collectives")
    ins.add_argument("--recipe", default="gpt_tiny")
    ins.add_argument("--mesh", default=None, help="preset name or mesh spec")
    ins.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ins.add_argument("--no-audit", action="store_true", help="skip compiling the step")
    ins.set_defaults(func=cmd_inspect)
    ben = sub.add_parser("bench", help="benchmarks measured side by side (medians, ratios)")
    ben.add_argument("suite", help="overhead | meshes | checkpoint | recovery | pipeline | comm")
    ben.add_argument("--recipe", default="gpt_tiny")
    ben.add_argument("--out", default="bench-results", help="directory for SUITE.json")
    ben.add_argument("--quick", action="store_true", help="a small, fast version")
    ben.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ben.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    if "" not in sys.path:
        sys.path.insert(0, "")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
