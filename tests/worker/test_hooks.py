"""The training loop's hooks (jaxpar/worker/hooks.py): phases, order, `every` and `due`."""

import pytest

from jaxpar.worker.hooks import AFTER, BEFORE, Hooks, StepContext


def test_hooks_run_in_order_when_due_and_may_replace_the_state():
    calls: list[tuple[str, int]] = []
    hooks = Hooks()

    def swap(c):
        c.state = {"swapped": c.step}

    hooks.add("a", lambda c: calls.append(("a", c.step)), when=BEFORE)
    hooks.add("swap", swap, when=BEFORE)
    hooks.add("every2", lambda c: calls.append(("every2", c.step)), every=2)
    hooks.add("odd", lambda c: calls.append(("odd", c.step)), due=lambda n: n % 2 == 1)
    hooks.add("always", lambda c: calls.append(("always", c.step)))
    hooks.add("never", lambda c: calls.append(("never", c.step)), every=0)
    assert hooks.names(BEFORE) == ["a", "swap"]
    assert hooks.names(AFTER) == ["every2", "odd", "always", "never"]
    for step in range(3):
        ctx = StepContext(None, {}, step)
        hooks.run(BEFORE, ctx)
        assert ctx.state == {"swapped": step}
        hooks.run(AFTER, StepContext(None, ctx.state, step + 1, {"loss": 0.0}))
    assert calls == [
        ("a", 0), ("odd", 1), ("always", 1),
        ("a", 1), ("every2", 2), ("always", 2),
        ("a", 2), ("odd", 3), ("always", 3),
    ]  # fmt: skip


def test_bad_registrations_are_refused():
    hooks = Hooks()
    hooks.add("x", lambda c: None)
    for kwargs, match in (
        ({"name": "x"}, "registered already"),
        ({"name": "y", "when": "during"}, "when="),
        ({"name": "z", "every": 3, "due": lambda n: True}, "not both"),
    ):
        name = kwargs.pop("name")
        with pytest.raises(ValueError, match=match):
            hooks.add(name, lambda c: None, **kwargs)
