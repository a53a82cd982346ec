"""Entry point: `python -m train [--recipe R] [--mesh SPEC|PRESET] [--steps N] [--run-dir DIR]
[--set key=value ...] [--fault SPEC ...]`.

With no arguments it trains `gpt_tiny` on all devices along `data` (8 simulated CPU devices when
there is no accelerator and XLA_FLAGS does not already set a host device count).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="gpt_tiny", help="name in train.recipes, or module:function")
    p.add_argument("--mesh", default=None, help="preset name (meshes.PRESETS) or 'data=2,tensor=4'")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides the recipe)")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/RECIPE-TIME)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from jaxpar import launch

    launch.configure_devices()
    launch.initialize_from_env()
    import meshes
    from jaxpar import trainer
    from jaxpar.config import apply_overrides, resolve_recipe

    try:
        cfg = resolve_recipe(args.recipe)
        cfg = apply_overrides(trainer.with_overrides(cfg, args.steps), args.overrides)
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
    from jaxpar.checkpoint import CheckpointMismatch, Preempted, ReplicaMismatch
    from jaxpar.faults import NonFiniteLoss
    from jaxpar.launch import EXIT_NAN, EXIT_PREEMPTED, EXIT_REPLICA

    # guard(): any other error in a multi-process job exits at once (43 for a collective error)
    # instead of waiting in jax's shutdown barrier for a dead peer.
    with launch.guard():
        try:
            summary = trainer.run(
                cfg, preset, run_dir, faults=args.faults, progress=not args.no_progress
            )
        except Preempted as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return EXIT_PREEMPTED
        except NonFiniteLoss as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return EXIT_NAN
        except ReplicaMismatch as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return EXIT_REPLICA
        except (CheckpointMismatch, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
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
