"""Manual data axis: accumulate microbatches on each replica's rows, reduce gradients once.

A plain scan over microbatches all-reduces the gradients of every microbatch over `data`. Inside
a shard_map manual over `data` each replica accumulates its own, and one mean over `data` follows
the loop. fsdp, tensor and pipeline stay automatic inside it.
"""

from __future__ import annotations

import jax

from jaxpar.mesh import DATA
from jaxpar.parallel.base import REP, ROWS, Context, Strategy, over_data, replica_gradients


class ManualData(Strategy):
    name = "manual_data"

    def __init__(self, ctx: Context):
        super().__init__(ctx)

        def local(params, batch, key):
            return jax.lax.pmean(replica_gradients(ctx, params, batch, key), DATA)

        self._grads = over_data(ctx, local, (REP, ROWS, REP), REP)

    def gradients(self, params, batch, key, extra):
        loss, aux, grads = self._grads(params, batch, key)
        return loss, aux, grads, extra
