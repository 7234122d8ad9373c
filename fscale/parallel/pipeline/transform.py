"""`pipeline(stages, loss_fn, optimizer, mesh, ...) -> Step`: pipeline parallelism across processes.

The model is cut into S stages placed on the P ranks of the mesh axis `axis` (S = P, or v·P
for the interleaved schedule); a batch ``(inputs, targets)``, given whole to every rank of the
axis, is split along dim 0 into `micro_batches` equal micro-batches (with ``pad=True`` the last
ones padded, the padding masked out of the loss) that flow through the stages as the
schedule's table says; what a stage passes on is a tensor or a pytree of tensors. Forward
collective: a send of each stage's output to the next stage's rank; backward collective: its
dual, the gradient sent back (`fscale.parallel.pipeline.transport`). Memory per rank: its
stages' parameters, gradients and optimizer state, the activations of at most the schedule's
`activation_bound` micro-batches (fewer with checkpointing), and the receive buffers of the
step's messages into the rank (all of them by default, `receive_ahead` of them if given).
Traffic per step: each stage boundary carries one activation and one gradient per
micro-batch, plus the loss (three float64 values) sent from the last stage's rank to each other
rank of the axis.

Reductions do not depend on the split: each micro-batch's mean loss is weighted by its share of
the batch (1/M) — or, when ``loss_fn`` returns ``(mean, count)``, by its count, the gradient
then divided by the batch's total count — so the gradient and ``metrics["loss"]`` are those of
the mean over the whole batch (of samples, or of the counted tokens), for any M, schedule and
number of stages. Across data-parallel ranks (``per_stage``) the data-parallel layer's mean
over ranks applies. Dropout keys are folded by (step, micro-batch, layer) — the stage index in
the functions form — so a mask does not depend on the schedule or the balance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from fscale import optim as optim_lib
from fscale import spmd
from fscale.distributed.mesh import Mesh
from fscale.parallel.pipeline.builders import BUILDERS, interleaved
from fscale.parallel.pipeline.check import check_schedule
from fscale.parallel.pipeline.layer import PipelinePlan
from fscale.parallel.pipeline.runner import CHECKPOINT_MODES
from fscale.parallel.pipeline.schedule import Schedule
from fscale.parallel.pipeline.stages import Stages, function_stages, module_stages
from fscale.train import Step, train_step

__all__ = ["pipeline"]


def pipeline(
    stages: Any,
    loss_fn: Callable[..., Any],
    optimizer: optim_lib.Optimizer,
    mesh: Mesh,
    axis: str = "pp",
    *,
    micro_batches: int,
    schedule: str | Schedule | Callable[[int, int], Schedule] = "1f1b",
    checkpoint: str = "except_last",
    balance: list[int] | None = None,
    virtual: int = 2,
    per_stage: Callable[[Step], Step] | None = None,
    pad: bool = False,
    on_nonfinite: str = "propagate",
    donate: bool = False,
    receive_ahead: int | None = None,
) -> Step:
    """A Step that trains `stages` as a pipeline over `axis` (see the module docstring).

    Args:
        stages: a list of functions ``stage_i(params_i, buffers_i, x, key) -> (y, buffers_i)``
            (or ``-> y`` for a tensor y), one per stage; or an ``nn.Sequential`` / list of modules
            cut by `balance`. The activation between stages is a tensor or a pytree of tensors
            (tuple, dict ...); its floating-point leaves carry gradients back.
        loss_fn: ``loss_fn(outputs, targets)``: the mean loss of one micro-batch, on the last
            stage; or ``(mean, count)``, a mean over `count` items (e.g. unpadded tokens).
        optimizer: an `fscale.optim.Optimizer`; each rank runs it on its stages.
        mesh: the mesh; `axis` must be one of its axes.
        axis: the pipeline axis.
        micro_batches: M, the number of micro-batches per batch.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (`virtual` stages per rank) or
            ``"zero_bubble"``; a `Schedule`; or a builder ``(num_ranks, micro_batches) ->
            Schedule``. It is checked by simulation here (`check_schedule`).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (torchgpipe's modes;
            ``"except_last"`` also keeps every forward that the rank's next action
            differentiates, `Schedule.back_to_back`, which recomputing would not help). Under
            ``"zero_bubble"`` a checkpointed micro-batch computes both of its gradients in B
            (one recompute) and its W only adds them.
        balance: for a module pipeline, the number of consecutive layers of each stage.
        virtual: stages per rank of the interleaved schedule.
        per_stage: a transformation of each rank's stage step, e.g. ``lambda s:
            fscale.data_parallel(s, mesh, "dp")``, ``fscale.shard_optimizer(s, mesh, "dp")`` or
            ``fscale.fully_shard(s, mesh, "dp")`` for pp × dp. Under fully_shard each rank
            holds 1/N of its stages' parameters, gradients and optimizer state at rest; its
            stages' units are gathered once per step (on first use) and kept for the step's
            micro-batches, their gradients reduce-scattered once at the end (the gather's dual).
        pad: a batch whose size is not a multiple of `micro_batches` is refused (False), or
            padded (True): the micro-batches take ``ceil(size / M)`` samples, the last ones
            filled with copies of the last sample, which the loss never sees, so loss,
            gradients and results equal those of the unpadded batch. The stages must treat
            samples independently (no BatchNorm statistics over the batch).
        on_nonfinite: ``"propagate"``, ``"skip"`` or ``"raise"``, as for `fscale.train_step`:
            the stages agree, so a NaN in one stage's gradients skips (or raises on) every rank.
        donate: as for `fscale.train_step`: the step updates the incoming state's parameters
            and optimizer state in place (as a torch.optim loop does) instead of copying them.
        receive_ahead: how many of a rank's receives are posted before the action that needs
            them. None (the default): every receive of the step, before its first action, so
            each message finds its receive posted and no post runs while messages are in
            flight; a rank then holds one receive buffer per message of the step (M
            activations and M gradients per boundary, as torch's ``PipelineStage`` keeps one
            receive buffer per micro-batch). An int k >= 1 posts k ahead, bounding the
            buffers to k; 0 posts each receive when its action needs it.

    Returns:
        A Step; ``state = step.init(params, buffers)`` takes the full model's pytrees (a list
        per stage, or the dicts of ``fscale.functionalize(sequential)``) and keeps this rank's
        pieces; ``fscale.consolidate(step, state)`` gives the full state back on every rank.

    Raises:
        TypeError / ValueError: bad arguments; a stage count that does not match the axis (and
            the schedule); `balance` not summing to the layer count; a schedule that fails the
            simulation check (`ScheduleError`, naming the first conflict). At the first step: a
            batch that does not split into `micro_batches`, stages whose outputs and inputs
            disagree (`StageContractError`, on every rank, naming both stages), or a rank whose
            stage parameters and batch are not all on one device.
        NotImplementedError: at the first step, a pipeline axis whose process group has no
            gloo backend: messages travel on gloo, matched by tag, stages on a GPU sending
            through host memory (`fscale.parallel.pipeline.transport.check_transport`).
    """
    caller = "pipeline"
    spmd.check_axis(mesh, axis, caller)
    if not callable(loss_fn):
        raise TypeError(f"{caller}: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"{caller}: `micro_batches` must be a positive int, got {micro_batches!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(
            f"{caller}: `checkpoint` must be one of {CHECKPOINT_MODES}, got {checkpoint!r}"
        )
    if receive_ahead is not None and (
        isinstance(receive_ahead, bool) or not isinstance(receive_ahead, int) or receive_ahead < 0
    ):
        raise ValueError(
            f"{caller}: `receive_ahead` must be None (post every receive of the step at its "
            f"start) or an int >= 0 (how many to post ahead of their use), got {receive_ahead!r}"
        )
    stage_set = _stages(stages, balance, caller)
    table = _schedule(schedule, mesh.size(axis), micro_batches, virtual, caller)
    if table.num_stages != len(stage_set):
        raise ValueError(
            f"{caller}: {len(stage_set)} stages were given but the schedule {table.name!r} on "
            f"{table.num_ranks} ranks of axis {axis!r} runs {table.num_stages}; give one stage "
            "per rank" + (f" times virtual={virtual}" if table.name == "interleaved" else "")
        )
    base = train_step(loss_fn, optimizer, on_nonfinite=on_nonfinite, donate=donate)
    if per_stage is not None:
        if not callable(per_stage):
            raise TypeError(f"{caller}: `per_stage` must be a Step -> Step transformation")
        base = per_stage(base)
        if not isinstance(base, Step):
            raise TypeError(f"{caller}: `per_stage` must return a Step, got {type(base).__name__}")
        if base.plan.find("accumulate") is not None:
            raise ValueError(
                f"{caller}: `per_stage` accumulates gradients inside the stage, which would run "
                "the whole pipeline once per slice; accumulate around the pipeline instead, "
                "fscale.accumulate(fscale.pipeline(...), k), or raise `micro_batches`"
            )
        if axis in base.plan.data_axes():
            raise ValueError(
                f"{caller}: `per_stage` splits the batch over the pipeline axis {axis!r}; use "
                "another mesh axis for data parallelism, e.g. fscale.Mesh(dp=2, pp=2)"
            )
    if not isinstance(pad, bool):
        raise TypeError(f"{caller}: `pad` must be a bool, got {type(pad).__name__}")
    plan = PipelinePlan(
        base.plan, mesh, axis, stage_set, table, loss_fn, checkpoint, pad, receive_ahead
    )
    return base.replace(plan=plan)


def _stages(stages: Any, balance: Any, caller: str) -> Stages:
    if isinstance(stages, nn.Sequential) or (
        isinstance(stages, (list, tuple))
        and stages
        and all(isinstance(s, nn.Module) for s in stages)
    ):
        return module_stages(stages, balance, caller)
    if balance is not None:
        raise ValueError(f"{caller}: `balance` applies to a module pipeline, not to functions")
    if not isinstance(stages, (list, tuple)) or not stages:
        raise TypeError(
            f"{caller}: `stages` must be a non-empty list of stage functions or an "
            f"nn.Sequential, got {type(stages).__name__}"
        )
    return function_stages(stages, caller)


def _schedule(schedule: Any, num_ranks: int, micro_batches: int, virtual: int, caller: str):
    if isinstance(schedule, str):
        if schedule not in BUILDERS:
            raise ValueError(
                f"{caller}: `schedule` must be one of {sorted(BUILDERS)}, a Schedule or a "
                f"builder, got {schedule!r}"
            )
        if schedule == "interleaved":
            table = interleaved(num_ranks, micro_batches, virtual)
        else:
            table = BUILDERS[schedule](num_ranks, micro_batches)
    elif isinstance(schedule, Schedule):
        table = schedule
    elif callable(schedule):
        table = schedule(num_ranks, micro_batches)
        if not isinstance(table, Schedule):
            raise TypeError(
                f"{caller}: the schedule builder returned a {type(table).__name__}, not a Schedule"
            )
    else:
        raise TypeError(f"{caller}: `schedule` must be a name, a Schedule or a builder")
    if table.num_ranks != num_ranks or table.micro_batches != micro_batches:
        raise ValueError(
            f"{caller}: the schedule {table.name!r} is for {table.num_ranks} ranks and "
            f"{table.micro_batches} micro-batches, but the axis has {num_ranks} ranks and "
            f"`micro_batches`={micro_batches}"
        )
    check_schedule(table)
    return table
