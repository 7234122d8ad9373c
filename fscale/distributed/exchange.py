"""All-gathers and reduce-scatters on gloo as pairwise exchanges: each byte crosses the wire once.

gloo's all-gather and reduce-scatter of a flat buffer cost far more than the bytes they move
(`bench/collectives.py`): on 2 ranks, 16 MB, an all-gather takes 0.8x and a reduce-scatter
1.5x the time of an all-reduce, which moves twice their bytes. Sends and receives between every
pair of ranks, all posted at once, move the same bytes in about half the time of the
collective: on this machine (gloo over loopback, 14.8 MB) the all-gather 10.3 -> 5.9 ms at 2
ranks and 21 -> 11.5 ms at 4, the 2-rank reduce-scatter 13.0 ms (an all-reduce) -> 7.0 ms.

- `exchange_all_gather`: rank r sends its shard to every other rank and receives theirs into
  their places in the buffer. No arithmetic, so the result is the collective's, bit for bit.
- `exchange_reduce_scatter`: rank r sends every other rank q its part q of the buffer and sums
  the N - 1 parts it receives with its own, element by element in the order gloo's ring
  all-reduce of the same buffer sums that element (`ring_chunk`), so the shard holds the bits
  of DDP's all-reduce (and of gloo's reduce-scatter, which follows the same ring). With two
  ranks any order gives them: one addition, and addition is commutative. Over more ranks the
  order depends on how gloo cuts the buffer, which changed between gloo versions:
  `exchanges_reduce_scatter` asks `ring_rule`, which probes the installed gloo once and
  answers None (keep gloo's collective) for an order it does not know. The parts received
  are the price: (N - 1)/N of the bucket per reduction in flight, one part of which becomes the
  shard the step keeps (gloo's ring holds two 1 MiB segments).

Both return a `PairWork`, which `fscale.distributed.watchdog.wait` bounds like a collective's
work. Messages carry tags from a range of their own, numbered by the collective's ticket
(every rank of the group counts its collectives alike), so they never match the pipeline's or
`ppermute`'s messages, nor one another across buckets in flight.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from fscale.distributed.comm import Comm
from fscale.distributed.debug import count
from fscale.distributed.watchdog import Ticket, wait

__all__ = [
    "PairWork",
    "chunks_between",
    "exchange_all_gather",
    "exchange_reduce_scatter",
    "exchanges",
    "exchanges_reduce_scatter",
    "ring_chunk",
    "ring_order",
    "ring_rule",
]

# Above every tag the pipeline's transport uses (its messages are numbered from 1 by
# micro-batch, stage and leaf); two tags per collective, for a buffer and its trailing part.
_TAG_BASE = 1 << 30
_TAGS_PER_BASE = 1 << 20
EXCHANGE_MIN_BYTES = 1 << 20
"""Smaller buffers keep gloo's collectives. Below this the time goes to the messages' count,
not their bytes, and 2(N - 1) posts from the calling thread cost more than gloo's one: with
every buffer exchanged, fully_shard's ResNet step (units of tens of KiB, 2 ranks) took 13%
longer (40 isolated rounds, paired), and ZeRO-2's (one 312 KiB bucket) 2-3% longer."""

# gloo's largest all-reduce segment (AllreduceOptions::kMaxSegmentSize).
_GLOO_MAX_SEGMENT = 1 << 20


