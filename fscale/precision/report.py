"""Which dtype each collective of a plan runs in under a mixed-precision policy (for `print`).

The layers of the built-in plans place these collectives on parameters and gradients:

- ``fully_shard``: all-gathers of the parameter shards, cast to ``param_dtype`` before the
  gather; reduce-scatters of the gradients, cast to ``reduce_dtype`` before the scatter.
- ``data_parallel`` (and HSDP's replica axis): all-reduces of the gradients of the state's
  leaves, which arrive in the master dtype (the policy allows nothing narrower there).
- ``shard_optimizer``: reduce-scatters of those gradients and all-gathers of the updated master
  parameters.
- any other layer with data axes reduces what it is given: the master dtype's gradients.
- ``pipeline``: sends of the activations between stages, and of their gradients back, in
  ``param_dtype`` (each stage computes in it); its stages' gradient reductions are the layers
  inside it (``per_stage=``).

Metrics and buffers are averaged by the `fscale.Step` in their own dtypes, as without a policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fscale.precision.policy import Policy

__all__ = ["collective_dtypes"]


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def collective_dtypes(plan: Any, policy: Policy) -> list[str]:
    """One entry per layer with data axes, outermost first, e.g.
    ``fully_shard[dp]: all_gather params bfloat16, reduce_scatter grads float32``."""
    param, reduce, master = (
        _name(d) for d in (policy.param_dtype, policy.reduce_dtype, policy.master_dtype)
    )
    entries = []
    for layer in plan.layers():
        axes = ",".join(layer.own_data_axes())
        if layer.name == "pipeline":
            axis = getattr(layer, "axis", "?")
            entries.append(f"pipeline[{axis}]: send activations and their gradients {param}")
            continue
        if not axes:
            continue
        if layer.name == "fully_shard":
            what = f"all_gather params {param}, reduce_scatter grads {reduce}"
        elif layer.name == "shard_optimizer":
            what = f"reduce_scatter grads {reduce}, all_gather params {master}"
        elif layer.name == "data_parallel":
            what = f"all_reduce grads {reduce}"
        else:
            what = f"grads {master}"
        entries.append(f"{layer.name}[{axes}]: {what}")
    return entries
