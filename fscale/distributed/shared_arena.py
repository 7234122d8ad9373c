"""`Arena`: one process group's windows in shared memory, and the worker thread that runs them.

The transport of `fscale.distributed.shared_memory`, whose docstring describes it: each rank's
region (a counter on its own page, then two windows), the wait on the peers' counters that ends
each window, the order of addition that gives gloo's bits, the daemon worker that runs a
group's collectives in the order they were started.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import queue
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from fscale.distributed.comm import Comm
from fscale.distributed.exchange import chunks_between, ring_order
from fscale.distributed.shared_regions import map_region, open_regions
from fscale.distributed.shared_setting import unlink_region

__all__ = ["HEADER_BYTES", "WINDOW_BYTES", "Arena"]

Tensor = torch.Tensor

WINDOW_BYTES = 1 << 20
"""The bytes a rank writes per wait. 1 MiB windows took 5.1 ms for a 29.6 MB all-reduce over 2
ranks, 4 MiB windows 5.3-5.8 ms (they leave the caches); each rank maps 2N of them."""

HEADER_BYTES = 4096
"""The region's header: the counter, alone on its page."""


class Arena:
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
            torch.frombuffer(m, dtype=torch.uint8, offset=HEADER_BYTES, count=2 * WINDOW_BYTES)
            for m in maps
        ]
        self._windows: dict[torch.dtype, list[list[Tensor]]] = {}
        # A daemon thread of its own, not an executor's: an executor's threads are joined at
        # exit, which would hang a process whose peer never arrived.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="fscale-shared-memory", daemon=True).start()

    @classmethod
    def open(cls, comm: Comm) -> Arena | None:
        """Every rank's region mapped, or None where the group keeps gloo (a collective)."""
        size = HEADER_BYTES + 2 * WINDOW_BYTES
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

    def unmap_windows(self) -> None:
        """Unmap the windows' pages (they keep their contents); run on the worker, where no
        window is in use."""
        for region in self._maps:
            region.madvise(mmap.MADV_DONTNEED, HEADER_BYTES, 2 * WINDOW_BYTES)

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
        """Part q of `out` = part `rank` of rank q's `flat`: `all_to_all_uneven` with N equal
        parts."""
        part = flat.numel() // self.size
        equal = (part,) * self.size
        self.all_to_all_uneven(flat, out, equal, equal, part)

    def all_to_all_uneven(
        self,
        flat: Tensor,
        out: Tensor,
        sends: tuple[int, ...],
        receives: tuple[int, ...],
        largest: int,
    ) -> None:
        """The next ``sends[j]`` elements of `flat` to rank j, the ``receives[q]`` from rank q
        into `out`, in rank order. Each window carries a slice of every destination's part,
        laid out as the reduce-scatter's; every rank runs the windows of the largest pair's
        count, `largest` (the same on every rank), sending or receiving or not."""
        step = WINDOW_BYTES // (flat.element_size() * self.size)
        send_at = [sum(sends[:j]) for j in range(self.size)]
        receive_at = [sum(receives[:q]) for q in range(self.size)]
        for start in range(0, largest, step):
            window = self._next_window(flat.dtype)
            slots = [w[: self.size * step].view(self.size, step) for w in window]
            for j, count in enumerate(sends):
                n = min(step, count - start)
                if n > 0:
                    slots[self.rank][j, :n].copy_(flat[send_at[j] + start :][:n])
            self._arrive()
            for q, count in enumerate(receives):
                n = min(step, count - start)
                if n > 0:
                    out[receive_at[q] + start :][:n].copy_(slots[q][self.rank, :n])

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
