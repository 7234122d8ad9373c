"""`all_to_all_uneven`: an all-to-all whose chunks have per-rank sizes; self-dual, sizes swapped.

The dropless mixture-of-experts exchange (MegaBlocks). Rank i splits its rows (dim 0) into N
chunks of ``send_sizes[j]`` rows and sends chunk j to rank j; it receives ``recv_sizes[j]``
rows from rank j and concatenates them in rank order. The sizes must be consistent across the
axis (``send_sizes[j]`` on rank i is ``recv_sizes[i]`` on rank j), so callers exchange them
first: a rank cannot post a receive of unknown size, and a mismatch would hang the group.

The exchange is a permutation of rows across the ranks; its inverse sends every row back where
it came from, which is the same exchange with the two size lists swapped, so the backward is
`all_to_all_uneven` of the gradient with ``recv_sizes`` and ``send_sizes`` exchanged.

Ledger: recorded as an ``"all_to_all"`` whose bytes are exactly the rows this rank sends to the
other ranks (every chunk but its own leaves the rank, the even all-to-all's ring count applied
to unequal chunks); ``numel`` is the elements of this rank's input. With the debug check on,
the ranks compare the row shape (every dim but the first) and the dtype before the exchange.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed.comm import Comm, check_tensor, resolve_comm
from fscale.distributed.debug import check_group, debug_enabled
from fscale.distributed.ledger import CommRecord, open_ledgers
from fscale.distributed.mesh import Mesh
from fscale.readback import to_list

__all__ = ["all_to_all_uneven"]

Tensor = torch.Tensor


def _record(comm: Comm, x: Tensor, send_sizes: tuple[int, ...]) -> None:
    if debug_enabled():
        # Row counts differ by design; what must agree is the shape of one row and the dtype.
        check_group(comm, "all_to_all", x.new_empty((0, *x.shape[1:])))
    ledgers = open_ledgers()
    if not ledgers:
        return
    row = math.prod(x.shape[1:])
    sent = (sum(send_sizes) - send_sizes[comm.index]) * row * x.dtype.itemsize
    entry = CommRecord("all_to_all", comm.axis, x.dtype, x.numel(), float(sent), comm.size)
    for ledger in ledgers:
        ledger.records.append(entry)


class _AllToAllUneven(torch.autograd.Function):
    """Chunk j (``send_sizes[j]`` rows) to rank j; ``recv_sizes[j]`` rows from rank j."""

    @staticmethod
    def forward(
        x: Tensor, comm: Comm, send_sizes: tuple[int, ...], recv_sizes: tuple[int, ...]
    ) -> Tensor:
        _record(comm, x, send_sizes)
        received = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        dist.all_to_all_single(
            received,
            x.contiguous(),
            output_split_sizes=list(recv_sizes),
            input_split_sizes=list(send_sizes),
            group=comm.group,
        )
        return received

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.send_sizes, ctx.recv_sizes = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return (
            _AllToAllUneven.apply(grad, ctx.comm, ctx.recv_sizes, ctx.send_sizes),
            None,
            None,
            None,
        )


def _sizes(sizes: Any, name: str, comm: Comm) -> tuple[int, ...]:
    if isinstance(sizes, Tensor):
        sizes = to_list(sizes)
    if not isinstance(sizes, Sequence) or isinstance(sizes, str):
        raise TypeError(
            f"all_to_all_uneven: `{name}` must be a sequence of {comm.size} ints (one per rank "
            f"of axis {comm.axis!r}), got {type(sizes).__name__}"
        )
    values = tuple(sizes)
    if len(values) != comm.size or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise ValueError(
            f"all_to_all_uneven: `{name}` must hold {comm.size} non-negative ints (one per rank "
            f"of axis {comm.axis!r}), got {list(values)!r}"
        )
    return values


def all_to_all_uneven(
    x: Tensor,
    axis: str,
    send_sizes: Sequence[int] | Tensor,
    recv_sizes: Sequence[int] | Tensor,
    *,
    mesh: Mesh | None = None,
) -> Tensor:
    """Send rows ``[sum(send_sizes[:j]), sum(send_sizes[:j+1]))`` of `x` to rank j; return the
    rows received, rank 0's first.

    Backward: `all_to_all_uneven` of the gradient with the two size lists swapped.

    Args:
        x: this rank's rows, ``x.shape[0] == sum(send_sizes)``; every other dim and the dtype
            the same on every rank.
        axis: mesh axis name.
        send_sizes: rows sent to each rank of the axis, in axis order (ints, or a 1-D tensor).
        recv_sizes: rows received from each rank; ``recv_sizes[i]`` here must equal
            ``send_sizes[this rank]`` on rank i (exchange the sizes first).
        mesh: the mesh; None for the current one.

    Returns:
        A tensor of ``sum(recv_sizes)`` rows.

    Raises:
        TypeError: `x` is not a tensor with at least one dimension, or sizes are not sequences.
        ValueError: sizes of the wrong length or negative, `send_sizes` not summing to
            ``x.shape[0]``, unknown axis, or no mesh.
    """
    check_tensor(x, "x", "all_to_all_uneven", min_dim=1)
    comm = resolve_comm(axis, mesh, "all_to_all_uneven")
    send = _sizes(send_sizes, "send_sizes", comm)
    recv = _sizes(recv_sizes, "recv_sizes", comm)
    if sum(send) != x.shape[0]:
        raise ValueError(
            f"all_to_all_uneven: `send_sizes` {list(send)} sum to {sum(send)}, but `x` has "
            f"{x.shape[0]} rows (shape {tuple(x.shape)}); they must cover dim 0 exactly"
        )
    if comm.size == 1:
        if recv != send:
            raise ValueError(
                f"all_to_all_uneven: over an axis of size 1 `recv_sizes` {list(recv)} must "
                f"equal `send_sizes` {list(send)}"
            )
        return x
    return _AllToAllUneven.apply(x, comm, send, recv)
