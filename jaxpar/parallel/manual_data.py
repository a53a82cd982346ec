"""Manual data axis: accumulate microbatches on each replica's rows, reduce gradients once.

A plain scan over microbatches all-reduces the gradients of every microbatch over `data`. Inside
a shard_map manual over `data` each replica accumulates its own, and one mean over `data` follows
the loop. fsdp, tensor and pipeline stay automatic inside it.
"""

from __future__ import annotations

import jax

from jaxpar.mesh import DATA
from jaxpar.parallel.base import (
    REP,
    ROWS,
    Context,
    Strategy,
    model_state,
    over_data,
    replica_gradients,
    with_model_state,
)


class ManualData(Strategy):
    name = "manual_data"

    def __init__(self, ctx: Context):
        super().__init__(ctx)

        def local(params, mstate, batch, key):
            loss, aux, grads, mstate = replica_gradients(ctx, params, mstate, batch, key)
            return (*jax.lax.pmean((loss, aux, grads), DATA), mstate)

        self._grads = over_data(ctx, local, (REP, REP, ROWS, REP), REP)

    def gradients(self, params, batch, key, extra):
        loss, aux, grads, mstate = self._grads(params, model_state(extra), batch, key)
        return loss, aux, grads, with_model_state(extra, mstate)