class PairWork:
    """The sends and receives of one exchange; `wait` blocks on all of them, then runs `done`.

    Has the part of c10d's Work that `fscale.distributed.watchdog.wait` uses: ``wait(timeout)``
    (raising on a timeout as c10d does) and ``is_completed()``. The watchdog waits `timeout`
    (its patience) for a collective, then compares where the ranks are and waits on while
    every peer is in it, so a peer late by less than twice the patience is no error. gloo
    closes the connection of a send or receive whose wait timed out, after which nothing
    more can pass, so an exchange cannot wait, compare and go on: it waits twice `timeout`
    before it reports the timeout. An exchange whose ranks have all posted completes as fast
    as its bytes move, so only a peer that is late or gone ever reaches that bound.
    """

    __slots__ = ("_closed", "_done", "_works", "buffers")

    def __init__(
        self,
        works: list,
        done: Callable[[], None] | None = None,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self._works = works
        self._done = done
        self._closed: str | None = None  # gloo's error once a timed wait closed the pair
        self.buffers = list(buffers)  # what the exchange allocated to receive into

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._closed is not None:
            raise RuntimeError(
                "exchange: its wait timed out earlier, and gloo then closed the connection "
                f"({self._closed}); the process group cannot be used again. For exchanges that "
                "take longer, raise FSCALE_COLLECTIVE_TIMEOUT"
            )
        deadline = None if timeout is None else time.monotonic() + 2 * timeout.total_seconds()
        while self._works:
            if deadline is None:
                self._works[0].wait()
            else:
                left = max(deadline - time.monotonic(), 1e-3)
                try:
                    self._works[0].wait(datetime.timedelta(seconds=left))
                except RuntimeError as error:
                    self._closed = str(error)
                    raise
            self._works.pop(0)
        if self._done is not None:
            done, self._done = self._done, None
            done()
        self.buffers = []
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def exchanges(comm: Comm, flat: torch.Tensor) -> bool:
    """Whether a collective over `comm` on `flat` runs as an exchange: on gloo, host tensors,
    buffers of at least `EXCHANGE_MIN_BYTES`."""
    return (
        comm.size > 1
        and flat.numel() * flat.element_size() >= EXCHANGE_MIN_BYTES
        and flat.device.type == "cpu"
        and dist.get_backend(comm.group) == "gloo"
    )


def exchanges_reduce_scatter(comm: Comm, flat: torch.Tensor) -> bool:
    """Whether a reduce-scatter over `comm` on `flat` runs as an exchange: as `exchanges`, and
    with more than two ranks only where the installed gloo's order is known (`ring_rule`,
    probed on the first call, on every rank at once)."""
    return exchanges(comm, flat) and (comm.size == 2 or ring_rule(comm) is not None)


def _tag(ticket: Ticket | None) -> int:
    seq = ticket.seq if ticket is not None else 0
    return _TAG_BASE + 2 * (seq % _TAGS_PER_BASE)


def exchange_all_gather(flat: torch.Tensor, comm: Comm, ticket: Ticket | None) -> PairWork:
    """Gather every rank's shard of `flat` (N equal parts, part r from rank r) into `flat`."""
    size, rank, tag = comm.size, comm.index, _tag(ticket)
    parts = flat.view(size, -1)
    works = []
    for step in range(1, size):
        to, source = (rank + step) % size, (rank - step) % size
        works.append(dist.isend(parts[rank], group=comm.group, group_dst=to, tag=tag))
        works.append(dist.irecv(parts[source], group=comm.group, group_src=source, tag=tag))
    return PairWork(works)


def ring_chunk(numel: int, size: int, element_size: int, rule: str = "count_first") -> int:
    """The length of the chunks gloo's ring all-reduce cuts a buffer of `numel` elements into.

    Chunk c (elements ``[c * L, (c + 1) * L)``, the last ones short or empty) is summed around
    the ring starting from rank c - 1, each rank adding its own term to the partial sum it
    receives, and ends complete on rank c: ``x[c] + (x[c + 1] + (... + (x[c - 2] + x[c - 1])))``
    (ranks mod N). gloo cuts the buffer into segments of at most 1 MiB, at least 2N of them and
    a multiple of N in number, each a whole number of elements; a chunk is 1/N of them. gloo
    has cut by two rules (`RING_RULES`): ``"count_first"`` fixes the number of segments, then
    their size (torch 2.13's gloo); ``"size_first"`` the size, then the number (older gloo).
    They differ only for buffers over 2N MiB. Pinned against gloo's own all-reduce, element
    for element, by `tests/test_exchange.py`; `ring_rule` finds the installed gloo's.
    """
    total = numel * element_size
    if rule == "count_first":
        segments = _round_up(max(-(-total // _GLOO_MAX_SEGMENT), 2 * size), size)
        segment = _round_up(-(-total // segments), element_size)
    elif rule == "size_first":
        segment = _round_up(min(-(-total // (2 * size)), _GLOO_MAX_SEGMENT), element_size)
        segments = _round_up(max(-(-total // segment), 2 * size), size)
    else:
        raise ValueError(f"ring_chunk: `rule` must be one of {RING_RULES}, got {rule!r}")
    return segments // size * segment // element_size


RING_RULES = ("count_first", "size_first")

_probed_rule: dict[str, str | None] = {}


def ring_rule(comm: Comm) -> str | None:
    """The rule (`ring_chunk`) by which the installed gloo cuts its all-reduces, or None when
    it follows neither; the first call runs a probe over `comm` (every rank of it must call).

    The probe all-reduces one buffer of 2N MiB and a little more, zero but at 64 positions
    that hold heavy-tailed values (the same on every rank, from a fixed seed) placed where the
    two rules put them in different chunks, and compares the sums bit for bit with each rule's
    order. Run once per process: the rule is the gloo library's.
    """
    if "rule" not in _probed_rule:
        _probed_rule["rule"] = _probe_rule(comm)
    return _probed_rule["rule"]


def _probe_rule(comm: Comm) -> str | None:
    size, rank = comm.size, comm.index
    numel = 2 * size * (_GLOO_MAX_SEGMENT // 4) + 5 * size  # float32: over 2N MiB
    generator = torch.Generator().manual_seed(20261204)
    positions = torch.randperm(numel, generator=generator)[:64].tolist()
    terms = torch.randn(size, 64, generator=generator, dtype=torch.float64)
    terms = (terms * torch.exp(terms * 4)).float()
    buffer = torch.zeros(numel)
    buffer[positions] = terms[rank]
    # Counted and bounded like every collective (the first exchange on a group runs it).
    ticket = count(comm, "all_reduce", buffer)
    wait(dist.all_reduce(buffer, group=comm.group, async_op=True), ticket)
    for rule in RING_RULES:
        chunk = ring_chunk(numel, size, 4, rule)
        expected = []
        for i, position in enumerate(positions):
            first, *rest = ring_order(min(position // chunk, size - 1), size)
            total = terms[first, i].clone()
            for source in rest:
                total = total + terms[source, i]
            expected.append(total)
        got = buffer[positions]
        if torch.equal(got.view(torch.int32), torch.stack(expected).view(torch.int32)):
            return rule
    return None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def exchange_reduce_scatter(
    flat: torch.Tensor, comm: Comm, ticket: Ticket | None, trailing: int
) -> tuple[PairWork, torch.Tensor]:
    """Sum `flat` over the group's ranks into this rank's part, and its last `trailing`
    elements whole, in the order gloo's all-reduce of `flat` sums each element.

    The first ``flat.numel() - trailing`` elements are cut into N equal parts, part r summed
    on rank r. Returns the work and a new tensor that holds this rank's part of the sum once
    the work is waited for; ``flat[-trailing:]`` then holds the trailing elements' sum. The
    rest of `flat` is only read; it must not change until the work is waited for.
    """
    size, rank, tag = comm.size, comm.index, _tag(ticket)
    numel = flat.numel() - trailing
    part = numel // size
    parts = flat[:numel].view(size, part)
    tail = flat[numel:]
    received = {peer: torch.empty_like(parts[rank]) for peer in range(size) if peer != rank}
    tails = {peer: torch.empty_like(tail) for peer in received} if trailing else {}
    works = []
    for step in range(1, size):
        to, source = (rank + step) % size, (rank - step) % size
        works.append(dist.isend(parts[to], group=comm.group, group_dst=to, tag=tag))
        works.append(dist.irecv(received[source], group=comm.group, group_src=source, tag=tag))
        if trailing:
            works.append(dist.isend(tail, group=comm.group, group_dst=to, tag=tag + 1))
            works.append(dist.irecv(tails[source], group=comm.group, group_src=source, tag=tag + 1))
    rule = "count_first" if size == 2 else ring_rule(comm)  # two terms: any order
    if rule is None:
        raise RuntimeError(
            "exchange_reduce_scatter: this gloo sums its all-reduces in an order fscale does "
            "not know; check exchanges_reduce_scatter(comm, flat) first"
        )
    chunk = ring_chunk(flat.numel(), size, flat.element_size(), rule)
    # The sum accumulates in the part received from rank r - 1: the first term of the chunk
    # r, which covers nearly all of part r (chunks are N-th parts rounded up).
    result = received[(rank - 1) % size]

    def terms(source: int, start: int, stop: int) -> torch.Tensor:
        """Rank `source`'s terms for elements [start, stop) of this rank's part."""
        mine = parts[rank] if source == rank else received[source]
        return mine[start:stop]

    def tail_terms(source: int, start: int, stop: int) -> torch.Tensor:
        return (tail if source == rank else tails[source])[start:stop]

    def add() -> None:
        for start, stop, c in chunks_between(rank * part, (rank + 1) * part, chunk, size):
            _sum_in_ring_order(result, terms, start - rank * part, stop - rank * part, c, size)
        for start, stop, c in chunks_between(numel, flat.numel(), chunk, size):
            _sum_in_ring_order(tail, tail_terms, start - numel, stop - numel, c, size)

    return PairWork(works, add, [*received.values(), *tails.values()]), result


def chunks_between(start: int, stop: int, chunk: int, size: int) -> Iterator[tuple[int, int, int]]:
    """The pieces of elements [start, stop) in one ring chunk each: (start, stop, chunk)."""
    while start < stop:
        c = min(start // chunk, size - 1)
        end = min(stop, (c + 1) * chunk) if c < size - 1 else stop
        yield start, end, c
        start = end


def ring_order(chunk: int, size: int) -> list[int]:
    """The ranks whose terms gloo's ring adds for chunk `chunk`, first to last: c - 1, c - 2,
    ..., c (mod N)."""
    return [(chunk - k) % size for k in range(1, size + 1)]


def _sum_in_ring_order(
    out: torch.Tensor,
    terms: Callable[[int, int, int], torch.Tensor],
    start: int,
    stop: int,
    chunk: int,
    size: int,
) -> None:
    """``out[start:stop]`` = the ring's sum of every rank's terms for chunk `chunk`.

    The ring adds each rank's term to the partial sum from rank c - 1 down to rank c; addition
    is commutative, so adding in place to the partial sum gives the ring's bits.
    """
    order = ring_order(chunk, size)
    first = terms(order[0], start, stop)
    target = out[start:stop]
    # Accumulate where the first term already lies, else in a copy of it.
    total = target if first.data_ptr() == target.data_ptr() else first.clone()
    for source in order[1:]:
        total.add_(terms(source, start, stop))
    if total is not target:
        target.copy_(total)
