"""Training-loop hooks: what runs before and after each compiled step, in the order registered.

    hooks = Hooks()
    hooks.add("heartbeat", beat, when=BEFORE)                   # before every step
    hooks.add("evaluation", evaluate, every=100)                # after every 100th step
    hooks.add("checkpoint", save, due=lambda step: ckpt.due(step))
    ...
    hooks.run(BEFORE, ctx)  # the loop (jaxpar/worker/training.py), around the compiled step

`StepContext.step` counts completed steps, as metrics.jsonl does: before the step with 0-based
index i it is i, after it i + 1; `every` and `due` are asked about that number. A before hook
may replace `ctx.state` (a fault that perturbs the parameters): the loop steps on what the
before hooks leave there. Hooks of one phase run in the order they were added, which is the
order of their side effects (events, heartbeats, saves), so training.py's `_hooks` is the one
place that order is decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BEFORE = "before_step"  # the loop has decided to run the step (stop checks done)
AFTER = "after_step"  # the step ran and its loss is finite
PHASES = (BEFORE, AFTER)


@dataclass
class StepContext:
    """What a hook sees: the session, the training state, completed steps, the metrics line."""

    session: Any  # jaxpar.worker.training.Session
    state: dict
    step: int
    line: dict | None = None  # the step's metrics line (after the step)


@dataclass(frozen=True)
class Hook:
    name: str
    fn: Callable[[StepContext], None]
    when: str = AFTER
    every: int = 1  # run when step % every == 0 (every <= 0: never), unless `due` is given
    due: Callable[[int], bool] | None = None

    def is_due(self, step: int) -> bool:
        if self.due is not None:
            return bool(self.due(step))
        return self.every > 0 and step % self.every == 0


class Hooks:
    """An ordered list of hooks; `run(phase, ctx)` calls those of a phase that are due."""

    def __init__(self) -> None:
        self.hooks: list[Hook] = []

    def add(
        self,
        name: str,
        fn: Callable[[StepContext], None],
        *,
        when: str = AFTER,
        every: int = 1,
        due: Callable[[int], bool] | None = None,
    ) -> Hook:
        if when not in PHASES:
            raise ValueError(f"hook {name!r}: when={when!r}; use one of {PHASES}")
        if due is not None and every != 1:
            raise ValueError(f"hook {name!r}: give `every` or `due`, not both")
        if name in self.names():
            raise ValueError(f"hook {name!r} is registered already")
        hook = Hook(name, fn, when, every, due)
        self.hooks.append(hook)
        return hook

    def names(self, when: str | None = None) -> list[str]:
        return [h.name for h in self.hooks if when is None or h.when == when]

    def run(self, when: str, ctx: StepContext) -> None:
        for hook in self.hooks:
            if hook.when == when and hook.is_due(ctx.step):
                hook.fn(ctx)
