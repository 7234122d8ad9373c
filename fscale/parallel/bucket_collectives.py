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
- `reduce_scatter_bucket_start`: this rank's shard of the mean. On gloo (host tensors, buckets
  of 1 MiB or more) each rank sends every other rank its part of the bucket and sums the parts
  it receives in the order gloo's all-reduce of the bucket would (`fscale.distributed.exchange`):
  the bits of DDP's all-reduce, half its bytes on the wire. Smaller buckets are all-reduced in
  place and sliced (gloo's own reduce-scatter sums in that order too, but takes 1.5x an
  all-reduce's time and copies its input). Other backends run their reduce-scatter.
- `all_gather_bucket_start`: every rank's shard of a bucket gathered into the bucket, whose own
  shard this rank has already written: no gathered copy beside the bucket. On gloo, from 1 MiB,
  exchanged between every pair of ranks (about half the time of gloo's all-gather).

Where every rank of the axis is on this host (host tensors, a gloo group), all three go through
shared memory instead (`fscale.distributed.shared_memory`: windows every rank maps, sums in the
order of gloo's ring, so the same bits; a fraction of the time of gloo's sockets).

The two reductions take ``trailing``: a few elements after the bucket in its buffer (the step's
loss and scalar metrics) whose mean travels in the bucket's own collective, so that the step
needs no collective of its own for them; ``pending.trailing`` holds that mean (a copy) once
waited for. The ledger records them as what the algorithm does with them, an all-reduce of
``trailing`` elements beside the bucket's own collective (they travel in one on the wire).

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
from fscale.distributed.exchange import (
    PairWork,
    exchange_all_gather,
    exchange_reduce_scatter,
    exchanges,
    exchanges_reduce_scatter,
)
from fscale.distributed.ledger import record
from fscale.distributed.mesh import Mesh
from fscale.distributed.pending import Pending, Work
from fscale.distributed.shared_memory import (
    SharedWork,
    shared_all_gather,
    shared_all_reduce,
    shared_reduce_scatter,
    shares_memory,
)
from fscale.outside_graph import outside_graph

__all__ = [
    "BucketPending",
    "all_gather_bucket_start",
    "all_reduce_bucket_start",
    "folds_trailing",
    "reduce_scatter_bucket_start",
]

_MEAN = REDUCTIONS.index("mean")
_SUM = REDUCTIONS.index("sum")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class BucketPending:
    """A bucket collective in flight; `wait()` blocks until it is done and returns the result.

    Waiting is idempotent, and bounded as every fscale collective is (the watchdog's ticket).

    Attributes:
        trailing: after `wait`, a copy of the buffer's last `num_trailing` elements as the
            collective left them (None when there are none).
    """

    __slots__ = ("_buffer", "_finish", "_num_trailing", "_result", "_work", "trailing")

    def __init__(
        self,
        buffer: torch.Tensor,
        work: Work | None,
        finish: Callable[[torch.Tensor], torch.Tensor] = _identity,
        num_trailing: int = 0,
    ) -> None:
        self._buffer: torch.Tensor | None = buffer
        self._work = work
        self._finish = finish
        self._num_trailing = num_trailing
        self._result: torch.Tensor | None = None
        self.trailing: torch.Tensor | None = None

    # Under torch.compile this runs outside the graph, as one call: it blocks on gloo's work
    # and the watchdog's host bookkeeping, each of which would end a graph of its own.
    @outside_graph
    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            buffer = self._buffer
            assert buffer is not None  # set until the first wait
            if self._num_trailing:
                self.trailing = buffer[buffer.numel() - self._num_trailing :].clone()
            self._result = self._finish(buffer)
            self._buffer = self._work = None
        return self._result

    @property
    def held(self) -> tuple[torch.Tensor, ...]:
        """The buffers the collective allocated and holds while in flight (an exchange's
        receives), for memory accounting; empty once waited for."""
        work = None if self._work is None else self._work.work
        return tuple(work.buffers) if isinstance(work, (PairWork, SharedWork)) else ()

    def then(self, after: Callable[[torch.Tensor], torch.Tensor]) -> BucketPending:
        """A pending whose `wait()` returns ``after(self.wait())``; `self` is consumed."""
        finish = self._finish
        if self._result is not None:
            return BucketPending(after(self._result), None)
        assert self._buffer is not None
        return BucketPending(
            self._buffer, self._work, lambda x: after(finish(x)), self._num_trailing
        )

    def __repr__(self) -> str:
        return f"BucketPending({'done' if self._result is not None else 'in flight'})"


def _comm(flat: torch.Tensor, axis: str, mesh: Mesh, caller: str) -> Comm:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"{caller}: `flat` must be a contiguous 1-D bucket buffer, got "
            + (f"shape {tuple(flat.shape)}" if isinstance(flat, torch.Tensor) else repr(flat))
        )
    return resolve_comm(axis, mesh, caller)


# Under torch.compile this runs outside the graph, as one call, as `reduce_scatter_bucket_start`.
@outside_graph
def all_reduce_bucket_start(
    flat: torch.Tensor, axis: str, mesh: Mesh, *, trailing: int = 0, divided: bool = False
) -> BucketPending:
    """Start the mean of `flat` over `axis` in `flat` itself; ``.wait()`` returns `flat`.

    The last `trailing` elements are averaged with the rest; ``pending.trailing`` copies them.
    The mean divides by the axis size, then sums; `divided`: `flat` holds its values divided
    already (`fscale.parallel.buckets.GradBuckets`'s ``divide_by``), only the sum is left.

    Raises:
        ValueError: `flat` is not a contiguous 1-D tensor, `axis` is not on `mesh`, or
            `trailing` is not in ``[0, flat.numel()]``.
    """
    comm = _comm(flat, axis, mesh, "all_reduce_bucket_start")
    _check_trailing(flat, trailing, "all_reduce_bucket_start")
    if comm.size == 1:
        return BucketPending(flat, None, num_trailing=trailing)
    work = Work()
    work.ticket = issue(comm, "all_reduce", flat, flat.numel() - trailing, extra=_MEAN)
    if trailing:
        record("all_reduce", comm.axis, flat.dtype, trailing, comm.size)
    if not divided:
        flat.div_(comm.size)
    if shares_memory(comm, flat, sums=True):
        work.work = shared_all_reduce(flat, comm)
    else:
        work.work = dist.all_reduce(flat, group=comm.group, async_op=True)
    return BucketPending(flat, work, num_trailing=trailing)


def _check_trailing(flat: torch.Tensor, trailing: int, caller: str) -> None:
    if isinstance(trailing, bool) or not isinstance(trailing, int):
        raise ValueError(f"{caller}: `trailing` must be an int, got {trailing!r}")
    if not 0 <= trailing <= flat.numel():
        raise ValueError(
            f"{caller}: `trailing`={trailing} is outside [0, {flat.numel()}] (the buffer's size)"
        )


def folds_trailing(axis: str, mesh: Mesh) -> bool:
    """Whether `reduce_scatter_bucket_start` over `axis` can carry trailing elements.

    It can on gloo with more than one rank, where the reduce-scatter is an all-reduce of the
    whole buffer or an exchange that sends the trailing elements to every rank beside the
    parts: a backend's own reduce-scatter leaves each rank only its own part.
    """
    comm = resolve_comm(axis, mesh, "folds_trailing")
    return comm.size > 1 and dist.get_backend(comm.group) == "gloo"


def _check_divides(flat: torch.Tensor, comm: Comm, axis: str, caller: str) -> None:
    """For a collective that cuts `flat` into one equal part per rank."""
    if flat.numel() % comm.size:
        raise ValueError(
            f"{caller}: `flat` has {flat.numel()} elements, which the {comm.size} ranks of "
            f"axis {axis!r} do not divide; pad the bucket to a multiple"
        )


# Under torch.compile this runs outside the graph, as one call (from a gradient hook, which
# Dynamo compiles as a frame of its own): issuing a gloo collective and the watchdog's
# agreement through the store would each end a graph.
@outside_graph
def reduce_scatter_bucket_start(
    flat: torch.Tensor, axis: str, mesh: Mesh, *, trailing: int = 0
) -> BucketPending | Pending:
    """Start the mean of `flat` over `axis`, keeping this rank's shard: ``.wait()`` returns it
    (a new tensor of ``(flat.numel() - trailing) // N`` elements). `flat`'s contents are
    consumed.

    The last `trailing` elements are not part of the bucket: their mean over the axis (divided,
    then summed, as `all_reduce_bucket_start` computes it) is ``pending.trailing``; only where
    `folds_trailing` says so.

    Raises:
        ValueError: `flat` is not a contiguous 1-D tensor, `axis` is not on `mesh`, the
            axis size does not divide the bucket's elements, or `trailing` is not in
            ``[0, flat.numel()]`` or given where `folds_trailing` is False.
    """
    caller = "reduce_scatter_bucket_start"
    comm = _comm(flat, axis, mesh, caller)
    _check_trailing(flat, trailing, caller)
    bucket = flat[: flat.numel() - trailing]
    _check_divides(bucket, comm, axis, caller)
    gloo = comm.size > 1 and dist.get_backend(comm.group) == "gloo"
    if not gloo:
        if trailing:
            raise ValueError(
                f"{caller}: `trailing` elements need the all-reduce of the whole buffer, which "
                f"axis {axis!r} does not run (see folds_trailing)"
            )
        return collectives.reduce_scatter_start(flat, axis, 0, "mean", mesh=mesh)
    size, rank = comm.size, comm.index
    shard_numel = bucket.numel() // size
    work = Work()
    stacked = bucket.view(size, shard_numel)
    work.ticket = issue(comm, "reduce_scatter", stacked, bucket.numel(), extra=_MEAN)
    if trailing:
        record("all_reduce", comm.axis, flat.dtype, trailing, size)
        flat[bucket.numel() :].div_(size)
    if shares_memory(comm, flat, sums=True):
        work.work, total = shared_reduce_scatter(flat, comm, trailing)
        return BucketPending(flat, work, lambda _: total.div_(size), trailing)
    if exchanges_reduce_scatter(comm, flat):
        work.work, total = exchange_reduce_scatter(flat, comm, work.ticket, trailing)
        return BucketPending(flat, work, lambda _: total.div_(size), trailing)
    work.work = dist.all_reduce(flat, group=comm.group, async_op=True)

    def shard_mean(total: torch.Tensor) -> torch.Tensor:
        return total[rank * shard_numel : (rank + 1) * shard_numel] / size

    return BucketPending(flat, work, shard_mean, trailing)


def all_gather_bucket_start(flat: torch.Tensor, axis: str, mesh: Mesh) -> BucketPending:
    """Start gathering every rank's shard of `flat` into `flat`; ``.wait()`` returns `flat`.

    This rank's shard (``flat`` cut in N equal parts, part r on rank r of `axis`) must already
    hold its values; the other parts are overwritten.

    Raises:
        ValueError: `flat` is not a contiguous 1-D tensor, `axis` is not on `mesh`, or the
            axis size does not divide ``flat.numel()``.
    """
    comm = _comm(flat, axis, mesh, "all_gather_bucket_start")
    _check_divides(flat, comm, axis, "all_gather_bucket_start")
    if comm.size == 1:
        return BucketPending(flat, None)
    shard_numel = flat.numel() // comm.size
    rank = comm.index
    shard = flat[rank * shard_numel : (rank + 1) * shard_numel]
    work = Work()
    work.ticket = issue(comm, "all_gather", shard, flat.numel(), extra=_SUM)
    if shares_memory(comm, flat, sums=False):
        work.work = shared_all_gather(flat, comm)
    elif exchanges(comm, flat):
        work.work = exchange_all_gather(flat, comm, work.ticket)
    else:
        work.work = all_gather_flat(flat, shard, group=comm.group, async_op=True)
    return BucketPending(flat, work)
