"""jaxpar._compat: the one module that uses jax's and orbax's internals, and its version check."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from jaxpar import _compat
from jaxpar.worker import bootstrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "jaxpar")
INTERNAL = re.compile(r"\b(jax|orbax\.checkpoint)(\._src\b|\s+import\s+_src\b)")


def test_no_module_but_compat_uses_jax_or_orbax_internals():
    found = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in sorted(files):
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "_compat.py"):
                continue
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if INTERNAL.search(line):
                        found.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    assert not found, (
        "jax/orbax internals outside jaxpar/_compat.py (add a named function there and call it):\n"
        + "\n".join(found)
    )


def test_importing_compat_imports_neither_jax_nor_orbax():
    code = (
        "import sys, jaxpar._compat as c, jaxpar.worker.bootstrap, jaxpar.recovery.save_watch; "
        "c.check_versions(); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'orbax')], 'imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_tested_versions_are_the_pinned_ones():
    with open(os.path.join(REPO, "constraints.txt")) as f:
        pins = dict(line.strip().split("==", 1) for line in f if "==" in line)
    assert _compat.TESTED == {package: pins[package] for package in _compat.TESTED}


def test_check_versions_is_empty_for_the_pinned_versions():
    assert _compat.check_versions() == []


def test_check_versions_names_the_package_the_versions_and_the_fix(monkeypatch):
    installed = _compat.installed_version("jax")
    monkeypatch.setitem(_compat.TESTED, "jax", "0.0.1")
    assert _compat.check_versions() == [
        "jaxpar uses jax internals (jax._src.distributed, jax._src.xla_bridge) tested with "
        f"jax 0.0.1; you have {installed}: pin jax==0.0.1 (constraints.txt) or report if it fails"
    ]
    versions = {"jax": "0.10.2", "jaxlib": "0.10.2+cuda12", "orbax-checkpoint": "0.13.0"}
    monkeypatch.setattr(_compat, "installed_version", versions.get)
    monkeypatch.setitem(_compat.TESTED, "jax", "0.10.2")
    (line,) = _compat.check_versions()  # a local label (+cuda12) is the same release
    assert line.startswith("jaxpar uses orbax internals (orbax.checkpoint._src.")
    assert "tested with orbax-checkpoint 0.12.8; you have 0.13.0: " in line
    assert line.endswith("pin orbax-checkpoint==0.12.8 (constraints.txt) or report if it fails")
    monkeypatch.setattr(_compat, "installed_version", lambda package: None)
    assert _compat.check_versions() == []  # not installed: nothing to compare


def test_worker_set_up_warns_once_on_stderr_only_when_versions_differ(monkeypatch, capsys):
    for var in (
        "JAXPAR_COORDINATOR",
        "JAXPAR_SUPERVISOR_PID",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(bootstrap._state, "versions_checked", False)
    assert bootstrap.initialize_from_env() is False  # no cluster: a single process
    assert capsys.readouterr().err == ""
    monkeypatch.setitem(bootstrap._state, "versions_checked", False)
    monkeypatch.setitem(_compat.TESTED, "jaxlib", "0.0.1")
    bootstrap.initialize_from_env()
    bootstrap.initialize_from_env()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("jaxpar: warning: jaxpar uses jax internals")
    assert "pin jaxlib==0.0.1 (constraints.txt)" in err[0]


def test_jax_internals_answer_outside_a_distributed_job():
    assert _compat.distributed_client() is None
    assert _compat.jax_distributed.global_state.client is None
    assert _compat.coordinator_address() is None
    assert not bootstrap.distributed_active()
    assert isinstance(_compat.xla_backends_initialized(), bool)


def test_a_missing_internal_names_it_and_both_versions(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setitem(_compat.TESTED, "jax", "0.9.0")
    monkeypatch.delattr(xla_bridge, "backends_are_initialized")
    with pytest.raises(RuntimeError) as got:
        _compat.xla_backends_initialized()
    installed = _compat.installed_version("jax")
    assert isinstance(got.value, _compat.InternalChanged)
    assert "jax._src.xla_bridge.backends_are_initialized" in str(got.value)
    assert f"jax {installed}" in str(got.value) and "tested with jax 0.9.0" in str(got.value)
    assert "pin jax==0.9.0 (constraints.txt)" in str(got.value)

    monkeypatch.setattr(_compat, "JAX_DISTRIBUTED", "jax._src.no_such_module")
    with pytest.raises(_compat.InternalChanged, match=r"jax\._src\.no_such_module.*jax 0\.9\.0"):
        _compat.distributed_client()
    monkeypatch.setattr(_compat, "ORBAX_ASYNCIO", "orbax.checkpoint._src.no_such_module")
    with pytest.raises(_compat.InternalChanged, match="tested with orbax-checkpoint 0.12.8"):
        _compat.drain_orbax_event_loops()


def test_without_jax_the_distributed_job_is_inactive(monkeypatch):
    monkeypatch.setattr(_compat, "JAX_DISTRIBUTED", "no_such_package_jaxpar._src.distributed")
    with pytest.raises(ImportError):
        _compat.distributed_client()  # no such package at all: not a changed internal
    assert not bootstrap.distributed_active()


def test_orbax_commit_errors_reach_the_watcher_once_and_are_raised_on(monkeypatch):
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    def wait(directory, futures, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_checkpointer, "_background_wait_for_commit_futures", wait)
    seen = []
    record = lambda directory, error: seen.append((directory, error.errno))  # noqa: E731
    _compat.watch_orbax_commit_errors(record)
    _compat.watch_orbax_commit_errors(record)  # idempotent
    with pytest.raises(OSError, match="No space"):
        async_checkpointer._background_wait_for_commit_futures(os.path.join("a", "3"), [])
    assert seen == [(os.path.join("a", "3"), 28)]


def test_the_checkpointer_drains_orbax_event_loops():
    from orbax.checkpoint._src import asyncio_utils

    import jaxpar.recovery.checkpoint  # noqa: F401 - installs it

    assert asyncio_utils._run_sync_via_new_loop is _compat.run_on_new_loop
