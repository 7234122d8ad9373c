"""The stage-to-stage pair: a differentiable send whose dual is a recv, with sends posted async.

`send_activation(y, link)` posts ``y`` to the next stage and returns a 0-dim token connected to
it; differentiating the token *receives* the gradient of ``y`` from that stage. Its dual,
`recv_activation(template, link)`, receives the activation, and its backward *sends* the
gradient of what it received back to the producer. So a stage's backward is one
``torch.autograd.grad`` of its token (or loss), and the gradients travel back along the same
links as the activations came, as `fscale.distributed.send` / `recv` define it.

Unlike those, a send here never blocks: gloo's send waits for the matching receive, so two
neighbours sending to each other at once (1F1B's steady state: an activation forward, a
gradient back) would each wait for the other. Sends go to an `Outbox` that the step drains at
its end; only receives wait, and a schedule that passes `fscale.parallel.pipeline.check`
receives only what an earlier tick has sent. Every message is tagged by (direction,
micro-batch, stage), so a rank may receive in another order than its peer sent.

The comm ledger records each send (the bytes this rank puts on the wire), under the
pipeline's axis. An outbox made with `on_wait` is told the seconds each receive along its links
and its final drain spent blocked (`fscale.parallel.pipeline.timeline` counts them as idle).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed.comm import Comm
from fscale.distributed.ledger import record

__all__ = ["Link", "Outbox", "message_tag", "recv_activation", "send_activation", "wait"]

Tensor = torch.Tensor


class Outbox:
    """Sends posted and not yet known to be delivered; `drain` waits for all of them.

    `on_wait`, if given, receives the seconds each blocking receive of a link through this
    outbox waited (see `timed_receive`)."""

    def __init__(self, on_wait: Callable[[float], None] | None = None) -> None:
        self._pending: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self.on_wait = on_wait

    def post(self, tensor: Tensor, comm: Comm, to: int, tag: int) -> None:
        payload = tensor.detach().contiguous()
        record("send", comm.axis, payload.dtype, payload.numel(), comm.size)
        work = dist.isend(payload, group=comm.group, group_dst=to, tag=tag)
        self._pending[(to, tag)] = (work, payload)  # the payload must live until delivered

    def settle(self, to: int, tag: int) -> None:
        """Forget the send (`to`, `tag`), which the caller knows was received: the peer
        answered it. Its payload (often the stage's output) is then freed with the stage's
        graph instead of living until the step's end."""
        sent = self._pending.pop((to, tag), None)
        if sent is not None:
            wait(sent[0])  # returns at once; gloo marks a send complete only when waited on

    def drain(self) -> float:
        """Wait for every posted send; returns the seconds that took."""
        start = time.perf_counter()
        pending, self._pending = self._pending, {}
        for work, _ in pending.values():
            wait(work)
        return time.perf_counter() - start

    def timed_receive(
        self, comm: Comm, shape: torch.Size, dtype: torch.dtype, source: int, tag: int
    ) -> Tensor:
        """`receive`, its blocked seconds reported to `on_wait`."""
        if self.on_wait is None:
            return receive(comm, shape, dtype, source, tag)
        start = time.perf_counter()
        buffer = receive(comm, shape, dtype, source, tag)
        self.on_wait(time.perf_counter() - start)
        return buffer


def receive(comm: Comm, shape: torch.Size, dtype: torch.dtype, source: int, tag: int) -> Tensor:
    """Block until the tensor tagged `tag` from index `source` along the axis has arrived."""
    buffer = torch.empty(shape, dtype=dtype)
    wait(dist.irecv(buffer, group=comm.group, group_src=source, tag=tag))
    return buffer


def wait(work: Any) -> None:
    """Wait for a point-to-point operation (None: it completed at once)."""
    if work is not None:
        work.wait()


def message_tag(gradient: bool, micro_batch: int, stage: int, micro_batches: int) -> int:
    """The tag of stage `stage`'s output (or the gradient sent back to it) for `micro_batch`."""
    return 2 * (stage * micro_batches + micro_batch) + int(gradient) + 1


@dataclasses.dataclass
class Link:
    """One direction of a stage boundary for one micro-batch: the peer, the tags, the outbox,
    and (filled by the backward of `send_activation`) the gradient that came back."""

    comm: Comm
    peer: int
    tag: int
    grad_tag: int
    outbox: Outbox
    received_grad: Tensor | None = None


class _SendActivation(torch.autograd.Function):
    @staticmethod
    def forward(y: Tensor, link: Link) -> Tensor:
        link.outbox.post(y, link.comm, link.peer, link.tag)
        return y.new_zeros(())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        y, ctx.link = inputs
        ctx.shape, ctx.dtype = y.shape, y.dtype

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        link = ctx.link
        grad_y = link.outbox.timed_receive(
            link.comm, ctx.shape, ctx.dtype, link.peer, link.grad_tag
        )
        link.received_grad = grad_y  # a split backward's W reuses it
        # The gradient came back, so the peer has the activation: its send is done.
        link.outbox.settle(link.peer, link.tag)
        return grad_y, None


class _RecvActivation(torch.autograd.Function):
    @staticmethod
    def forward(template: Tensor, link: Link) -> Tensor:
        return link.outbox.timed_receive(
            link.comm, template.shape, template.dtype, link.peer, link.tag
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.link = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        link = ctx.link
        link.outbox.post(grad, link.comm, link.peer, link.grad_tag)
        return grad, None


def send_activation(y: Tensor, link: Link) -> Tensor:
    """Post `y` to `link.peer`; the returned token's backward receives `y`'s gradient."""
    return _SendActivation.apply(y, link)


def recv_activation(template: Tensor, link: Link) -> Tensor:
    """Receive a tensor shaped like `template` (which must require grad, so that autograd runs
    this function's backward, the send of the gradient back to `link.peer`)."""
    return _RecvActivation.apply(template, link)
