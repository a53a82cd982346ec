"""Where a user's own modules (recipes, model packages, data sources) are imported from."""

from __future__ import annotations

import os
import sys


def search_current_directory() -> None:
    """Let a user's modules in the current directory be imported, after the installed ones."""
    if "" not in sys.path and "." not in sys.path and os.getcwd() not in sys.path:
        sys.path.append("")
