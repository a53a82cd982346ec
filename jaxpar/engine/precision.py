"""Mixed precision: float32 parameters and optimizer state, forward and backward in bfloat16.

    python -m train --recipe gpt_small --set precision.compute=bfloat16

Where the casts are, and why there is no float16: docs/design.md, "The engine".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.config import PrecisionConfig

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class Policy:
    """The compute dtype of the forward and backward pass (parameters stay float32)."""

    compute: Any = jnp.float32

    @property
    def mixed(self) -> bool:
        return self.compute != jnp.float32

    def cast(self, tree: Any) -> Any:
        """`tree` with its floating leaves in the compute dtype (other leaves unchanged)."""
        if not self.mixed:
            return tree

        def one(x):
            return x.astype(self.compute) if jnp.issubdtype(x.dtype, jnp.floating) else x

        return jax.tree.map(one, tree)


FP32 = Policy()


def policy(cfg: PrecisionConfig) -> Policy:
    """The validated policy of a config; ValueError names the accepted values."""
    if cfg.params != "float32":
        raise ValueError(
            f"precision.params={cfg.params!r}: parameters and optimizer state are kept in "
            f"float32; lower the compute dtype instead (--set precision.compute=bfloat16)"
        )
    if cfg.compute not in COMPUTE_DTYPES:
        raise ValueError(
            f"precision.compute={cfg.compute!r}: use one of {sorted(COMPUTE_DTYPES)} "
            f"(float16 would need loss scaling)"
        )
    return Policy(COMPUTE_DTYPES[cfg.compute])
