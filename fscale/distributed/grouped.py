"""`replicate_many`: `replicate` over many tensors, their gradients reduced together.

`replicate` on each of N parameters issues N all-reduces in backward, each one as its gradient
appears, and on gloo each one waits there for the slowest rank to reach the same point of its
backward: with tens of leaves the waits add up to a large part of a step (an expert-parallel
GPT's 42 replicated leaves doubled its step on 2 CPU ranks). `replicate_many` is one autograd
node over all of them: forward, the identity on each; backward, once every gradient is known,
one all-reduce per dtype and device of the gradients concatenated.

The same collective runs on every rank whichever of the tensors each one's loss used (as long
as it used one: a rank whose loss used none runs no backward for the node): a gradient a rank
did not produce travels as zeros, and beside the gradients goes one flag per tensor, whether
this rank produced its gradient. A tensor no rank used gets no gradient (None, as autograd gives
an unused leaf, so a step can skip it); one that some rank used gets the mean (or sum) over all
ranks, the ranks that did not use it counting zero. (With per-tensor `replicate`, a rank that
did not use a tensor would skip its all-reduce while the others wait in theirs.)

The dual is the identity with an all-reduce of the gradient, as for `replicate`; the backward
calls only `fscale.distributed` primitives, so it holds under `torch.func` transforms as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fscale.distributed.comm import axes, check_op, check_tensor, resolve_comm
from fscale.distributed.mesh import Axis, Mesh
from fscale.distributed.replication import all_reduce
from fscale.readback import to_list

__all__ = ["replicate_many"]

Tensor = torch.Tensor


class _ReplicateMany(torch.autograd.Function):
    """Identity forward on every tensor; backward: one all-reduce per dtype and device."""

    @staticmethod
    def forward(axis: str, mesh: Mesh, op: str, *xs: Tensor) -> tuple[Tensor, ...]:
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.axis, ctx.mesh, ctx.op = inputs[0], inputs[1], inputs[2]
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs[3:]]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, (_, dtype, device) in enumerate(ctx.like):
            groups.setdefault((dtype, device), []).append(i)
        out: list[Tensor | None] = [None] * len(grads)
        for (dtype, device), members in groups.items():
            pieces = [
                torch.zeros(ctx.like[i][0], dtype=dtype, device=device).reshape(-1)
                if grads[i] is None
                else grads[i].reshape(-1)  # type: ignore[union-attr]
                for i in members
            ]
            used = torch.tensor(
                [float(grads[i] is not None) for i in members], dtype=dtype, device=device
            )
            reduced = all_reduce(torch.cat([*pieces, used]), ctx.axis, ctx.op, mesh=ctx.mesh)
            sizes = [p.numel() for p in pieces]
            values = reduced[: sum(sizes)].split(sizes)
            # A gradient this rank produced is used somewhere: the flags are read back (a host
            # sync inside backward) only when this rank lacks one of the group's gradients.
            if all(grads[i] is not None for i in members):
                anyone = [True] * len(members)
            else:
                anyone = to_list(reduced[sum(sizes) :] > 0)
            for i, value, used_somewhere in zip(members, values, anyone):
                if used_somewhere:
                    out[i] = value.view(ctx.like[i][0])
        return (None, None, None, *out)


def replicate_many(
    tensors: Sequence[Tensor], axis: Axis, op: str = "sum", *, mesh: Mesh | None = None
) -> list[Tensor]:
    """`replicate` each of `tensors`, their gradients all-reduced in one collective per dtype
    and device (see the module docstring).

    Args:
        tensors: tensors holding the same values on every rank of `axis`.
        axis: mesh axis name, or a tuple of names to reduce over all of them.
        op: the BACKWARD reduction, "sum" or "mean" (as `replicate`).
        mesh: the mesh; None for the current one.

    Returns:
        A view of each tensor, in order.

    Raises:
        ValueError: bad `op`, unknown axis, or no mesh.
        TypeError: an element is not a tensor, or op="mean" on an integer tensor.
    """
    tensors = list(tensors)
    for i, x in enumerate(tensors):
        check_tensor(x, f"tensors[{i}]", "replicate_many")
        check_op(op, x, "replicate_many")
    if not tensors:
        return []
    for name in axes(axis, "replicate_many"):
        comm = resolve_comm(name, mesh, "replicate_many")
        if comm.size > 1:  # the mesh resolved now: backward may run outside a `with mesh:`
            tensors = list(_ReplicateMany.apply(name, comm.mesh, op, *tensors))
    return tensors
