"""The Hugging Face peer of tests/hf: torch and transformers in a virtual environment of their own
(never jaxpar's), and the reference files its script writes.

The environment is created once, by pip, in `$XDG_CACHE_HOME` (else `~/.cache`)
`/jaxpar/test-peers/hf-<TRANSFORMERS>`; torch comes from where `jaxpar bench survivors` takes it
(`survivors_peer.torch_requirement`: the index's torch when it brings no GPU packages, else a CPU
wheel from pip's find-links or `$JAXPAR_BENCH_TORCH`). `$JAXPAR_HF_PEER` names an existing
environment (its folder) to use as it is.

`references()` runs tests/support/hf_peer_script.py in it once and keeps what it wrote (tiny
models saved with `save_pretrained`, their logits, greedy generations and training losses) in the
same cache, keyed by the script's hash and the versions: a later session reads them back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from jaxpar.bench.survivors_peer import PeerUnavailable, torch_requirement

TRANSFORMERS = "5.25.0"  # the release whose save_pretrained layout and config keys are tested
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_peer_script.py")
INSTALL_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 600

__all__ = ["PeerUnavailable", "ensure", "references", "run_script"]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpar", "test-peers")


def _python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("WARNING")]
    return lines[-1].strip() if lines else "no output"


@contextlib.contextmanager
def _locked(path: str):
    """One creator at a time (test sessions may run side by side)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _versions(venv: str) -> dict:
    code = (
        "import json, torch, transformers; "
        "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__}))"
    )
    r = subprocess.run([_python(venv), "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise PeerUnavailable(f"torch/transformers do not import: {_last_line(r.stderr)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ensure() -> tuple[str, dict]:
    """(the peer environment's folder, {"torch", "transformers": versions}), created on first
    use; PeerUnavailable when it cannot be."""
    given = os.environ.get("JAXPAR_HF_PEER")
    if given:
        return given, _versions(given)
    venv = os.path.join(cache_dir(), f"hf-{TRANSFORMERS}")
    ready = os.path.join(venv, "ready.json")
    with _locked(venv + ".lock"):
        if os.path.exists(ready):
            with contextlib.suppress(OSError, ValueError):
                with open(ready) as f:
                    return venv, json.load(f)
        shutil.rmtree(venv, ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
        if r.returncode != 0:
            raise PeerUnavailable(f"cannot create a virtual environment: {_last_line(r.stderr)}")
        torch = torch_requirement(venv)
        cmd = [_python(venv), "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
               torch, f"transformers=={TRANSFORMERS}"]  # fmt: skip
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"pip install took over {INSTALL_TIMEOUT_S} s") from None
        if r.returncode != 0:
            raise PeerUnavailable(
                f"pip cannot install torch + transformers: {_last_line(r.stderr)}"
            )
        info = _versions(venv)
        with open(ready, "w") as f:
            json.dump(info, f)
        return venv, info


def run_script(venv: str, script: str, *args: str, timeout: float = RUN_TIMEOUT_S) -> str:
    """Run a Python script in the peer environment (one thread pool of 2, no jaxpar, no XLA
    settings); returns its stdout, raises RuntimeError with its stderr's tail on failure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXPAR_", "XLA_"))}
    env.update({"OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "0",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})  # fmt: skip
    env.pop("PYTHONPATH", None)
    r = subprocess.run([_python(venv), script, *args], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=os.path.dirname(script))  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"{os.path.basename(script)} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def references() -> str:
    """The folder of hf_peer_script.py's output (see its docstring), made once per script
    version and peer versions."""
    venv, info = ensure()
    with open(SCRIPT, "rb") as f:
        key = hashlib.sha256(f.read() + json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    out = os.path.join(cache_dir(), f"hf-{TRANSFORMERS}-refs", key)
    with _locked(out + ".lock"):
        if os.path.exists(os.path.join(out, "manifest.json")):
            return out
        tmp = f"{out}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.time()
        run_script(venv, SCRIPT, tmp)
        shutil.rmtree(out, ignore_errors=True)  # a folder left without its manifest
        os.replace(tmp, out)
        print(f"\n[hf peer] reference models written in {time.time() - t0:.1f}s", file=sys.stderr)
        return out
