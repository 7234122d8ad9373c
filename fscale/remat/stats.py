"""Remat accounting: what checkpointed calls keep for backward and how often they recompute."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from fscale import tracking

__all__ = ["RematStats", "count", "track"]


@dataclasses.dataclass
class RematStats:
    """What checkpointed calls kept for backward while a `track()` context was open.

    Attributes:
        calls: checkpointed calls that kept state for backward (calls under `no_grad` or with
            no input requiring grad just run fn and are not counted).
        saved_bytes: bytes kept for backward: argument tensors, kept named values and
            snapshots of mutated buffers, each storage counted once per call. A checkpointed
            module's own parameters and unmodified buffers are not counted: the model holds
            them anyway.
        offloaded_bytes: the part of `saved_bytes` that `offload=True` parks in host memory
            (on CPU the host is the device, so this is every byte an offloading checkpoint
            keeps).
        recomputations: backward passes that ran fn again.
    """

    calls: int = 0
    saved_bytes: int = 0
    offloaded_bytes: int = 0
    recomputations: int = 0


_TRACKERS: tracking.Stack[RematStats] = tracking.stack(__name__)


@contextlib.contextmanager
def track() -> Iterator[RematStats]:
    """Count the bytes checkpoints keep and the recomputations they run inside the block.

    Yields:
        A `RematStats` filled in as checkpointed functions run; nested `track()` blocks each
        see every event.
    """
    with _TRACKERS.open(RematStats()) as stats:
        yield stats


def count(**increments: int) -> None:
    """Add `increments` (`RematStats` field -> amount) to every open `track()` block."""
    for stats in _TRACKERS.active():
        for field, amount in increments.items():
            setattr(stats, field, getattr(stats, field) + amount)
