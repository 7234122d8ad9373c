"""`broadcast` from a source rank, and its dual: a sum-reduction onto that rank.

``broadcast(x, axis, src)`` gives every rank of the axis the value rank `src` holds. Its
adjoint is a reduce: the cotangents of all ranks are summed onto `src`, and every other rank's
`x` gets a zero gradient (its value never reached an output). The adjoint of that reduce is a
broadcast of the cotangent from `src` again, so second derivatives stay exact.

Like ``replicate(op="sum")``, the backward computes the gradient of the SUM of the per-rank
losses: each rank differentiating its own loss of the broadcast value gives `src` the sum of
their gradients. A loss that is itself replicated (the same on every rank, counted once)
should be differentiated on one rank only, or divided by N.

Both directions are single c10d calls (``broadcast``, ``reduce``) on a copy of the input, so
the input is never modified. The ledger records them as "broadcast" and "reduce"; with the debug
check on, the ranks also compare `src`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed.comm import Comm, check_index, check_tensor, resolve_comm
from fscale.distributed.debug import issue
from fscale.distributed.mesh import Mesh
from fscale.distributed.watchdog import wait

__all__ = ["broadcast"]

Tensor = torch.Tensor


class _Broadcast(torch.autograd.Function):
    """Rank `src`'s `x` on every rank; backward: reduce(sum) of the gradient onto `src`."""

    @staticmethod
    def forward(x: Tensor, comm: Comm, src: int) -> Tensor:
        ticket = issue(comm, "broadcast", x, x.numel(), extra=src)
        buffer = x.clone(memory_format=torch.contiguous_format)
        wait(dist.broadcast(buffer, group=comm.group, group_src=src, async_op=True), ticket)
        return buffer

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.src = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _Reduce.apply(grad, ctx.comm, ctx.src), None, None


class _Reduce(torch.autograd.Function):
    """The sum of `x` over the ranks on rank `dst`, zeros elsewhere; backward: broadcast."""

    @staticmethod
    def forward(x: Tensor, comm: Comm, dst: int) -> Tensor:
        ticket = issue(comm, "reduce", x, x.numel(), extra=dst)
        buffer = x.clone(memory_format=torch.contiguous_format)
        work = dist.reduce(
            buffer, group=comm.group, group_dst=dst, op=dist.ReduceOp.SUM, async_op=True
        )
        wait(work, ticket)
        # Off `dst`, c10d leaves partial sums in the buffer; the reduce's value there is zero.
        return buffer if comm.index == dst else torch.zeros_like(buffer)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.dst = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _Broadcast.apply(grad, ctx.comm, ctx.dst), None, None


def broadcast(x: Tensor, axis: str, src: int = 0, *, mesh: Mesh | None = None) -> Tensor:
    """Rank `src`'s `x` on every rank of `axis`; backward: the gradients summed onto `src`.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank (only `src`'s values
            are used).
        axis: mesh axis name.
        src: the source's index along `axis`.
        mesh: the mesh; None for the current one.

    Returns:
        A new tensor holding `src`'s value; `x` is unchanged.

    Raises:
        ValueError: `src` out of range, unknown axis, or no mesh.
        TypeError: `x` is not a tensor, or `src` is not an int.
    """
    check_tensor(x, "x", "broadcast")
    comm = resolve_comm(axis, mesh, "broadcast")
    check_index(src, "src", comm, "broadcast")
    if comm.size == 1:
        return x
    return _Broadcast.apply(x, comm, src)
