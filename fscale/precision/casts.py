"""The casts a mixed-precision step makes around the user's loss function.

`policy_loss_fn` wraps ``loss_fn(params, buffers, batch, key)`` so that it sees the
parameters in ``param_dtype`` (unless a `fully_shard` layer already gathers them in it), the
batch's floating-point leaves in ``param_dtype`` too (as torch FSDP2's
``cast_forward_inputs``; integer leaves such as token ids stay as they are), and the buffers in
``buffer_dtype``, and returns its loss in ``output_dtype``. The casts are
differentiable: the backward of the parameter cast turns each ``param_dtype`` gradient into
the master dtype at the state's leaf, where the plan's reducers find it. The cast copy is a
working buffer: it lives from the forward until the backward has used it, and the state keeps
only the master weights.

New buffers the loss returns are cast back to the dtypes the state holds them in; a buffer the
loss returns unchanged is handed back as the state's own tensor, so the step does not count it
as updated (and does not average it across ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fscale import tree
from fscale.grad import normalize_loss_output
from fscale.precision.policy import Policy

__all__ = ["cast_floating", "policy_loss_fn", "restore_buffers"]

PyTree = Any


def cast_floating(values: PyTree, dtype: torch.dtype) -> PyTree:
    """`values` with every floating-point leaf cast to `dtype` (other leaves as they are)."""

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype:
            return leaf.to(dtype)
        return leaf

    return tree.map(cast, values)


def restore_buffers(state_buffers: PyTree, seen: PyTree, returned: PyTree) -> PyTree:
    """The loss's new buffers in the state's dtypes; unchanged ones as the state's tensors."""
    state_leaves, state_def = tree.flatten(state_buffers)
    seen_leaves = tree.leaves(seen)
    returned_leaves, returned_def = tree.flatten(returned)
    if returned_def != state_def:
        return returned
    restored = [
        original
        if new is cast
        else new.to(original.dtype)
        if isinstance(new, torch.Tensor) and isinstance(original, torch.Tensor)
        else new
        for original, cast, new in zip(state_leaves, seen_leaves, returned_leaves)
    ]
    return tree.unflatten(state_def, restored)


def policy_loss_fn(
    loss_fn: Callable[..., Any], policy: Policy, *, cast_params: bool
) -> Callable[..., Any]:
    """`loss_fn` under `policy`'s casts (see the module docstring).

    `cast_params`: whether to cast the parameters here (False when the plan's gathers do).
    """

    def loss_under_policy(params: PyTree, buffers: PyTree, batch: Any, key: Any) -> Any:
        if cast_params:
            params = cast_floating(params, policy.param_dtype)
        batch = cast_floating(batch, policy.param_dtype)
        seen = buffers
        if policy.buffer_dtype is not None:
            seen = cast_floating(buffers, policy.buffer_dtype)
        out = normalize_loss_output(loss_fn(params, seen, batch, key), seen)
        new_buffers = out.buffers
        if seen is not buffers:
            new_buffers = restore_buffers(buffers, seen, out.buffers)
        loss = out.loss if policy.output_dtype is None else out.loss.to(policy.output_dtype)
        return loss, new_buffers, out.metrics

    loss_under_policy.__name__ = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    return loss_under_policy
