"""The step's loss in a pipeline: sent by the last stage's rank to the others.

Only the rank of the last stage computes the loss. It sends three float64 values, (weighted
loss sum, count sum, whether the loss gave counts), to every other rank of the axis as soon as
its last forward has run; the others post the receive at the step's start and read it at its
end (`LossMessage`). A collective in its place would hold every rank until the slowest one's
last action, and inside the schedule a collective would deadlock: its first-time agreement
waits for every rank to issue it, while the last rank issues it only after receiving the
others' activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fscale.distributed.comm import Comm
from fscale.parallel.pipeline.schedule import Schedule
from fscale.parallel.pipeline.transport import LOSS_TAG, Mailbox

__all__ = ["LOSS_SPEC", "LossMessage", "loss_of", "loss_values"]

Tensor = torch.Tensor


class LossMessage:
    """One step's loss values on one rank: sent once the last stage's forwards on this rank
    are all done (on the last stage's rank), or received from that rank (on the others)."""

    def __init__(self, schedule: Schedule, index: int, comm: Comm | None, mailbox: Mailbox):
        self._source = schedule.stage_ranks[schedule.num_stages - 1]
        self._comm, self._mailbox = comm, mailbox
        self._forwards_left = schedule.micro_batches
        self._values: Tensor | None = None
        self._receive: Callable[[], Tensor] | None = None
        self._others = [r for r in range(schedule.num_ranks) if r != index]
        if comm is not None and index != self._source:
            self._receive = mailbox.receive_later(comm, LOSS_SPEC, self._source, LOSS_TAG)

    def forward_done(self, values: Callable[[], Tensor]) -> None:
        """After each forward of the last stage: once all are done, send the values."""
        self._forwards_left -= 1
        if self._forwards_left == 0:
            self._values = values()
            if self._comm is not None:
                for rank in self._others:
                    self._mailbox.post(self._values, self._comm, rank, LOSS_TAG)

    def values(self) -> Tensor:
        """The values the last stage's rank computed, on every rank (waits for them)."""
        if self._receive is not None:
            return self._receive()
        assert self._values is not None, "the last stage's forwards did not all run"
        return self._values


# (loss sum, count sum, whether counted): float64 keeps a float64 model's loss whole; for
# float32 and narrower losses the result, cast back, is what float32 arithmetic gives (one
# sum, one correctly rounded division).
LOSS_SPEC = (torch.Size([3]), torch.float64)


def loss_values(loss_sum: Tensor | None, counts: list[Tensor]) -> Tensor:
    """What the last stage's rank sends: its loss sum and, when the loss gives counts (one per
    micro-batch), their sum and 1, on the loss's device. Outside autograd: a raw send must not
    carry a tensor that a graph tracks (a count the loss function computed from its outputs
    would be one)."""
    found = [loss_sum] if loss_sum is not None else counts
    values = torch.zeros(3, dtype=torch.float64, device=found[0].device if found else None)
    with torch.no_grad():
        if loss_sum is not None:  # None: every micro-batch was padding
            values[0] = loss_sum.double()
        if counts:
            values[1], values[2] = torch.stack(counts).sum(), 1.0
    return values


def loss_of(values: Tensor) -> tuple[Tensor, Tensor | None]:
    """The batch's mean loss and, when the loss gave counts, the batch's count."""
    if values[2] > 0:
        return values[0] / values[1], values[1]
    return values[0], None
