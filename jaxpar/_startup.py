"""Process start-up without IPython when nothing runs in IPython.

flax.nnx (reprlib, visualization, summary) and treescope probe at import time whether they run
inside IPython by importing it (`from IPython import get_ipython`). Where Jupyter is installed,
that import alone costs about a second of CPU in every process that imports flax — each worker,
spare and restart of a job — and its answer is known without it: in a process that has not
imported IPython, `get_ipython()` is None. This finder answers those probes with ImportError,
which the probing modules treat as "not in IPython", exactly what the import would have told
them. It only declines `import IPython` issued by flax or treescope code while IPython is not
loaded; every other import of IPython (a user's `IPython.embed()`, a notebook kernel, where
IPython is loaded before any of this) proceeds as usual.
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
