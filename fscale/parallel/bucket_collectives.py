"""Collectives on the flat buffers of gradient and parameter buckets, in the buffers themselves.

The differentiable collectives of `fscale.distributed` never write into their inputs (a value
autograd or a torch.func transform tracks must not change), so each one allocates its result
beside its input. The buckets of `fscale.parallel.reduce` and of `shard_optimizer`'s update
are different: the engine allocated them, nothing else views them while they are reduced, and
no transform tracks them (they are filled inside gradient hooks or under ``no_grad``). So these
collectives work in place, with the same arithmetic and the same record in the comm ledger
(`fscale.distributed.debug.issue`: the algorithm's op and element count, the cross-rank checks):

- `all_reduce_bucket_start`: the mean over an axis, divided and summed in the bucket (as torch
  DDP reduces its buckets): no copy of the bucket per reduction in flight.
- `reduce_scatter_bucket_start`: this rank's shard of the mean. On gloo it is an all-reduce (sum)
  in the bucket followed by slicing the shard out and dividing it: gloo's own reduce-scatter
  reduces the whole input in the same order (bit for bit, tested) but first copies it and keeps
  another half of it, 1.5 buckets of transient memory per reduction in flight (measured), and
  puts as many bytes on the wire as the all-reduce. Other backends run their reduce-scatter.
- `all_gather_bucket_start`: every rank's shard of a bucket gathered into the bucket, whose own
  shard this rank has already written: no gathered copy beside the bucket.

Each returns a `BucketPending`: the collective in flight, waited for without an autograd node
(the differentiable `Pending` runs two `autograd.Function` applications per collective, each
binding its arguments to a signature, a fixed cost per bucket and step). They must not be given
tensors a torch.func transform tracks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from fscale.distributed import collectives
from fscale.distributed.comm import REDUCTIONS, Comm, all_gather_flat, resolve_comm
from fscale.distributed.debug import issue
from fscale.distributed.mesh import Mesh
from fscale.distributed.pending import Pending, Work

__all__ = [
    "BucketPending",
    "all_gather_bucket_start",
    "all_reduce_bucket_start",
    "reduce_scatter_bucket_start",
]

_MEAN = REDUCTIONS.index("mean")
_SUM = REDUCTIONS.index("sum")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class BucketPending:
    """A bucket collective in flight; `wait()` blocks until it is done and returns the result.

    Waiting is idempotent, and bounded as every fscale collective is (the watchdog's ticket).
    """

    __slots__ = ("_buffer", "_finish", "_result", "_work")

    def __init__(
        self,
        buffer: torch.Tensor,
        work: Work | None,
        finish: Callable[[torch.Tensor], torch.Tensor] = _identity,
    ) -> None:
        self._buffer: torch.Tensor | None = buffer
        self._work = work
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            assert self._buffer is not None  # set until the first wait
            self._result = self._finish(self._buffer)
            self._buffer = self._work = None
        return self._result

    def then(self, after: Callable[[torch.Tensor], torch.Tensor]) -> BucketPending:
        """A pending whose `wait()` returns ``after(self.wait())``; `self` is consumed."""
        finish = self._finish
        if self._result is not None:
            return BucketPending(after(self._result), None)
        assert self._buffer is not None
        return BucketPending(self._buffer, self._work, lambda x: after(finish(x)))

    def __repr__(self) -> str:
        return f"BucketPending({'done' if self._result is not None else 'in flight'})"


def _comm(flat: torch.Tensor, axis: str, mesh: Mesh, caller: str) -> Comm:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"{caller}: `flat` must be a contiguous 1-D bucket buffer, got "
            + (f"shape {tuple(flat.shape)}" if isinstance(flat, torch.Tensor) else repr(flat))
        )
    return resolve_comm(axis, mesh, caller)


def all_reduce_bucket_start(flat: torch.Tensor, axis: str, mesh: Mesh) -> BucketPending:
    """Start the mean of `flat` over `axis` in `flat` itself; ``.wait()`` returns `flat`.

    Raises:
        ValueError: `flat` is not a contiguous 1-D tensor, or `axis` is not on `mesh`.
    """
    comm = _comm(flat, axis, mesh, "all_reduce_bucket_start")
    if comm.size == 1:
        return BucketPending(flat, None)
    work = Work()
    work.ticket = issue(comm, "all_reduce", flat, flat.numel(), extra=_MEAN)
    flat.div_(comm.size)
    work.work = dist.all_reduce(flat, group=comm.group, async_op=True)
    return BucketPending(flat, work)


def _divided_comm(flat: torch.Tensor, axis: str, mesh: Mesh, caller: str) -> Comm:
    """`_comm`, for a collective that cuts `flat` into one equal part per rank."""
    comm = _comm(flat, axis, mesh, caller)
    if flat.numel() % comm.size:
        raise ValueError(
            f"{caller}: `flat` has {flat.numel()} elements, which the {comm.size} ranks of "
            f"axis {axis!r} do not divide; pad the bucket to a multiple"
        )
    return comm


def reduce_scatter_bucket_start(
    flat: torch.Tensor, axis: str, mesh: Mesh
) -> BucketPending | Pending:
    """Start the mean of `flat` over `axis`, keeping this rank's shard: ``.wait()`` returns it
    (a new tensor of ``flat.numel() // N`` elements). `flat`'s contents are consumed.

    Raises:
        ValueError: `flat` is not a contiguous 1-D tensor, `axis` is not on `mesh`, or the
            axis size does not divide ``flat.numel()``.
    """
    comm = _divided_comm(flat, axis, mesh, "reduce_scatter_bucket_start")
    if comm.size == 1 or dist.get_backend(comm.group) != "gloo":
        return collectives.reduce_scatter_start(flat, axis, 0, "mean", mesh=mesh)
    size, rank = comm.size, comm.index
    shard_numel = flat.numel() // size
    work = Work()
    stacked = flat.view(size, shard_numel)
    work.ticket = issue(comm, "reduce_scatter", stacked, flat.numel(), extra=_MEAN)
    work.work = dist.all_reduce(flat, group=comm.group, async_op=True)

    def shard_mean(total: torch.Tensor) -> torch.Tensor:
        return total[rank * shard_numel : (rank + 1) * shard_numel] / size

    return BucketPending(flat, work, shard_mean)


def all_gather_bucket_start(flat: torch.Tensor, axis: str, mesh: Mesh) -> BucketPending:
    """Start gathering every rank's shard of `flat` into `flat`; ``.wait()`` returns `flat`.

    This rank's shard (``flat`` cut in N equal parts, part r on rank r of `axis`) must already
    hold its values; the other parts are overwritten.

    Raises:
        ValueError: `flat` is not a contiguous 1-D tensor, `axis` is not on `mesh`, or the
            axis size does not divide ``flat.numel()``.
    """
    comm = _divided_comm(flat, axis, mesh, "all_gather_bucket_start")
    if comm.size == 1:
        return BucketPending(flat, None)
    shard_numel = flat.numel() // comm.size
    rank = comm.index
    shard = flat[rank * shard_numel : (rank + 1) * shard_numel]
    work = Work()
    work.ticket = issue(comm, "all_gather", shard, flat.numel(), extra=_SUM)
    work.work = all_gather_flat(flat, shard, group=comm.group, async_op=True)
    return BucketPending(flat, work)
