"""Ownership and clean-up of the local snapshot tier's folders (jaxpar/recovery/local_tier.py), so
that node RAM (/dev/shm) does not fill with the snapshots of runs nobody can resume.

The run directory's identity (RUN_DIR/local_tier_id), the owner marker, what each start removes
and what it never touches: docs/design.md, "Recovery tiers", "Clean-up".
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil

from jaxpar.recovery import local_tier_store as store
from jaxpar.rundir import runlog

RUN_ID_FILE = runlog.LOCAL_TIER_ID  # in the run directory
OWNER_FILE = "owner.json"  # in each node folder of the local tier
CREATED_BY = "jaxpar local tier"
_ID = re.compile(r"[0-9a-f]{32}")
_PROC = re.compile(r"proc(\d+)")


def read_run_id(run_path: str) -> str | None:
    """The run directory's identity, or None when it has none (or not a valid one)."""
    try:
        with open(os.path.join(run_path, RUN_ID_FILE), "rb") as f:
            text = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if _ID.fullmatch(text) else None


def run_id(run_path: str) -> str:
    """The run directory's identity, created on first use. Processes racing to create it agree:
    each writes a candidate and hard-links it into place; the first link wins."""
    found = read_run_id(run_path)
    if found is not None:
        return found
    path = os.path.join(run_path, RUN_ID_FILE)
    token = secrets.token_hex(16)
    tmp = f"{path}.tmp.{os.getpid()}.{token[:8]}"
    try:
        with open(tmp, "w") as f:
            f.write(token + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            if read_run_id(run_path) is None:  # garbage in its place: replace it
                os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    found = read_run_id(run_path)
    if found is None:
        raise OSError(errno.EIO, f"{path}: cannot create the run directory's identity")
    return found


def _owner(folder: str) -> dict | None:
    """The owner marker of a node folder that jaxpar may manage, else None: a real directory
    (not a symlink) of this user with a readable marker."""
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.getuid():
        return None
    try:
        marker = runlog.read_json_object(os.path.join(folder, OWNER_FILE), "owner marker")
    except ValueError:
        return None
    if marker.get("created_by") != CREATED_BY or not isinstance(marker.get("run_dir"), str):
        return None
    return marker


def _orphaned(marker: dict) -> bool:
    """Whether nobody can restore from the folder: its run directory is gone or was remade."""
    run_dir = marker["run_dir"]
    if not os.path.isdir(run_dir):
        return True
    return read_run_id(run_dir) != marker.get("run_id")


def _remove(path: str, removed: list[str]) -> None:
    if os.path.islink(path):  # never follow one (shutil.rmtree refuses them too)
        return
    shutil.rmtree(path, ignore_errors=True)
    removed.append(path)


def claim(node: str, run_path: str, ident: str) -> None:
    """Create this run's node folder (private) with its owner marker (before any snapshot)."""
    store.private_dirs(node)
    marker = {"created_by": CREATED_BY, "run_dir": os.path.realpath(run_path), "run_id": ident}
    store.write_private_json(os.path.join(node, OWNER_FILE), marker)


def prepare(root: str, node: str, run_path: str, nproc: int) -> tuple[str, list[str]]:
    """At start-up, on every process: remove stale folders (module docstring), claim `node`.

    Returns (this run directory's run_id, the folders removed)."""
    ident = run_id(run_path)
    removed: list[str] = []
    with contextlib.suppress(OSError):
        entries = sorted(e.path for e in os.scandir(root) if e.name.startswith("run-"))
        for folder in entries:
            marker = _owner(folder)
            if marker is None:
                continue
            if folder == node:
                if marker.get("run_id") != ident:  # an earlier run directory at this path
                    _remove(folder, removed)
            elif _orphaned(marker):
                _remove(folder, removed)
    if _owner(node) is not None:
        for parent in (node, os.path.join(node, "peer")):
            with contextlib.suppress(OSError):
                for e in os.scandir(parent):
                    m = _PROC.fullmatch(e.name)
                    if m and int(m.group(1)) >= nproc and not e.is_symlink():
                        _remove(e.path, removed)
    claim(node, run_path, ident)
    return ident, removed


def release(node: str) -> None:
    """Remove this run's node folder once only its owner marker is left (the run finished;
    other processes' snapshots may remain until they finish too)."""
    with contextlib.suppress(OSError):
        if os.listdir(node) == [OWNER_FILE]:
            os.remove(os.path.join(node, OWNER_FILE))
            os.rmdir(node)
