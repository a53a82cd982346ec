"""The `jaxpar` package's public surface: lazy imports, every exported name resolves."""

import subprocess
import sys

import jaxpar


def test_import_jaxpar_and_supervisor_do_not_import_jax():
    code = (
        "import sys, jaxpar, jaxpar.supervisor; "
        "print(jaxpar.__version__); assert 'jax' not in sys.modules, 'jax imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == jaxpar.__version__


def test_every_exported_name_resolves():
    for name in jaxpar.__all__:
        assert getattr(jaxpar, name) is not None, name
    assert sorted(dir(jaxpar)) == sorted(jaxpar.__all__)


def test_unknown_attribute_is_an_attribute_error():
    try:
        jaxpar.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("expected AttributeError")
