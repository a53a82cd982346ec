"""The spare pool (jaxpar/worker/spare.py --pool, jaxpar/supervisor/spare_pool.py): one real
pool process forks scripts as a cold `python SCRIPT` would run them, and reports each exit as
`Popen.returncode` would (codes, signals, uncaught exceptions, `sys.exit("message")`); a fork
runs the child's atexit functions and joins its threads; a worker environment that differs in
what jax reads at import is refused (the caller starts it cold); workers die with the pool."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from jaxpar.supervisor.spare_pool import SparePool
from tests.support.helpers import cpu_env, run

SCRIPT = """
import atexit, json, os, signal, sys, threading, time
mode, out = sys.argv[1], sys.argv[2]
def record(**kw):
    with open(out, "a") as f:
        f.write(json.dumps(kw) + "\\n")
record(pid=os.getpid(), ppid=os.getppid(), sid=os.getsid(0), argv=sys.argv[1:],
       env=os.environ.get("POOL_TEST"), supervisor=os.environ.get("JAXPAR_SUPERVISOR_PID"),
       name=__name__)
atexit.register(lambda: record(atexit=True))
if mode == "code":
    sys.exit(3)
if mode == "message":
    sys.exit("stopped: a message for the log")
if mode == "raise":
    raise ValueError("an uncaught error")
if mode == "thread":  # a non-daemon thread outlives the main one: the exit waits for it
    threading.Thread(target=lambda: (time.sleep(0.5), record(thread_done=True))).start()
    sys.exit(0)
if mode == "sleep":
    time.sleep(600)
if mode == "state":  # what it holds of whoever forked its pool
    record(fds=sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
           sigterm=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, wakeup=signal.set_wakeup_fd(-1),
           sigint=signal.getsignal(signal.SIGINT) is signal.default_int_handler,
           path0=sys.path[0], cwd=os.getcwd())
if mode == "spin":  # some CPU, and a line on each stream
    while time.process_time() < 0.3:
        pass
    print("to stdout")
    print("to stderr", file=sys.stderr)
    record(cpu_s=time.process_time())
"""

pytestmark = pytest.mark.timeout(300)


def _pool(tmp_path):
    env = cpu_env(devices=None)
    env["JAXPAR_SUPERVISOR_PID"] = str(os.getpid())  # the pool dies with this test process
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    with open(tmp_path / "pool.log", "ab") as log:
        p = SparePool(env, f"script:{script}", log)
    p.env, p.script, p.dir = env, str(script), tmp_path
    yield p
    for pid in p.forked:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    p.close()


@pytest.fixture
def pool(tmp_path):
    """A pool of the test's own: the test refuses a worker (which breaks it) or kills it."""
    yield from _pool(tmp_path)


@pytest.fixture(scope="module")
def shared_pool(tmp_path_factory):
    """One pool for the tests that leave it working (each asserts so): its imports paid once."""
    yield from _pool(tmp_path_factory.mktemp("pool"))


def _fork(pool, mode: str, **env):
    out, log = pool.dir / f"{mode}.jsonl", pool.dir / f"{mode}.log"
    env = {**pool.env, "POOL_TEST": mode, "JAXPAR_PROCESS_ID": "7", **env}
    w = pool.fork(env, [sys.executable, pool.script, mode,
                  str(out)], str(log))  # fmt: skip
    return w, out, log


def _records(out) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_forked_workers_exit_as_cold_ones_would(shared_pool):
    pool = shared_pool
    runs = {mode: _fork(pool, mode) for mode in ("code", "message", "raise", "thread", "sleep")}
    worker = runs["sleep"][0]
    deadline = time.time() + 120
    while not _records(runs["sleep"][1]) and time.time() < deadline:
        time.sleep(0.1)
    with open(f"/proc/{worker.pid}/comm") as f:  # `top` and `pgrep` name it by its process id
        assert f.read().strip() == "jaxpar-proc7"
    os.kill(worker.pid, signal.SIGKILL)
    codes = {mode: w.wait(timeout=120) for mode, (w, _, _) in runs.items()}
    assert codes == {"code": 3, "message": 1, "raise": 1, "thread": 0, "sleep": -signal.SIGKILL}
    assert all(w.poll() == codes[m] for m, (w, _, _) in runs.items())  # poll agrees, again
    for mode, (w, out, _log) in runs.items():
        first = _records(out)[0]
        # its own process, session and environment; the script ran as __main__ with its argv
        assert first["pid"] == w.pid and first["sid"] == w.pid and first["ppid"] == pool.proc.pid
        assert first["env"] == mode and first["name"] == "__main__"
        assert first["argv"] == [mode, str(out)]
        assert first["supervisor"] == str(pool.proc.pid)  # its parent-death signal: the pool's
        ended = _records(out)[1:]
        assert ({"atexit": True} in ended) == (mode != "sleep"), (mode, ended)
    assert {"thread_done": True} in _records(runs["thread"][1])
    assert "stopped: a message for the log" in runs["message"][2].read_text()
    assert "ValueError: an uncaught error" in runs["raise"][2].read_text()
    assert not pool.broken


