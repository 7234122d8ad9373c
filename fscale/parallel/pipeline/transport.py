"""Stage-to-stage messages: an activation's leaves sent forward, their gradients sent back.

The forward collective of a pipeline is a send of each stage's output to the next stage's
rank; its dual, in backward, is the send of the gradient of what was received back to the
producer (`fscale.distributed.send` / `recv` are the differentiable pair; this module is the
same pair as a scheduled runtime drives it). An activation is a pytree of tensors: each leaf
is one message, and each floating-point leaf gets exactly one gradient message back (zeros
when the stage did not use it), so both sides agree on what travels without looking at the
graph.

A send never blocks: gloo's send waits for the matching receive, so two neighbours sending to
each other at once (1F1B's steady state: an activation forward, a gradient back) would each
wait for the other. Sends go to a `Mailbox` that the step drains at its end; only receives
wait, and a schedule that passes `fscale.parallel.pipeline.check` receives only what an earlier
tick has sent. Every message is tagged by (direction, micro-batch, stage, leaf), so a rank may
receive in another order than its peer sent.

Between neighbouring ranks of one host the messages go through shared memory
(`fscale.distributed.shared_channels`, when the runner passes the axis's channels to the
`Mailbox`): a send copies into a ring, a receive takes what has arrived, nothing is posted
ahead. What follows about posting is gloo's, the transport everywhere else.

Receives are posted ahead (`Link.expect_activation` / `expect_gradients`): gloo moves a message
only once both sides have posted it — a send that finds no posted receive waits for the
receiver's notice and the sender's progress thread to write it — so a receive posted before
its send arrives takes the message at once, and the wait for it is the sender's compute only.
By default the runner posts every receive of the step before its first action: a post takes
the connection's lock, which the progress thread holds while it moves a message, so posts made
while messages are in flight block for a while, on a loaded host often for milliseconds (on
2 and 4 gloo ranks, `bench/pipeline.py`'s small model with 8 micro-batches: GPipe, 1F1B and
interleaved steps took 3–17% less time with every receive posted at the start than with two
posted ahead before each action). `fscale.pipeline(..., receive_ahead=k)` posts k ahead
instead, for stages whose boundary tensors are too large to hold one per micro-batch.

Stages on an accelerator (a GPU) send through host memory: a message is copied to the host
before it is sent (`Mailbox.post`) and to the receiving rank's device once it has arrived
(the `device` of its `Mailbox`), so the same matching by tag, shared memory and gloo carry it.
Each message then costs a copy each way across the host link, which NCCL's direct send would
not; NCCL cannot take this transport's messages as they are posted (`check_transport`).

Every wait is bounded (`arrival`): by the step's ticks in the schedule's table times the
collective timeout, which no wait exceeds while each action takes less than that timeout. A
peer that failed or left is then named with the message it never sent, and a rank whose step
failed while messages were in flight refuses its next step (`in_flight`): the
receives it posted would take that step's messages.

The comm ledger records each send (the bytes this rank puts on the wire), under the
pipeline's axis. A mailbox made with `on_wait` is told the seconds each receive through it
took, blocked and taking the message in (`fscale.parallel.pipeline.timeline` counts them as
idle).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed.comm import Comm
from fscale.distributed.ledger import record
from fscale.distributed.shared_channels import Channels, ChannelWaitError
from fscale.distributed.watchdog import CollectiveTimeoutError, collective_timeout

__all__ = [
    "LOSS_TAG",
    "Link",
    "Mailbox",
    "arrival",
    "check_transport",
    "differentiable",
    "in_flight",
    "message_tag",
    "wait",
]

Tensor = torch.Tensor
LeafSpec = tuple[torch.Size, torch.dtype]


def check_transport(backend: str, devices: set[torch.device], axis: str) -> torch.device:
    """The device this rank's messages arrive on, or an error for stages the transport
    cannot carry, before anything is sent.

    `backend` is the pipeline axis's process-group backend as `torch.distributed.get_backend`
    names it (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``), `devices` the devices of this
    rank's stage parameters and of the batch. Messages travel on gloo between host tensors,
    matched by tag (a stage on a GPU sends through host memory, see the module docstring):
    NCCL ignores tags, matches a pair of ranks' messages in the order they were issued on one
    stream, and lets a send block until its receive runs, so the same posts would hang or
    cross there.
    """
    if len(devices) > 1:
        named = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"pipeline: this rank's stages and batch on axis {axis!r} are on several devices "
            f"({named}); put each rank's stage parameters and the batch on one device (the "
            "batch goes whole to every rank of the axis: move it to that rank's device)"
        )
    if "gloo" not in backend:
        raise NotImplementedError(
            f"pipeline: the process group of axis {axis!r} runs on {backend!r}; pipeline "
            "messages travel on gloo (host tensors, matched by tag; stages on a GPU send "
            "through host memory). Initialise the ranks with gloo for the host, e.g. "
            "fscale.launch(..., backend='gloo') or torch.distributed.init_process_group("
            "'cpu:gloo,cuda:nccl')"
        )
    return next(iter(devices), torch.device("cpu"))


# Process groups on which a pipeline step failed while its messages were in flight, and why.
_FAILED: dict[Any, str] = {}


@contextlib.contextmanager
def in_flight(comm: Comm | None) -> Iterator[None]:
    """The part of a step in which its messages are in flight.

    An error inside it (a stage's, a receive that never came) leaves receives posted that
    would take the next step's messages, so the group is noted, and a later block on it is
    refused at entry, before anything is posted."""
    if comm is None:
        yield
        return
    failed = _FAILED.get(comm.group)
    if failed is not None:
        raise RuntimeError(
            f"pipeline: an earlier step failed on this rank while its messages over axis "
            f"{comm.axis!r} were in flight ({failed}); receives it posted are still pending and "
            "would take this step's messages. Start the ranks' process group anew (a new "
            "fscale.launch, or destroy_process_group and init_process_group) before the next "
            "pipeline step"
        )
    try:
        yield
    except BaseException as error:
        _FAILED[comm.group] = f"{type(error).__name__}: {str(error)[:200]}"
        raise


def differentiable(dtype: torch.dtype) -> bool:
    """Whether a leaf of `dtype` carries a gradient between stages."""
    return dtype.is_floating_point or dtype.is_complex


def message_tag(
    gradient: bool, micro_batch: int, stage: int, micro_batches: int, leaf: int, num_leaves: int
) -> int:
    """The tag of leaf `leaf` of stage `stage`'s output for `micro_batch` (or its gradient)."""
    message = 2 * (stage * micro_batches + micro_batch) + int(gradient)
    return message * num_leaves + leaf + 1


# The tag of the step's loss, sent by the last stage's rank to the others (`message_tag`
# numbers the stages' messages from 1).
LOSS_TAG = 0


def wait(work: Any) -> None:
    """Wait for a point-to-point operation (None: it completed at once)."""
    if work is not None:
        work.wait()


class Mailbox:
    """Sends posted and not yet known to be delivered (`drain` waits for all of them), and
    receives posted ahead of their use.

    `on_wait`, if given, receives the seconds each blocking receive through this mailbox
    took. `patience` bounds each wait, in seconds (`arrival`). Messages to and from the
    ranks `channels` links (`fscale.distributed.shared_channels`) go through shared memory
    instead of gloo: nothing is posted ahead there, and a send is done once in the ring.
    Messages travel as host tensors; a received one is placed on `device` (None: the host).
    """

    def __init__(
        self,
        patience: float,
        on_wait: Callable[[float], None] | None = None,
        channels: Channels | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._pending: dict[tuple[int, int], tuple[Any, Tensor, Comm]] = {}
        self._expected: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self.patience = patience
        self.on_wait = on_wait
        self._channels = channels
        self._comm: Comm | None = None  # the axis the channels serve, once a message names it
        self._device = None if device is None or device.type == "cpu" else device

    def _shared(self, comm: Comm, peer: int) -> Channels | None:
        channels = self._channels
        if channels is None or not channels.links(peer):
            return None
        self._comm = comm
        return channels

    def post(self, tensor: Tensor, comm: Comm, to: int, tag: int) -> None:
        payload = tensor.detach()
        if payload.device.type != "cpu":  # gloo and the rings carry host memory
            payload = payload.cpu()
        record("send", comm.axis, payload.dtype, payload.numel(), comm.size)
        channels = self._shared(comm, to)
        if channels is not None:
            channels.send(to, tag, payload)
            return
        if not payload.is_contiguous():
            payload = payload.contiguous()
        work = dist.isend(payload, group=comm.group, group_dst=to, tag=tag)
        self._pending[(to, tag)] = (work, payload, comm)  # the payload lives until delivered

    def settle(self, to: int, tag: int) -> None:
        """Forget the send (`to`, `tag`), which the caller knows was received: the peer
        answered it. Its payload (often the stage's output) is then freed with the stage's
        graph instead of living until the step's end."""
        sent = self._pending.pop((to, tag), None)
        if sent is not None:
            wait(sent[0])  # returns at once; gloo marks a send complete only when waited on

    def drain(self) -> float:
        """Wait for every posted send; returns the seconds that took."""
        if self._expected:  # the next step reuses the tags: nothing may stay posted
            raise RuntimeError(
                f"pipeline: receives {sorted(self._expected)} (source, tag) were posted and "
                "never used"
            )
        start = time.perf_counter()
        if self._channels is not None and self._comm is not None:
            try:
                self._channels.flush(self.patience)
            except ChannelWaitError as error:
                what = "messages this rank sent"
                raise _lost(self._comm, None, what, self.patience, error) from error
        pending, self._pending = self._pending, {}
        for (to, _), (work, _, comm) in pending.items():
            arrival(work, comm, to, "a message this rank sent", self.patience, sent=True)
        return time.perf_counter() - start

    def expect(self, comm: Comm, spec: LeafSpec, source: int, tag: int) -> None:
        """Post the receive of the tensor tagged `tag` from index `source` now."""
        if self._shared(comm, source) is not None:
            return  # shared memory takes messages as they come
        self._expected[(source, tag)] = _post_receive(comm, spec, source, tag)

    def receive_later(
        self, comm: Comm, spec: LeafSpec, source: int, tag: int
    ) -> Callable[[], Tensor]:
        """Post the receive of a message no action waits for (the step's loss) now; the
        function returned blocks until it has arrived and returns it."""
        if self._shared(comm, source) is not None:
            return lambda: self._placed(self._take(comm, spec, source, tag, "the step's loss"))
        work, buffer = _post_receive(comm, spec, source, tag)

        def arrived() -> Tensor:
            arrival(work, comm, source, "the step's loss", self.patience)
            return self._placed(buffer)

        return arrived

    def receive(
        self, comm: Comm, spec: LeafSpec, source: int, tag: int, what: str = "a message"
    ) -> Tensor:
        """Block until the tensor tagged `tag` from index `source` along the axis arrives
        (`what` it is names it in the error if it never does; see `arrival`)."""
        start = time.perf_counter()
        if self._shared(comm, source) is not None:
            found = self._take(comm, spec, source, tag, what)
        else:
            posted = self._expected.pop((source, tag), None)
            if posted is None:
                posted = _post_receive(comm, spec, source, tag)
            arrival(posted[0], comm, source, what, self.patience)
            found = posted[1]
        found = self._placed(found)
        if self.on_wait is not None:
            self.on_wait(time.perf_counter() - start)
        return found

    def _placed(self, tensor: Tensor) -> Tensor:
        """A received host tensor on this rank's device."""
        return tensor if self._device is None else tensor.to(self._device)

    def _take(self, comm: Comm, spec: LeafSpec, source: int, tag: int, what: str) -> Tensor:
        """A message through shared memory, as the tensor `spec` describes."""
        assert self._channels is not None
        try:
            data = self._channels.receive(source, tag, self.patience)
        except ChannelWaitError as error:
            raise _lost(comm, source, what, self.patience, error) from error
        shape, dtype = spec
        expected = math.prod(shape) * dtype.itemsize
        if data.numel() != expected:
            raise ValueError(
                f"pipeline: {what} from index {source} of axis {comm.axis!r} holds "
                f"{data.numel()} bytes, where a {tuple(shape)} {dtype} tensor has {expected}: "
                "the two ranks disagree on what crosses this boundary"
            )
        return data.view(dtype).view(shape)


def _post_receive(comm: Comm, spec: LeafSpec, source: int, tag: int) -> tuple[Any, Tensor]:
    buffer = torch.empty(spec[0], dtype=spec[1])
    return dist.irecv(buffer, group=comm.group, group_src=source, tag=tag), buffer


def arrival(
    work: Any, comm: Comm, source: int, what: str, patience: float, sent: bool = False
) -> None:
    """Wait for a receive from index `source` of `comm`'s axis (or, `sent`, for the send to it
    to be taken), at most `patience` seconds.

    A peer that failed in the step (an error in its stage), left, or waits elsewhere never
    sends; without a bound the wait would end only at the process group's timeout, in the
    backend's "Timed out waiting ... for recv". Raises `CollectiveTimeoutError` naming the
    message, both ranks and the cause (the backend's error when the peer's connection closed).
    After it the step's other posted receives are still pending: as after any collective that
    timed out, the process group cannot be used again.
    """
    if work is None:
        return
    try:
        work.wait(datetime.timedelta(seconds=patience))
        return
    except RuntimeError as error:
        failure = error
    raise _lost(comm, source, what, patience, failure, sent) from failure


def _lost(
    comm: Comm,
    source: int | None,
    what: str,
    patience: float,
    failure: Exception,
    sent: bool = False,
) -> CollectiveTimeoutError:
    """The error for a wait that outlasted `patience`: the message, both ranks (`source`
    None: any neighbour), the cause."""
    me = comm.mesh.global_rank(comm.axis, comm.index)
    timed_out = isinstance(failure, TimeoutError) or "timed out" in str(failure).lower()
    reason = "the wait timed out" if timed_out else "the connection failed"
    if source is None:
        peer_named = f"a neighbour along axis {comm.axis!r}"
    else:
        peer = comm.mesh.global_rank(comm.axis, source)
        peer_named = f"rank {peer} ({comm.axis}={source})"
    taken = sent or source is None
    subject = f"{peer_named} to take {what}" if taken else f"{what} from {peer_named}"
    return CollectiveTimeoutError(
        f"pipeline: rank {me} ({comm.axis}={comm.index}) waited for {subject} in vain: "
        f"{reason} (this rank waits at most {patience:g} s: the step's ticks in the schedule's "
        f"table times FSCALE_COLLECTIVE_TIMEOUT, {collective_timeout():g} s, which no wait "
        "exceeds while every action takes less than that). The peer failed in this step (its "
        "own error says why), left, or waits elsewhere; for actions that take longer, raise "
        f"FSCALE_COLLECTIVE_TIMEOUT. The transport reported: {failure}"
    )


@dataclasses.dataclass
class Link:
    """One stage boundary for one micro-batch, seen from one side: the peer's index along the
    axis, the leaves' shapes and dtypes, and the tags of their messages."""

    comm: Comm
    mailbox: Mailbox
    peer: int
    micro_batch: int
    stage: int  # the stage whose output crosses the boundary
    micro_batches: int
    specs: Sequence[LeafSpec]

    def tag(self, gradient: bool, leaf: int) -> int:
        return message_tag(
            gradient, self.micro_batch, self.stage, self.micro_batches, leaf, len(self.specs)
        )

    def send_activation(self, leaves: Sequence[Tensor]) -> None:
        for index, leaf in enumerate(leaves):
            self.mailbox.post(leaf, self.comm, self.peer, self.tag(False, index))

    def receive_activation(self) -> list[Tensor]:
        what = f"the output of stage {self.stage} for micro-batch {self.micro_batch}"
        return [
            self.mailbox.receive(self.comm, spec, self.peer, self.tag(False, index), what)
            for index, spec in enumerate(self.specs)
        ]

    def expect_activation(self) -> None:
        for index, spec in enumerate(self.specs):
            self.mailbox.expect(self.comm, spec, self.peer, self.tag(False, index))

    def expect_gradients(self) -> None:
        for index, spec in enumerate(self.specs):
            if differentiable(spec[1]):
                self.mailbox.expect(self.comm, spec, self.peer, self.tag(True, index))

    def send_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """Send the gradient of every differentiable leaf received (None: zeros)."""
        for index, (spec, grad) in enumerate(zip(self.specs, grads)):
            if differentiable(spec[1]):
                grad = torch.zeros(spec[0], dtype=spec[1]) if grad is None else grad
                self.mailbox.post(grad, self.comm, self.peer, self.tag(True, index))

    def receive_gradients(self) -> list[Tensor | None]:
        """The gradients of the differentiable leaves sent (None for the others); the peer
        has then received the activation, so its sends are settled."""
        grads: list[Tensor | None] = []
        what = f"the gradient of stage {self.stage}'s output for micro-batch {self.micro_batch}"
        for index, spec in enumerate(self.specs):
            if differentiable(spec[1]):
                tag = self.tag(True, index)
                grads.append(self.mailbox.receive(self.comm, spec, self.peer, tag, what))
            else:
                grads.append(None)
        for index in range(len(self.specs)):
            self.mailbox.settle(self.peer, self.tag(False, index))
        return grads
