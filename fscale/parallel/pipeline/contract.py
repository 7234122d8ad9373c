"""Stage contracts: the first step checks, stage by stage, what each stage sends and receives.

Before the first step on a batch of a new shape, every rank runs a probe: the first
micro-batch goes through the stages in order without gradients, each rank receiving a header
(the output's structure and each leaf's shape and dtype, or the failure of a stage before) and
then the leaves from the rank of the previous stage, running its stage on them, and passing
its output on; the last stage runs the loss. A stage output may be a tensor or a pytree of
tensors (tuple, list, dict ...); each leaf is checked. A stage that fails — on an input it
cannot take, or returning a leaf that is not a tensor — sends a failure header on instead of
its output, so no rank waits for what will not come; then the ranks exchange what went wrong
and every rank raises the same error, naming the stage that failed, its rank, and the stage
and the leaves' shapes and dtypes it received.

The structures and shapes found are what the step's receives allocate (a stage's output for
every micro-batch of the batch).

A rank probes when its batch's shapes are new to it, so ranks given batches of different
shapes would part ways: one probing, the others running the step on shapes they have seen, each
waiting for messages the other never sends until the process group's timeout ends in the
backend's "Timed out waiting ... for recv". The probe therefore begins with the ranks gathering
a digest of their first micro-batch's shapes, dtypes and bytes, counted and bounded as every
collective is (`fscale.distributed.setup_traffic`): ranks whose batches differ fail on every rank
naming each rank's shapes (or, for batches of the same shapes, which ranks hold which
values), and a rank that probes alone fails within twice the collective timeout (the wait,
then the peers' records), saying why. The values are compared at each probe (the first step,
and a batch of new shapes), not at every step: a data loader that gives each pipeline rank its
own batch shows at the first step.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
import torch.distributed as dist

from fscale import random as fsrandom
from fscale import spmd, tree
from fscale.distributed import setup_traffic, watchdog
from fscale.distributed.comm import Comm
from fscale.grad import normalize_loss_output
from fscale.parallel.pipeline.runner import StageOutput
from fscale.parallel.pipeline.schedule import Schedule
from fscale.parallel.pipeline.stages import Stages
from fscale.parallel.pipeline.transport import wait

__all__ = ["StageContractError", "probe_stages"]

PyTree = Any
_HEADER = 12  # dtype code, ndim, up to 10 dims
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
_PROBE_SPAN = 1 << 12  # tags per stage boundary: head, structure, headers, then one per leaf


class StageContractError(ValueError):
    """Neighbouring stages disagree on what passes between them (raised on every rank)."""


def _leaf_problem(y: PyTree) -> str | None:
    """Why `y` cannot pass between stages, or None."""
    paths, leaves, _ = tree.flatten_with_paths(y)
    if not leaves:
        return "it returned no tensor"
    for path, leaf in zip(paths, leaves):
        where = "it returned" if path == "<root>" else f"its output leaf {path!r} is"
        if not isinstance(leaf, torch.Tensor):
            return f"{where} a {type(leaf).__name__}, not a tensor"
        if leaf.dtype not in _DTYPES or leaf.dim() > _HEADER - 2:
            return f"{where} a tensor of dtype {leaf.dtype} and {leaf.dim()} dims (not sendable)"
    return None


def _leaf_header(leaf: torch.Tensor) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = _DTYPES.index(leaf.dtype)
    header[1] = leaf.dim()
    header[2 : 2 + leaf.dim()] = torch.tensor(leaf.shape, dtype=torch.int64)
    return header


def _describe(output: StageOutput) -> str:
    """The leaves' shapes and dtypes, for messages."""
    parts = [f"shape {tuple(shape)} and dtype {dtype}" for shape, dtype in output.specs]
    if output.treedef == tree.structure(0):  # a single tensor
        return f"a tensor of {parts[0]}"
    return f"a pytree {output.treedef} of tensors of " + "; ".join(parts)


def _output_of(y: PyTree) -> StageOutput:
    leaves, treedef = tree.flatten(y)
    return StageOutput(treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))


def probe_stages(
    schedule: Schedule,
    index: int,
    comm: Comm | None,
    mesh: Any,
    axis: str,
    stages: Stages,
    params: tuple[PyTree, ...],
    buffers: tuple[PyTree, ...],
    inputs: PyTree,
    targets: Any,
    loss_fn: Any,
    key: torch.Tensor,
    device: torch.device | None = None,
) -> dict[int, StageOutput]:
    """The structure, shapes and dtypes of every stage's output for one micro-batch (see the
    module docstring); raises `StageContractError` on every rank when a stage fails. Leaves
    travel as host tensors and are placed on `device` (this rank's stages') on arrival."""
    if comm is not None:
        _check_every_rank_probes_this_batch(comm, axis, inputs, targets)
    local = schedule.local_stages(index)
    last = schedule.num_stages - 1
    shapes: dict[int, StageOutput] = {}
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
                    x = _receive(comm, source, stage - 1, device)
                if x is None:  # an earlier stage failed; pass that on
                    outputs[stage] = None
                    if stage < last:
                        _send_on(comm, schedule, index, stage, None, sends)
                    continue
                received = f"stage {stage - 1}'s output ({_describe(_output_of(x))})"
            y: Any = None
            try:
                y, _ = stages.calls[stage](
                    params[local.index(stage)],
                    buffers[local.index(stage)],
                    x,
                    fsrandom.fold_in(key, 0),
                )
                problem = _leaf_problem(y)
                if problem is not None:
                    raise TypeError(problem)
                if stage == last:
                    normalize_loss_output(loss_fn(y, targets), None)
            except Exception as error:  # reported on every rank below
                where = (
                    "its output in loss_fn"
                    if stage == last and _leaf_problem(y) is None
                    else received
                )
                failure = (
                    f"stage {stage} (rank {index} along {axis!r}) failed on {where}: "
                    f"{type(error).__name__}: {error}"
                )
                y = None
            if y is not None:
                shapes[stage] = _output_of(y)
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


