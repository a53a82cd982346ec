"""A checkpoint write that failed on this process is seen at once, not after orbax's timeout.

`install()` records this process's failed write as orbax's write thread raises it; `wait()` and
`failed()` raise it without joining orbax's finalize thread, stuck at a barrier the other
processes never reach. Why: docs/design.md, "Shrink, hangs, a full disk".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable

from jaxpar import _compat

POLL_S = 0.05  # how often `wait` looks for a recorded failure

_lock = threading.Lock()
_failed: dict[str, BaseException] = {}  # a step's (tmp) folder -> the error of its write
_CANCELLED = (concurrent.futures.CancelledError, asyncio.CancelledError)


def failed(root: str) -> BaseException | None:
    """The recorded error of a failed write of a checkpoint under `root` (taken: once)."""
    prefix = os.path.join(os.path.abspath(root), "")
    with _lock:
        for folder in list(_failed):
            if os.path.abspath(folder).startswith(prefix):
                return _failed.pop(folder)
    return None


def wait(finish: Callable[[], None], root: str) -> None:
    """`finish()` (orbax's wait_until_finished), but raise a failed write's error recorded under
    `root` as soon as it is seen (`finish` may be left blocked, in a daemon thread)."""
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            finish()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="jaxpar-save-wait", daemon=True).start()
    while not done.wait(POLL_S):
        recorded = failed(root)
        if recorded is not None:
            raise recorded
    recorded = failed(root)  # the same error, when orbax raised it too
    if error:
        raise error[0]
    if recorded is not None:
        raise recorded


def _record(directory: str, error: BaseException) -> None:
    if not isinstance(error, _CANCELLED):
        with _lock:
            _failed[directory] = error


def install() -> None:
    """Record the errors of orbax's background writes (idempotent)."""
    _compat.watch_orbax_commit_errors(_record)
