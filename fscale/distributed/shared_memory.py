"""Collectives between the ranks of one host through shared memory, for host tensors on gloo.

gloo moves a host tensor between two processes of one machine through TCP over loopback, every
byte copied into the kernel and out, around a ring of 2(N - 1) steps; through memory every rank
maps, a rank reads its peers' terms where they wrote them. An all-reduce of 29.6 MB took 5.1
against gloo's 18.8 ms at 2 ranks, 19.6 against 45 ms at 4 (`bench/collectives.py`). Served
here: all-reduce, reduce-scatter and all-gather (the gradient buckets', and the differentiable
ones of `fscale.distributed.replication` and `.sharding`) and the even all-to-all
(`fscale.distributed.dispatch`, mixture-of-experts dispatch); the all-to-all with per-rank sizes
(`fscale.distributed.uneven`) stays on the backend.

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
import mmap
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fscale import tracking
from fscale.distributed.comm import Comm
from fscale.distributed.exchange import chunks_between, ring_chunk, ring_order, ring_rule
from fscale.distributed.shared_regions import map_region, open_regions
from fscale.distributed.shared_setting import (
    enabled_from_env,
    set_shared_memory,
    shared_memory_enabled,
    unlink_region,
)

__all__ = [
    "WINDOW_BYTES",
    "SharedWork",
    "release_windows",
    "set_shared_memory",
    "shared_all_gather",
    "shared_all_reduce",
    "shared_all_to_all",
    "shared_memory_enabled",
    "shared_reduce_scatter",
    "shares_memory",
]

Tensor = torch.Tensor

WINDOW_BYTES = 1 << 20
"""The bytes a rank writes per wait. 1 MiB windows took 5.1 ms for a 29.6 MB all-reduce over 2
ranks, 4 MiB windows 5.3-5.8 ms (they leave the caches); each rank maps 2N of them."""

_HEADER = 4096  # the counter, alone on its page
# Process group -> its arena, or None where it keeps gloo (`tracking.reset` forgets them).
_ARENAS: dict[Any, _Arena | None] = {}


def shares_memory(comm: Comm, flat: Tensor, *, sums: bool) -> bool:
    """Whether a collective over `comm` on `flat` runs through shared memory (`sums`: it adds
    terms, so over more than two ranks gloo's order must be known). The first call per group
    is a collective over it (see the module docstring)."""
    if comm.size == 1 or flat.device.type != "cpu":
        return False
    # Called for every bucket of every step: the group's decision is made once.
    if comm.group not in _ARENAS:
        gloo = dist.get_backend(comm.group) == "gloo"
        _ARENAS[comm.group] = _Arena.open(comm) if gloo else None
    if _ARENAS[comm.group] is None:
        return False
    return not sums or comm.size == 2 or ring_rule(comm) is not None


@torch.compiler.disable(recursive=True)
def release_windows() -> None:
    """Unmap every group's windows from this process once its collectives in flight are done
    (the pages keep their contents; the next collective maps them again). Returns at once."""
    for arena in _ARENAS.values():
        if arena is not None and not arena.closed:
            arena.submit(arena._unmap_windows)


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


def _arena(comm: Comm, flat: Tensor, *, sums: bool) -> tuple[_Arena, int]:
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


class _Arena:
    """One group's regions, mapped by this rank, and the worker that runs its windows."""

    def __init__(self, comm: Comm, maps: list[mmap.mmap], own_path: str) -> None:
        self.size, self.rank = comm.size, comm.index
        self.seq = 0  # the number of the last window this rank arrived at
        self.closed = False
        self._path: str | None = own_path  # unlinked once every peer has mapped it
        weakref.finalize(self, unlink_region, own_path)  # at the latest when the process exits
        self._maps = maps
        self._counters = [np.frombuffer(m, dtype=np.int64, count=1) for m in maps]
        self._bytes = [
            torch.frombuffer(m, dtype=torch.uint8, offset=_HEADER, count=2 * WINDOW_BYTES)
            for m in maps
        ]
        self._windows: dict[torch.dtype, list[list[Tensor]]] = {}
        # A daemon thread of its own, not an executor's: an executor's threads are joined at
        # exit, which would hang a process whose peer never arrived.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="fscale-shared-memory", daemon=True).start()

    @classmethod
    def open(cls, comm: Comm) -> _Arena | None:
        """Every rank's region mapped, or None where the group keeps gloo (a collective)."""
        size = _HEADER + 2 * WINDOW_BYTES
        regions = open_regions(comm, size, "fscale-", "the bucket collectives")
        if regions is None:
            return None
        try:
            maps = [
                regions.own if q == comm.index else map_region(path, size)
                for q, path in enumerate(regions.paths)
            ]
        except BaseException:
            unlink_region(regions.path)
            raise
        return cls(comm, maps, regions.path)

    def submit(self, work: Callable[[], None]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, work))
        return future

    def close(self) -> None:
        """Stop the worker: the collective it runs fails, the ones queued are cancelled."""
        self.closed = True
        self._queue.put(None)
        if self._path is not None:
            unlink_region(self._path)
            self._path = None

    def _unmap_windows(self) -> None:  # on the worker: no window is in use
        for region in self._maps:
            region.madvise(mmap.MADV_DONTNEED, _HEADER, 2 * WINDOW_BYTES)

    def _serve(self) -> None:
        # Grad mode is per thread: the windows' copies write into buffers (a gathered shard's
        # rows) that autograd must not see, as the collective's caller did under no_grad.
        torch.set_grad_enabled(False)
        while True:
            item = self._queue.get()
            if item is None:
                break
            future, work = item
            if self.closed:
                future.cancel()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            failure = None
            try:
                work()
            except BaseException as error:
                failure = error
            # The closure holds the collective's buffers: dropped before the waiter wakes (kept
            # until the next one, it kept the step's last bucket alive between steps).
            del item, work
            if failure is None:
                future.set_result(None)
            else:
                future.set_exception(failure)
            del future, failure
        while True:  # what was queued behind the close
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    # ---- on the worker --------------------------------------------------------------------

    def all_reduce(self, flat: Tensor, base: int, ring: int) -> None:
        """`flat` = the sum of every rank's `flat`, in place; `base` is `flat`'s offset in the
        buffer whose ring chunks (of `ring` elements) set each element's order."""
        step = WINDOW_BYTES // flat.element_size()
        for start in range(0, flat.numel(), step):
            n = min(step, flat.numel() - start)
            window = self._next_window(flat.dtype)
            window[self.rank][:n].copy_(flat[start : start + n])
            self._arrive()
            terms = [w[:n] for w in window]
            self._sum(flat[start : start + n], terms, base + start, ring)

    def reduce_scatter(self, flat: Tensor, trailing: int, out: Tensor, ring: int) -> None:
        numel = flat.numel() - trailing
        part = numel // self.size
        parts = flat[:numel].view(self.size, part)
        step = WINDOW_BYTES // (flat.element_size() * self.size)
        mine = slice(self.rank * step, (self.rank + 1) * step)
        for start in range(0, part, step):
            n = min(step, part - start)
            window = self._next_window(flat.dtype)
            window[self.rank][: self.size * step].view(self.size, step)[:, :n].copy_(
                parts[:, start : start + n]
            )
            self._arrive()
            terms = [w[mine][:n] for w in window]
            self._sum(out[start : start + n], terms, self.rank * part + start, ring)
        if trailing:
            self.all_reduce(flat[numel:], numel, ring)

    def all_gather(self, flat: Tensor) -> None:
        part = flat.numel() // self.size
        parts = flat.view(self.size, part)
        step = WINDOW_BYTES // flat.element_size()
        for start in range(0, part, step):
            n = min(step, part - start)
            window = self._next_window(flat.dtype)
            window[self.rank][:n].copy_(parts[self.rank, start : start + n])
            self._arrive()
            for q in range(self.size):
                if q != self.rank:
                    parts[q, start : start + n].copy_(window[q][:n])

    def all_to_all(self, flat: Tensor, out: Tensor) -> None:
        """Part q of `out` = part `rank` of rank q's `flat`; each window carries a slice of
        every part, laid out as the reduce-scatter's."""
        part = flat.numel() // self.size
        parts, received = flat.view(self.size, part), out.view(self.size, part)
        step = WINDOW_BYTES // (flat.element_size() * self.size)
        for start in range(0, part, step):
            n = min(step, part - start)
            window = self._next_window(flat.dtype)
            slots = [w[: self.size * step].view(self.size, step) for w in window]
            slots[self.rank][:, :n].copy_(parts[:, start : start + n])
            self._arrive()
            for q in range(self.size):
                received[q, start : start + n].copy_(slots[q][self.rank, :n])

    def _sum(self, out: Tensor, terms: list[Tensor], first: int, ring: int) -> None:
        """``out`` = the sum of `terms` (one per rank) for buffer elements [first, first + n),
        added in gloo's ring order (`ring`: its chunk length)."""
        if self.size == 2:  # one addition: the same bits in either order
            torch.add(terms[0], terms[1], out=out)
            return
        for start, stop, chunk in chunks_between(first, first + out.numel(), ring, self.size):
            a, b = start - first, stop - first
            one, two, *rest = ring_order(chunk, self.size)
            total = out[a:b]
            torch.add(terms[one][a:b], terms[two][a:b], out=total)
            for q in rest:
                total.add_(terms[q][a:b])

    def _next_window(self, dtype: torch.dtype) -> list[Tensor]:
        """Every rank's window for the next arrival, as `dtype`."""
        windows = self._windows.get(dtype)
        if windows is None:
            half = WINDOW_BYTES
            windows = self._windows[dtype] = [
                [b[g * half : (g + 1) * half].view(dtype) for b in self._bytes] for g in (0, 1)
            ]
        return windows[(self.seq + 1) % 2]

    def _arrive(self) -> None:
        """Tell the peers this rank's window is written; return once theirs are."""
        self.seq += 1
        seq = self.seq
        self._counters[self.rank][0] = seq
        polls = 0
        while min(int(c[0]) for c in self._counters) < seq:
            if self.closed:
                raise RuntimeError("shared memory: the group's regions were closed")
            polls += 1
            time.sleep(0.0 if polls < 64 else min(2e-5 * (polls - 63), 5e-4))
        if self._path is not None:  # every peer mapped every region before it arrived
            unlink_region(self._path)
            self._path = None


def _reset() -> None:
    for arena in _ARENAS.values():
        if arena is not None:
            arena.close()
    _ARENAS.clear()
    set_shared_memory(enabled_from_env())


tracking.register("fscale.distributed.shared_memory", _reset)
