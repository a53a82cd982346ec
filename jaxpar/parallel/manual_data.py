"""Manual data axis: accumulate microbatches on each replica's rows, reduce gradients once.

A plain scan over microbatches all-reduces the gradients of every microbatch over `data`. Inside
a shard_map manual over `data` each replica accumulates its own, and one mean over `data` follows
the loop. fsdp, tensor and pipeline stay automatic inside it.
"""

from __future__ import annotations

from jaxpar.parallel.base import OverData


class ManualData(OverData):
    """The manual data axis: OverData's default reduction, one mean over `data`."""

    name = "manual_data"
