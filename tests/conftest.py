# ruff: noqa: E402  (XLA_FLAGS must be set before jax creates its CPU backend)
"""Shared test set-up: 8 simulated CPU devices, cached compiled steps and reference runs.

Tiers: `python -m pytest -m "not slow"` is the fast tier; `slow` marks multi-layout parity,
subprocess and end-to-end tests. A test needing another device count calls
`rerun_with_devices(request, n)`, which re-runs that one test in a subprocess.

Every test checks (autouse fixture) that the process has exactly the devices it expects, so a
multi-device test can never silently run on one device. Command lines run as subprocesses through
tests/support/helpers.py, which share one persistent compilation cache per pytest session.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = int(os.environ.get("JAXPAR_TEST_DEVICES", "8"))


if REPO not in sys.path:
    sys.path.insert(0, REPO)  # jaxpar (models/, meshes/, train/ as jaxpar.*) from the checkout

from tests.support import forkserver, helpers  # imports jax but creates no backend


def _xla_flags(existing: str, devices: int) -> str:
    """XLA_FLAGS for the tests: the device count and helpers.XLA_TEST_FLAGS, each unless
    `existing` sets that flag already."""
    flags = existing.split()
    wanted = [f"--xla_force_host_platform_device_count={devices}", *helpers.XLA_TEST_FLAGS.split()]
    for flag in wanted:
        if not any(f.split("=")[0] == flag.split("=")[0] for f in flags):
            flags.append(flag)
    return " ".join(flags)


# Must happen before jax creates its CPU backend (the first jax.devices() call).
os.environ["XLA_FLAGS"] = _xla_flags(os.environ.get("XLA_FLAGS", ""), DEVICES)
# as `jaxpar launch` gives its workers: a supervisor forked from the tests' pool then has their
# start-up environment, and forks its own spare pool instead of starting one cold
os.environ.setdefault("PYTHONUNBUFFERED", "1")
helpers.START_ENV.update(os.environ)

import jax
import pytest

from tests.support import groups, programs  # programs: jax's threefry made sharding-independent


def pytest_configure(config):
    """Compile the checkout's modules once, before the workers start: the suite starts ~600
    Python processes, and where PYTHONDONTWRITEBYTECODE is set each would compile jaxpar's own
    modules again (~0.1 s of CPU apiece)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    for name in ("jaxpar", "models", "train", "meshes", "tests", "docs"):
        compileall.compile_dir(os.path.join(REPO, name), quiet=2)


PARITY_STEPS = programs.PARITY_STEPS
IN_PROCESS_CACHE_MIN_S = 2.0  # compile time from which a test process's program is cached
# The folder all processes of a session share (its xdist workers, a child pytest): set once below
SESSION_ENV = "JAXPAR_TEST_SESSION_DIR"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """One xdist group per test module (or the cluster folder), the longest groups first."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups.group_of(item, REPO)))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike; xdist hands out groups
        items.sort(
            key=lambda item: -groups.LONGEST_FIRST.get(groups.group_of(item, REPO), 0)
        )  # stable: file order


@pytest.fixture(autouse=True, scope="session")
def _device_count():
    got = jax.device_count()
    assert got == DEVICES, (
        f"tests expect {DEVICES} devices, jax sees {got}: XLA_FLAGS must be set before jax starts "
        f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})"
    )


@pytest.fixture(autouse=True, scope="session")
def _session_compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the session's processes (subprocesses through
    tests.support.helpers.cpu_env); a child pytest (rerun_with_devices) keeps its parent's."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one for all workers
    os.environ.setdefault(SESSION_ENV, str(shared))
    cache = os.environ.setdefault(helpers.CACHE_ENV, str(shared / "jax-cache"))
    # The test processes share it too: a test that builds a program another test (on any worker)
    # already compiled loads it. Only programs that took seconds go in, so the compiled-program
    # cache's own tests (tiny programs) never see it.
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", IN_PROCESS_CACHE_MIN_S)
    local = os.environ.setdefault(helpers.LOCAL_ENV, str(tmp_path_factory.getbasetemp() / "local"))
    os.environ.setdefault("JAXPAR_LOCAL_DIR", local)  # in-process runs too


@pytest.fixture(scope="module")
def cache_every_program(_session_compilation_cache):
    """For one module (`pytestmark = pytest.mark.usefixtures("cache_every_program")`): every
    program its tests compile goes into the session's persistent cache however fast it compiled,
    so a test that builds a program an earlier one built (the same init, a checkpoint's checksum,
    a step of the same layout) loads it. jax keys the cache by the program itself: only an
    identical program is loaded. The threshold is back to IN_PROCESS_CACHE_MIN_S after the
    module, for the compiled-program cache's own tests."""
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", IN_PROCESS_CACHE_MIN_S)


@pytest.fixture(scope="session")
def devices8():
    """The 8 simulated devices (asserted, never skipped)."""
    assert jax.device_count() == 8, f"needs 8 devices, have {jax.device_count()}"
    return jax.devices()


