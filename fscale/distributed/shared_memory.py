"""Collectives between the ranks of one host through shared memory, for host tensors on gloo.

gloo moves a host tensor between two processes of one machine through TCP over loopback, every
byte copied into the kernel and out, around a ring of 2(N - 1) steps; through memory every rank
maps, a rank reads its peers' terms where they wrote them. An all-reduce of 29.6 MB took 5.1
against gloo's 18.8 ms at 2 ranks, 19.6 against 45 ms at 4 (`bench/collectives.py`). Served
here: all-reduce, reduce-scatter and all-gather (the gradient buckets', and the differentiable
ones of `fscale.distributed.replication` and `.sharding`) and the even all-to-all
(`fscale.distributed.dispatch`) and the one with per-rank sizes (`fscale.distributed.uneven`),
mixture-of-experts dispatch.

**The transport.** Each rank of a group owns a region of ``/dev/shm`` that every rank of the
group maps: a counter and two windows of `WINDOW_BYTES`. A collective runs window by window:
each rank copies its terms for the window into its own region, sets its counter to the
window's number, waits until every peer's counter has reached that number, and reads what it
needs from every region. Consecutive windows alternate between the region's two, so a rank
writes into one again only after every peer has raised its counter past the window it last
read there: one wait per window and no other synchronisation. The regions keep their size
whatever the buffer (two windows per rank, each rank mapping all N), so no bucket is held twice
and the memory is the same every step. `release_windows` unmaps the windows' pages once the
collectives before it are done (``MADV_DONTNEED``: the pages keep their contents); fully_shard
calls it after its forward, so they are not resident where an LM's activations peak (the loss).
The next window maps them again, a minor fault per page: not after every collective.

**Bits.** A sum adds each element's terms in the order gloo's ring all-reduce of the same
buffer adds them (`fscale.distributed.exchange.ring_order`), so the results are gloo's, bit for
bit: over two ranks any order gives them (one addition, which is commutative); over more, the
order of the installed gloo must be known (`fscale.distributed.exchange.ring_rule`), or sums
keep gloo.

**Visibility.** A peer reads a window once it sees the counter stored after the window's data.
x86-64 makes a processor's stores visible in the order it issued them, so that read finds the
data; other processors need fences that Python cannot issue, so the transport is used on
x86-64 Linux only.

**Waiting.** The windows of a group's collectives run, in the order they were started, on one
worker thread of the group's own, so a start returns at once as gloo's does; `SharedWork` is
what `fscale.distributed.watchdog.wait` bounds. A waiting rank polls its peers' counters,
yielding its core between polls, then sleeping up to 0.5 ms. A peer that never arrives is the
watchdog's to report; `fscale.tracking.reset` closes the regions and stops their workers.

**Choice.** `shares_memory` answers whether a collective runs here: host tensors, a gloo group
whose ranks are all on this host, not turned off. The first call per group gathers each rank's
host and setting (a collective, at the same point on every rank, as every first collective of
a step is); ranks of one host whose settings differ are refused there. Each region's pages are
reserved when it is made, so a full ``/dev/shm`` keeps the group on gloo with a warning instead
of faulting later. ``FSCALE_SHARED_MEMORY=0`` or `set_shared_memory(False)` keeps gloo.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fscale import tracking
from fscale.distributed.comm import Comm
from fscale.distributed.exchange import ring_chunk, ring_rule
from fscale.distributed.shared_arena import WINDOW_BYTES, Arena
from fscale.distributed.shared_setting import (
    enabled_from_env,
    set_shared_memory,
    shared_memory_enabled,
)
from fscale.outside_graph import outside_graph

__all__ = [
    "WINDOW_BYTES",
    "SharedWork",
    "release_windows",
    "set_shared_memory",
    "shared_all_gather",
    "shared_all_reduce",
    "shared_all_to_all",
    "shared_all_to_all_uneven",
    "shared_memory_enabled",
    "shared_reduce_scatter",
    "shares_memory",
]

Tensor = torch.Tensor

# Process group -> its arena, or None where it keeps gloo (`tracking.reset` forgets them).
_ARENAS: dict[Any, Arena | None] = {}


def shares_memory(comm: Comm, flat: Tensor, *, sums: bool) -> bool:
    """Whether a collective over `comm` on `flat` runs through shared memory (`sums`: it adds
    terms, so over more than two ranks gloo's order must be known). The first call per group
    is a collective over it (see the module docstring)."""
    if comm.size == 1 or flat.device.type != "cpu":
        return False
    # Called for every bucket of every step: the group's decision is made once.
    if comm.group not in _ARENAS:
        gloo = dist.get_backend(comm.group) == "gloo"
        _ARENAS[comm.group] = Arena.open(comm) if gloo else None
    if _ARENAS[comm.group] is None:
        return False
    return not sums or comm.size == 2 or ring_rule(comm) is not None


@outside_graph
def release_windows() -> None:
    """Unmap every group's windows from this process once its collectives in flight are done
    (the pages keep their contents; the next collective maps them again). Returns at once."""
    for arena in _ARENAS.values():
        if arena is not None and not arena.closed:
            arena.submit(arena.unmap_windows)


class SharedWork:
    """A shared-memory collective in flight on its group's worker; what c10d's Work offers
    `fscale.distributed.watchdog.wait`: ``wait(timeout)``, raising on a timeout as c10d does,
    and ``is_completed()``."""

    __slots__ = ("_future", "buffers")

    def __init__(self, future: concurrent.futures.Future, buffers: Sequence[Tensor] = ()) -> None:
        self._future = future
        self.buffers = list(buffers)  # what the collective allocated (a reduce-scatter's shard)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            self._future.result(None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise RuntimeError(
                "shared-memory collective timed out waiting for its peers' windows"
            ) from None
        except Exception as error:
            raise RuntimeError(f"shared-memory collective failed: {error}") from error
        self.buffers = []
        return True

    def is_completed(self) -> bool:
        return self._future.done()


def shared_all_reduce(flat: Tensor, comm: Comm) -> SharedWork:
    """Start summing the contiguous 1-D `flat` over `comm`'s ranks into `flat` itself, in
    gloo's order. Check `shares_memory(comm, flat, sums=True)` first."""
    _check_flat(flat, comm, "shared_all_reduce")
    arena, ring = _arena(comm, flat, sums=True)
    return SharedWork(arena.submit(lambda: arena.all_reduce(flat, 0, ring)))


def shared_reduce_scatter(
    flat: Tensor, comm: Comm, trailing: int, out: Tensor | None = None
) -> tuple[SharedWork, Tensor]:
    """Start summing `flat` over the ranks into this rank's part, in gloo's order: the first
    ``flat.numel() - trailing`` elements in N equal parts (part r summed on rank r), the last
    `trailing` whole on every rank, in `flat`. Returns the work and the tensor that holds the
    part's sum once it is waited for: `out` (contiguous, of the part's size and dtype; e.g. an
    autograd Function's output, which must not be a view written later) or a new 1-D one.
    `flat` must not change until then."""
    _check_flat(flat, comm, "shared_reduce_scatter", trailing=trailing)
    numel = (flat.numel() - trailing) // comm.size
    if out is None:
        out = torch.empty(numel, dtype=flat.dtype)
    elif not (out.is_contiguous() and out.numel() == numel and out.dtype == flat.dtype):
        raise ValueError(
            f"shared_reduce_scatter: `out` must be a contiguous {numel}-element "
            f"{flat.dtype} tensor, got shape {tuple(out.shape)} {out.dtype}"
        )
    part = out.view(-1)
    arena, ring = _arena(comm, flat, sums=True)
    future = arena.submit(lambda: arena.reduce_scatter(flat, trailing, part, ring))
    return SharedWork(future, [out]), out


def shared_all_gather(flat: Tensor, comm: Comm) -> SharedWork:
    """Start gathering every rank's part of `flat` (N equal parts, part r from rank r) into
    `flat`. Check `shares_memory(comm, flat, sums=False)` first."""
    _check_flat(flat, comm, "shared_all_gather", trailing=0)
    arena, _ = _arena(comm, flat, sums=False)
    return SharedWork(arena.submit(lambda: arena.all_gather(flat)))


def shared_all_to_all(flat: Tensor, comm: Comm, out: Tensor) -> SharedWork:
    """Start sending part j of `flat` (N equal parts) to rank j, rank i's part landing as part
    i of `out` (contiguous, `flat`'s size and dtype). Check `shares_memory(comm, flat,
    sums=False)` first; neither tensor may be used until the work is waited for."""
    _check_flat(flat, comm, "shared_all_to_all", trailing=0)
    if not (out.is_contiguous() and out.numel() == flat.numel() and out.dtype == flat.dtype):
        raise ValueError(
            f"shared_all_to_all: `out` must be a contiguous {flat.numel()}-element "
            f"{flat.dtype} tensor, got shape {tuple(out.shape)} {out.dtype}"
        )
    arena, _ = _arena(comm, flat, sums=False)
    return SharedWork(arena.submit(lambda: arena.all_to_all(flat, out.view(-1))), [out])


def shared_all_to_all_uneven(
    flat: Tensor,
    comm: Comm,
    sends: Sequence[int],
    out: Tensor,
    receives: Sequence[int],
    largest: int,
) -> SharedWork:
    """Start sending the next ``sends[j]`` elements of `flat` to rank j, in rank order, and
    writing the ``receives[q]`` elements from rank q into `out`, rank 0's first. The counts
    must agree across the ranks (``sends[j]`` here is ``receives[this rank]`` on rank j), and
    `largest`, the largest count any rank sends any rank, is the same on every rank: the
    windows every rank runs are counted from it (`fscale.distributed.uneven` gathers the counts
    first). `out` is contiguous and holds ``sum(receives)``. Check `shares_memory(comm, flat,
    sums=False)` first; neither tensor may be used until the work is waited for."""
    _check_flat(flat, comm, "shared_all_to_all_uneven")
    if len(sends) != comm.size or len(receives) != comm.size or sum(sends) != flat.numel():
        raise ValueError(
            f"shared_all_to_all_uneven: `sends` {list(sends)} must hold one count per rank of "
            f"axis {comm.axis!r} ({comm.size}) summing to `flat`'s {flat.numel()} elements, "
            f"and `receives` {list(receives)} one per rank"
        )
    if not (out.is_contiguous() and out.numel() == sum(receives) and out.dtype == flat.dtype):
        raise ValueError(
            f"shared_all_to_all_uneven: `out` must be a contiguous {sum(receives)}-element "
            f"{flat.dtype} tensor, got shape {tuple(out.shape)} {out.dtype}"
        )
    if largest < max(*sends, *receives):
        raise ValueError(
            f"shared_all_to_all_uneven: `largest` {largest} is below this rank's own counts "
            f"{list(sends)} / {list(receives)}; it must be the largest count of every rank"
        )
    arena, _ = _arena(comm, flat, sums=False)
    counts = (tuple(sends), tuple(receives), largest)
    work = arena.submit(lambda: arena.all_to_all_uneven(flat, out.view(-1), *counts))
    return SharedWork(work, [out])


def _check_flat(flat: Any, comm: Comm, caller: str, *, trailing: int | None = None) -> None:
    """Raise unless `flat` is a contiguous 1-D tensor whose first ``numel - trailing`` elements
    split into one equal part per rank (`trailing` None: no parts)."""
    if not isinstance(flat, Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        got = f"shape {tuple(flat.shape)}" if isinstance(flat, Tensor) else type(flat).__name__
        raise ValueError(f"{caller}: `flat` must be a contiguous 1-D tensor, got {got}")
    if trailing is None:
        return
    if isinstance(trailing, bool) or not isinstance(trailing, int):
        raise ValueError(f"{caller}: `trailing` must be an int, got {trailing!r}")
    if not 0 <= trailing <= flat.numel() or (flat.numel() - trailing) % comm.size:
        raise ValueError(
            f"{caller}: `trailing`={trailing} must leave a multiple of the {comm.size} ranks "
            f"of axis {comm.axis!r} of the buffer's {flat.numel()} elements"
        )


def _arena(comm: Comm, flat: Tensor, *, sums: bool) -> tuple[Arena, int]:
    """The group's arena and the length of gloo's ring chunks for `flat` (0 when unused)."""
    if not shares_memory(comm, flat, sums=sums):
        raise RuntimeError(
            f"shared memory does not carry this collective over axis {comm.axis!r}; check "
            "shares_memory(comm, flat, sums=...) first"
        )
    arena = _ARENAS[comm.group]
    assert arena is not None
    if not sums:
        return arena, 0
    rule = "count_first" if comm.size == 2 else ring_rule(comm)
    assert rule is not None
    return arena, ring_chunk(flat.numel(), comm.size, flat.element_size(), rule)


def _reset() -> None:
    for arena in _ARENAS.values():
        if arena is not None:
            arena.close()
    _ARENAS.clear()
    set_shared_memory(enabled_from_env())


tracking.register("fscale.distributed.shared_memory", _reset)
