"""Prefetch schedule: which of a sequence of items are on the device, fetched ahead of their use.

Items ``0 .. n-1`` (stages, parameter units) are used in order in forward and in reverse order
in backward. Using item i means: make it resident (issue its copy, unless a prefetch already
did), issue the copies of the next `prefetch` items (the previous ones, in backward) so they
overlap item i's compute, wait for item i's copy, compute, release it. The schedule owns the
bookkeeping only; what a copy is comes from two callables, ``start(i) -> handle`` (issue the
copy) and ``finish(handle) -> value`` (wait for it, return the usable value), so the same
schedule drives host-to-device uploads (`fscale.offload_params`) and the forward all-gathers
of `fscale.fully_shard`'s units.

An item is *resident* from the moment its copy is issued until it is released, which is what
bounds device memory to ``prefetch + 1`` items. Every change is logged as a `ResidencyEvent`.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any, NamedTuple

__all__ = ["PrefetchSchedule", "ResidencyEvent"]


class ResidencyEvent(NamedTuple):
    """One entry of a residency log (`PrefetchSchedule.log`, `OffloadedStages.residency_log`).

    Attributes:
        phase: "forward" or "backward".
        action: "fetch" (a copy of the item to the device was issued: from here on it
            occupies device memory), "compute" (the item is in use, e.g. a stage runs on its
            device params) or "release" (the device copy was dropped).
        stage: the item's (stage's) index.
        resident: the items whose copies are on the device after the event, sorted.
    """

    phase: str
    action: str
    stage: int
    resident: tuple[int, ...]


class PrefetchSchedule:
    """The device residency of `num_items` items used in order, `prefetch` items ahead.

    Args:
        num_items: how many items there are (indexes ``0 .. num_items - 1``).
        prefetch: how many items ahead of (behind, in backward) the used one are fetched early.
        start: ``start(i)`` issues item i's copy and returns a handle for `finish`.
        finish: ``finish(handle)`` waits for the copy and returns the usable value.

    Attributes:
        log: every `ResidencyEvent` so far.

    Raises:
        ValueError: if `num_items` < 0 or `prefetch` < 0.
        TypeError: if `start` or `finish` is not callable.
    """

    def __init__(
        self,
        num_items: int,
        prefetch: int,
        start: Callable[[int], Any],
        finish: Callable[[Any], Any],
    ) -> None:
        if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
            raise ValueError(
                f"PrefetchSchedule: `num_items` must be an int >= 0, got {num_items!r}"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"PrefetchSchedule: `prefetch` must be an int >= 0, got {prefetch!r}")
        for arg, fn in (("start", start), ("finish", finish)):
            if not callable(fn):
                raise TypeError(f"PrefetchSchedule: `{arg}` must be callable, got {fn!r}")
        self.num_items = num_items
        self.prefetch = prefetch
        self._start = start
        self._finish = finish
        self._in_flight: dict[int, Any] = {}
        self._resident: set[int] = set()
        self.log: list[ResidencyEvent] = []

    @property
    def resident(self) -> tuple[int, ...]:
        """The resident items, sorted."""
        return tuple(sorted(self._resident))

    def record(self, phase: str, action: str, item: int) -> None:
        """Log `action` on `item` with the current residency."""
        self.log.append(ResidencyEvent(phase, action, item, self.resident))

    def fetch(self, item: int, phase: str) -> None:
        """Issue `item`'s copy unless it is resident already."""
        if item in self._resident:
            return
        self._in_flight[item] = self._start(item)
        self._resident.add(item)
        self.record(phase, "fetch", item)

    def acquire(self, item: int, phase: str) -> Any:
        """`item`'s usable value: fetched now unless a prefetch did, then waited for.

        An item used before and not released (a unit called twice in one forward) has no copy
        in flight any more: it is copied again.
        """
        self.fetch(item, phase)
        if item not in self._in_flight:
            self._in_flight[item] = self._start(item)
            self.record(phase, "fetch", item)
        return self._finish(self._in_flight.pop(item))

    def drain(self, phase: str) -> list[Any]:
        """The handles of copies issued but never acquired (prefetched items nobody used),
        released; the caller waits for them (a collective must complete on every rank)."""
        handles = []
        for item in sorted(self._in_flight):
            handles.append(self._in_flight.pop(item))
            self._resident.discard(item)
            self.record(phase, "release", item)
        return handles

    def adopt(self, item: int, phase: str) -> None:
        """Count `item` as resident through a copy made by the caller (no `start`).

        A copy issued for it earlier is dropped: the caller's copy replaces it.
        """
        self._in_flight.pop(item, None)
        if item not in self._resident:
            self._resident.add(item)
            self.record(phase, "fetch", item)

    def holds(self, item: int) -> bool:
        """Whether `item` is resident (its copy issued and not released)."""
        return item in self._resident

    def release(self, item: int, phase: str) -> Any:
        """Drop `item`'s device copy; returns the handle of a copy still in flight (None if
        there is none), for a caller whose copies must be waited for (a collective)."""
        handle = self._in_flight.pop(item, None)
        self._resident.discard(item)
        self.record(phase, "release", item)
        return handle

    def prefetch_after(self, item: int, phase: str = "forward") -> None:
        """Fetch the `prefetch` items after `item` (those the forward uses next)."""
        last = min(item + self.prefetch, self.num_items - 1)
        for ahead in range(item + 1, last + 1):
            self.fetch(ahead, phase)

    def prefetch_before(
        self, item: int, phase: str = "backward", among: Container[int] | None = None
    ) -> None:
        """Fetch the `prefetch` items before `item` that the backward uses next.

        Args:
            item: the item in use.
            phase: the log's phase.
            among: the items the backward will still use (default all): only they are fetched
                and counted, so an item that gets no backward call is skipped (its copy would
                never be released) and the next used one is fetched in its place.
        """
        fetched = 0
        for behind in range(item - 1, -1, -1):
            if fetched == self.prefetch:
                break
            if among is None or behind in among:
                self.fetch(behind, phase)
                fetched += 1
