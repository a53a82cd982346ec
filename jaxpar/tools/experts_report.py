"""The experts of a mixture-of-experts run in `jaxpar report`: their load over time and whether
they collapsed (one expert chosen by most tokens). No jax.

Reads `moe_expert_load` (each expert's share of the routed assignments, summing to 1) from the
metrics lines, `moe_dropped_frac` and `moe_aux_loss` beside it, and `model.top_k` from
config.json: an expert's share of the *tokens* is its share of the assignments x top_k. The text
states every expert's load as a share of the tokens (the plot stacks shares of the assignments,
which add up to 1); the dropped share is of the assignments and says so. The run
directory is untrusted: a line whose loads are not a list of finite numbers of the run's expert
count is skipped.
"""

from __future__ import annotations

import math

import numpy as np

LOAD = "moe_expert_load"
# Collapse: one expert chosen by more than this share of the tokens (an even load is top_k / E)
# and taking at least twice its even share of the assignments (so that four experts with top-2,
# evenly loaded at 50% of the tokens each, are not called collapsed).
COLLAPSE = 0.5


def loads(per_step: dict[int, dict]) -> dict[int, list[float]]:
    """step -> the expert loads of the lines that carry well-formed ones, in step order."""
    out: dict[int, list[float]] = {}
    n = None
    for step in sorted(per_step):
        v = per_step[step].get(LOAD)
        if not (isinstance(v, list) and v and all(_number(x) for x in v)):
            continue
        n = len(v) if n is None else n
        if len(v) == n:
            out[step] = [float(x) for x in v]
    return out


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def top_k(config: dict) -> int:
    """The run's experts per token (config.json's model.top_k; 1 when absent or malformed)."""
    model = config.get("model") if isinstance(config, dict) else None
    k = model.get("top_k") if isinstance(model, dict) else None
    return k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else 1


def collapsed_steps(by_step: dict[int, list[float]], k: int) -> dict[int, tuple[int, float]]:
    """step -> (expert, its share of the tokens) at the steps where one expert took more than
    COLLAPSE of the tokens."""
    out = {}
    for step, load in by_step.items():
        e = int(np.argmax(load))
        share = min(1.0, load[e] * k)
        if share > COLLAPSE and load[e] >= 2.0 / len(load):
            out[step] = (e, share)
    return out


def section(per_step: dict[int, dict], config: dict) -> list[str]:
    """The report's "Experts" section (markdown lines); [] for a run without expert loads."""
    by_step = loads(per_step)
    if not by_step:
        return []
    k = top_k(config)
    n = len(next(iter(by_step.values())))
    last = max(by_step)
    final = by_step[last]
    out = ["## Experts", ""]
    # every share below is of the tokens: an expert's share of the assignments x top_k (a token
    # is assigned to k experts, so the shares of the tokens add up to k, not 1)
    out.append(
        f"{n} experts, top-{k} routing: each token is sent to {k} expert(s), so an even load has "
        f"each expert chosen by {min(1.0, k / n):.1%} of the tokens. At step {last} the busiest "
        f"expert was chosen by {min(1.0, max(final) * k):.1%} of the tokens and the idlest by "
        f"{min(1.0, min(final) * k):.1%}."
    )
    dropped = [v.get("moe_dropped_frac") for v in per_step.values()]
    dropped = [d for d in dropped if _number(d)]
    if dropped:
        out.append(
            f"Token-to-expert assignments dropped over capacity: {float(np.median(dropped)):.2%} "
            f"of the assignments (median over the logged steps)."
        )
    bad = collapsed_steps(by_step, k)
    out.append("")
    if bad:
        first = min(bad)
        e, share = bad[first]
        still = last in bad
        out.append(
            f"**The experts collapsed**: from step {first} expert {e} was chosen by "
            f"{share:.0%} of the tokens (more than {COLLAPSE:.0%}), at {len(bad)} of "
            f"{len(by_step)} logged steps"
            + (
                f"; still at step {last} (expert {bad[last][0]}, {bad[last][1]:.0%})."
                if still
                else f"; balanced again by step {last}."
            )  # fmt: skip
        )
        out.append(
            "Raise model.moe_aux_weight (load balancing) or lower the learning rate; "
            "model.capacity_factor bounds what a collapsed expert can take."
        )
    else:
        peak = max(by_step, key=lambda s: max(by_step[s]))
        out.append(
            f"No collapse: no expert took most of the tokens (the busiest: "
            f"{min(1.0, max(by_step[peak]) * k):.0%} of them at step {peak})."
        )
    return out


def plot(per_step: dict[int, dict], path: str, figure) -> bool:
    """Expert load over the steps as stacked shares; False (nothing drawn) without loads."""
    by_step = loads(per_step)
    if not by_step:
        return False
    steps = list(by_step)
    shares = np.array([by_step[s] for s in steps]).T  # [E, steps]
    fig, ax = figure((9, 3.6))
    ax.stackplot(steps, shares, labels=[f"expert {e}" for e in range(len(shares))])
    ax.axhline(1.0 / len(shares), color="k", lw=0.6, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("share of assignments")
    ax.set_ylim(0, 1)
    ax.set_title("Expert load (stacked; dotted: an even share)")
    if len(shares) <= 16:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.savefig(path, dpi=110)
    return True
