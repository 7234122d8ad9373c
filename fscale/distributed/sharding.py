"""`all_gather` and `reduce_scatter`, each the other's dual, with their asynchronous starts.

``all_gather`` concatenates the ranks' shards (ZeRO-3 parameters, sequence parallelism) and
reduce-scatters the gradient; ``reduce_scatter`` sums over the ranks and keeps this rank's
slice (ZeRO-2/3 gradients) and all-gathers the gradient, with op="sum" so that a second
derivative sums again. For all-gather `op` is the BACKWARD reduction; a mean divides after the
reduce-scatter, on the 1/N-sized shard, which is exact for power-of-two N.

The Functions work on a "stacked" layout: all-gather maps a shard of shape S to (N, *S), row i
from rank i, and reduce-scatter maps (N, *S) to S. The public functions move `dim` to and from
the front with ordinary (differentiable) reshapes, which are views for dim=0. Over a tuple of
axes they run one axis at a time, the first axis outermost (the order of `Mesh.rank` over the
tuple).

Where every rank of the axis is on this host (host tensors, a gloo group) both go through
shared memory (`fscale.distributed.shared_memory`, as the gradient buckets do): fully_shard's
gathers and gradient reduce-scatters at a fraction of gloo's time. Elsewhere on gloo, host
tensors of 1 MiB or more are exchanged between every pair of ranks
(`fscale.distributed.exchange`): gloo's own all-gather and reduce-scatter take about twice as
long for the same bytes. Either way the reduce-scatter sums in the order of gloo's ring, so its
bits are gloo's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fscale.distributed.comm import (
    REDUCTIONS,
    Comm,
    all_gather_flat,
    axes,
    check_divisible,
    check_op,
    check_tensor,
    normalize_dim,
    reduce_scatter_flat,
    resolve_comm,
)
from fscale.distributed.debug import issue
from fscale.distributed.exchange import (
    exchange_all_gather,
    exchange_reduce_scatter,
    exchanges,
    exchanges_reduce_scatter,
)
from fscale.distributed.mesh import Axis, Mesh
from fscale.distributed.pending import Pending, Work
from fscale.distributed.shared_memory import shared_all_gather, shared_reduce_scatter, shares_memory
from fscale.outside_graph import outside_graph

__all__ = ["all_gather", "all_gather_start", "reduce_scatter", "reduce_scatter_start"]

Tensor = torch.Tensor


class _AllGatherStart(torch.autograd.Function):
    """Start gathering shards into (N, *S); backward: reduce-scatter (sum or mean)."""

    @staticmethod
    def forward(shard: Tensor, comm: Comm, op: str, work: Work) -> Tensor:
        numel = shard.numel() * comm.size
        work.ticket = issue(comm, "all_gather", shard, numel, REDUCTIONS.index(op))
        gathered = shard.new_empty((comm.size, *shard.shape))
        _start_gather(gathered, shard, comm, work)
        return gathered

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.op, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _reduce_scatter_start(grad, ctx.comm, ctx.op).wait(), None, None, None


class _ReduceScatterStart(torch.autograd.Function):
    """Start summing (N, *S) over ranks, keeping row `index`; backward: all-gather."""

    @staticmethod
    def forward(stacked: Tensor, comm: Comm, op: str, work: Work) -> Tensor:
        # `op` is only checked here: a mean is divided out after the wait, on the shard.
        work.ticket = issue(comm, "reduce_scatter", stacked, stacked.numel(), REDUCTIONS.index(op))
        return _start_reduce_scatter(stacked, comm, work)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_gather_start(grad, ctx.comm, "sum").wait(), None, None, None


# The transfers start outside a compiled graph, in one call each: gloo's calls with
# async_op=True are refused by Dynamo, and the shared-memory transport is host code (its
# group's first call is itself a collective).
@outside_graph
def _start_gather(gathered: Tensor, shard: Tensor, comm: Comm, work: Work) -> None:
    """Start filling the stacked `gathered` (N, *S) with every rank's `shard`."""
    flat = gathered.view(-1)
    shared = shares_memory(comm, gathered, sums=False)
    if not shared and not exchanges(comm, gathered):
        work.work = all_gather_flat(flat, shard.reshape(-1), group=comm.group, async_op=True)
        return
    gathered[comm.index].copy_(shard)  # both gather around this rank's own row, in place
    if shared:
        work.work = shared_all_gather(flat, comm)
    else:
        work.work = exchange_all_gather(flat, comm, work.ticket)


@outside_graph
def _start_reduce_scatter(stacked: Tensor, comm: Comm, work: Work) -> Tensor:
    """Start summing the stacked (N, *S) over the ranks; the tensor this rank's S lands in.

    Every transport reads `stacked` (copies it into the windows, or sends and adds it) and
    never writes it.
    """
    if shares_memory(comm, stacked, sums=True):
        # The output itself, not a view of a 1-D buffer: the worker writes into it after this
        # Function returns, and autograd refuses a Function's output view whose base changed.
        # A gradient may be an expanded one (the backward of a sum): the windows copy from a
        # contiguous buffer.
        flat = stacked.reshape(-1).contiguous()
        shard = stacked.new_empty(stacked.shape[1:])
        work.work, _ = shared_reduce_scatter(flat, comm, 0, out=shard)
        return shard
    if exchanges_reduce_scatter(comm, stacked):
        work.work, total = exchange_reduce_scatter(stacked.reshape(-1), comm, work.ticket, 0)
        return total.view(stacked.shape[1:])
    shard = stacked.new_empty(stacked.shape[1:])
    work.work = reduce_scatter_flat(
        shard.view(-1), stacked.reshape(-1), group=comm.group, async_op=True
    )
    return shard


