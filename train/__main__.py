"""Entry point: `python -m train [--recipe R] [--mesh SPEC|PRESET] [--steps N] [--run-dir DIR]
[--set key=value ...] [--fault SPEC ...]` (installed: `jaxpar train ...` or
`python -m jaxpar.train ...`, the same options).

With no arguments it trains `gpt_tiny` on all devices along `data` (8 simulated CPU devices when
there is no accelerator and XLA_FLAGS does not already set a host device count).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jaxpar.cli import Parser, add_train_arguments

    p = Parser(prog="python -m train", description=__doc__.split("\n\n")[0])
    return add_train_arguments(p, argv).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