def _check_every_rank_probes_this_batch(
    comm: Comm, axis: str, inputs: PyTree, targets: PyTree
) -> None:
    """Raise on every rank of the axis unless all of them probe the same batch (shapes and
    values), and on this rank, within twice the collective timeout, if its peers do not probe
    at all."""
    batch = f"inputs {_describe(_output_of(inputs))}, targets {_describe(_output_of(targets))}"
    contents = (_content_digest(inputs), _content_digest(targets))
    digest = hashlib.sha1("\n".join((batch, *contents)).encode()).hexdigest()
    try:
        digests = setup_traffic.all_gather_objects(digest, comm)
    except watchdog.CollectiveTimeoutError as error:
        me = comm.mesh.global_rank(comm.axis, comm.index)
        raise watchdog.CollectiveTimeoutError(
            f"pipeline: rank {me} ({axis}={comm.index}) was given a batch whose first "
            f"micro-batch ({batch}) is new to it, so it checks the stages on it before the "
            f"step, and not every rank along {axis!r} does: a rank given a batch of the shapes "
            "it saw before runs the step instead. Give every rank of the pipeline axis the same "
            f"whole batch.\n{error}"
        ) from error
    if len(set(digests)) == 1:
        return
    everyone = setup_traffic.all_gather_objects((batch, contents), comm)  # every rank is here
    names = [f"rank {comm.mesh.global_rank(axis, i)} ({axis}={i})" for i in range(comm.size)]
    same_rule = (
        "Every rank of the pipeline axis takes the same whole batch: the first stage its "
        "inputs, the last its targets."
    )
    if len({b for b, _ in everyone}) > 1:
        lines = [f"  {name}: {b}" for name, (b, _) in zip(names, everyone)]
        raise StageContractError(
            f"pipeline: the ranks along {axis!r} were given batches of different shapes (the "
            "first micro-batch of each):\n" + "\n".join(lines) + "\n" + same_rule
        )
    differ = [
        part
        for part, column in (("inputs", 0), ("targets", 1))
        if len({c[column] for _, c in everyone}) > 1
    ]
    groups: dict[tuple[str, str], list[str]] = {}
    for name, (_, c) in zip(names, everyone):
        groups.setdefault(c, []).append(name)
    lines = [f"  batch {i + 1} on {', '.join(g)}" for i, g in enumerate(groups.values())]
    raise StageContractError(
        f"pipeline: the ranks along {axis!r} were given batches of the same shapes whose "
        f"{' and '.join(differ)} differ (the first micro-batch of each, by the ranks that "
        "hold it):\n"
        + "\n".join(lines)
        + f"\n{same_rule} Batches that differ would train one rank's inputs against another's "
        "targets. A data loader that splits the data by global rank gives every pipeline rank "
        "its own batch: split it over the data-parallel axes only (e.g. DistributedSampler("
        "num_replicas=mesh.size('dp'), rank=mesh.rank('dp')))."
    )


def _content_digest(values: PyTree) -> str:
    """A digest of `values`' leaves: their bytes (tensors, copied to the host) or their repr."""
    digest = hashlib.sha1()
    for leaf in tree.leaves(values):
        if isinstance(leaf, torch.Tensor):
            flat = leaf.detach().reshape(-1).contiguous().cpu()
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


def _send_on(
    comm: Comm | None, schedule: Schedule, index: int, stage: int, y: Any, sends: list[Any]
) -> None:
    peer = schedule.stage_ranks[stage + 1]
    if peer == index or comm is None:
        return
    tag = _PROBE_TAG + _PROBE_SPAN * stage

    def post(tensor: torch.Tensor, offset: int) -> None:
        sends.append(dist.isend(tensor, group=comm.group, group_dst=peer, tag=tag + offset))

    head = torch.zeros(3, dtype=torch.int64)  # failed, number of leaves, structure bytes
    if y is None:
        head[0] = 1
        post(head, 0)
        return
    leaves, treedef = tree.flatten(y)
    structure = torch.frombuffer(bytearray(pickle.dumps(treedef)), dtype=torch.uint8)
    head[1], head[2] = len(leaves), structure.numel()
    post(head, 0)
    post(structure, 1)
    post(torch.stack([_leaf_header(leaf) for leaf in leaves]), 2)
    for position, leaf in enumerate(leaves):  # host tensors, as the transport sends them
        post(leaf.detach().cpu().contiguous(), 3 + position)


def _receive(comm: Comm, source: int, stage: int, device: torch.device | None) -> PyTree | None:
    tag = _PROBE_TAG + _PROBE_SPAN * stage

    def take(buffer: torch.Tensor, offset: int) -> torch.Tensor:
        wait(dist.irecv(buffer, group=comm.group, group_src=source, tag=tag + offset))
        return buffer

    head = take(torch.empty(3, dtype=torch.int64), 0)
    if int(head[0]) != 0:
        return None
    structure = take(torch.empty(int(head[2]), dtype=torch.uint8), 1)
    treedef = pickle.loads(structure.numpy().tobytes())
    headers = take(torch.empty(int(head[1]), _HEADER, dtype=torch.int64), 2)
    leaves = []
    for position, header in enumerate(headers):
        ndim = int(header[1])
        shape = torch.Size(int(d) for d in header[2 : 2 + ndim])
        leaf = take(torch.empty(shape, dtype=_DTYPES[int(header[0])]), 3 + position)
        leaves.append(leaf.to(device))
    return tree.unflatten(treedef, leaves)
