"""jaxpar[gloo] for the replica groups' tests: torch (CPU) installed once, by pip, into a folder of
its own that the tests put on their workers' PYTHONPATH — never into jaxpar's environment, whose
default install must stay without torch.

The folder is `$XDG_CACHE_HOME` (else `~/.cache`) `/jaxpar/test-peers/gloo-torch-<TORCH>`; it
holds torch (`site/`, shared) and, per Python environment (`deps-<hash of sys.prefix>/`), what
torch needs that this environment lacks (pip's dry run against it). torch
comes from where `jaxpar bench survivors` takes it (`survivors_peer.torch_requirement`: the
index's torch when it brings no GPU packages, else a CPU wheel from pip's find-links or
`$JAXPAR_BENCH_TORCH`). Tests that need it skip with the reason when it cannot be installed,
unless JAXPAR_REQUIRE_GLOO=1 (CI), where they fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxpar.bench.survivors_peer import PeerUnavailable, torch_requirement
from tests.support.hf_peer import _last_line, _locked, cache_dir

TORCH = "2.13.0"  # constraints.txt's pin of the gloo extra
INSTALL_TIMEOUT_S = 1800
REQUIRE = "JAXPAR_REQUIRE_GLOO"


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"pip {args[0]} took over {INSTALL_TIMEOUT_S} s") from None


def _torch(folder: str) -> str:
    """torch alone (no dependencies) in `folder`/site, installed once for every environment;
    returns the requirement it was installed from."""
    done = os.path.join(folder, "torch.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)["requirement"]
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    req = torch_requirement(folder, python=sys.executable)
    req = f"torch=={TORCH}" if req == "torch" else req
    r = _pip(["install", "--quiet", "--no-deps", "--target", os.path.join(folder, "site"), req])
    if r.returncode != 0:
        raise PeerUnavailable(f"pip cannot install {req}: {_last_line(r.stderr)}")
    with open(done, "w") as f:
        json.dump({"requirement": req}, f)
    return req


def ensure() -> str:
    """The PYTHONPATH entries that make torch importable in this environment (torch's folder,
    shared, and one of what torch needs that this environment lacks, per environment: a virtual
    environment may lack what the system's has), installed on first use; PeerUnavailable when
    they cannot be."""
    folder = os.path.join(cache_dir(), f"gloo-torch-{TORCH}")
    env_key = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    deps = os.path.join(folder, f"deps-{env_key}")
    with _locked(folder + ".lock"):
        req = _torch(folder)
        path = os.pathsep.join([os.path.join(folder, "site"), deps])
        if os.path.exists(os.path.join(deps, "ready.json")):
            return path
        shutil.rmtree(deps, ignore_errors=True)
        os.makedirs(deps)
        report = os.path.join(deps, "report.json")
        r = _pip(["install", "--dry-run", "--quiet", "--report", report, req])
        if r.returncode != 0:
            raise PeerUnavailable(f"pip cannot resolve {req}: {_last_line(r.stderr)}")
        with open(report) as f:
            wanted = json.load(f).get("install", [])
        # torch's own wheel is in the shared folder; setuptools it needs only to build
        # extensions, and a newer one on the workers' path would shadow the environment's
        names = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in wanted
                 if i.get("metadata", {}).get("name", "").lower() not in ("torch", "setuptools")]  # fmt: skip
        if names:
            r = _pip(["install", "--quiet", "--no-deps", "--target", deps, *names])
            if r.returncode != 0:
                raise PeerUnavailable(f"pip cannot install {names}: {_last_line(r.stderr)}")
        code = "import torch.distributed as d, torch; print(torch.__version__)"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": path}, timeout=300)  # fmt: skip
        if r.returncode != 0:
            raise PeerUnavailable(f"torch does not import: {_last_line(r.stderr)}")
        with open(os.path.join(deps, "ready.json"), "w") as f:
            json.dump({"torch": r.stdout.strip(), "deps": names, "prefix": sys.prefix}, f)
        return path


def site() -> str:
    """The PYTHONPATH entries for the workers; the test skips (fails under JAXPAR_REQUIRE_GLOO=1)
    when torch cannot be installed."""
    try:
        return ensure()
    except PeerUnavailable as e:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"jaxpar[gloo] (torch) cannot be installed for the tests: {e}")
        pytest.skip(f"jaxpar[gloo] (torch) cannot be installed for the tests: {e}")


def site_or_none() -> str | None:
    """The folder for the workers' PYTHONPATH, or None where torch cannot be installed (said on
    stderr; a failure under JAXPAR_REQUIRE_GLOO=1): those tests then run the hub path."""
    try:
        return ensure()
    except PeerUnavailable as e:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"jaxpar[gloo] (torch) cannot be installed for the tests: {e}")
        print(f"\n[gloo] the hub path only: {e}", file=sys.stderr)
        return None


def launch_env() -> tuple[dict, bool]:
    """(the environment for `jaxpar launch` whose workers exchange peer to peer, whether they
    do): the tests' clean environment with jaxpar[gloo]'s folder on PYTHONPATH; without it (torch
    cannot be installed here, and JAXPAR_REQUIRE_GLOO is not 1) the hub path's, as before."""
    from tests.support.launch_util import clean_env

    env, folder = clean_env(), site_or_none()
    if folder is not None:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], folder])
    return env, folder is not None
