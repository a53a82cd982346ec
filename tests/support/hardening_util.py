"""Helpers of the hardening tests: run-directory snapshots and in-process command lines."""

from __future__ import annotations

import os


def snapshot(path) -> dict | None:
    """Every file's bytes and every folder under `path` (None if it does not exist)."""
    if not os.path.exists(path):
        return None
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = None
        for f in files:
            full = os.path.join(root, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = fh.read()
    return out


def call(main, argv) -> int:
    """A command line's `main(argv)` in this process; argparse's SystemExit becomes the code."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code
