"""What happens before every collective is issued: the cross-rank agreement check, the ledger.

With ``set_debug(True)`` or ``FSCALE_DEBUG=1``, the ranks of the axis exchange the operation,
its argument (reduction, permutation digest or source index), and the tensor's shape and dtype
before every collective, forward or backward. On a mismatch EVERY rank raises
`CollectiveMismatchError` naming the operation, the axis and each rank's shape and dtype,
instead of hanging or silently computing garbage. The check is itself a collective: one small
all-gather of a fixed-size metadata row per collective (a send/recv pair swaps one row), so
every rank must use the same setting.

Without the check, `fscale.distributed.watchdog` counts every collective, agrees on each
signature once and bounds every wait (`issue` and `check_group` / `check_pair` pass it the
collective's `Ticket`, so the check's own exchange is bounded too).

Then the collective is recorded in every open `fscale.distributed.ledger` (`issue`; send and
recv run `check_pair` and record themselves).

The flag is process state registered with `fscale.tracking`: `fscale.tracking.reset` sets it
back to what ``FSCALE_DEBUG`` says.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from fscale import tracking
from fscale.distributed.comm import Comm, all_gather_flat
from fscale.distributed.ledger import record
from fscale.distributed.watchdog import CollectiveMismatchError, Ticket, admit, wait
from fscale.outside_graph import outside_graph
from fscale.readback import to_list

__all__ = [
    "CollectiveMismatchError",
    "check_group",
    "check_pair",
    "count",
    "debug_enabled",
    "debug_from_env",
    "issue",
    "set_debug",
]

Tensor = torch.Tensor


def debug_from_env(environ: Any = os.environ) -> bool:
    """Whether the environment (``FSCALE_DEBUG``) asks for the check."""
    return str(environ.get("FSCALE_DEBUG", "0")).strip().lower() not in ("", "0", "false", "no")


_DEBUG = debug_from_env()


def set_debug(enabled: bool) -> None:
    """Turn the cross-rank metadata check before every collective on or off.

    The check is also on when the environment variable ``FSCALE_DEBUG=1`` is set at import.
    Every rank must use the same setting (the check is itself a collective).
    """
    global _DEBUG
    _DEBUG = bool(enabled)


def debug_enabled() -> bool:
    """Whether the cross-rank metadata check runs before every collective."""
    return _DEBUG


tracking.register(__name__, lambda: set_debug(debug_from_env()))


# New operations go at the end: the codes are only compared between ranks of one program, but
# keeping them stable keeps messages from older runs readable.
_OP_CODES = {
    name: code
    for code, name in enumerate(
        (
            "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute", "send",
            "recv", "broadcast", "reduce",
        )
    )
}  # fmt: skip
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool,
)  # fmt: skip
_MAX_DIMS = 8  # shapes are sent in full up to this many dimensions; ndim and numel always


def _describe(row: list[int]) -> str:
    op = next((name for name, code in _OP_CODES.items() if code == row[0]), f"op#{row[0]}")
    dtype = _DTYPES[row[1]] if 0 <= row[1] < len(_DTYPES) else f"dtype#{row[1]}"
    ndim, numel = row[2], row[3]
    dims = row[5 : 5 + min(ndim, _MAX_DIMS)]
    shape = "(" + ", ".join(map(str, dims)) + ("," if ndim == 1 else "")
    shape += f", ... {ndim} dims, {numel} elements)" if ndim > _MAX_DIMS else ")"
    return f"{op} of shape {shape} {str(dtype).replace('torch.', '')}"


def _metadata(op: str, x: Tensor, extra: int) -> Tensor:
    dtype_code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    dims = list(x.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(x.dim(), _MAX_DIMS))
    row = [_OP_CODES[op], dtype_code, x.dim(), x.numel(), extra, *dims]
    return torch.tensor(row, dtype=torch.int64, device=x.device)


def check_group(
    comm: Comm, op: str, x: Tensor, extra: int = 0, ticket: Ticket | None = None
) -> None:
    """Raise on every rank of the axis unless all ranks issue the same collective.

    `extra` is the operation's argument as an int, compared like the shape. `ticket` is the
    collective's count (`fscale.distributed.watchdog`), which bounds the check's own wait.
    """
    mine = _metadata(op, x, extra)
    rows = mine.new_empty((comm.size, mine.numel()))
    wait(all_gather_flat(rows.view(-1), mine, group=comm.group, async_op=True), ticket)
    table = to_list(rows)
    if all(row == table[0] for row in table):
        return
    lines = [
        f"  rank {comm.mesh.global_rank(comm.axis, i)} ({comm.axis}={i}): {_describe(row)}"
        + (" [different op/perm argument]" if _only_extra_differs(row, table[0]) else "")
        for i, row in enumerate(table)
    ]
    raise CollectiveMismatchError(
        f"{op} over axis {comm.axis!r}: the {comm.size} ranks disagree:\n"
        + "\n".join(lines)
        + "\nEvery rank of the axis must issue the same collective, in the same order, with "
        "tensors of the same shape and dtype."
    )


def _only_extra_differs(row: list[int], reference: list[int]) -> bool:
    # Column 4 holds the reduction ("sum"/"mean"), a digest of the permutation, or the source.
    return row[4] != reference[4] and row[:4] + row[5:] == reference[:4] + reference[5:]


def check_pair(comm: Comm, op: str, x: Tensor, peer: int, ticket: Ticket | None = None) -> None:
    """Raise on both ends of a send/recv unless the sent and expected tensors agree.

    `ticket` bounds the exchange's wait, as in `check_group`.
    """
    mine = _metadata(op, x, 0)
    theirs = torch.empty_like(mine)
    works = [
        dist.isend(mine, group=comm.group, group_dst=peer),
        dist.irecv(theirs, group=comm.group, group_src=peer),
    ]
    for work in works:
        if work is not None:  # None: this rank is outside the group, so nothing was issued
            wait(work, ticket)
    mine_row, their_row = to_list(mine), to_list(theirs)
    if {mine_row[0], their_row[0]} == {_OP_CODES["send"], _OP_CODES["recv"]} and (
        mine_row[1:] == their_row[1:]
    ):
        return
    me = comm.mesh.global_rank(comm.axis, comm.index)
    other = comm.mesh.global_rank(comm.axis, peer)
    raise CollectiveMismatchError(
        f"{op} between ranks {me} ({comm.axis}={comm.index}) and {other} ({comm.axis}={peer}) "
        f"do not match:\n  rank {me}: {_describe(mine_row)}\n  rank {other}: "
        f"{_describe(their_row)}\nA send must meet a recv of a tensor of the same shape and "
        "dtype."
    )


# Under torch.compile this runs outside the graph, as one call: the store, the debug check's
# collective and the ledger are host work, each of which would end a graph of its own.
@outside_graph
def issue(comm: Comm, op: str, x: Tensor, numel: int, extra: int = 0) -> Ticket:
    """Before a group collective on `x`: its count, the debug check when on, the ledger record.

    Without the debug check, a signature new on the group is agreed once through the store
    (`fscale.distributed.watchdog.admit`). `numel` is the element count the ledger records
    (see `fscale.distributed.ledger`). Returns the ticket that bounds the collective's wait.
    """
    ticket = count(comm, op, x, extra)
    if _DEBUG:
        check_group(comm, op, x, extra, ticket)
    record(op, comm.axis, x.dtype, numel, comm.size)
    return ticket


def count(comm: Comm, op: str, x: Tensor, extra: int = 0) -> Ticket:
    """Count a collective on `x` over `comm`'s group and return the ticket that bounds its
    wait (`fscale.distributed.watchdog.admit`: agreed through the store when the debug check
    is off), without the debug check or the ledger record, which `issue` adds and a collective
    with per-rank shapes makes its own way (`fscale.distributed.uneven`)."""
    return admit(comm.group, _peers(comm), comm.axis, op, x, extra, not _DEBUG)


def _peers(comm: Comm) -> Any:
    return lambda: comm.mesh.peers(comm.axis)
