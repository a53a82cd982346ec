"""Orbax's short-lived asyncio event loops, closed only after the work they started has ended.

Orbax runs each batch of reads or writes (`asyncio_utils.run_sync`) on a new event loop that it
closes as soon as the awaited coroutine returns. When one of many concurrent TensorStore reads or
writes fails (a full disk, a damaged checkpoint), `asyncio.gather` raises at once while the other
operations are still running; the loop is closed under them, and each one that completes later
calls `loop.call_soon_threadsafe` from a TensorStore thread: "RuntimeError: Event loop is closed",
printed as a bare traceback (dozens per failed save), or a PytestUnraisableExceptionWarning.

`install()` makes those loops wait (bounded) for the tasks still pending before closing, and
marks their errors as seen (the first one has already been raised to the caller).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from orbax.checkpoint._src import asyncio_utils

_T = TypeVar("_T")

DRAIN_S = 60.0  # the longest a failed batch waits for its other reads/writes to end


def _finish(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """Let the tasks still pending on `loop` end (cancel those still running after `timeout`)."""
    pending = asyncio.all_tasks(loop)
    if not pending:
        return
    _, late = loop.run_until_complete(asyncio.wait(pending, timeout=timeout))
    for task in late:
        task.cancel()
    if late:
        loop.run_until_complete(asyncio.wait(late, timeout=timeout))
    for task in pending:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "Task exception was never retrieved" log


def run_on_new_loop(coro: Coroutine[Any, Any, _T], timeout: float = DRAIN_S) -> _T:
    """Run `coro` on a new event loop, as orbax does, then close the loop only after the tasks it
    left pending have ended (at most ~2 x `timeout` seconds)."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(coro)
        finally:
            _finish(loop, timeout)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def install() -> None:
    """Use `run_on_new_loop` for orbax's synchronous runs (idempotent)."""
    asyncio_utils._run_sync_via_new_loop = run_on_new_loop
