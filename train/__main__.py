"""Entry point: `python -m train [--recipe R] [--mesh SPEC|PRESET] [--steps N] [--run-dir DIR]
[--set key=value ...] [--fault SPEC ...]`.

With no arguments it trains `gpt_tiny` on all devices along `data` (8 simulated CPU devices when
there is no accelerator and XLA_FLAGS does not already set a host device count).

Every mistake (an unknown key, a value out of range, a bad fault spec, a run directory that
cannot be one, a checkpoint of another config, a run directory in use) is one line on stderr
and exit code 2, and leaves the run directory untouched. Ctrl-C saves a checkpoint at the next
step and prints the command that resumes (exit 130); a second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (exit 2), not usage text plus an error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _epilog() -> str:
    """Recipe, preset and fault names for --help (imported only when help is asked for)."""
    from jaxpar.faults import KINDS

    try:
        import meshes
        from train.recipes import RECIPES

        recipes, presets = ", ".join(RECIPES), ", ".join(meshes.PRESETS)
    except ImportError as e:  # not run from the checkout
        recipes = presets = f"(unavailable: {e})"
    return (
        f"recipes: {recipes}\n"
        f"mesh presets: {presets}\n"
        f"fault kinds: {', '.join(KINDS)} (SPEC = KIND@STEP[:process=P][:permanent][:repeat]"
        f"[:seconds=X]; see jaxpar/faults.py)\n"
        f"--set keys: SECTION.KEY for the sections data, optim, train, log, ckpt, run, pipeline, "
        f"comm, precision and model (e.g. --set optim.lr=1e-3 --set model.n_layers=2)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    want_help = any(a in ("-h", "--help") for a in argv)
    p = _Parser(
        prog="python -m train",
        description=__doc__.split("\n\n")[0],
        epilog=_epilog() if want_help else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--recipe",
        default="gpt_tiny",
        help="name in train.recipes, or module:function (default: gpt_tiny)",
    )
    p.add_argument(
        "--mesh", default=None, help="preset name or 'data=2,tensor=4' (default: the recipe's)"
    )
    p.add_argument(
        "--steps", type=_int_at_least(1), default=None,
        help="optimizer steps, >= 1 (default: the recipe's train.steps)",
    )  # fmt: skip
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/RECIPE-TIME)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. optim.lr=1e-3 (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--fault", dest="faults", action="append", default=[], metavar="SPEC",
        help="inject a failure, e.g. kill@15 (repeatable; kinds below)",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    return p.parse_args(argv)


def resume_command(argv: list[str], run_dir: str) -> str:
    """The command line that resumes this run (its --run-dir made explicit)."""
    args = list(argv)
    if not any(a == "--run-dir" or a.startswith("--run-dir=") for a in args):
        args += ["--run-dir", run_dir]
    return shlex.join(["python", "-m", "train", *args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        return _main(args, argv)
    except KeyboardInterrupt:  # before the loop's handler is installed, or after it
        print("jaxpar: interrupted; nothing more was saved", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    from jaxpar import launch

    launch.configure_devices()
    launch.initialize_from_env()
    import meshes
    from jaxpar import trainer
    from jaxpar.config import apply_overrides, resolve_recipe, validate

    try:
        cfg = resolve_recipe(args.recipe)
        cfg = validate(apply_overrides(trainer.with_overrides(cfg, args.steps), args.overrides))
        keys = {o.partition("=")[0].strip() for o in args.overrides}
        cfg = trainer.vocab_from_data(cfg, explicit="model.vocab_size" in keys)
        preset = meshes.resolve(args.mesh if args.mesh is not None else cfg.mesh)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = (
        args.run_dir
        or os.environ.get(launch.ENV_RUN_DIR)
        or os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    from jaxpar.checkpoint import Preempted, ReplicaMismatch, disk_full_path, is_disk_full
    from jaxpar.faults import NonFiniteLoss
    from jaxpar.launch import EXIT_NAN, EXIT_PREEMPTED, EXIT_REPLICA

    # guard(): any other error in a multi-process job exits at once (43 for a collective error)
    # instead of waiting in jax's shutdown barrier for a dead peer.
    with launch.guard():
        try:
            summary = trainer.run(
                cfg, preset, run_dir, faults=args.faults, progress=not args.no_progress
            )
        except trainer.NothingToDo as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return 0
        except Preempted as e:
            if e.interrupted and not os.environ.get(launch.ENV_SUPERVISED):
                print(f"jaxpar: {e}; resume with: {resume_command(argv, run_dir)}", file=sys.stderr)
                return EXIT_INTERRUPTED
            print(f"jaxpar: {e}", file=sys.stderr)
            return EXIT_PREEMPTED
        except NonFiniteLoss as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return EXIT_NAN
        except ReplicaMismatch as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return EXIT_REPLICA
        except Exception as e:
            if is_disk_full(e):
                where = disk_full_path(e, os.path.abspath(run_dir))
                print(
                    f"jaxpar: no space left on device (ENOSPC) writing {where}; free space there "
                    f"and rerun the same command (committed checkpoints are intact)",
                    file=sys.stderr,
                )
                return launch.EXIT_NO_SPACE
            if isinstance(e, ValueError):  # CheckpointMismatch, RunDirLocked, bad config
                print(f"error: {e}", file=sys.stderr)
                return 2
            raise
    import jax

    if summary is not None and summary.get("final_loss") is not None and jax.process_index() == 0:
        print(f"run directory: {os.path.abspath(run_dir)}")
        print(
            f"final loss {summary['final_loss']:.4f} after {summary['steps']} steps "
            f"in {summary['wall_s']:.1f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
