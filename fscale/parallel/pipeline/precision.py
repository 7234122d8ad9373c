"""How a step's mixed-precision policy and loss scale reach the stages of a pipeline.

A `fscale.mixed_precision` layer anywhere around the pipeline is the plan's one policy; the
pipeline cannot take it as a loss-function wrapper (the loss it differentiates is the
schedule, not a forward), so it applies the policy where the stages run:

- each stage's parameters: cast to ``param_dtype`` once per step, differentiably, from the
  runner's aliases of the master weights, so every micro-batch's weight gradient is cast back
  to the master dtype before it is added to the step's sum (accumulation in the master dtype,
  never in ``param_dtype``), and the plan inside (``per_stage=data_parallel`` ...) reduces
  master-dtype gradients;
- the micro-batches' floating-point leaves, inputs and targets: cast to ``param_dtype`` before
  the split, so stage 0 computes in it and each stage's output, what the wire carries to the
  next stage, is in it; the first step's contract check probes the stages with the same casts
  and so agrees on the wire's dtype;
- the buffers: seen in ``buffer_dtype`` (if set), new ones stored back in the state's dtypes;
- the loss of each micro-batch: cast to ``output_dtype`` (if set) before it is weighted.

A `fscale.loss_scale` layer around the pipeline puts its scale into the context's loss weight;
the plan inside the pipeline would only apply it to the step's finished gradient, after the
low-precision backward that the scale protects. So under a loss scale the pipeline takes the
whole loss weight into each micro-batch's loss before its backward and hands the plan inside a
weight of 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fscale.plan import Context, Plan
from fscale.precision.casts import cast_floating, restore_buffers
from fscale.precision.policy import Policy

__all__ = ["StagePolicy", "stage_policy"]

PyTree = Any


class StagePolicy(NamedTuple):
    """The casts and the loss weight of a pipeline step (see the module docstring).

    Attributes:
        policy: the plan's mixed-precision policy, or None.
        loss_weight: the factor each micro-batch's loss is multiplied by for its backward.
    """

    policy: Policy | None
    loss_weight: float

    def param_cast(self) -> Callable[[PyTree], PyTree] | None:
        """What the runner applies to each stage's parameters (None: nothing)."""
        policy = self.policy
        if policy is None or not policy.casts_params:
            return None
        return lambda params: cast_floating(params, policy.param_dtype)

    def cast_params(self, params: PyTree) -> PyTree:
        """`params` as the stages see them (for the contract check, without gradients)."""
        cast = self.param_cast()
        return params if cast is None else cast(params)

    def cast_batch(self, values: PyTree) -> PyTree:
        return values if self.policy is None else cast_floating(values, self.policy.param_dtype)

    def cast_buffers(self, buffers: PyTree) -> PyTree:
        if self.policy is None or self.policy.buffer_dtype is None:
            return buffers
        return cast_floating(buffers, self.policy.buffer_dtype)

    def restore_buffers(self, state_buffers: PyTree, seen: PyTree, returned: PyTree) -> PyTree:
        """The stages' returned buffers in the state's dtypes (unchanged ones as they were)."""
        if seen is state_buffers:
            return returned
        return tuple(
            restore_buffers(state, cast, new)
            for state, cast, new in zip(state_buffers, seen, returned)
        )

    def loss_fn(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """`loss_fn(outputs, targets)` with its mean cast to ``output_dtype`` (if set)."""
        policy = self.policy
        if policy is None or policy.output_dtype is None:
            return loss_fn
        dtype = policy.output_dtype

        def loss_in_output_dtype(outputs: Any, targets: Any) -> Any:
            out = loss_fn(outputs, targets)
            if isinstance(out, tuple) and len(out) == 2:  # (mean, count)
                return (out[0].to(dtype), out[1])
            return out.to(dtype) if isinstance(out, torch.Tensor) else out

        return loss_in_output_dtype


def stage_policy(plan: Plan, ctx: Context, caller: str = "pipeline") -> StagePolicy:
    """The `StagePolicy` of the whole `plan` (the step's) under `ctx`.

    Which policies a pipeline can honour is checked by the policy's layer
    (`fscale.precision.plan.check_plan`).
    """
    names = [layer.name for layer in plan.layers()]
    pipe = names.index("pipeline")
    policy = plan.precision()
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            f"{caller}: the plan's mixed-precision policy is a {type(policy).__name__}, not a "
            "fscale.precision.Policy; build it with fscale.mixed_precision"
        )
    # A loss scale inside the pipeline (`per_stage`) scales the finished gradient alone.
    weight = ctx.loss_weight if "loss_scale" in names[:pipe] else 1.0
    return StagePolicy(policy, weight)
