"""`mixed_precision(step, ...)`: one dtype policy for every gather, reduction and update of a step.

The step computes its forward and backward in ``param_dtype`` on casts of ``master_dtype``
master weights, reduces its gradients in ``reduce_dtype``, and updates the master weights
(and the optimizer state, which follows their dtype) in ``master_dtype``:

=====================  ===========================================================
where                  dtype
=====================  ===========================================================
state.params           ``master_dtype`` (full, or sharded as the plan shards them)
optimizer state        ``master_dtype`` (Adam: two moments, 8 bytes per fp32 param)
forward / backward     ``param_dtype``: a working copy, cast at the start of the forward
                       and freed once the backward has used it (never in the state); the
                       batch's floating-point leaves are cast to it as well
fully_shard gathers    ``param_dtype``: each shard is cast *before* its all-gather
gradient reductions    ``reduce_dtype`` (fully_shard casts each unit's gradient to it before
                       the reduce-scatter; other reducers receive master-dtype gradients)
accumulation           in the state's layout, in ``master_dtype`` (``fscale.accumulate``)
=====================  ===========================================================

So bf16 params, fp32 master weights and Adam hold 4Ψ + 8Ψ bytes of state (divided by N where
the plan shards them) plus the 2Ψ-byte bf16 working copy during the step (under
``fully_shard``: this rank's 2Ψ/N cast shard and the gathered units the policy keeps), and a
``fully_shard`` forward gathers 2Ψ(N−1)/N bytes per rank. ``print(step)`` lists each
collective's dtype; `fscale.distributed.comm_ledger` records it per collective.

A `fscale.parallel.tensor_parallel` model (a model transformation, not a plan layer) computes on
the casts like any model, so its activation collectives carry ``param_dtype``. Over
`fscale.pipeline` each stage's forward sees casts of its master weights and the micro-batches'
floating-point leaves are cast, so the activations sent between stages are in ``param_dtype``;
each micro-batch's weight gradient is cast back to ``master_dtype`` before it joins the step's
sum, which ``per_stage`` reducers (data_parallel, shard_optimizer) then reduce. A policy inside
the pipeline (``per_stage=``) or over fully sharded stages is refused.

float16 needs dynamic loss scaling (its range ends at 65504, and small gradients flush to
zero): without a ``loss_scale`` layer in the step, float16 is warned about at construction.
Apply `fscale.loss_scale` first (the warning looks for a layer named ``loss_scale`` inside):
``mixed_precision(loss_scale(step), param_dtype=torch.float16, output_dtype=torch.float32)``;
the float32 output keeps the scaled loss itself from overflowing float16.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fscale.parallel import layers
from fscale.precision.plan import MixedPrecisionPlan, check_plan
from fscale.precision.policy import make_policy
from fscale.train import Step

__all__ = ["mixed_precision"]


def mixed_precision(
    step: Step,
    param_dtype: Any = torch.bfloat16,
    reduce_dtype: Any = torch.float32,
    master_dtype: Any = torch.float32,
    buffer_dtype: Any = None,
    output_dtype: Any = None,
) -> Step:
    """`step` under a mixed-precision policy (see the module docstring).

    Args:
        step: any Step (local, data_parallel, shard_optimizer, fully_shard, accumulate, a
            plan of your own); the layers may be added before or after this one.
        param_dtype: the compute dtype: torch.bfloat16, torch.float16 (with a loss scale) or
            torch.float32 (no cast).
        reduce_dtype: the gradient reduction dtype, between `param_dtype` and `master_dtype`
            (narrower than `master_dtype` only under fully_shard).
        master_dtype: the dtype of the state's parameters and optimizer state (float32 or
            float64); `Step.init` takes params in it.
        buffer_dtype: the dtype the loss function sees floating-point buffers in (None: theirs).
        output_dtype: the dtype the loss is cast to before backward (None: as computed).

    Returns:
        A Step whose plan has a ``mixed_precision`` layer.

    Raises:
        TypeError / ValueError: a dtype that is not supported or a combination the plan cannot
            honour, naming the argument (see `fscale.precision.make_policy`, `check_plan`).

    Example:
        >>> import torch, fscale as fs
        >>> def loss_fn(p, buffers, batch, key):
        ...     return (p["w"] * batch).sum() ** 2
        >>> step = fs.mixed_precision(fs.train_step(loss_fn, fs.optim.sgd(0.1)))
        >>> state = step.init({"w": torch.ones(3)})
        >>> state, metrics = step(state, torch.ones(3))
        >>> metrics["loss"].dtype, state.params["w"].dtype, state.params["w"][0].item()
        (torch.bfloat16, torch.float32, 0.3999999761581421)
    """
    layers.check_step(step, "mixed_precision")
    policy = make_policy(param_dtype, reduce_dtype, master_dtype, buffer_dtype, output_dtype)
    plan = MixedPrecisionPlan(step.plan, policy)
    check_plan(plan, policy, "mixed_precision")
    if policy.param_dtype == torch.float16 and step.plan.find("loss_scale") is None:
        warnings.warn(
            "mixed_precision: param_dtype=torch.float16 without a loss scale: gradients below "
            "float16's range flush to zero and large ones overflow. Wrap the step in "
            "fs.loss_scale first: fs.mixed_precision(fs.loss_scale(step), "
            "param_dtype=torch.float16), or use param_dtype=torch.bfloat16",
            UserWarning,
            stacklevel=2,
        )
    return step.replace(plan=plan)
