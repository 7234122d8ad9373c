"""The tensor-parallel region boundaries that `fscale.distributed` lacks, each beside its dual.

Megatron names four boundaries of a tensor-parallel region. Two are fscale collectives already:
``f`` is `fscale.distributed.replicate` (identity forward, all-reduce of the gradient backward:
a replicated activation enters a region in which every rank holds a part of the computation)
and ``g`` is `fscale.distributed.all_reduce` (sum forward, identity backward: the partial
outputs of a row-parallel layer leave the region replicated). Sequence parallelism uses
`fscale.distributed.all_gather` (the sequence shards of a varying activation are gathered, the
gradient reduce-scattered) and `fscale.distributed.reduce_scatter` (its dual).

The two pairs written here join a *replicated* value to a *sharded* one, where the cotangent
needs no reduction because every rank holds the same one:

==========================  =================================  ===================================
primitive                   forward                            backward
==========================  =================================  ===================================
``gather_replicated``       all-gather the shards along `dim`  keep this rank's slice of the
                            into a value used replicatedly     (identical) gradient: no collective
``split_replicated``        keep this rank's slice of a        all-gather the slices' gradients
                            replicated value along `dim`
==========================  =================================  ===================================

They are JAX's ``all_gather_invariant`` / ``dynamic_slice`` pair. ``gather_replicated`` is the
output of a column-parallel layer whose full result every rank consumes the same way (the logits
of a vocab-parallel output layer fed to a replicated loss); fscale's `all_gather` would instead
sum the N identical cotangents. ``split_replicated`` enters a sequence-parallel region from a
replicated activation.

`all_reduce_max` is the non-differentiable maximum over the ranks, for the max subtraction of a
vocab-parallel softmax (the subtracted constant carries no gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed import all_gather
from fscale.distributed.comm import Comm, check_divisible, normalize_dim, resolve_comm
from fscale.distributed.debug import issue
from fscale.distributed.mesh import Mesh
from fscale.distributed.watchdog import wait

__all__ = ["all_reduce_max", "gather_replicated", "split_replicated"]

Tensor = torch.Tensor


class _GatherReplicated(torch.autograd.Function):
    """All-gather along `dim` forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(shard: Tensor, comm: Comm, dim: int) -> Tensor:
        return all_gather(shard, comm.axis, dim, mesh=comm.mesh)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.dim = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _SplitReplicated.apply(grad, ctx.comm, ctx.dim), None, None


class _SplitReplicated(torch.autograd.Function):
    """This rank's slice along `dim` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(full: Tensor, comm: Comm, dim: int) -> Tensor:
        size = full.shape[dim] // comm.size
        return full.narrow(dim, comm.index * size, size).clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.dim = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _GatherReplicated.apply(grad, ctx.comm, ctx.dim), None, None


def gather_replicated(x: Tensor, axis: str, dim: int = -1, *, mesh: Mesh | None = None) -> Tensor:
    """Concatenate the ranks' shards along `dim` for a consumer that is the same on every rank.

    Backward keeps this rank's slice of the gradient, which is complete because every rank
    differentiates the same replicated consumer.

    Args:
        x: this rank's shard; the same shape on every rank of `axis`.
        axis: the tensor-parallel mesh axis.
        dim: the dimension to concatenate along.
        mesh: the mesh; None for the current one.

    Raises:
        ValueError: `dim` out of range, unknown axis, or no mesh.
    """
    comm = resolve_comm(axis, mesh, "gather_replicated")
    dim = normalize_dim(dim, x, "dim", "gather_replicated")
    if comm.size == 1:
        return x
    return _GatherReplicated.apply(x, comm, dim)


def split_replicated(x: Tensor, axis: str, dim: int = 1, *, mesh: Mesh | None = None) -> Tensor:
    """This rank's contiguous slice along `dim` of a value that is the same on every rank.

    Backward all-gathers the slices' gradients into the replicated value's gradient.

    Args:
        x: a replicated tensor whose `dim` divides by the axis size.
        axis: the tensor-parallel mesh axis.
        dim: the dimension to slice (the sequence, for sequence parallelism).
        mesh: the mesh; None for the current one.

    Raises:
        ValueError: `dim` out of range or not divisible by the axis size, unknown axis, no mesh.
    """
    comm = resolve_comm(axis, mesh, "split_replicated")
    dim = normalize_dim(dim, x, "dim", "split_replicated")
    check_divisible(x, dim, comm, "dim", "split_replicated")
    if comm.size == 1:
        return x
    return _SplitReplicated.apply(x, comm, dim)


def all_reduce_max(x: Tensor, axis: str, *, mesh: Mesh | None = None) -> Tensor:
    """The elementwise maximum of `x` over the ranks of `axis`, detached (no gradient).

    Args:
        x: this rank's tensor; the same shape and dtype on every rank.
        axis: the mesh axis.
        mesh: the mesh; None for the current one.
    """
    comm = resolve_comm(axis, mesh, "all_reduce_max")
    result = x.detach().clone(memory_format=torch.contiguous_format)
    if comm.size == 1:
        return result
    ticket = issue(comm, "all_reduce", result, result.numel())
    wait(dist.all_reduce(result, op=dist.ReduceOp.MAX, group=comm.group, async_op=True), ticket)
    return result
