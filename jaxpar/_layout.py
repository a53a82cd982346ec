"""Where `jaxpar.models`, `jaxpar.meshes` and `jaxpar.train` come from in a source checkout.

An installed jaxpar carries the repository's `models/`, `meshes/` and `train/` inside the package
(setup.py maps them); used without installing, this finder serves the same names from those
folders. Why: docs/api.md, "How jaxpar is installed".
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec

SUBPACKAGES = ("models", "meshes", "train")


class CheckoutFinder:
    """Meta path finder for `jaxpar.<folder>` -> `<checkout>/<folder>/__init__.py`."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != "jaxpar" or name not in SUBPACKAGES:
            return None
        folder = os.path.join(self.root, name)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def checkout_root(package_dir: str) -> str | None:
    """The checkout holding this `jaxpar/` when it is used from source, else None (installed)."""
    if all(os.path.isdir(os.path.join(package_dir, name)) for name in SUBPACKAGES):
        return None  # installed: the folders are inside the package
    root = os.path.dirname(os.path.abspath(package_dir))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return None
    if not all(os.path.isfile(os.path.join(root, n, "__init__.py")) for n in SUBPACKAGES):
        return None
    return root


def install(package_dir: str) -> None:
    """Put the checkout finder first on sys.meta_path (once) when `package_dir` is a checkout's.

    First, so that a worktree's folders win over an editable install of another checkout.
    """
    root = checkout_root(package_dir)
    if root is None:
        return
    for finder in sys.meta_path:
        if isinstance(finder, CheckoutFinder) and finder.root == root:
            return
    sys.meta_path.insert(0, CheckoutFinder(root))