@pytest.fixture(scope="session")
def jp():
    """tests/support/programs.py, for test modules (build, compile, train, compare)."""
    return programs


@pytest.fixture(scope="session")
def compiled():
    """Session cache of compiled train steps: compiled(recipe, layout, microbatches=1, steps=5)."""
    cache: dict[tuple, programs.Compiled] = {}

    def get(name: str, layout: str, microbatches: int = 1, steps: int = PARITY_STEPS):
        key = (name, layout, microbatches, steps)
        if key not in cache:
            cache[key] = programs.compile_layout(
                programs.recipe(name, steps, microbatches=microbatches), layout
            )
        return cache[key]

    return get


@pytest.fixture(scope="session")
def runs(compiled):
    """Session cache of training runs: runs(recipe, layout, microbatches=1, steps=5)."""
    cache: dict[tuple, programs.RunResult] = {}

    def get(name: str, layout: str, microbatches: int = 1, steps: int = PARITY_STEPS):
        key = (name, layout, microbatches, steps)
        if key not in cache:
            cache[key] = programs.train(compiled(*key))  # from the config's initial state
        return cache[key]

    return get


@pytest.fixture(scope="session")
def reference_run(runs):
    """gpt_tiny on one device: 5-step losses and first-step gradients (shared by all tests)."""
    return runs("gpt_tiny", "cpu1")


# ---- other device counts ------------------------------------------------------------------------


@pytest.fixture
def rerun(request):
    """rerun(n): see rerun_with_devices."""
    return lambda devices, timeout=300: programs.rerun_with_devices(request, devices, timeout)


# ---- subprocess runs (tests/support/helpers.py) ---------------------------------------------------------

CKPT_STEPS, CKPT_EVERY = 30, 10


@pytest.fixture(scope="session")
def ckpt_reference(_session_compilation_cache):
    """An uninterrupted `python -m train` run dir: gpt_tiny made small (helpers.SMALL), 30 steps,
    a save every 10, 8 devices.

    The reference of the checkpoint-fault, local-tier, reshard and run-directory tests, which copy
    it or compare with it (their runs pass helpers.SMALL too: the same config and program). It
    is run once per session, not once per xdist worker: it lives in the session's shared folder,
    and the first worker that needs it runs it while the others wait on a lock.
    """
    shared = Path(os.environ[SESSION_ENV])
    run_dir, complete = shared / "ckpt-reference" / "run", shared / "ckpt-reference" / "complete"
    run_dir.parent.mkdir(exist_ok=True)
    with open(shared / "ckpt-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not complete.exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a worker's run that failed
            every = f"ckpt.every={CKPT_EVERY}"
            cmd = helpers.train_cmd(run_dir, "--set", every, *helpers.SMALL, steps=CKPT_STEPS)
            helpers.ok(helpers.run(cmd))
            complete.touch()
    return run_dir


@pytest.fixture(scope="session")
def tokens_corpus(tmp_path_factory) -> str:
    """A folder prepared by `jaxpar data prepare` (tests/support/corpus.py), once per session."""
    from tests.support.corpus import prepare_corpus

    return prepare_corpus(tmp_path_factory.mktemp("tokens") / "corpus")


@pytest.fixture
def small_fs(tmp_path):
    """A 6 MiB tmpfs (root may mount); the test says why if this machine does not allow it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


CPU_LOG_ENV = "JAXPAR_TEST_CPU_LOG"  # a file: one JSON line per test with the CPU seconds it used
CPU_LOG_OWNER_ENV = "JAXPAR_TEST_CPU_LOG_PID"  # the process whose tests are logged


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With JAXPAR_TEST_CPU_LOG set, append each test's CPU seconds (this process's and those of
    the subprocesses it waited for) to that file: where the suite's time goes, load apart."""
    path = os.environ.get(CPU_LOG_ENV)
    # A test's child pytest (helpers.in_child, rerun_with_devices) logs nothing: its CPU seconds
    # are its parent's, counted once in the parent test's row (the children it waited for).
    owner = os.environ.setdefault(CPU_LOG_OWNER_ENV, str(os.getpid()))
    helpers.START_ENV.setdefault(CPU_LOG_OWNER_ENV, owner)
    if not path or owner != str(os.getpid()):
        yield
        return
    import json
    import resource
    import time

    def cpu() -> tuple[float, float]:  # (this process, the subprocesses it waited for)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # + the runs the fork server ran
        return time.process_time(), kids.ru_utime + kids.ru_stime + forkserver.cpu_s()

    (own, kids), wall = cpu(), time.monotonic()
    yield
    own_after, kids_after = cpu()
    row = {"test": item.nodeid, "cpu_s": round(own_after - own + kids_after - kids, 2),
           "children_cpu_s": round(kids_after - kids, 2),
           "wall_s": round(time.monotonic() - wall, 2)}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
