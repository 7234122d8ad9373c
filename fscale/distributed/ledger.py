"""The communication ledger: a record of every collective this rank issues, for tests and tuning.

Inside ``with comm_ledger() as ledger:`` each collective of `fscale.distributed.collectives`
appends a `CommRecord` to `ledger.records` at the point where it is issued, in the forward pass
or in the backward pass, so a test can assert that a strategy moves exactly the bytes its
analysis says::

    with fscale.distributed.comm_ledger() as ledger:
        grads = step_grads(params, batch)
    psi = sum(p.numel() for p in params)
    assert ledger.total_elements(axis="dp") == 2 * psi * (n - 1) / n  # DDP: one all-reduce

Bytes are counted under the ring model, the traffic of the bandwidth-optimal algorithm NCCL
uses, and are what THIS rank sends. With ``N`` ranks on the axis and ``S`` the size in bytes of
the full tensor (``numel * element_size``; for all-gather and reduce-scatter the unsharded one):

==================  =========================  ==================================================
operation           bytes sent by one rank     why
==================  =========================  ==================================================
all_reduce          ``2 (N-1)/N * S``          a reduce-scatter followed by an all-gather
all_gather          ``(N-1)/N * S``            each rank forwards the N-1 shards it does not own
reduce_scatter      ``(N-1)/N * S``            each rank forwards N-1 partial sums of one shard
all_to_all          ``(N-1)/N * S``            every chunk but its own leaves the rank
broadcast           ``(N-1)/N * S``            a pipelined chain from the source: every rank but
                                               the last forwards the whole tensor once
reduce              ``(N-1)/N * S``            the same chain run towards the destination,
                                               adding as it goes (broadcast's adjoint)
send / ppermute     ``S`` (0 if it sends none) the whole tensor goes to one peer
recv                ``0``                      receiving costs the sender, not this rank
==================  =========================  ==================================================

The ring counts are averages over the ranks of the axis (for broadcast and reduce, where one
rank of the chain sends nothing and the others ``S``, the average is ``(N-1)/N * S``: the total
``(N-1) * S`` any algorithm must move to reach N-1 ranks, shared out), so they are fractional
when ``S`` is not a multiple of ``N``.
Collectives over an axis of size 1 move nothing and record nothing.

Open ledgers live on a `fscale.tracking` stack, so `fscale.tracking.reset` closes any a
program left open. When none is open, recording costs one truth test of that stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

from fscale import tracking

__all__ = ["CommLedger", "CommRecord", "comm_ledger", "open_ledgers", "ring_bytes"]


class CommRecord(NamedTuple):
    """One collective as issued by this rank.

    Attributes:
        op: the operation: "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
            "broadcast", "reduce", "ppermute", "send" or "recv".
        axis: the mesh axis it ran over.
        dtype: the element type of the tensor it moved.
        numel: elements of the full tensor (the unsharded one for all-gather and
            reduce-scatter; the tensor sent for point-to-point operations).
        bytes: bytes this rank sends under the ring model (see the module docstring).
        axis_size: number of ranks on the axis.
    """

    op: str
    axis: str
    dtype: torch.dtype
    numel: int
    bytes: float
    axis_size: int

    @property
    def elements(self) -> float:
        """Ring-model elements this rank sends (`bytes` divided by the element size)."""
        return self.bytes / _itemsize(self.dtype)


def ring_bytes(op: str, numel: int, dtype: torch.dtype, axis_size: int) -> float:
    """Bytes one rank sends for `op` on a tensor of `numel` elements under the ring model.

    Args:
        op: an operation name as in `CommRecord.op`.
        numel: elements of the full tensor (unsharded for all-gather and reduce-scatter).
        dtype: its element type.
        axis_size: number of ranks taking part.

    Returns:
        The byte count, fractional when the size does not divide evenly by `axis_size`.

    Raises:
        ValueError: an unknown `op`.
    """
    size = numel * _itemsize(dtype)
    n = axis_size
    # Multiply before dividing so the result is exact whenever it is a whole number.
    if op == "all_reduce":
        return 2 * (n - 1) * size / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"):
        return (n - 1) * size / n
    if op in ("send", "ppermute"):
        return float(size)
    if op == "recv":
        return 0.0
    raise ValueError(f"ring_bytes: unknown op {op!r}; expected one of {sorted(_OPS)}")


_OPS = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
    "ppermute", "send", "recv",
)  # fmt: skip


class CommLedger:
    """The collectives issued while this ledger was open, with totals by op and axis."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def _select(
        self, op: str | None, axis: str | None, dtype: torch.dtype | None = None
    ) -> list[CommRecord]:
        if op is not None and op not in _OPS:
            raise ValueError(f"`op` must be one of {list(_OPS)} or None, got {op!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"`dtype` must be a torch.dtype or None, got {type(dtype).__name__}")
        return [
            record
            for record in self.records
            if (op is None or record.op == op)
            and (axis is None or record.axis == axis)
            and (dtype is None or record.dtype == dtype)
        ]

    def count(
        self, op: str | None = None, axis: str | None = None, dtype: torch.dtype | None = None
    ) -> int:
        """Number of collectives issued, optionally only those of `op`, on `axis`, in `dtype`."""
        return len(self._select(op, axis, dtype))

    def total_bytes(
        self, op: str | None = None, axis: str | None = None, dtype: torch.dtype | None = None
    ) -> float:
        """Ring-model bytes this rank sent, optionally only for `op`, on `axis`, in `dtype`."""
        return sum(record.bytes for record in self._select(op, axis, dtype))

    def total_elements(
        self, op: str | None = None, axis: str | None = None, dtype: torch.dtype | None = None
    ) -> float:
        """Ring-model elements this rank sent, optionally only for `op`, on `axis`, in `dtype`.

        Element counts are what the analysis of a strategy predicts (e.g. DDP sends
        ``2 * psi * (N - 1) / N`` per step for ``psi`` parameters), independent of dtype.
        """
        return sum(record.elements for record in self._select(op, axis, dtype))

    def summary(self) -> str:
        """A table of calls, elements and bytes per (op, axis), with a total line."""
        groups: dict[tuple[str, str], list[CommRecord]] = {}
        for record in self.records:
            groups.setdefault((record.op, record.axis), []).append(record)
        rows = [("op", "axis", "calls", "elements", "bytes")]
        for (op, axis), records in sorted(groups.items()):
            rows.append(
                (
                    op,
                    axis,
                    str(len(records)),
                    _number(sum(r.elements for r in records)),
                    _human_bytes(sum(r.bytes for r in records)),
                )
            )
        rows.append(("total", "", str(len(self.records)), "", _human_bytes(self.total_bytes())))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(
                cell.ljust(width) if i < 2 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommLedger({len(self.records)} records, {_human_bytes(self.total_bytes())})"


# Open ledgers, innermost last.
_LEDGERS: tracking.Stack[CommLedger] = tracking.stack(__name__)


@contextlib.contextmanager
def comm_ledger() -> Iterator[CommLedger]:
    """Record the collectives issued inside the block into a new `CommLedger`.

    Ledgers nest: a collective is recorded in every ledger open at the time it is issued.

    Yields:
        The ledger, which keeps its records after the block ends.
    """
    with _LEDGERS.open(CommLedger()) as ledger:
        yield ledger


def open_ledgers() -> tuple[CommLedger, ...]:
    """The ledgers open now, outermost first."""
    return _LEDGERS.active()


def record(op: str, axis: str, dtype: torch.dtype, numel: int, axis_size: int) -> None:
    """Append a record of a collective to every open ledger (a no-op when none is open)."""
    if not _LEDGERS:
        return
    entry = CommRecord(op, axis, dtype, numel, ring_bytes(op, numel, dtype, axis_size), axis_size)
    for ledger in _LEDGERS.active():
        ledger.records.append(entry)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _number(value: float) -> str:
    # Ring-model counts are averages over the ranks, fractional when a size does not divide by
    # N; a table of elements and bytes shows them to the nearest whole one.
    return f"{round(value):,}"


def _human_bytes(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{_number(value)} B"
