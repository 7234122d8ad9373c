"""Tagged point-to-point messages between neighbouring ranks of one host, through shared memory.

A pipeline's stages send each other small tensors (a micro-batch's activation, its gradient)
dozens of times a step. Through gloo each message is a socket write by a progress thread, a
receive posted ahead under the connection's lock, and a wakeup of the waiting thread: about
0.2 ms of a rank's own time per send and per posted receive on this kind of host, on the
pipeline's critical path. Through memory both ranks map, a send is a copy into a ring and a
receive a copy out of it.

**Channels.** Along one axis, rank r talks this way to its ring neighbours r - 1 and r + 1
(mod N): where a pipeline's stages sit, interleaved schedules included. Rank r owns a region of
``/dev/shm`` holding its doorbell and one ring per neighbour it sends to; the neighbours map it.
A ring has one writer (its owner) and one reader, so two counters suffice: the bytes written
(`head`, stored by the writer after the data) and the bytes consumed (`tail`, stored by the
reader after copying them out). A message is written as records of a 64-byte header (tag,
message bytes, offset, bytes in this record) and a payload; a message larger than the free
space goes in several records, and a record never wraps: the rest of the ring is skipped by a
padding record. x86-64 keeps a processor's stores in order for the others, which is what the
counters rely on (`host_supports_shared_memory`).

**Never blocking a send.** A pipeline's neighbours send to each other at the same time (1F1B's
steady state), so a send must not wait for its receiver: what does not fit in the ring stays
queued on the sender and is written whenever that rank next sends, receives or `flush`es. A
rank waiting for anything takes every record its neighbours wrote into local tensors (as a
receive gloo posted ahead would) and writes what it has queued; so no ring stays full while
its reader waits, and no two ranks can wait on each other through full rings.

**Waiting.** Every event for a rank (a record written for it, space freed in a ring it writes)
raises that rank's doorbell (`fscale.distributed.doorbell`), a 32-bit counter in its region,
and wakes it. A waiting rank reads its doorbell, looks for what it waits for, watches the
doorbell briefly where every rank of the host has a core, and sleeps in the kernel until it
moves, so a rank in a bubble costs no processor time, as in gloo's blocking receive. Each wait
is bounded by the caller's patience (`ChannelTimeoutError`), and a neighbour whose process has
ended is named within 50 ms (`ChannelPeerExitedError`).

**Choice.** `open_channels` makes the channels of a group at its first call (a collective over
the group, at the same point on every rank): gloo groups whose ranks share a host, the setting
of `fscale.distributed.shared_setting` on (`FSCALE_SHARED_MEMORY=0` keeps gloo). Regions whose
pages cannot be reserved keep the group on gloo, with a warning.
"""

from __future__ import annotations

import collections
import mmap
import os
import time
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fscale import tracking
from fscale.distributed import setup_traffic
from fscale.distributed.comm import Comm
from fscale.distributed.doorbell import Doorbell, spin_for
from fscale.distributed.shared_regions import map_region, open_regions
from fscale.distributed.shared_setting import unlink_region

__all__ = [
    "RING_BYTES",
    "ChannelPeerExitedError",
    "ChannelTimeoutError",
    "ChannelWaitError",
    "Channels",
    "open_channels",
    "ring_neighbours",
]

Tensor = torch.Tensor

RING_BYTES = 1 << 20
"""Each ring's bytes: 16 of the pipeline bench's 64 KiB activations, or one 1 MiB record."""

_PAGE = 4096  # the doorbell, and each ring's counters, alone on a page
_RECORD = 64  # a record's header; records start at multiples of it
_PADDING = -1  # the tag of a record that skips to the ring's end
# Process group -> its channels, or None where it keeps gloo (`tracking.reset` forgets them).
_CHANNELS: dict[Any, Channels | None] = {}


class ChannelWaitError(OSError):
    """A wait on a shared-memory channel that ended without what it waited for."""


class ChannelTimeoutError(ChannelWaitError, TimeoutError):
    """A wait on a shared-memory channel outlasted the caller's patience."""


class ChannelPeerExitedError(ChannelWaitError, ConnectionError):
    """A neighbour's process ended while this rank waited on it (as a closed socket tells a
    gloo receive at once, instead of at the end of the patience)."""


def ring_neighbours(index: int, size: int) -> tuple[int, ...]:
    """The indices rank `index` of an axis of `size` ranks has channels with, ascending."""
    return tuple(sorted({(index + 1) % size, (index - 1) % size} - {index}))


def open_channels(comm: Comm) -> Channels | None:
    """This rank's channels over `comm`'s axis, or None where messages keep gloo. The first
    call per group is a collective over it (every rank at the same point)."""
    if comm.size == 1:
        return None
    if comm.group not in _CHANNELS:
        gloo = dist.get_backend(comm.group) == "gloo"
        _CHANNELS[comm.group] = Channels.open(comm) if gloo else None
    return _CHANNELS[comm.group]


