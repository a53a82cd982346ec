"""Process start-up without IPython when nothing runs in IPython.

This finder answers the import-time IPython probes of flax and treescope with ImportError ("not
in IPython") while IPython is not loaded; every other import of IPython proceeds as usual. Why,
and what exactly it declines: docs/design.md, "Library internals".
"""

from __future__ import annotations

import sys

PROBING = ("flax.", "treescope.")  # packages whose IPython import is only a probe


class IPythonProbeFinder:
    """Meta path finder: ImportError for `import IPython` from flax or treescope code."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "IPython" or "IPython" in sys.modules:
            return None
        if _importer().startswith(PROBING):
            raise ImportError("IPython is not loaded in this process (jaxpar._startup)")
        return None


def _importer() -> str:
    """Module name of the code that issued the import being resolved."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib")) and name != __name__:
            return name
        frame = frame.f_back
    return ""


def install() -> None:
    if not any(isinstance(f, IPythonProbeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, IPythonProbeFinder())
