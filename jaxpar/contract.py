"""The model contract: what jaxpar needs from a model config, its model, a loss and an optimizer.

Typed protocols, checked with `isinstance` instead of probing attributes: a model config's
`build(rngs) -> nnx.Module` is the one requirement, everything else an optional protocol of its
own. Explained with examples: docs/model_contract.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import jax
    from flax import nnx


@runtime_checkable
class ModelConfig(Protocol):
    """Required: builds the model (its parameters annotated with logical axis names)."""

    def build(self, rngs: nnx.Rngs) -> nnx.Module: ...


@runtime_checkable
class FlopsPerToken(Protocol):
    def flops_per_token(self) -> float: ...


@runtime_checkable
class FlopsPerExample(Protocol):
    def flops_per_example(self) -> float: ...


@runtime_checkable
class CountsParams(Protocol):
    def num_params(self) -> int: ...


@runtime_checkable
class HashExclusions(Protocol):
    NOT_HASHED: ClassVar[tuple[str, ...]]


@runtime_checkable
class PipelineModel(Protocol):
    """A built model that can be split into pipeline stages."""

    def pipeline_parts(self) -> tuple[Callable, nnx.Module, Callable]: ...


LossFn = Callable[["nnx.Module", dict, "nnx.Rngs"], tuple["jax.Array", dict]]


def check_model_config(model_cfg: Any) -> None:
    """ValueError naming the fix when `model_cfg` does not provide `build(rngs)`."""
    if not isinstance(model_cfg, ModelConfig):
        raise ValueError(
            f"TrainConfig.model is a {type(model_cfg).__name__}, which has no build(rngs) method; "
            f"give a model config (e.g. a frozen dataclass) with build(rngs) -> nnx.Module "
            f"(jaxpar docs model_contract)"
        )


def not_hashed(model_cfg: Any) -> tuple[str, ...]:
    """Model config fields left out of the config hash."""
    return tuple(model_cfg.NOT_HASHED) if isinstance(model_cfg, HashExclusions) else ()


def flops_per_step(model_cfg: Any, kind: str, global_batch: int, seq_len: int) -> float | None:
    """Model FLOPs of one optimizer step, where the model config says (else None)."""
    if kind == "lm" and isinstance(model_cfg, FlopsPerToken):
        return model_cfg.flops_per_token() * global_batch * seq_len
    if isinstance(model_cfg, FlopsPerExample):
        return model_cfg.flops_per_example() * global_batch
    return None


def num_params(model_cfg: Any) -> int | None:
    return model_cfg.num_params() if isinstance(model_cfg, CountsParams) else None


def unsharded_warning(param_logical: Any) -> str | None:
    """A warning when no parameter of the model names its dimensions (nothing can be sharded).

    `param_logical`: pytree of parameter path -> logical names (None where the model gave none).
    """
    import jax  # noqa: PLC0415 - this module stays importable without jax

    names = jax.tree.leaves(param_logical, is_leaf=lambda x: x is None or isinstance(x, tuple))
    if any(n is not None and any(a is not None for a in n) for n in names):
        return None
    return (
        "warning: no parameter of the model names its dimensions, so nothing is sharded: every "
        "device holds the whole model and optimizer state (data parallelism only). Annotate "
        "parameters with nnx.with_partitioning(init, names) (jaxpar docs model_contract)"
    )