# ---- one ring ------------------------------------------------------------------------------


class _Ring:
    """One writer's ring to one reader, as one mapping sees it (the owner's or the peer's)."""

    def __init__(self, region: mmap.mmap, offset: int) -> None:
        self._counters = np.frombuffer(region, dtype=np.int64, count=16, offset=offset)
        base = offset + _PAGE
        self._words = np.frombuffer(region, dtype=np.int64, count=RING_BYTES // 8, offset=base)
        self._bytes = torch.frombuffer(region, dtype=torch.uint8, offset=base, count=RING_BYTES)

    # head: bytes written (word 0, the writer's); tail: bytes consumed (word 8, the reader's)

    def write(self, queue: collections.deque) -> bool:
        """Write as much of `queue`'s messages (``[tag, uint8 tensor, bytes written]``) as
        fits; returns whether anything was written."""
        head, tail = int(self._counters[0]), int(self._counters[8])
        start = head
        while queue:
            message = queue[0]
            tag, data, done = message
            position = head % RING_BYTES
            contiguous = RING_BYTES - position
            free = RING_BYTES - (head - tail)
            if contiguous < 2 * _RECORD:  # no room for a useful record before the end
                if free < contiguous:
                    break
                self._header(position, _PADDING, 0, 0, contiguous - _RECORD)
                head += contiguous
                continue
            room = min(free, contiguous) - _RECORD
            left = data.numel() - done
            if room < min(left, _RECORD):
                break
            n = min(left, room)
            self._header(position, tag, data.numel(), done, n)
            payload = position + _RECORD
            self._bytes[payload : payload + n].copy_(data[done : done + n])
            head += _RECORD + _rounded(n)
            message[2] = done + n
            if done + n == data.numel():
                queue.popleft()
        if head == start:
            return False
        self._counters[0] = head  # after the records: the reader trusts what lies below it
        return True

    def read(self, arrived: dict[int, collections.deque], partial: list[Any]) -> bool:
        """Copy every record written out of the ring: finished messages into `arrived` (by
        tag, oldest first), a message still being written into ``partial[0]``; returns
        whether anything was consumed."""
        head, tail = int(self._counters[0]), int(self._counters[8])
        if head == tail:
            return False
        while tail < head:
            position = tail % RING_BYTES
            word = position // 8
            tag, total, offset, n = (int(v) for v in self._words[word : word + 4])
            if tag != _PADDING:
                if offset == 0:
                    partial[0] = (tag, torch.empty(total, dtype=torch.uint8))
                current = partial[0]
                if current is None or current[0] != tag or current[1].numel() != total:
                    raise RuntimeError(
                        f"shared-memory channel: a record of message {tag} at offset {offset} "
                        "continues no message begun (the ring's contents are inconsistent)"
                    )
                payload = position + _RECORD
                current[1][offset : offset + n].copy_(self._bytes[payload : payload + n])
                if offset + n == total:
                    arrived.setdefault(tag, collections.deque()).append(current[1])
                    partial[0] = None
            tail += _RECORD + _rounded(n)
        self._counters[8] = tail  # after the copies: the writer may now reuse the space
        return True

    def _header(self, position: int, tag: int, total: int, offset: int, n: int) -> None:
        word = position // 8
        self._words[word : word + 4] = (tag, total, offset, n)


def _rounded(n: int) -> int:
    return -(-n // _RECORD) * _RECORD


# ---- a rank's channels ---------------------------------------------------------------------


class Channels:
    """This rank's channels with its ring neighbours along one axis of one host."""

    def __init__(
        self, comm: Comm, maps: dict[int, mmap.mmap], own_path: str, pids: dict[int, int]
    ) -> None:
        self.axis, self.index, self.closed = comm.axis, comm.index, False
        self.neighbours = ring_neighbours(comm.index, comm.size)
        self._maps = maps  # kept mapped for the rings' and doorbells' views of them
        self._doorbells = {q: Doorbell(m) for q, m in maps.items()}
        # The ring from a writer q to reader p lives in q's region, at p's place among q's
        # neighbours.
        place = {q: ring_neighbours(q, comm.size) for q in maps}
        mine = maps[comm.index]
        self._out = {p: _Ring(mine, _ring_offset(i)) for i, p in enumerate(self.neighbours)}
        self._in = {
            q: _Ring(maps[q], _ring_offset(place[q].index(comm.index))) for q in self.neighbours
        }
        self._queued = {p: collections.deque() for p in self._out}
        self._arrived: dict[int, dict[int, collections.deque]] = {q: {} for q in self._in}
        self._partial: dict[int, list[Any]] = {q: [None] for q in self._in}
        self._pids = pids  # the neighbours' processes (this host's)
        self._spin = spin_for(_ranks_on_host(comm))
        self._path: str | None = own_path
        weakref.finalize(self, unlink_region, own_path)

    @classmethod
    def open(cls, comm: Comm) -> Channels | None:
        """Every neighbour's region mapped, or None where the group keeps gloo (a
        collective over the group)."""
        neighbours = ring_neighbours(comm.index, comm.size)
        size = _region_bytes(len(neighbours))
        regions = open_regions(comm, size, "fscale-channels-", "pipeline messages")
        if regions is None:
            return None
        try:
            maps = {comm.index: regions.own}
            for q in neighbours:
                peer_size = _region_bytes(len(ring_neighbours(q, comm.size)))
                maps[q] = map_region(regions.paths[q], peer_size)
            channels = cls(comm, maps, regions.path, {q: regions.pids[q] for q in neighbours})
            setup_traffic.barrier(comm)  # every neighbour has mapped this region: unlink it
        except BaseException:
            unlink_region(regions.path)
            raise
        channels._forget_path()
        return channels

    def links(self, peer: int) -> bool:
        """Whether messages to and from index `peer` go through these channels."""
        return peer in self._in

    def send(self, to: int, tag: int, payload: Tensor) -> None:
        """Send `payload` (a host tensor; it must not change until `flush`) tagged `tag` to
        index `to`. Never waits: what does not fit stays queued."""
        data = payload.detach().contiguous().reshape(-1).view(torch.uint8)
        self._queued[to].append([tag, data, 0])
        self._progress()

    def receive(self, source: int, tag: int, patience: float) -> Tensor:
        """The bytes of the oldest message tagged `tag` from index `source` (a new uint8
        tensor), waiting at most `patience` seconds (`ChannelTimeoutError`)."""
        arrived = self._arrived[source]
        deadline = time.monotonic() + patience
        own = self._doorbells[self.index]
        while True:
            seen = own.read()
            self._progress()
            waiting = arrived.get(tag)
            if waiting:
                found = waiting.popleft()
                if not waiting:
                    del arrived[tag]
                return found
            self._sleep(own, seen, deadline, f"message {tag} from index {source}")

    def flush(self, patience: float) -> None:
        """Wait until every message sent is written into its ring (its receiver takes it from
        there), at most `patience` seconds."""
        deadline = time.monotonic() + patience
        own = self._doorbells[self.index]
        while True:
            seen = own.read()
            self._progress()
            late = [p for p, queue in self._queued.items() if queue]
            if not late:
                return
            self._sleep(own, seen, deadline, f"room for messages to index {late[0]}")

    def _sleep(self, own: Doorbell, seen: int, deadline: float, what: str) -> None:
        if self.closed:
            raise RuntimeError("shared-memory channels: closed while waiting (tracking.reset)")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelTimeoutError(f"shared-memory channels over axis {self.axis!r}: {what}")
        gone = [(q, pid) for q, pid in self._pids.items() if not _alive(pid)]
        if gone:
            raise ChannelPeerExitedError(
                f"shared-memory channels over axis {self.axis!r}: waiting for {what}, the "
                f"process of index {gone[0][0]} (pid {gone[0][1]}) has exited"
            )
        # Woken by an event, or after a while to look again and time out.
        own.wait(seen, min(left, 0.05), self._spin)

    def _progress(self) -> None:
        """Take what the neighbours wrote, write what is queued; tell whom it concerns."""
        for q, ring in self._in.items():
            if ring.read(self._arrived[q], self._partial[q]):
                self._doorbells[q].ring()  # room in q's ring
        for p, queue in self._queued.items():
            if queue and self._out[p].write(queue):
                self._doorbells[p].ring()

    def _forget_path(self) -> None:
        if self._path is not None:
            unlink_region(self._path)
            self._path = None

    def close(self) -> None:
        self.closed = True
        self._forget_path()
        for doorbell in self._doorbells.values():
            doorbell.release()


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (signal 0 is sent to no one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _ranks_on_host(comm: Comm) -> int:
    """The ranks this host runs: torchrun's ``LOCAL_WORLD_SIZE``, else every rank of the job
    (`fscale.launch` starts them all here), at least the axis's own (all on this host)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = int(local) if local and local.isdigit() else dist.get_world_size()
    return max(ranks, comm.size)


def _ring_offset(place: int) -> int:
    return _PAGE + place * (_PAGE + RING_BYTES)


def _region_bytes(rings: int) -> int:
    return _ring_offset(rings)


def _reset() -> None:
    for channels in _CHANNELS.values():
        if channels is not None:
            channels.close()
    _CHANNELS.clear()


tracking.register("fscale.distributed.shared_channels", _reset)
