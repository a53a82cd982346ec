"""A checkpoint write that failed on this process is seen at once, not after orbax's timeout.

In a multi-process job every process writes its shards of a checkpoint in an orbax background
thread, then waits at a barrier for the others. When the write fails on one process (e.g. a full
disk: another writer filled it after jaxpar's free-space check), that thread raises without
reaching the barrier, and orbax's save-finalize thread then enters a second barrier the other
processes never reach: every process's `wait_until_finished` blocks until orbax's timeout
(10 minutes), and `check_for_errors` never sees the error.

`install()` records the error of this process's failed write as it happens; `wait()` waits for
the save in flight but raises a recorded error as soon as there is one, and `failed()` hands it
to the per-step check, so the failing process exits at once and the supervisor stops the group.
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
