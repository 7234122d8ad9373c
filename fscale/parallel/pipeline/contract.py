"""Stage contracts: the first step checks, stage by stage, what each stage sends and receives.

Before the first step on a batch of a new shape, every rank runs a probe: the first
micro-batch goes through the stages in order without gradients, each rank receiving a header
(the shape and dtype, or the failure of a stage before) and then the tensor from the rank of
the previous stage, running its stage on it, and passing its output on; the last stage runs the
loss. A stage that fails — on an input it cannot take, or returning something that is not a
tensor — sends a failure header on instead of a tensor, so no rank waits for what will not
come; then the ranks exchange what went wrong and every rank raises the same error, naming the
stage that failed, its rank, and the stage and the shape and dtype it received.

The shapes found are what the step's receives allocate (a stage's output shape for every
micro-batch of the batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fscale import random as fsrandom
from fscale import spmd
from fscale.distributed.comm import Comm
from fscale.grad import normalize_loss_output
from fscale.parallel.pipeline.schedule import Schedule
from fscale.parallel.pipeline.stages import Stages
from fscale.parallel.pipeline.transport import wait

__all__ = ["StageContractError", "probe_stages"]

PyTree = Any
_HEADER = 12  # status, dtype code, ndim, up to 9 dims
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
)
_PROBE_TAG = 1 << 28  # outside the step's message tags


class StageContractError(ValueError):
    """Neighbouring stages disagree on what passes between them (raised on every rank)."""


def _header(y: Any) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    if not isinstance(y, torch.Tensor) or y.dtype not in _DTYPES or y.dim() > _HEADER - 3:
        header[0] = 1
        return header
    header[1] = _DTYPES.index(y.dtype)
    header[2] = y.dim()
    header[3 : 3 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
    return header


def _describe(shape: torch.Size, dtype: torch.dtype) -> str:
    return f"a tensor of shape {tuple(shape)} and dtype {dtype}"


def probe_stages(
    schedule: Schedule,
    index: int,
    comm: Comm | None,
    mesh: Any,
    axis: str,
    stages: Stages,
    params: tuple[PyTree, ...],
    buffers: tuple[PyTree, ...],
    inputs: torch.Tensor,
    targets: Any,
    loss_fn: Any,
    key: torch.Tensor,
) -> dict[int, tuple[torch.Size, torch.dtype]]:
    """The shape and dtype of every stage's output for one micro-batch (see the module
    docstring); raises `StageContractError` on every rank when a stage fails."""
    local = schedule.local_stages(index)
    last = schedule.num_stages - 1
    shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
    outputs: dict[int, Any] = {}
    failure: str | None = None
    sends: list[Any] = []
    with torch.no_grad():
        for stage in local:
            x: Any = inputs
            received = "the micro-batch's inputs"
            if stage > 0:
                source = schedule.stage_ranks[stage - 1]
                if source == index:
                    x = outputs[stage - 1]
                elif comm is not None:
                    x = _receive(comm, source, stage - 1)
                if x is None:  # an earlier stage failed; pass that on
                    outputs[stage] = None
                    if stage < last:
                        _send_on(comm, schedule, index, stage, None, sends)
                    continue
                received = f"stage {stage - 1}'s output ({_describe(x.shape, x.dtype)})"
            y: Any = None
            try:
                y, _ = stages.calls[stage](
                    params[local.index(stage)],
                    buffers[local.index(stage)],
                    x,
                    fsrandom.fold_in(key, 0),
                )
                if not isinstance(y, torch.Tensor):
                    raise TypeError(f"it returned a {type(y).__name__}, not a tensor")
                if stage == last:
                    normalize_loss_output(loss_fn(y, targets), None)
            except Exception as error:  # reported on every rank below
                where = (
                    "its output in loss_fn"
                    if isinstance(y, torch.Tensor) and stage == last
                    else (received)
                )
                failure = (
                    f"stage {stage} (rank {index} along {axis!r}) failed on {where}: "
                    f"{type(error).__name__}: {error}"
                )
                y = None
            if y is not None:
                shapes[stage] = (y.shape, y.dtype)
            outputs[stage] = y
            if stage < last:
                _send_on(comm, schedule, index, stage, y, sends)
    for work in sends:
        wait(work)
    failures = [failure]
    found = None
    if comm is not None:
        failures = spmd.all_gather_objects((failure, shapes), mesh, axis)
        found = {}
        for _, rank_shapes in failures:
            found.update(rank_shapes)
        failures = [f for f, _ in failures]
    problems = [f for f in failures if f is not None]
    if problems:
        raise StageContractError(
            "pipeline: the stages disagree on what passes between them (checked on the first "
            "step):\n  - " + "\n  - ".join(problems)
        )
    return shapes if found is None else found


def _send_on(
    comm: Comm | None, schedule: Schedule, index: int, stage: int, y: Any, sends: list[Any]
) -> None:
    peer = schedule.stage_ranks[stage + 1]
    if peer == index or comm is None:
        return
    header = _header(y)
    tag = _PROBE_TAG + 2 * stage
    sends.append(dist.isend(header, group=comm.group, group_dst=peer, tag=tag))
    if header[0] == 0:
        payload = y.contiguous()
        sends.append(dist.isend(payload, group=comm.group, group_dst=peer, tag=tag + 1))


def _receive(comm: Comm, source: int, stage: int) -> torch.Tensor | None:
    tag = _PROBE_TAG + 2 * stage
    header = torch.empty(_HEADER, dtype=torch.int64)
    wait(dist.irecv(header, group=comm.group, group_src=source, tag=tag))
    if int(header[0]) != 0:
        return None
    ndim = int(header[2])
    shape = torch.Size(int(d) for d in header[3 : 3 + ndim])
    buffer = torch.empty(shape, dtype=_DTYPES[int(header[1])])
    wait(dist.irecv(buffer, group=comm.group, group_src=source, tag=tag + 1))
    return buffer
