"""`run_schedule`: one rank's part of a pipeline step, its actions run in the schedule's order.

For each (micro-batch m, stage s) the rank holds:

- ``F``: the input is micro-batch m's inputs (stage 0), the previous stage's output on this rank
  (cut from its graph), or received leaf by leaf (`fscale.parallel.pipeline.transport`); the
  stage runs (under `fscale.checkpoint` when the checkpoint mode says so) and its output — a
  tensor or a pytree of tensors — goes to the next stage, or, on the last stage, into
  ``loss_fn(outputs, targets)``: a mean over the micro-batch's samples, weighted by the
  micro-batch's share of the batch (1/M), or ``(mean, count)``, a mean over `count` items
  (tokens), weighted by `count` — the caller divides by the global count. Either way the
  gradient is that of the mean over the whole batch, whatever M is. With padding, the loss
  sees the micro-batch's real samples only and is weighted by their share of the batch.
- ``B``: the gradients of the output's floating-point leaves arrive from the next stage; one
  backward from them (or the loss) gives the gradients of the input's leaves, sent to the
  previous stage, and — unless the schedule splits — adds the weights' gradients to the
  stage's sum, in place (``torch.autograd.backward`` into the leaves' ``.grad``). A module
  stage whose input came from another rank sends the input's gradient first: its linear
  layers' weight gradients wait (`deferred_linear`) and are added right after the send, in
  the same B, so the previous stage's rank starts its own B that much sooner, each added to
  the sum by its own product (`deferred_linear`: equal to autograd's sum within rounding). The
  table is unchanged; the first micro-batch's gradients are the one backward's bit for bit
  where each weight serves one layer alone.
- ``W`` (split schedules): B computed the input gradient only and kept the graph; W computes
  the weights' gradients from the same graph without running any of B's work again
  (`fscale.parallel.pipeline.split_backward`). A checkpointed micro-batch would be recomputed
  for W as well; its B computes both gradients at once instead and its W adds them, as does
  stage 0, whose B feeds no stage.

Under `fscale.parallel.pipeline.timeline.record_timeline` each action is timed, its waits on
receives counted, and the activations it saves measured.

Checkpoint modes are torchgpipe's: ``"always"`` recomputes every micro-batch's stage in
backward, ``"except_last"`` all but the last micro-batch's (whose backward comes first in
GPipe's drain, so recomputing it saves nothing), ``"never"`` keeps every activation. The
reason torchgpipe gives for the last micro-batch holds, in any schedule, for every forward that
the rank's next action differentiates (`Schedule.back_to_back`: every micro-batch of 1F1B's and
ZB-H1's last stage): what it saves is held over no other action, so ``"except_last"`` recomputes
none of them either; the peak is the same and the recompute is saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from fscale import random as fsrandom
from fscale import tree
from fscale.distributed.comm import Comm
from fscale.distributed.shared_channels import open_channels
from fscale.distributed.watchdog import collective_timeout
from fscale.grad import normalize_loss_output
from fscale.parallel.pipeline.deferred_linear import LinearStore, deferring
from fscale.parallel.pipeline.loss_message import LossMessage, loss_of, loss_values
from fscale.parallel.pipeline.schedule import Schedule
from fscale.parallel.pipeline.split_backward import WeightWork, input_backward, weight_backward
from fscale.parallel.pipeline.stages import Stages
from fscale.parallel.pipeline.timeline import StepRecorder, recording
from fscale.parallel.pipeline.transport import (
    Link,
    Mailbox,
    differentiable,
    in_flight,
)
from fscale.remat import checkpoint as remat_checkpoint

__all__ = ["CHECKPOINT_MODES", "RankResult", "StageOutput", "run_schedule"]

PyTree = Any
Tensor = torch.Tensor
CHECKPOINT_MODES = ("always", "except_last", "never")


class StageOutput(NamedTuple):
    """What a stage passes on for one micro-batch: its structure and each leaf's shape and
    dtype (found by the first step's contract check)."""

    treedef: Any
    specs: tuple[tuple[torch.Size, torch.dtype], ...]


class RankResult(NamedTuple):
    """What one rank computed: gradients and new buffers per local stage, and on every rank the
    batch's loss (float64): the sum of the weighted micro-batch losses, divided by the batch's
    count when the loss gives counts; `count`, that count (else None: the weights were the
    samples' shares)."""

    grads: tuple[PyTree, ...]
    buffers: tuple[PyTree, ...]
    loss: Tensor
    count: Tensor | None


class _Unit:
    """One (micro-batch, stage) between its forward and its last backward action."""

    __slots__ = (
        "checkpointed",
        "held",
        "input_leaves",
        "out_link",
        "outputs",
        "roots",
        "store",
        "work",
    )

    def __init__(self) -> None:
        # The input's leaves (None on stage 0); B differentiates w.r.t. the floating ones.
        self.input_leaves: list[Tensor] | None = None
        self.outputs: list[Tensor] = []  # the output's leaves
        self.roots: list[Tensor] = []  # the loss (last stage): B's root when set
        self.out_link: Link | None = None
        self.checkpointed = False
        self.work: WeightWork | None = None  # what B left for W
        self.held: Sequence[Tensor | None] = ()  # weight gradients B computed (split)
        self.store: LinearStore | None = None  # linear layers whose weight gradient waits


def _cut(leaves: Sequence[Tensor]) -> list[Tensor]:
    """Leaves of a new graph: floating-point ones require grad (their gradient goes back)."""
    return [
        x.detach().requires_grad_(True) if differentiable(x.dtype) else x.detach() for x in leaves
    ]


def run_schedule(
    schedule: Schedule,
    index: int,
    comm: Comm | None,
    stages: Stages,
    params: Sequence[PyTree],
    buffers: Sequence[PyTree],
    inputs: Sequence[PyTree],
    targets: Sequence[Any],
    loss_fn: Any,
    key: Tensor,
    checkpoint: str,
    shapes: dict[int, StageOutput],
    real_sizes: Sequence[int] | None = None,
    *,
    param_cast: Callable[[PyTree], PyTree] | None = None,
    loss_weight: float = 1.0,
    receive_ahead: int | None = None,
    device: torch.device | None = None,
) -> RankResult:
    """Run rank `index`'s actions of `schedule` (see the module docstring).

    `params` / `buffers` hold one pytree per local stage (in `schedule.local_stages(index)`
    order) and are not modified; `shapes[s]` is what stage s passes on. `real_sizes`, with
    padding, is the number of real samples of each micro-batch, out of the batch's
    ``sum(real_sizes)``; `targets` then hold the real samples only. `param_cast` maps a
    stage's parameters to what its forward sees (a mixed-precision policy's working copy):
    applied once per step, differentiably, so every micro-batch's weight gradient is cast back
    to the parameters' own dtype before it joins the sum. `loss_weight` multiplies each
    micro-batch's loss for its backward (a loss scale); the returned loss sum is unweighted.
    `receive_ahead` is how many receives are posted ahead of their use (None: all of the
    step's, before its first action; see `fscale.parallel.pipeline.transport`). `device` is
    where this rank's stages run: received messages and the step's loss are placed there.
    """
    local = schedule.local_stages(index)
    position = {stage: i for i, stage in enumerate(local)}
    last = schedule.num_stages - 1
    micro_batches = schedule.micro_batches
    split = schedule.split
    # A stage whose input came from another rank sends the input's gradient before computing
    # its linear layers' weight gradients (`deferred_linear`), which follow at once in the
    # same B, each added into the sum by its own product: the rank upstream starts its own B
    # that much sooner; the table is unchanged. (Other stages gain nothing from the order,
    # and the recording costs more than the fused sums save.)
    early = {
        stage: not split
        and param_cast is None
        and stage > 0
        and schedule.stage_ranks[stage - 1] != index
        and stages.deferrable[stage]
        for stage in local
    }
    # Split schedules leave linear layers' weight gradients to W (`deferred_linear`), not stage
    # 0, whose B feeds no stage (its recording cost more than the split gained: ZB-H1 on the bench
    # GPT, P = 2, M = 8, 4.4% slower than 1F1B with it, 0.7% without). Casts hide the leaves.
    records = {s: early[s] or (split and s > 0 and param_cast is None) for s in local}
    # Own aliases of the parameters: the per-micro-batch backwards must not fire the hooks
    # that the plans around the pipeline put on the live leaves.
    leaves = [[t.detach().requires_grad_(True) for t in tree.leaves(p)] for p in params]
    treedefs = [tree.structure(p) for p in params]
    stage_params = [tree.unflatten(d, ls) for d, ls in zip(treedefs, leaves)]
    if param_cast is not None:
        with torch.enable_grad():
            stage_params = [param_cast(p) for p in stage_params]
    split_grads: list[list[Tensor | None]] = [[None] * len(ls) for ls in leaves]
    owned: list[list[bool]] = [[False] * len(ls) for ls in leaves]
    stage_buffers = list(buffers)
    units: dict[tuple[int, int], _Unit] = {}
    local_grads: dict[tuple[int, int], list[Tensor | None]] = {}
    recorder = StepRecorder(tree.leaves((params, buffers))) if recording() else None
    # A message can wait behind at most one action per tick of the table: with every action
    # shorter than the collective timeout, no wait lasts longer than the table's ticks times it.
    # Neighbours of one host send through shared memory (a collective over the axis at the
    # group's first step, which every rank of the axis runs).
    mailbox = Mailbox(
        collective_timeout() * schedule.length,
        None if recorder is None else recorder.waited,
        None if comm is None else open_channels(comm),
        device,
    )
    keys = [fsrandom.fold_in(key, m) for m in range(micro_batches)]
    adjacent = schedule.back_to_back(index)
    total = sum(real_sizes) if real_sizes is not None else 0
    loss_sum: Tensor | None = None
    counts: list[Tensor] = []

    def link(m: int, stage: int, peer_stage: int) -> Link:
        assert comm is not None
        peer = schedule.stage_ranks[peer_stage]
        return Link(comm, mailbox, peer, m, stage, micro_batches, shapes[stage].specs)

    def add(i: int, found: Sequence[Tensor | None]) -> None:
        # In place once this step owns the sum (autograd's results may be views or aliases).
        for j, g in enumerate(found):
            if g is None:
                continue
            held = split_grads[i][j]
            if held is None:
                split_grads[i][j] = g
            elif owned[i][j]:
                held.add_(g)
            else:  # the sum in the parameter's layout, as autograd keeps .grad
                total = torch.empty_like(held, memory_format=torch.contiguous_format)
                split_grads[i][j], owned[i][j] = torch.add(held, g, out=total), True

    def forward(m: int, stage: int) -> None:
        unit = units.setdefault((m, stage), _Unit())
        i = position[stage]
        if stage == 0:
            x = inputs[m]
        else:
            if schedule.stage_ranks[stage - 1] == index:
                received = units[(m, stage - 1)].outputs
            else:
                received = link(m, stage - 1, stage - 1).receive_activation()
            unit.input_leaves = _cut(received)
            x = tree.unflatten(shapes[stage - 1].treedef, unit.input_leaves)
        call = stages.calls[stage]
        if checkpoint == "always" or (
            checkpoint == "except_last" and m < micro_batches - 1 and (m, stage) not in adjacent
        ):
            call = remat_checkpoint(call)
            unit.checkpointed = True
        defer = records[stage] and not unit.checkpointed
        with torch.enable_grad(), deferring(leaves[i]) if defer else _no_store() as store:
            unit.store = store
            y, stage_buffers[i] = call(stage_params[i], stage_buffers[i], x, keys[m])
            if recorder is not None and store is not None:
                recorder.hold(entry[2] for entry in store.entries)
            if stage == last:
                unit.roots = _loss_roots(y, m)
            else:
                unit.outputs = tree.leaves(y)
                if schedule.stage_ranks[stage + 1] != index:
                    unit.out_link = link(m, stage, stage + 1)
                    unit.out_link.send_activation(unit.outputs)

    def _loss_roots(y: PyTree, m: int) -> list[Tensor]:
        nonlocal loss_sum
        share = 1.0 / micro_batches
        if real_sizes is not None:
            real = real_sizes[m]
            if real == 0:  # all padding: no loss, no gradient
                return []
            if real < tree.leaves(y)[0].shape[0]:
                y = tree.map(lambda t: t[:real], y)
            share = real / total
        loss, count = _loss_and_count(loss_fn(y, targets[m]), m, len(counts))
        if count is not None:
            counts.append(count)
        root = loss * (share if count is None else count)
        loss_sum = root.detach() if loss_sum is None else loss_sum + root.detach()
        return [root if loss_weight == 1.0 else root * loss_weight]

    def seeds(m: int, stage: int, unit: _Unit) -> tuple[list[Tensor], list[Tensor | None]]:
        if stage == last:
            return unit.roots, [None] * len(unit.roots)
        if unit.out_link is not None:
            grads = unit.out_link.receive_gradients()
        else:
            grads = local_grads.pop((m, stage))
        pairs = [(y, g) for y, g in zip(unit.outputs, grads) if g is not None and y.requires_grad]
        return [y for y, _ in pairs], [g for _, g in pairs]

    def backward(m: int, stage: int) -> None:
        unit = units[(m, stage)]
        i = position[stage]
        roots, grad_roots = seeds(m, stage, unit)
        wanted = [x for x in unit.input_leaves or () if x.requires_grad]
        weights = leaves[i]
        found: Sequence[Tensor | None] = [None] * len(wanted)
        if roots and not split:
            torch.autograd.backward(roots, grad_roots, inputs=wanted + weights)
            found = [x.grad for x in wanted]
        elif roots and (
            not wanted or unit.checkpointed or (unit.store is not None and unit.store.entries)
        ):
            # One backward for the input and every weight but the deferred linear layers' (with
            # no input gradient to send, as on stage 0, splitting B would gain nothing).
            everything = _grad(roots, grad_roots, wanted + weights)
            found, unit.held = everything[: len(wanted)], everything[len(wanted) :]
        elif roots:
            found, unit.work = input_backward(roots, grad_roots, wanted, weights)
        if stage > 0:
            by_leaf = iter(found)
            grads = [next(by_leaf) if x.requires_grad else None for x in unit.input_leaves or ()]
            if schedule.stage_ranks[stage - 1] == index:
                local_grads[(m, stage - 1)] = grads
            else:
                link(m, stage - 1, stage - 1).send_gradients(grads)
        if not split:
            del units[(m, stage)]
            if unit.store is not None:  # an early stage: its linear layers' turn, after the send
                if recorder is not None:
                    recorder.sent()
                _add_linear_grads(weights, unit.store)

    def weight_grads(m: int, stage: int) -> None:
        unit = units.pop((m, stage))
        i = position[stage]
        if unit.work is not None:
            add(i, weight_backward(unit.work, leaves[i]))
        else:
            add(i, unit.held)
        if unit.store is not None and unit.store.entries:
            sums = split_grads[i]
            for j in unit.store.positions():  # the products add into sums this step owns
                held = sums[j]
                if held is not None and not owned[i][j]:
                    sums[j] = held.clone(memory_format=torch.contiguous_format)
                owned[i][j] = True
            unit.store.add_weight_grads(sums)

    def run(kind: str, m: int, stage: int) -> None:
        if kind == "F":
            forward(m, stage)
            if stage == last:
                loss_message.forward_done(lambda: loss_values(loss_sum, counts))
        elif kind == "B":
            backward(m, stage)
        else:
            weight_grads(m, stage)

    actions = schedule.rank_actions(index)
    receives = _receives(schedule, index, actions)
    # All of the step's receives are posted before its first action, or (`receive_ahead`) a
    # window of them ahead of their use (0: each when its action needs it).
    window = len(receives) if receive_ahead is None else receive_ahead
    posted = consumed = 0
    with in_flight(comm):
        # The loss goes from the last stage's rank to the others as soon as its last forward
        # is done; they post its receive now and read it at the step's end (`LossMessage`).
        loss_message = LossMessage(schedule, index, comm, mailbox)
        for action in actions:
            posted = max(posted, consumed)  # a receive made at its use is not posted again
            while posted < min(len(receives), consumed + window):
                m, stage, gradient = receives[posted]
                peer_stage = stage + 1 if gradient else stage
                ahead = link(m, stage, peer_stage)
                if gradient:
                    ahead.expect_gradients()
                else:
                    ahead.expect_activation()
                posted += 1
            if receives[consumed : consumed + 1] == [_receive_of(schedule, index, action)]:
                consumed += 1
            if recorder is None:
                run(action.kind, action.micro_batch, action.stage)
            else:
                timed = recorder.action(action.kind, action.micro_batch, action.stage)
                with timed, recorder.saving():
                    run(action.kind, action.micro_batch, action.stage)
        loss, count = loss_of(loss_message.values().to(device))
        drain_wait = mailbox.drain()
    if recorder is not None:
        recorder.finish(drain_wait)
    stage_grads = []
    for i, (d, ls) in enumerate(zip(treedefs, leaves)):
        found = split_grads[i] if split else [t.grad for t in ls]
        stage_grads.append(tree.unflatten(d, [_as_grad(g, t) for g, t in zip(found, ls)]))
    return RankResult(tuple(stage_grads), tuple(stage_buffers), loss, count)


def _add_linear_grads(leaves: Sequence[Tensor], store: LinearStore) -> None:
    """Add the linear layers' weight gradients recorded in `store` into the leaves' ``.grad``,
    in place, as autograd adds a gradient to a sum it holds (the first becomes the sum)."""
    sums = [leaf.grad for leaf in leaves]
    store.add_weight_grads(sums)
    for leaf, total in zip(leaves, sums):
        if total is not leaf.grad:
            leaf.grad = total


def _as_grad(found: Tensor | None, leaf: Tensor) -> Tensor:
    """The step's gradient of `leaf`: zeros if nothing reached it, contiguous as the leaf
    (a weight gradient autograd returns may be a transposed view)."""
    if found is None:
        return torch.zeros_like(leaf)
    return found if found.is_contiguous() else found.contiguous()


@contextlib.contextmanager
def _no_store() -> Iterator[None]:
    yield None


def _receive_of(schedule: Schedule, index: int, action: Any) -> tuple[int, int, bool] | None:
    """What `action` receives from another rank: (micro-batch, stage of the output, whether
    the gradient), or None."""
    m, stage = action.micro_batch, action.stage
    if action.kind == "F" and stage > 0 and schedule.stage_ranks[stage - 1] != index:
        return (m, stage - 1, False)
    last = schedule.num_stages - 1
    if action.kind == "B" and stage < last and schedule.stage_ranks[stage + 1] != index:
        return (m, stage, True)
    return None


def _receives(schedule: Schedule, index: int, actions: Sequence[Any]) -> list[Any]:
    """The rank's receives in the order its actions make them."""
    found = (_receive_of(schedule, index, a) for a in actions)
    return [r for r in found if r is not None]


def _grad(
    roots: list[Tensor], grad_roots: list[Tensor | None], wanted: list[Tensor]
) -> Sequence[Tensor | None]:
    if not wanted:
        return []
    return torch.autograd.grad(roots, wanted, grad_roots, allow_unused=True)


def _loss_and_count(out: Any, m: int, counted: int) -> tuple[Tensor, Tensor | None]:
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
