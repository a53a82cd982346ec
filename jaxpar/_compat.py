"""The one module of jaxpar that reaches into jax's and orbax's private modules.

Each internal jaxpar needs is a small named function here, imported on first use (importing this
module imports no jax); `TESTED` holds the versions they were tested with and `check_versions()`
warns when the installed ones differ. Design, and how to move to a new jax or orbax:
docs/design.md, "Library internals".
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any, TypeVar

_T = TypeVar("_T")

# The versions the internals below were tested with: constraints.txt's pins (a unit test checks).
TESTED = {"jax": "0.10.2", "jaxlib": "0.10.2", "orbax-checkpoint": "0.12.8"}

# The internals each package's version decides. The jax.distributed client is jaxlib's object.
JAX_DISTRIBUTED = "jax._src.distributed"
JAX_XLA_BRIDGE = "jax._src.xla_bridge"
ORBAX_ASYNCIO = "orbax.checkpoint._src.asyncio_utils"
ORBAX_ASYNC_CHECKPOINTER = "orbax.checkpoint._src.checkpointers.async_checkpointer"
INTERNALS = {
    "jax": (JAX_DISTRIBUTED, JAX_XLA_BRIDGE),
    "jaxlib": (JAX_DISTRIBUTED,),
    "orbax-checkpoint": (ORBAX_ASYNCIO, ORBAX_ASYNC_CHECKPOINTER),
}
_PACKAGE_OF = {"jax": "jax", "orbax": "orbax-checkpoint"}  # top-level module -> distribution


class InternalChanged(RuntimeError):
    """A jax or orbax internal jaxpar uses is missing or changed shape in the installed version."""


def installed_version(package: str) -> str | None:
    """The installed version of distribution `package` (None when it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _same(installed: str, tested: str) -> bool:
    return installed.split("+", 1)[0] == tested  # a local label (+cuda12) is the same release


def _fix(package: str) -> str:
    return f"pin {package}=={TESTED[package]} (constraints.txt)"


def check_versions() -> list[str]:
    """One line per installed package whose version differs from the one jaxpar's use of its
    internals was tested with (empty with constraints.txt's pins). Imports no jax."""
    warnings = []
    for package, tested in TESTED.items():
        installed = installed_version(package)
        if installed is None or _same(installed, tested):
            continue
        kind = "orbax" if package.startswith("orbax") else "jax"
        warnings.append(
            f"jaxpar uses {kind} internals ({', '.join(INTERNALS[package])}) tested with "
            f"{package} {tested}; you have {installed}: {_fix(package)} or report if it fails"
        )
    return warnings


def _changed(internal: str, error: BaseException) -> InternalChanged:
    package = _PACKAGE_OF[internal.split(".", 1)[0]]
    installed = installed_version(package) or "(not installed)"
    return InternalChanged(
        f"jaxpar uses {internal}, which {package} {installed} does not have or has changed "
        f"(tested with {package} {TESTED[package]}): {_fix(package)} or report it "
        f"({type(error).__name__}: {error})"
    )


def _module(name: str) -> ModuleType:
    """Import internal module `name`. Raises ImportError when its package is not installed at
    all, InternalChanged when the package lacks that module."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if importlib.util.find_spec(name.split(".", 1)[0]) is None:
            raise  # no jax (or orbax) at all: not a changed internal
        raise _changed(name, e) from e


def _attr(obj: Any, name: str, internal: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise _changed(internal, e) from e


# ---- jax ---------------------------------------------------------------------------------------


def global_distributed_state() -> Any:
    """jax.distributed's process state (`jax._src.distributed.global_state`): `.client` (None
    outside a multi-process job) and `.coordinator_address`. ImportError without jax."""
    internal = f"{JAX_DISTRIBUTED}.global_state"
    state = _attr(_module(JAX_DISTRIBUTED), "global_state", internal)
    for field in ("client", "coordinator_address"):
        _attr(state, field, f"{internal}.{field}")
    return state


class _JaxDistributed:
    """Stands for the module `jax._src.distributed` where only `.global_state` is read
    (`from jaxpar._compat import jax_distributed as distributed`)."""

    @property
    def global_state(self) -> Any:
        return global_distributed_state()


jax_distributed = _JaxDistributed()


def distributed_client() -> Any:
    """The client `jax.distributed.initialize` made (None outside a multi-process job): the
    coordination service's `wait_at_barrier`, `key_value_set`, `blocking_key_value_get`. jax has
    no public key-value API; Orbax uses the same client for its cross-process metadata.
    ImportError without jax."""
    return global_distributed_state().client


def coordinator_address() -> str | None:
    """HOST:PORT of the jax.distributed coordinator (None outside a multi-process job)."""
    return global_distributed_state().coordinator_address


def xla_backends_initialized() -> bool:
    """Whether jax has created a backend in this process
    (`jax._src.xla_bridge.backends_are_initialized()`): after that, device counts, collectives
    and XLA flags can no longer change. Imports jax (check `sys.modules` first to avoid that)."""
    internal = f"{JAX_XLA_BRIDGE}.backends_are_initialized"
    return bool(_attr(_module(JAX_XLA_BRIDGE), "backends_are_initialized", internal)())


# ---- orbax: failed background writes -----------------------------------------------------------

_COMMIT_WAIT = "_background_wait_for_commit_futures"


def watch_orbax_commit_errors(on_error: Callable[[str, BaseException], None]) -> None:
    """Call `on_error(directory, error)` as orbax's background wait for a checkpoint's writes
    (`async_checkpointer._background_wait_for_commit_futures(directory, ...)`, run in orbax's
    save thread) raises, before orbax's barriers; the error is raised on as before. Idempotent
    for the same `on_error`."""
    module = _module(ORBAX_ASYNC_CHECKPOINTER)
    original = _attr(module, _COMMIT_WAIT, f"{ORBAX_ASYNC_CHECKPOINTER}.{_COMMIT_WAIT}")
    if getattr(original, "jaxpar_on_error", None) is on_error:
        return

    def watched(directory, *args, **kwargs):
        try:
            return original(directory, *args, **kwargs)
        except BaseException as e:
            on_error(str(directory), e)
            raise

    watched.jaxpar_on_error = on_error
    setattr(module, _COMMIT_WAIT, watched)


# ---- orbax: short-lived event loops, closed only after the work they started has ended ---------
#
# Orbax runs each batch of reads or writes (`asyncio_utils.run_sync`) on a new event loop that it
# closes as soon as the awaited coroutine returns. When one of many concurrent TensorStore reads
# or writes fails (a full disk, a damaged checkpoint), `asyncio.gather` raises at once while the
# other operations are still running; the loop is closed under them, and each one that completes
# later calls `loop.call_soon_threadsafe` from a TensorStore thread: "RuntimeError: Event loop is
# closed", printed as a bare traceback (dozens per failed save), or a
# PytestUnraisableExceptionWarning. `drain_orbax_event_loops()` makes those loops wait (bounded)
# for the tasks still pending before closing, and marks their errors as seen (the first one has
# already been raised to the caller).

DRAIN_S = 60.0  # the longest a failed batch waits for its other reads/writes to end
_NEW_LOOP = "_run_sync_via_new_loop"


def _finish(loop: Any, timeout: float) -> None:
    """Let the tasks still pending on `loop` end (cancel those still running after `timeout`)."""
    import asyncio

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
    import asyncio

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


def drain_orbax_event_loops() -> None:
    """Use `run_on_new_loop` for orbax's synchronous runs (`asyncio_utils._run_sync_via_new_loop`,
    which `asyncio_utils.run_sync` calls outside a running loop). Idempotent."""
    module = _module(ORBAX_ASYNCIO)
    _attr(module, _NEW_LOOP, f"{ORBAX_ASYNCIO}.{_NEW_LOOP}")  # replaced only where it exists
    setattr(module, _NEW_LOOP, run_on_new_loop)
