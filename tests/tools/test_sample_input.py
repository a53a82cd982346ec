"""`jaxpar.tools.sample` called as a library: bad sampling settings are refused before the run
is loaded (the command line refuses them while parsing: tests/api/test_bad_input_cli.py)."""

from __future__ import annotations

import pytest

from jaxpar.tools import sample as sample_lib


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": float("nan")}, "--temperature nan must be a finite number"),
        ({"temperature": float("inf")}, "--temperature inf must be a finite number"),
        ({"temperature": -1.0}, "--temperature -1.0 must be a finite number"),
        ({"top_k": -1}, "--top-k -1 must be >= 0"),
    ],
)
def test_sampling_settings_are_checked_before_loading(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        sample_lib.sample(str(tmp_path / "no-such-run"), "x", **kw)


def test_a_prompt_that_is_not_utf8_is_refused(tmp_path):
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match="--prompt is not valid UTF-8"):
        sample_lib.sample(str(tmp_path / "no-such-run"), prompt)


class _Cached:
    def init_cache(self, batch):
        raise AssertionError("not reached")

    decode = init_cache


def test_generate_checks_too():
    with pytest.raises(ValueError, match="--top-k -2"):
        sample_lib.generate(_Cached(), [1, 2], 3, top_k=-2)
    with pytest.raises(ValueError, match="--temperature nan"):
        sample_lib.generate(_Cached(), [1, 2], 3, temperature=float("nan"))
