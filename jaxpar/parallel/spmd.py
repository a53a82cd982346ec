"""Plain SPMD: XLA partitions the whole step from the shardings (jit + sharding constraints).

Gradient accumulation over train.microbatches is a scan inside the step; with data > 1 each
microbatch's gradients are all-reduced (the data-manual strategy reduces once per step instead).
"""

from __future__ import annotations

from jaxpar.parallel.base import Strategy


class SPMD(Strategy):
    """The base strategy as is: automatic partitioning, the optimizer update after it."""

    name = "spmd"
