"""The supervisor's choice of restart path (standby group / spares / cold) in policy terms, and
the standby worker's protocol (ready line, then "go" or release) without jax."""

from __future__ import annotations

import os
import subprocess
import sys

from jaxpar.supervisor.policy import restart_path
from jaxpar.worker import standby

WANT = {"incarnation": 3, "attempt": 2, "nproc": 2, "process_ids": [0, 1], "layout": None,
        "faults": [], "collective_timeout": 600.0}  # fmt: skip


def decide(standby=WANT, ready=True, enabled=True, nnodes=1, spares=True):
    sb = None if standby is None else dict(standby, coordinator="127.0.0.1:1", standby=True)
    return restart_path(enabled=enabled, nnodes=nnodes, standby=sb, ready=ready, want=WANT,
                        spares=spares)  # fmt: skip


def test_ready_standby_built_for_this_group_is_used():
    assert decide() == ("standby", "")


def test_standby_not_ready_falls_back_to_spares_or_cold():
    assert decide(ready=False) == ("spares", "standby not ready")
    assert decide(ready=False, spares=False) == ("cold", "standby not ready")
    assert decide(standby=None) == ("spares", "no standby group")


def test_shrink_changes_the_layout_so_the_standby_is_not_used():
    shrunk = dict(WANT, nproc=1, process_ids=[0], layout={"mesh": "data=2", "microbatches": 2})
    assert decide(standby=shrunk) == ("spares", "layout changed")
    assert decide(standby=dict(WANT, layout={"mesh": "data=2", "microbatches": 2}),
                  spares=False) == ("cold", "layout changed")  # fmt: skip


def test_standby_of_another_incarnation_is_not_used():
    assert decide(standby=dict(WANT, attempt=1)) == ("spares", "built for another incarnation")
    assert decide(standby=dict(WANT, incarnation=4)) == ("spares", "built for another incarnation")


def test_multi_node_and_off():
    assert decide(nnodes=2) == ("spares", "multi-node job")
    assert decide(enabled=False) == ("spares", "")  # off: no reason to report
    assert decide(enabled=False, spares=False) == ("cold", "")


STANDBY_CHILD = """
import os, sys
from jaxpar.worker import standby
standby.wait_for_go()
print("went", standby.start_path(), standby.pending(), os.environ.get("JAXPAR_STANDBY"), flush=True)
"""


# a worker with its own loop: its first RunDir is where it waits
# A user's own loop on the library API: its first run-directory writer (here the checkpoint
# manager's) is where a standby waits; `RunDir` itself never waits.
OWN_LOOP_CHILD = """
import sys
import jaxpar
manager = jaxpar.CheckpointManager(sys.argv[1], use_async=False)
manager.run.event("start")
print("wrote", flush=True)
manager.close()
"""


def _child(tmp_path, env_extra, code=STANDBY_CHILD, args=()):
    """A standby child: (its Popen, the ready pipe's read end, the go pipe's write end), both
    named pipes in a directory of their own, as the supervisor makes them."""
    chan = tmp_path.parent / f"{tmp_path.name}-channel"
    chan.mkdir()
    os.mkfifo(chan / "ready")
    os.mkfifo(chan / "go")
    r = os.open(chan / "ready", os.O_RDWR)
    g = os.open(chan / "go", os.O_RDWR)
    env = {**os.environ, "JAXPAR_STANDBY": "1", "JAXPAR_STANDBY_READY": str(chan / "ready"),
           "JAXPAR_STANDBY_GO": str(chan / "go"), **env_extra}  # fmt: skip
    env.pop("JAXPAR_RUN_DIR", None)
    p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE)  # fmt: skip
    return p, r, g


def test_standby_reports_ready_then_goes_on_in_the_log(tmp_path):
    p, r, g = _child(tmp_path, {})
    try:
        assert os.read(r, 64) == b"ready\n"
        log = tmp_path / "worker.log"
        os.write(g, f'{{"log": "{log}"}}\n'.encode())
        assert p.wait(timeout=120) == 0
        assert log.read_text() == "went standby False None\n"  # its output moved to the worker log
        assert p.stdout.read() == b""
    finally:
        os.close(r)
        os.close(g)
        p.kill()
        p.wait()


def test_released_standby_exits_0_writing_nothing(tmp_path):
    p, r, g = _child(tmp_path, {})
    try:
        assert os.read(r, 64) == b"ready\n"
        os.close(g)  # end of input: released
        g = None
        assert p.wait(timeout=120) == 0
        assert p.stdout.read() == b""
        assert list(tmp_path.iterdir()) == []
    finally:
        os.close(r)
        if g is not None:
            os.close(g)
        p.kill()
        p.wait()


def test_compile_cache_read_only_writes_nothing_until_configured_again(tmp_path):
    """A standby loads compiled programs but stores none before "go"; then its miss is stored."""
    import jax
    import jax.numpy as jnp

    from jaxpar.recovery import compile_cache

    folder = tmp_path / "compiled"
    lowered = jax.jit(lambda x: jnp.sin(x) * 3.0).lower(jnp.ones((4,), jnp.float32))
    try:
        compile_cache.configure(str(folder), readonly=True)
        _, hit = compile_cache.compile(lowered, "standby_probe")
        assert not hit and not folder.exists()  # nothing written, not even the folder
        compile_cache.configure(str(folder))
        assert [p.name.startswith("standby_probe-") for p in folder.iterdir()] == [True]
        _, hit = compile_cache.compile(lowered, "standby_probe")
        assert hit  # what the read-only process compiled serves the next one
    finally:
        compile_cache.configure(None)


def test_own_loop_waits_at_its_first_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    p, r, g = _child(tmp_path, {}, OWN_LOOP_CHILD, [str(run_dir)])
    try:
        assert os.read(r, 64) == b"ready\n"
        assert not run_dir.exists()  # waiting: nothing written
        log = tmp_path / "w.log"
        os.write(g, f'{{"log": "{log}"}}\n'.encode())
        assert p.wait(timeout=120) == 0
        # (orbax's signalling thread may log an error at interpreter exit after it: not ours)
        assert log.read_text().startswith("wrote\n")
        assert "start" in (run_dir / "events.jsonl").read_text()
    finally:
        os.close(r)
        os.close(g)
        p.kill()
        p.wait()


def test_start_role_is_what_the_supervisor_set():
    """Read once from the spawn environment; a spare is told by the supervisor's hand-over."""
    assert standby.StartRole.from_environment({}) == standby.StartRole("cold")
    assert standby.StartRole.from_environment({"JAXPAR_START_PATH": "spare"}).path == "spare"
    role = standby.StartRole.from_environment(
        {"JAXPAR_STANDBY": "1", "JAXPAR_STANDBY_READY": "/r", "JAXPAR_STANDBY_GO": "/g"}
    )
    assert (role.path, role.waiting, role.ready_path, role.go_path) == ("standby", True, "/r", "/g")
    role.waiting = False
    role.wait_for_go()  # gone already: returns at once, reads nothing
