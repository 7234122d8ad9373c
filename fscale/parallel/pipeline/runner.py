"""`run_schedule`: one rank's part of a pipeline step, its actions run in the schedule's order.

For each (micro-batch m, stage s) the rank holds:

- ``F``: the input is micro-batch m's inputs (stage 0), the previous stage's output on this rank
  (cut from its graph), or received with `recv_activation`; the stage runs (under
  `fscale.checkpoint` when the checkpoint mode says so) and its output goes to the next stage —
  through `send_activation`, whose token is then the root of the stage's backward — or, on the
  last stage, into ``loss_fn(outputs, targets)``: a mean over the micro-batch's samples,
  weighted by the micro-batch's share of the batch (1/M), or ``(mean, count)``, a mean over
  `count` items (tokens), weighted by `count` — the caller divides by the global count. Either
  way the gradient is that of the mean over the whole batch, whatever M is.
- ``B``: one ``torch.autograd.grad`` from the root: the gradient of the output arrives from the
  next stage (the token's backward receives it), the input's gradient leaves for the previous
  stage (the recv's backward sends it), and — unless the schedule splits — the weights'
  gradients are added to the stage's sum.
- ``W`` (split schedules): the weights' gradients, from the output and the gradient B received,
  through the graph B kept. Autograd runs backward through the layers again for this (it cannot
  keep the per-layer output gradients of B), so W costs about one more input-gradient pass,
  and a checkpointed stage is recomputed for B and again for W.

Under `fscale.parallel.pipeline.timeline.record_timeline` each action is timed, its waits on
receives counted, and the activations it saves measured.

Checkpoint modes are torchgpipe's: ``"always"`` recomputes every micro-batch's stage in
backward, ``"except_last"`` all but the last micro-batch's (whose backward comes first in
GPipe's drain, so recomputing it saves nothing), ``"never"`` keeps every activation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fscale import random as fsrandom
from fscale import tree
from fscale.distributed.comm import Comm
from fscale.grad import normalize_loss_output
from fscale.parallel.pipeline.schedule import Schedule
from fscale.parallel.pipeline.stages import Stages
from fscale.parallel.pipeline.timeline import StepRecorder, recording
from fscale.parallel.pipeline.transport import (
    Link,
    Outbox,
    message_tag,
    recv_activation,
    send_activation,
)
from fscale.remat import checkpoint as remat_checkpoint

__all__ = ["CHECKPOINT_MODES", "RankResult", "run_schedule"]

PyTree = Any
CHECKPOINT_MODES = ("always", "except_last", "never")


class RankResult(NamedTuple):
    """What one rank computed: gradients and new buffers per local stage; on the rank of the
    last stage, the sum of the weighted micro-batch losses and, when the loss gives counts,
    the sum of the counts (else None: the weights were 1/M)."""

    grads: tuple[PyTree, ...]
    buffers: tuple[PyTree, ...]
    loss: torch.Tensor | None
    count: torch.Tensor | None


class _Unit:
    """One (micro-batch, stage) between its forward and its last backward action."""

    __slots__ = ("grad_out", "input", "link", "output", "root")

    def __init__(self) -> None:
        # What B differentiates w.r.t. for the input's gradient (None on stage 0): the leaf cut
        # from the previous stage's output on this rank, or the received tensor's template.
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.root: torch.Tensor | None = None  # what B differentiates: token, loss or output
        self.grad_out: torch.Tensor | None = None  # grad of root (None: implicit, scalar root)
        self.link: Link | None = None  # the link to the next stage, if remote


def run_schedule(
    schedule: Schedule,
    index: int,
    comm: Comm | None,
    stages: Stages,
    params: Sequence[PyTree],
    buffers: Sequence[PyTree],
    inputs: Sequence[torch.Tensor],
    targets: Sequence[Any],
    loss_fn: Any,
    key: torch.Tensor,
    checkpoint: str,
    shapes: dict[int, tuple[torch.Size, torch.dtype]],
) -> RankResult:
    """Run rank `index`'s actions of `schedule` (see the module docstring).

    `params` / `buffers` hold one pytree per local stage (in `schedule.local_stages(index)`
    order) and are not modified; `shapes[s]` is the shape and dtype of stage s's output.
    """
    local = schedule.local_stages(index)
    position = {stage: i for i, stage in enumerate(local)}
    last = schedule.num_stages - 1
    micro_batches = schedule.micro_batches
    weight = 1.0 / micro_batches
    # Own aliases of the parameters: the per-micro-batch backwards must not fire the hooks
    # that the plans around the pipeline put on the live leaves.
    leaves = [[t.detach().requires_grad_(True) for t in tree.leaves(p)] for p in params]
    treedefs = [tree.structure(p) for p in params]
    stage_params = [tree.unflatten(d, ls) for d, ls in zip(treedefs, leaves)]
    grads: list[list[torch.Tensor | None]] = [[None] * len(ls) for ls in leaves]
    stage_buffers = list(buffers)
    units: dict[tuple[int, int], _Unit] = {}
    local_grads: dict[tuple[int, int], torch.Tensor] = {}
    recorder = StepRecorder(tree.leaves((params, buffers))) if recording() else None
    outbox = Outbox(None if recorder is None else recorder.waited)
    loss_sum: torch.Tensor | None = None
    counts: list[torch.Tensor] = []

    def link(m: int, stage: int, gradient_of: int) -> Link:
        # The link carries stage `gradient_of`'s output forward and its gradient back.
        peer = schedule.stage_ranks[stage]
        assert comm is not None
        return Link(
            comm,
            peer,
            message_tag(False, m, gradient_of, micro_batches),
            message_tag(True, m, gradient_of, micro_batches),
            outbox,
        )

    def add(i: int, found: Sequence[torch.Tensor | None]) -> None:
        for j, g in enumerate(found):
            if g is not None:
                total = grads[i][j]
                grads[i][j] = g if total is None else total + g

    def forward(m: int, stage: int) -> None:
        nonlocal loss_sum
        unit = units.setdefault((m, stage), _Unit())
        i = position[stage]
        if stage == 0:
            x = inputs[m]
        elif schedule.stage_ranks[stage - 1] == index:
            x = units[(m, stage - 1)].output.detach().requires_grad_(True)  # type: ignore[union-attr]
            unit.input = x
        else:
            shape, dtype = shapes[stage - 1]
            template = torch.zeros(shape, dtype=dtype, requires_grad=True)
            x = recv_activation(template, link(m, stage - 1, stage - 1))
            # Differentiating w.r.t. the template, not x, runs the recv's backward: the send
            # of x's gradient to the previous stage.
            unit.input = template
        call = stages.calls[stage]
        if checkpoint == "always" or (checkpoint == "except_last" and m < micro_batches - 1):
            call = remat_checkpoint(call)
        with torch.enable_grad():
            y, stage_buffers[i] = call(
                stage_params[i], stage_buffers[i], x, fsrandom.fold_in(key, m)
            )
            unit.output = y
            if stage == last:
                loss, count = _loss_and_count(loss_fn(y, targets[m]), m, len(counts))
                if count is not None:
                    counts.append(count)
                unit.root = loss * (weight if count is None else count)
                loss_sum = unit.root.detach() if loss_sum is None else loss_sum + unit.root.detach()
            elif schedule.stage_ranks[stage + 1] == index:
                unit.root = y
            else:
                unit.link = link(m, stage + 1, stage)
                unit.root = send_activation(y, unit.link)

    def targets_of(unit: _Unit, i: int, with_weights: bool) -> list[torch.Tensor]:
        wanted = [unit.input] if unit.input is not None else []
        if with_weights:
            wanted += leaves[i]
        return wanted or [unit.output]  # type: ignore[list-item]

    def backward(m: int, stage: int, split: bool) -> None:
        unit = units[(m, stage)]
        i = position[stage]
        if stage < last and schedule.stage_ranks[stage + 1] == index:
            unit.grad_out = local_grads.pop((m, stage))
        wanted = targets_of(unit, i, not split)
        assert unit.root is not None
        found = torch.autograd.grad(
            unit.root, wanted, unit.grad_out, retain_graph=split, allow_unused=True
        )
        if unit.input is not None and stage > 0 and schedule.stage_ranks[stage - 1] == index:
            local_grads[(m, stage - 1)] = found[0]
        if not split:
            add(i, found[len(wanted) - len(leaves[i]) :] if leaves[i] else [])
            del units[(m, stage)]

    def weight_grads(m: int, stage: int) -> None:
        unit = units.pop((m, stage))
        i = position[stage]
        if not leaves[i]:
            return
        if unit.link is not None:  # the root was the token: differentiate the output instead
            root, grad_out = unit.output, unit.link.received_grad
        else:
            root, grad_out = unit.root, unit.grad_out
        assert root is not None
        add(i, torch.autograd.grad(root, leaves[i], grad_out, allow_unused=True))

    split = schedule.split

    def run(kind: str, m: int, stage: int) -> None:
        if kind == "F":
            forward(m, stage)
        elif kind == "B":
            backward(m, stage, split)
        else:
            weight_grads(m, stage)

    for action in schedule.rank_actions(index):
        if recorder is None:
            run(action.kind, action.micro_batch, action.stage)
        else:
            timed = recorder.action(action.kind, action.micro_batch, action.stage)
            with timed, recorder.saving():
                run(action.kind, action.micro_batch, action.stage)
    drain_wait = outbox.drain()
    if recorder is not None:
        recorder.finish(drain_wait)
    stage_grads = tuple(
        tree.unflatten(d, [torch.zeros_like(t) if g is None else g for g, t in zip(gs, ls)])
        for d, gs, ls in zip(treedefs, grads, leaves)
    )
    count_sum = torch.stack(counts).sum() if counts else None
    return RankResult(stage_grads, tuple(stage_buffers), loss_sum, count_sum)


def _loss_and_count(out: Any, m: int, counted: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss and, if `loss_fn` returned ``(mean, count)``, the count; every micro-batch
    must return the same kind."""
    count = None
    if isinstance(out, tuple) and len(out) == 2:
        out, count = out
        count = torch.as_tensor(count, dtype=torch.float32).reshape(())
        if not bool(count > 0):
            raise ValueError(
                f"pipeline: loss_fn returned a count of {float(count)} for micro-batch {m}; a "
                "(mean, count) loss needs the positive number of items the mean is over"
            )
    loss = normalize_loss_output(out, None).loss
    if (count is None) != (counted == 0) and m > 0:
        raise ValueError(
            "pipeline: loss_fn returned (mean, count) for some micro-batches and a plain mean "
            "for others; return the same kind for every micro-batch"
        )
    return loss, count