def test_stderr_apart_and_the_cpu_a_worker_used(shared_pool):
    pool = shared_pool
    out, log, err = (pool.dir / f"spin.{x}" for x in ("jsonl", "log", "err"))
    env = {**pool.env, "POOL_TEST": "spin"}
    w = pool.fork(env, [sys.executable, pool.script, "spin", str(out)], str(log), str(err))
    assert w.wait(timeout=120) == 0 and w.cpu_s is not None
    assert log.read_text() == "to stdout\n" and err.read_text() == "to stderr\n"
    # what the worker measured of itself before its exit
    (used,) = [r["cpu_s"] for r in _records(out) if "cpu_s" in r]
    assert used >= 0.3 and w.cpu_s >= used - 0.02, (w.cpu_s, used)
    assert not pool.broken


@pytest.mark.parametrize("changed", [{"JAX_ENABLE_X64": "1"}, {"PYTHONPATH": "/elsewhere"}])
def test_a_changed_import_time_variable_is_refused_and_starts_cold(pool, changed):
    w, out, _ = _fork(pool, "code", **changed)
    assert w is None and "refused" in pool.broken, pool.broken
    # from then on every worker starts cold (the caller's part), even one the pool would take
    assert pool.fork(pool.env, [sys.executable, pool.script, "code", str(out)], os.devnull) is None


def test_device_ids_of_a_slot_do_not_refuse_and_workers_die_with_the_pool(pool):
    # the slot's own device ids are read by jax.distributed.initialize only: no refusal
    w, out, _ = _fork(pool, "sleep", JAX_LOCAL_DEVICE_IDS="2,3")
    assert w is not None, pool.broken
    deadline = time.time() + 120
    while not _records(out) and time.time() < deadline:
        time.sleep(0.1)
    pool.proc.kill()  # the pool gone: its workers get their parent-death signal
    assert w.wait(timeout=60) == -signal.SIGKILL
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with open(f"/proc/{w.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except OSError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"worker {w.pid} outlived its pool")
    assert pool.fork(pool.env, [sys.executable, pool.script, "code", str(out)], os.devnull) is None


# A supervisor that holds jaxpar's imports (as one forked from a pool does): its descriptors,
# signal handlers, wake-up fd and atexit functions are its own; the pool it forks has none of them.
SUPERVISOR = """
import atexit, json, os, signal, socket, sys
from jaxpar.worker import spare
spare.preload(None)
from jaxpar.supervisor.spare_pool import SparePool
script, out, log = sys.argv[1:]
r, w = socket.socketpair()
w.setblocking(False)
# numbered apart from what a process opens first (e.g. the worker's listing of its fds)
held = [os.dup2(os.open(out + ".held", os.O_WRONLY | os.O_CREAT), 40), os.dup2(r.fileno(), 41),
        os.dup2(w.fileno(), 42)]
signal.set_wakeup_fd(42, warn_on_full_buffer=False)
signal.signal(signal.SIGTERM, lambda *a: None)
atexit.register(lambda: open(out + ".atexit", "a").write(f"{os.getpid()}\\n"))
env = dict(os.environ, JAXPAR_SUPERVISOR_PID=str(os.getpid()), POOL_TEST="state")
with open(log, "ab") as f:
    pool = SparePool(env, f"script:{script}", f, fork_self=True)
worker = pool.fork(env, [sys.executable, script, "state", out], log)
code = worker.wait(120)
pool.close()
print(json.dumps({"pid": os.getpid(), "code": code, "pool": pool.proc.pid, "pool_code": pool.proc.returncode,
                  "held": held, "worker": worker.pid}))
"""


def test_a_supervisor_holding_the_imports_forks_its_pool_and_passes_on_nothing_else(tmp_path):
    script, out, log = tmp_path / "worker.py", tmp_path / "state.jsonl", tmp_path / "pool.log"
    script.write_text(SCRIPT)
    env = cpu_env(devices=None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = run([sys.executable, "-c", SUPERVISOR, str(script), str(out), str(log)], env=env,
               cwd=tmp_path, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["code"] == 0 and got["pool_code"] == 0, log.read_text()
    assert f"spare pool {got['pool']}: ready (forked from the supervisor's imports)" in (
        log.read_text()
    )
    state = {k: v for record in _records(out) for k, v in record.items()}
    assert state["ppid"] == got["pool"] and state["pid"] == got["worker"]
    # none of the supervisor's descriptors (its file, its wake-up socket pair) nor the pool's
    # pipes: 0, 1, 2 and what the interpreter itself opens
    assert not set(got["held"]) & set(state["fds"]), (got, state)
    assert state["fds"][:3] == [0, 1, 2] and len(state["fds"]) <= 5, state
    assert state["sigterm"] and state["sigint"] and state["wakeup"] == -1
    assert state["path0"] == state["cwd"] == str(tmp_path)  # as `python -m` has it
    # the supervisor's atexit function ran once, in the supervisor
    assert (tmp_path / "state.jsonl.atexit").read_text().split() == [str(got["pid"])]
