"""What comes back from a set of ranks for one call: results, failures, and the error for them.

`gather_replies` waits for one reply per rank while watching the processes die; `Replies`
turns what arrived into the results in rank order or the `RankError` that explains why there
are none: the first failure first (usually the cause), the ranks that were still running, and
the ranks that had already returned (a rank that returns early leaves its peers waiting).
Shared by `launch` and `fscale.testing.RankPool`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import pickle
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fscale.distributed.ranks import RankError, RankTimeoutError

if TYPE_CHECKING:
    from fscale.distributed.ranks import PipeEnd

__all__ = ["Replies", "gather_replies"]

# After the first rank fails, give the others this long to report their own failures (ranks
# often fail together, e.g. on the same bad input) before terminating them.
_FAILURE_GRACE_S = 0.5


@dataclasses.dataclass
class Replies:
    """What came back from a set of ranks for one call."""

    world_size: int
    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    failures: dict[int, str] = dataclasses.field(default_factory=dict)
    unfinished: list[int] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether every rank returned a result."""
        return len(self.results) == self.world_size

    def results_or_raise(self, timeout: float) -> list[Any]:
        """The results in rank order, or the `RankError` that explains why there are none."""
        if self.failures:
            raise _failure_error(self.world_size, self.failures, self.unfinished, self.results)
        if self.unfinished:
            finished = sorted(self.results)
            raise RankTimeoutError(
                f"rank(s) {self.unfinished} of {self.world_size} did not finish within "
                f"{timeout:g} s and were killed (finished: {finished}). A rank that waits "
                "in a collective its peers never call hangs like this.",
                unfinished=self.unfinished,
            )
        return [self.results[r] for r in range(self.world_size)]


def gather_replies(
    connections: Sequence[PipeEnd],
    processes: Sequence[multiprocessing.process.BaseProcess],
    deadline: float,
) -> Replies:
    """Wait for one reply per rank, stopping early after a failure or at `deadline`.

    Rank ``r`` replies on ``connections[r]`` and runs as ``processes[r]``. A rank whose
    process ends without replying counts as failed. Once any rank has failed, the others get
    `_FAILURE_GRACE_S` to report before they are given up on: they may be blocked in a
    collective with the failed rank and would otherwise wait out the process-group timeout.
    """
    replies = Replies(len(connections))
    pending = set(range(len(connections)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        by_handle: dict[Any, int] = {}
        for rank_id in pending:
            by_handle[connections[rank_id]] = rank_id
            by_handle[processes[rank_id].sentinel] = rank_id
        for handle in multiprocessing.connection.wait(list(by_handle), timeout=remaining):
            rank_id = by_handle[handle]
            if rank_id in pending:
                pending.discard(rank_id)
                _receive(rank_id, connections[rank_id], processes[rank_id], replies)
        if replies.failures:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    replies.unfinished = sorted(pending)
    return replies


def _receive(
    rank_id: int,
    connection: PipeEnd,
    process: multiprocessing.process.BaseProcess,
    replies: Replies,
) -> None:
    """Read rank `rank_id`'s reply into `replies`, or record how its process ended."""
    try:
        status, value = pickle.loads(connection.recv_bytes())
    except (EOFError, OSError):
        process.join(1.0)
        replies.failures[rank_id] = (
            f"the process ended (exit code {process.exitcode}) without returning a result; "
            "its own output on stderr may say why (a rank that ends before running `fn` "
            "often re-ran the program's launch call while importing the main module: put it "
            'under `if __name__ == "__main__":`)'
        )
        return
    except Exception:
        replies.failures[rank_id] = (
            "its result could not be unpickled in the calling process:\n" + traceback.format_exc()
        )
        return
    if status == "ok":
        replies.results[rank_id] = value
    else:
        replies.failures[rank_id] = value


def _failure_error(
    world: int,
    failures: Mapping[int, str],
    unfinished: Sequence[int],
    results: Mapping[int, Any] | None = None,
) -> RankError:
    # `failures` is in arrival order. The first failure is usually the cause: a rank that
    # raises leaves its peers' collectives, so their errors ("connection closed") follow it.
    first, *later = failures
    summary = f"rank {first} of {world} failed"
    if later:
        summary += f"; then rank(s) {sorted(later)} failed too"
    if unfinished:
        summary += f"; rank(s) {list(unfinished)} were still running and were terminated"
    if results:
        # `results` is in arrival order too: the first to return is named first.
        summary += (
            f". Rank(s) {list(results)} had returned (in that order) while the others still "
            "ran: a rank that returns early (e.g. one step fewer) leaves its peers waiting in a "
            "collective, so the failure may be theirs, not the failing rank's"
        )
    sections = [f"{summary}."]
    sections.extend(f"--- rank {rank_id} ---\n{failures[rank_id].rstrip()}" for rank_id in failures)
    return RankError("\n\n".join(sections), failures, unfinished)
