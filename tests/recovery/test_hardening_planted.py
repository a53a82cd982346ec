"""Planted executables: RUN_DIR/compiled/ entries are authenticated before anything is
deserialised; the console script never runs code from the current directory first."""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.recovery import compile_cache


class _Plant:
    """Unpickling this creates a marker file: code the attacker chose runs."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """compile_cache configured on RUN_DIR/compiled with a key file of the test's own."""
    monkeypatch.setenv(compile_cache.ENV_KEY_FILE, str(tmp_path / "home" / "key"))
    directory = tmp_path / "run" / "compiled"
    compile_cache.configure(str(directory))
    yield directory
    compile_cache.configure(None)


def _arg():
    """An input sharded over every device, like the trainer's (the cache serves those)."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    return jax.device_put(jnp.zeros((8,), jnp.float32), NamedSharding(mesh, PartitionSpec("data")))


def _compile():
    fn = jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.25)  # a program no other test compiles
    return compile_cache.compile(fn.lower(_arg()), "hardening")


def _entry(directory) -> str:
    (name,) = [n for n in os.listdir(directory) if n.startswith("hardening-")]
    return os.path.join(directory, name)


def test_key_is_private_and_a_genuine_entry_loads(cache, tmp_path):
    _, hit = _compile()
    assert not hit
    key = tmp_path / "home" / "key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    compiled, hit = _compile()
    assert hit and float(np.asarray(compiled(_arg()))[0]) == 0.25


def test_planted_pickle_is_never_deserialised(cache, tmp_path):
    _compile()
    path = _entry(cache)
    marker = tmp_path / "owned"
    with open(path, "wb") as f:  # a planted file, with and without the format's magic
        f.write(pickle.dumps(_Plant(str(marker))))
    _, hit = _compile()
    with open(path, "wb") as f:
        f.write(compile_cache.MAGIC + b"\0" * 32 + pickle.dumps(_Plant(str(marker))))
    _, hit2 = _compile()
    assert not hit and not hit2 and not marker.exists()
    assert _compile()[1]  # rewritten by this user: loads again


def test_copied_run_dir_recompiles_instead_of_loading(cache, tmp_path, monkeypatch):
    _compile()
    other = tmp_path / "copied" / "compiled"
    shutil.copytree(cache, other)
    monkeypatch.setenv(compile_cache.ENV_KEY_FILE, str(tmp_path / "other-user" / "key"))
    compile_cache.configure(str(other))
    _, hit = _compile()
    assert not hit  # another user's key: not trusted, compiled again and rewritten
    assert _compile()[1]


def test_entries_writable_by_others_are_not_loaded(cache):
    _compile()
    path = _entry(cache)
    os.chmod(path, 0o666)
    assert not _compile()[1]
    os.chmod(cache, 0o777)
    try:
        assert not _compile()[1] and not _compile()[1]
    finally:
        os.chmod(cache, 0o755)
    assert _compile()[1]


def test_console_script_does_not_run_a_package_from_the_cwd(tmp_path):
    cwd = tmp_path / "cwd"
    (cwd / "matplotlib").mkdir(parents=True)
    marker = tmp_path / "executed"
    (cwd / "matplotlib" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit(99)\n"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 5.0, "step_time_s": 0.5, "time": 2.0, "incarnation": 0}\n'
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo)
    # `python -c` puts the current directory first on sys.path, as the bug did
    code = "import sys; from jaxpar.cli import main; sys.exit(main())"
    proc = subprocess.run(
        [sys.executable, "-c", code, "report", str(run_dir)], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
    assert (run_dir / "report" / "report.md").exists()
