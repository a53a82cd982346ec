"""A hot spare (jaxpar/worker/spare.py) for a `python SCRIPT.py` command: what it runs, and that
it runs the script as `python SCRIPT.py` would (argv, sys.path, __main__), with jax preloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxpar.worker import spare
from tests.support.helpers import REPO

SCRIPT = """
import json, os, sys
jax_preloaded = "jax" in sys.modules and "jaxpar.api" in sys.modules
import helper_module  # found next to the script, as `python SCRIPT.py` finds it
out = {"argv": sys.argv, "path0": sys.path[0], "name": __name__, "preloaded": jax_preloaded,
       "helper": helper_module.VALUE, "env": os.environ.get("MY_WORKER_VAR")}
print(json.dumps(out))
"""


def test_spare_targets(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("")
    me = sys.executable
    assert spare.target_of([me, "-m", "train", "--steps", "3"]) == "module:train"
    assert spare.target_of([me, str(script), "--steps", "3"]) == f"script:{script}"
    assert spare.script_of([me, str(script)]) == str(script)
    assert spare.target_of([me, "-u", str(script)]) is None  # interpreter options: cold start
    assert spare.target_of([me, str(tmp_path / "absent.py")]) is None
    assert spare.target_of(["/nonexistent/python", str(script)]) is None
    assert spare.target_of([me]) is None


def test_a_spare_runs_a_script_as_python_would(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    script = folder / "loop.py"
    script.write_text(SCRIPT)
    (folder / "helper_module.py").write_text("VALUE = 7\n")
    log = tmp_path / "worker.log"
    argv = [sys.executable, str(script), "--steps", "3"]
    env = {**os.environ, "PYTHONPATH": str(REPO), spare.ENV_TARGET: spare.target_of(argv)}
    env.pop("JAXPAR_SUPERVISOR_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxpar.worker.spare"], env=env, cwd=tmp_path,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip().endswith("ready")
        worker_env = {**env, "MY_WORKER_VAR": "handed over"}
        msg = {"env": worker_env, "argv": argv, "log": str(log)}
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.close()
        assert proc.wait(timeout=300) == 0, log.read_text()
    finally:
        proc.kill()
        proc.wait()
    got = json.loads(log.read_text().strip().splitlines()[-1])
    assert got["argv"] == [str(script), "--steps", "3"]
    assert got["path0"] == str(folder)  # the script's folder, not the spare's working directory
    assert got["name"] == "__main__" and got["helper"] == 7
    assert got["preloaded"] and got["env"] == "handed over"
