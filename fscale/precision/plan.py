"""The `mixed_precision` layer: the policy's casts around the loss, and the plans it can honour.

`MixedPrecisionPlan` is a layer like the others; wherever it sits in the plan, it is the plan's
one policy (`fscale.Plan.precision`), read by the layers that gather parameters or reduce
gradients. Its own work is small: it checks at init that the state's parameters are the
master weights, and in the gradient phase it hands the layers inside it a loss function under
the policy's casts (`fscale.precision.casts`). The update needs nothing: the optimizer runs on
the state's parameters, which are the master weights, so its state is in the master dtype too.

Under a pipeline, whose loss function is the schedule, the pipeline layer applies the casts
where each stage runs (`fscale.parallel.pipeline.precision`); this layer only checks.

Plans it refuses, naming the argument: a policy inside a pipeline (``per_stage=``: the casts
would wrap the schedule, not the stages) or over fully sharded stages, a second policy, and a
`reduce_dtype` narrower than the master dtype under a layer that reduces the state's
master-dtype gradients as they are (``data_parallel``, ``shard_optimizer``, and any other
layer with data axes but ``fully_shard``, whose reduce-scatter casts its gradient first).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fscale import tree
from fscale.plan import Plan
from fscale.precision.casts import policy_loss_fn
from fscale.precision.policy import Policy, dtype_name

__all__ = ["MixedPrecisionPlan", "check_plan"]

# Layers whose gradient collectives cast to the policy's reduce dtype themselves.
_CASTING_REDUCERS = ("fully_shard",)


def check_plan(plan: Plan, policy: Policy, caller: str) -> None:
    """Raise unless every layer of `plan` can honour `policy` (see the module docstring)."""
    layers = list(plan.layers())
    names = [layer.name for layer in layers]
    if "pipeline" in names:
        _check_pipeline(names, caller)
    policies = [layer for layer in layers if layer.own_precision() is not None]
    if len(policies) > 1:
        raise ValueError(
            f"{caller}: the step already has a mixed-precision policy ({policies[1].describe()}); "
            "one policy governs every gather and reduction of a step. Apply mixed_precision once"
        )
    if policy.reduces_below_master:
        for layer in layers:
            if layer.own_data_axes() and layer.name not in _CASTING_REDUCERS:
                raise ValueError(
                    f"{caller}: `reduce_dtype`={dtype_name(policy.reduce_dtype)} cannot be "
                    f"honoured by {layer.describe()}: it reduces the gradients of the state's "
                    f"leaves, which are {dtype_name(policy.master_dtype)} master gradients. Use "
                    f"reduce_dtype={dtype_name(policy.master_dtype)} (a narrower reduction is "
                    "supported under fully_shard alone)"
                )


def _check_pipeline(names: list[str], caller: str) -> None:
    inside = names[names.index("pipeline") + 1 :]
    if "mixed_precision" in inside:
        raise ValueError(
            f"{caller}: the policy is applied inside the pipeline (`per_stage`), where it would "
            "cast the schedule rather than each stage's parameters; apply it around the "
            "pipeline: mixed_precision(pipeline(...), param_dtype=...)"
        )
    if "fully_shard" in inside:
        raise ValueError(
            f"{caller}: a policy over a pipeline whose stages are fully sharded "
            "(`per_stage`=fully_shard) is not supported; use data_parallel or shard_optimizer "
            "per stage"
        )


def check_master_params(params: Any, policy: Policy, caller: str) -> None:
    """Raise unless every floating-point leaf of `params` is in the master dtype."""
    paths, leaves, _ = tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        floating = isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
        if floating and leaf.dtype != policy.master_dtype:
            raise ValueError(
                f"{caller}: params leaf `{path}` is {dtype_name(leaf.dtype)}, but the state "
                f"keeps master weights in `master_dtype`={dtype_name(policy.master_dtype)}; "
                f"pass {dtype_name(policy.master_dtype)} params (e.g. "
                f"model.to({policy.master_dtype})): the forward sees "
                f"{dtype_name(policy.param_dtype)} casts of them"
            )


@dataclasses.dataclass(frozen=True, repr=False)
class MixedPrecisionPlan(Plan):
    """The plan's mixed-precision policy as a layer; see the module docstring."""

    inner: Plan
    policy: Policy

    @property
    def name(self) -> str:
        return "mixed_precision"

    def describe(self) -> str:
        return f"mixed_precision({self.policy.describe()})"

    def own_precision(self) -> Policy:
        return self.policy

    def init(self, step, params, buffers, key, ctx):
        check_plan(step.plan, self.policy, "mixed_precision")
        check_master_params(params, self.policy, "mixed_precision")
        return self.inner.init(step, params, buffers, key, ctx)

    def gradients(self, step, state, batch, ctx):
        check_plan(step.plan, self.policy, "mixed_precision")
        if step.plan.find("pipeline") is not None:
            # The pipeline casts each stage's parameters and micro-batches itself
            # (`fscale.parallel.pipeline.precision`); its loss function is the schedule.
            return self.inner.gradients(step, state, batch, ctx)
        # Under fully_shard the loss receives gathered units, cast before their all-gather.
        cast_params = step.plan.find("fully_shard") is None
        loss_fn = policy_loss_fn(step.loss_fn, self.policy, cast_params=cast_params)
        return self.inner.gradients(step.replace(loss_fn=loss_fn), state, batch, ctx)
