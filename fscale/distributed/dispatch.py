"""`all_to_all`: chunk j of every rank goes to rank j; self-dual with the dims swapped.

The mixture-of-experts dispatch primitive. The exchange is a permutation of rows across the
ranks in the stacked layout (N, *C): row j goes to rank j, row i of the result comes from rank
i. Its inverse sends every row back where it came from, which is the same exchange, so the
backward is `all_to_all` of the gradient with `split_dim` and `concat_dim` swapped.

Where every rank of the axis is on this host (host tensors, a gloo group) the exchange goes
through shared memory (`fscale.distributed.shared_memory`), as the gathers do; elsewhere through
the backend's ``all_to_all_single``. Either way the rows arrive unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed.comm import (
    Comm,
    check_divisible,
    check_tensor,
    normalize_dim,
    resolve_comm,
)
from fscale.distributed.debug import issue
from fscale.distributed.mesh import Mesh
from fscale.distributed.shared_memory import shared_all_to_all, shares_memory
from fscale.distributed.watchdog import wait
from fscale.outside_graph import outside_graph

__all__ = ["all_to_all"]

Tensor = torch.Tensor


class _AllToAll(torch.autograd.Function):
    """Row j of (N, *C) goes to rank j, row i of the result comes from rank i. Self-dual."""

    @staticmethod
    def forward(stacked: Tensor, comm: Comm) -> Tensor:
        ticket = issue(comm, "all_to_all", stacked, stacked.numel())
        received = torch.empty_like(stacked, memory_format=torch.contiguous_format)
        wait(_start_all_to_all(stacked.contiguous(), received, comm), ticket)
        return received

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _AllToAll.apply(grad, ctx.comm), None


# Outside a compiled graph, as the other collectives' starts: the shared-memory transport is
# host code.
@outside_graph
def _start_all_to_all(stacked: Tensor, received: Tensor, comm: Comm) -> Any:
    """Start the exchange of the contiguous `stacked` into `received`; the work to wait for."""
    flat = stacked.view(-1)
    if shares_memory(comm, flat, sums=False):
        return shared_all_to_all(flat, comm, received.view(-1))
    return dist.all_to_all_single(received, stacked, group=comm.group, async_op=True)


def all_to_all(
    x: Tensor,
    axis: str,
    split_dim: int = 0,
    concat_dim: int = 0,
    *,
    mesh: Mesh | None = None,
) -> Tensor:
    """Split `x` into N chunks along `split_dim`, send chunk j to rank j, concatenate the
    chunks received (rank i's at position i) along `concat_dim`.

    Backward: `all_to_all` with the two dims swapped.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank, with
            ``x.shape[split_dim]`` divisible by the axis size.
        axis: mesh axis name.
        split_dim: the dimension split into outgoing chunks.
        concat_dim: the dimension incoming chunks are concatenated along.
        mesh: the mesh; None for the current one.

    Returns:
        A tensor with `split_dim` N times shorter and `concat_dim` N times longer (the same
        shape as `x` when they are the same dimension).

    Raises:
        ValueError: bad dims, indivisible size, unknown axis, or no mesh.
        TypeError: `x` is not a tensor with at least one dimension.
    """
    check_tensor(x, "x", "all_to_all", min_dim=1)
    split_dim = normalize_dim(split_dim, x, "split_dim", "all_to_all")
    concat_dim = normalize_dim(concat_dim, x, "concat_dim", "all_to_all")
    comm = resolve_comm(axis, mesh, "all_to_all")
    check_divisible(x, split_dim, comm, "split_dim", "all_to_all")
    if comm.size == 1:
        return x
    stacked = x.unflatten(split_dim, (comm.size, -1)).movedim(split_dim, 0)
    received = _AllToAll.apply(stacked, comm)
    return received.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)
