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
The watchdog counts it under that signature too, and bounds its wait as every collective's.

Where every rank of the axis is on this host (host tensors, a gloo group) the rows go through
shared memory (`fscale.distributed.shared_memory`): the ranks first gather every rank's sizes,
refuse sizes that disagree (on every rank alike), and all run the windows of the largest;
elsewhere through the backend's ``all_to_all_single`` with split sizes. A caller that already
holds every rank's sizes (the mixture-of-experts exchange gathers its counts first) passes them
as `all_sizes`, and the gather is skipped: each rank checks that its own sizes are its row and
column of that table, and the windows are counted from it (with the debug check on, the sizes
are gathered and checked all the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed.comm import Comm, check_tensor, resolve_comm
from fscale.distributed.debug import check_group, count, debug_enabled
from fscale.distributed.ledger import CommRecord, open_ledgers
from fscale.distributed.mesh import Mesh
from fscale.distributed.shared_memory import (
    shared_all_gather,
    shared_all_to_all_uneven,
    shares_memory,
)
from fscale.distributed.watchdog import wait
from fscale.outside_graph import outside_graph
from fscale.readback import to_list

__all__ = ["all_to_all_uneven"]

Tensor = torch.Tensor
Table = tuple[tuple[int, ...], ...]  # row i: the rows rank i sends to each rank


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
        x: Tensor,
        comm: Comm,
        send_sizes: tuple[int, ...],
        recv_sizes: tuple[int, ...],
        table: Table | None,
    ) -> Tensor:
        _record(comm, x, send_sizes)
        # Counted and bounded as every collective, under the one signature the ranks share:
        # the shape of a row and the dtype.
        ticket = count(comm, "all_to_all", x.new_empty((0, *x.shape[1:])))
        received = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        work = _start(x.contiguous(), received, comm, send_sizes, recv_sizes, table, ticket)
        wait(work, ticket)
        return received

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.comm, ctx.send_sizes, ctx.recv_sizes, ctx.table = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        # Every row goes back where it came from: the sizes swapped, the table transposed.
        back = None if ctx.table is None else tuple(zip(*ctx.table))
        return (
            _AllToAllUneven.apply(grad, ctx.comm, ctx.recv_sizes, ctx.send_sizes, back),
            None,
            None,
            None,
            None,
        )


# Outside a compiled graph, as the other collectives' starts: the shared-memory transport is
# host code.
@outside_graph
def _start(
    x: Tensor,
    received: Tensor,
    comm: Comm,
    send: tuple[int, ...],
    recv: tuple[int, ...],
    table: Table | None,
    ticket: Any,
) -> Any:
    """Start the exchange of the contiguous `x` into `received`; the work to wait for.

    Through shared memory every rank first gathers every rank's sizes (one window), unless
    the caller gave them all (`table`): the windows each runs are counted from the largest,
    and sizes that disagree are refused on every rank alike, where a backend would hang or
    abort.
    """
    flat = x.view(-1)
    if not shares_memory(comm, flat, sums=False):
        return dist.all_to_all_single(
            received,
            x,
            output_split_sizes=list(recv),
            input_split_sizes=list(send),
            group=comm.group,
            async_op=True,
        )
    # With the debug check on, a given table is checked too: the sizes are gathered anyway.
    if table is None or debug_enabled():
        gathered = torch.zeros(comm.size, 2 * comm.size, dtype=torch.int64)
        gathered[comm.index] = torch.tensor([*send, *recv])
        wait(shared_all_gather(gathered.view(-1), comm), ticket)
        _check_agreed(to_list(gathered), comm)
        most = int(gathered.max())
    else:
        most = max(max(sizes) for sizes in table)
    row = math.prod(x.shape[1:])
    sends, receives = [n * row for n in send], [n * row for n in recv]
    return shared_all_to_all_uneven(flat, comm, sends, received.view(-1), receives, most * row)


def _check_agreed(table: list[list[int]], comm: Comm) -> None:
    """Raise, on every rank alike, unless each rank receives from each what it sends there
    (`table` row i: rank i's send sizes, then its receive sizes)."""
    size = comm.size
    for i in range(size):
        for j in range(size):
            sent, expected = table[i][j], table[j][size + i]
            if sent != expected:
                source = comm.mesh.global_rank(comm.axis, i)
                raise ValueError(
                    f"all_to_all_uneven: rank {source} ({comm.axis}={i}) sends {sent} rows to "
                    f"{comm.axis}={j}, which expects {expected} from it; `recv_sizes[i]` on "
                    f"each rank must equal `send_sizes[that rank]` on rank i (exchange the "
                    "sizes first)"
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


def _table(
    all_sizes: Any, send: tuple[int, ...], recv: tuple[int, ...], comm: Comm
) -> Table | None:
    """`all_sizes` as a tuple of rows, checked against this rank's own sizes; None if None."""
    if all_sizes is None:
        return None
    if isinstance(all_sizes, Tensor):
        all_sizes = to_list(all_sizes)
    if not isinstance(all_sizes, Sequence) or len(all_sizes) != comm.size:
        raise ValueError(
            f"all_to_all_uneven: `all_sizes` must hold {comm.size} rows (row i: the send_sizes "
            f"of rank i of axis {comm.axis!r}), got {all_sizes!r}"
        )
    table = tuple(_sizes(sizes, f"all_sizes[{i}]", comm) for i, sizes in enumerate(all_sizes))
    me = comm.index
    if table[me] != send or tuple(sizes[me] for sizes in table) != recv:
        raise ValueError(
            f"all_to_all_uneven: `all_sizes` says {comm.axis}={me} sends {list(table[me])} and "
            f"receives {[sizes[me] for sizes in table]}, but `send_sizes` is {list(send)} and "
            f"`recv_sizes` {list(recv)}; pass this rank's row and column of the same table"
        )
    return table


def all_to_all_uneven(
    x: Tensor,
    axis: str,
    send_sizes: Sequence[int] | Tensor,
    recv_sizes: Sequence[int] | Tensor,
    *,
    mesh: Mesh | None = None,
    all_sizes: Sequence[Sequence[int]] | Tensor | None = None,
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
        all_sizes: optionally every rank's `send_sizes`, row i from rank i, the same table on
            every rank (one the caller already gathered): the exchange then skips gathering
            the sizes. This rank's row must be `send_sizes` and its column `recv_sizes`.

    Returns:
        A tensor of ``sum(recv_sizes)`` rows.

    Raises:
        TypeError: `x` is not a tensor with at least one dimension, or sizes are not sequences.
        ValueError: sizes of the wrong length or negative, `send_sizes` not summing to
            ``x.shape[0]``, `all_sizes` that disagrees with this rank's sizes, unknown axis,
            or no mesh.
    """
    check_tensor(x, "x", "all_to_all_uneven", min_dim=1)
    comm = resolve_comm(axis, mesh, "all_to_all_uneven")
    send = _sizes(send_sizes, "send_sizes", comm)
    recv = _sizes(recv_sizes, "recv_sizes", comm)
    table = _table(all_sizes, send, recv, comm)
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
    return _AllToAllUneven.apply(x, comm, send, recv, table)