def _all_gather_start(shard: Tensor, comm: Comm, op: str) -> Pending:
    """Gather to the stacked layout (N, *S)."""
    if comm.size == 1:
        return Pending.ready(shard.unsqueeze(0))
    work = Work()
    return Pending(_AllGatherStart.apply(shard, comm, op, work), work)


def _reduce_scatter_start(stacked: Tensor, comm: Comm, op: str) -> Pending:
    """Reduce the stacked layout (N, *S) to this rank's S."""
    if comm.size == 1:
        return Pending.ready(stacked.squeeze(0))
    work = Work()
    shard = _ReduceScatterStart.apply(stacked, comm, op, work)
    if op == "mean":
        return Pending(shard, work, _divide_by(comm.size))
    return Pending(shard, work)


def _divide_by(divisor: int) -> Callable[[Tensor], Tensor]:
    return lambda x: x / divisor


def all_gather_start(
    x: Tensor, axis: str, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Pending:
    """Start `all_gather` and return at once; ``.wait()`` gives the gathered tensor.

    For prefetching: start the next unit's gather, compute the current one, then wait. The
    backward of the pair is `reduce_scatter(g, dim, op)`. Arguments as `all_gather`, for a
    single axis.
    """
    check_tensor(x, "x", "all_gather_start", min_dim=1)
    check_op(op, x, "all_gather_start")
    dim = normalize_dim(dim, x, "dim", "all_gather_start")
    pending = _all_gather_start(x, resolve_comm(axis, mesh, "all_gather_start"), op)
    return pending.then(lambda stacked: stacked.movedim(0, dim).flatten(dim, dim + 1))


def reduce_scatter_start(
    x: Tensor, axis: str, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Pending:
    """Start `reduce_scatter` and return at once; ``.wait()`` gives this rank's shard.

    Usable on plain tensors inside another Function's backward (ZeRO-2: reduce-scatter a
    gradient bucket as soon as it is complete, wait before the optimizer step). Arguments as
    `reduce_scatter`, for a single axis.
    """
    check_tensor(x, "x", "reduce_scatter_start", min_dim=1)
    check_op(op, x, "reduce_scatter_start")
    dim = normalize_dim(dim, x, "dim", "reduce_scatter_start")
    comm = resolve_comm(axis, mesh, "reduce_scatter_start")
    check_divisible(x, dim, comm, "dim", "reduce_scatter_start")
    stacked = x.unflatten(dim, (comm.size, -1)).movedim(dim, 0)
    return _reduce_scatter_start(stacked, comm, op)


def all_gather(
    x: Tensor, axis: Axis, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Tensor:
    """Concatenate the ranks' shards along `dim`; backward: `reduce_scatter(g, dim, op)`.

    Each rank holds a shard, every rank gets the whole, rank i's shard at position i.

    Args:
        x: this rank's shard; the same shape and dtype on every rank.
        axis: mesh axis name, or a tuple of names (concatenated row-major, first outermost,
            i.e. in the order of `Mesh.rank` over the tuple).
        dim: the dimension to concatenate along.
        op: the BACKWARD reduction of the gradient: "sum" or "mean" (see `replicate`).
        mesh: the mesh; None for the current one.

    Returns:
        A tensor whose `dim` is N times longer.

    Raises:
        ValueError: bad `op` or `dim`, unknown axis, or no mesh.
        TypeError: `x` is not a tensor with at least one dimension, or op="mean" on an
            integer tensor.
    """
    check_tensor(x, "x", "all_gather", min_dim=1)
    check_op(op, x, "all_gather")
    dim = normalize_dim(dim, x, "dim", "all_gather")
    # Gathering the innermost axis first makes the outermost one vary slowest.
    for name in reversed(axes(axis, "all_gather")):
        stacked = _all_gather_start(x, resolve_comm(name, mesh, "all_gather"), op).wait()
        x = stacked.movedim(0, dim).flatten(dim, dim + 1)
    return x


def reduce_scatter(
    x: Tensor, axis: Axis, dim: int = 0, op: str = "sum", *, mesh: Mesh | None = None
) -> Tensor:
    """Reduce `x` over the ranks of `axis` and keep this rank's slice of `dim`.

    Rank i gets slice i of N equal slices; backward: `all_gather(g, dim)` (times 1/N for
    mean).

    Args:
        x: this rank's full-size tensor; the same shape and dtype on every rank, with
            ``x.shape[dim]`` divisible by the axis size.
        axis: mesh axis name, or a tuple of names (sliced row-major, first outermost).
        dim: the dimension to slice.
        op: "sum" or "mean".
        mesh: the mesh; None for the current one.

    Returns:
        This rank's slice of the reduction: `dim` is N times shorter.

    Raises:
        ValueError: bad `op` or `dim`, indivisible size, unknown axis, or no mesh.
        TypeError: `x` is not a tensor with at least one dimension, or op="mean" on an
            integer tensor.
    """
    check_tensor(x, "x", "reduce_scatter", min_dim=1)
    check_op(op, x, "reduce_scatter")
    dim = normalize_dim(dim, x, "dim", "reduce_scatter")
    for name in axes(axis, "reduce_scatter"):
        comm = resolve_comm(name, mesh, "reduce_scatter")
        check_divisible(x, dim, comm, "dim", "reduce_scatter")
        stacked = x.unflatten(dim, (comm.size, -1)).movedim(dim, 0)
        x = _reduce_scatter_start(stacked, comm, op).wait()
    return x
