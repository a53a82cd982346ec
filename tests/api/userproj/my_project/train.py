"""The user project's own entrypoint, through jaxpar's library API:

jaxpar launch --nproc 2 --devices-per-proc 4 --run-dir runs/x -- python -m my_project.train
"""

from __future__ import annotations

import argparse
import dataclasses

import jaxpar
from my_project.recipes import digits_bn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="data=2,tensor=4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--run-dir", default=None)  # default: jaxpar launch's --run-dir
    args = p.parse_args()
    cfg = digits_bn()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.steps))
    summary = jaxpar.fit(cfg, mesh=args.mesh, run_dir=args.run_dir, progress=False)
    print(f"final loss {summary['final_loss']:.4f}")


if __name__ == "__main__":
    jaxpar.entrypoint(main)
