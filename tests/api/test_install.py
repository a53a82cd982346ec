"""jaxpar installed from a built wheel, used from a directory outside the checkout.

The wheel goes into a fresh virtual environment that sees this interpreter's site-packages (jax,
flax, ... are not reinstalled; this interpreter may itself run in a virtual environment); every command runs with that environment's `jaxpar` script and
python, no PYTHONPATH, and a temporary directory as the current directory.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxpar.rundir.runlog import read_jsonl
from tests.support.helpers import REPO, cpu_env

pytestmark = pytest.mark.slow

PACKAGED = (
    "pyproject.toml",
    "setup.py",
    "README.md",
    "jaxpar",
    "models",
    "meshes",
    "train",
    "docs",
)
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv with the jaxpar wheel built from this checkout installed (no dependencies)."""
    base = tmp_path_factory.mktemp("install")
    # Built from a copy of what a source distribution holds: setuptools writes build/ and
    # *.egg-info into the tree it builds, and stale files there would end up in the wheel.
    src = base / "src"
    src.mkdir()
    for name in PACKAGED:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(REPO / name, src / name, **({"ignore": IGNORE} if (REPO / name).is_dir() else {}))
    wheels = base / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
        check=True, timeout=900, capture_output=True, env=_env(),
    )  # fmt: skip
    (wheel,) = wheels.glob("jaxpar-*.whl")
    env_dir = base / "venv"
    # Without a pip of its own (ensurepip installing one costs more than the rest of the
    # fixture): this interpreter's pip installs into it, run by the venv's own python
    # (`pip --python`), as the venv's pip would.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(env_dir)], check=True, timeout=300, env=_env())  # fmt: skip
    # Inside a virtual environment, `--system-site-packages` means the *base* interpreter's
    # packages, which lack jax: the new venv also sees this interpreter's own site-packages (a
    # plain path list in a .pth file: appended after the venv's own, so the wheel wins).
    (site_dir,) = (env_dir / "lib").glob("python3*/site-packages")
    (site_dir / "outer-site-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"),
                    "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
                   check=True, timeout=600, capture_output=True, env=_env())  # fmt: skip
    return env_dir


def _env() -> dict[str, str]:
    env = cpu_env()
    env.pop("PYTHONPATH", None)  # nothing from the checkout
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def test_wheel_holds_one_top_level_package(venv):
    site = next((venv / "lib").glob("python3*/site-packages"))
    (dist,) = site.glob("jaxpar-*.dist-info")
    assert (dist / "top_level.txt").read_text().split() == ["jaxpar"]
    for sub in ("models", "meshes", "train"):
        assert (site / "jaxpar" / sub / "__init__.py").is_file(), sub
        assert not (site / sub).exists(), f"generic top-level package {sub!r} installed"
    assert (site / "jaxpar" / "docs" / "cluster.md").is_file()  # `jaxpar docs` reads them
    examples = sorted(p.name for p in (site / "jaxpar" / "docs" / "examples").glob("*.py"))
    assert examples == sorted(p.name for p in (REPO / "docs" / "examples").glob("*.py"))
    assert not (site / "docs").exists()


def test_installed_cli_from_outside_the_checkout(venv, tmp_path):
    jaxpar = str(venv / "bin" / "jaxpar")
    out = _run([jaxpar, "--version"], tmp_path)
    assert out.stdout.strip() == "jaxpar 0.1.0"
    page = _run([jaxpar, "docs", "cluster"], tmp_path).stdout
    assert page == (REPO / "docs" / "cluster.md").read_text()
    assert "examples/custom_loop.py" in _run([jaxpar, "docs", "examples"], tmp_path).stdout
    script = _run([jaxpar, "docs", "examples/custom_loop.py"], tmp_path).stdout
    assert script == (REPO / "docs" / "examples" / "custom_loop.py").read_text()
    where = _run([str(venv / "bin" / "python"), "-c", "import jaxpar; print(jaxpar.__file__)"],
                 tmp_path)  # fmt: skip
    assert str(venv) in where.stdout and str(REPO) not in where.stdout

    # A user's recipe module in the current directory; and a package there that shadows an
    # installed one (flax) must not be imported ahead of it.
    proj = tmp_path / "my_project"
    proj.mkdir()
    (proj / "__init__.py").write_text("")
    (proj / "recipes.py").write_text(
        textwrap.dedent("""
        import dataclasses
        from jaxpar.train.recipes import digits_mlp

        def small():
            cfg = digits_mlp()
            return dataclasses.replace(cfg, name="small", data=dataclasses.replace(
                cfg.data, global_batch=16))
    """)
    )
    (tmp_path / "flax").mkdir()
    (tmp_path / "flax" / "__init__.py").write_text("raise ImportError('cwd shadowed flax')\n")

    run_dir = tmp_path / "run"
    out = _run([jaxpar, "train", "--recipe", "my_project.recipes:small", "--mesh", "fsdp8",
                "--steps", "2", "--run-dir", str(run_dir), "--no-progress"], tmp_path)  # fmt: skip
    assert "final loss" in out.stdout
    lines = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if "loss" in m]
    assert [m["step"] for m in lines] == [1, 2]
    config = (run_dir / "config.json").read_text()
    assert '"jaxpar.models.mlp:MLPConfig"' in config and '"data=1,fsdp=8' in config

    # Built-in recipes and presets by name, through inspect (no compile).
    out = _run([jaxpar, "inspect", "--recipe", "digits_cnn", "--mesh", "dp2_tp4", "--no-audit"],
               tmp_path)  # fmt: skip
    assert "# digits_cnn on mesh" in out.stdout and "'tensor': 4" in out.stdout

    assert os.listdir(tmp_path / "flax") == ["__init__.py"]  # never imported (no __pycache__)

    # python -m jaxpar.train: the same entrypoint (python -m puts the current directory first
    # itself, so this runs elsewhere); bad input is a one-line usage error.
    other = tmp_path / "other"
    other.mkdir()
    bad = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "jaxpar.train", "--recipe", "nope"],
        cwd=other,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2, bad.stderr
    assert "unknown recipe 'nope'" in bad.stderr and "gpt_tiny" in bad.stderr
    assert not (other / "runs").exists()
