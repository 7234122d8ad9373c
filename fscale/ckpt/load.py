"""`load`: a checkpoint written under any plan and world size, as the state of another.

Each rank lays out fresh tensors as the target state holds them (`fscale.ckpt.pieces`), so it
knows which elements of which full leaf it needs; DCP reads exactly those from the saved
chunks, whichever ranks wrote them. Before anything is read, the checkpoint's leaves (names,
full shapes, dtypes) are compared with the target's, and every difference is listed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from fscale.ckpt import dcp_io
from fscale.ckpt import directory as dirs
from fscale.ckpt.boxes import Piece
from fscale.ckpt.manifest import (
    CheckpointError,
    Leaves,
    Manifest,
    check_matches,
    dtype_of,
    join_leaves,
    leaves_of,
    read_manifest,
)
from fscale.ckpt.pieces import pieces_into
from fscale.ckpt.placement import tensor_parallel_of
from fscale.ckpt.planner import PieceLoadPlanner, piece_name
from fscale.ckpt.save import (
    FAILURES,
    FINDING,
    agree,
    checkpoint_group,
    every_rank_arrives,
    exchange_or_fail,
    failure_message,
    single_process_quiet,
    tell_peers,
    wait_saves,
)
from fscale.functional import FunctionalModule
from fscale.parallel.tensor.apply import shard_like
from fscale.plan import TrainState
from fscale.train import Step

__all__ = ["load"]


def load(
    path: str | os.PathLike[str],
    like: TrainState | Step,
    *,
    step: Step | None = None,
    model: Any = None,
) -> TrainState:
    """The state `step` continues from on this rank, read from the checkpoint at `path`.

    Every rank calls it. Training resumes bit for bit when `step` has the plan and world size
    that saved the checkpoint; under another plan or world size the state is the same full
    state resharded (exact too), and the steps after it follow the numerics the README states
    for the new plan.

    Args:
        path: a checkpoint directory (``root/step_<n>``), or a root, meaning its newest
            complete checkpoint (`fscale.latest`).
        like: a state of `step` for this model (e.g. ``step.init(params, buffers)``): it gives
            the layout and is not modified. Or the Step itself, when its parameters and
            buffers are flat ``{name: tensor}`` dicts (as `fscale.functionalize` returns): the
            state is then initialised from the checkpoint's shapes (``step.init`` on empty
            tensors, on the CPU) and filled.
        step: the step that will run on the result (when `like` is a state).
        model: the module the state's parameters belong to, when it is a `tensor_parallel`
            one (or its FunctionalModule): its splits say which shard each rank reads.

    Returns:
        The loaded TrainState (step count and key included).

    Raises:
        FileNotFoundError: nothing is at `path`.
        CheckpointError: `path` is a file, a partial or damaged checkpoint, a checkpoint of a
            newer format, or one of another model (the differing leaves are listed).
    """
    target: TrainState | None = None
    if isinstance(like, Step) and step in (None, like):
        step = like
    elif isinstance(like, TrainState):
        target = like
    else:
        raise TypeError(
            f"load: `like` must be a TrainState of `step` or a Step, got {type(like).__name__}"
        )
    if not isinstance(step, Step):
        raise TypeError(f"load: `step` must be a Step, got {type(step).__name__}")
    if model is not None and not isinstance(model, (nn.Module, FunctionalModule)):
        raise TypeError(
            "load: `model` must be the nn.Module (or its FunctionalModule) the state's "
            f"parameters belong to, or None; got {type(model).__name__}"
        )
    wait_saves()
    directory = dirs.resolve(path, "load")
    every_rank_arrives("load", directory.name)
    group = checkpoint_group()
    try:
        manifest = read_manifest(directory)
        if target is None:
            params, buffers = _empty_model(manifest, directory)
            module = model.module if isinstance(model, FunctionalModule) else model
            if isinstance(module, nn.Module) and tensor_parallel_of(module) is not None:
                params = shard_like(params, module)
            target = step.init(params, buffers)
        _, pieces, assemble = pieces_into(step, target, model)
    except FAILURES as error:
        tell_peers(error, group, FINDING, caller="load")
        raise
    wanted = _leaves_of_ranks(pieces, group)
    try:
        check_matches(manifest, wanted, str(directory))
    except CheckpointError as error:
        if tensor_parallel_of(model) is None and _looks_split(manifest.leaves, wanted):
            raise CheckpointError(
                f"{error}\nSome leaves are a whole fraction of the checkpoint's along one "
                "dimension: for a tensor-parallel model, pass model=, the module "
                "fscale.tensor_parallel returned"
            ) from None
        raise
    planner = PieceLoadPlanner(pieces)
    values = {piece_name(p): p.values for p in pieces if p.values.numel()}
    error = None
    try:
        with single_process_quiet():
            dcp_io.read(values, FileSystemReader(directory), planner, group)
    except FAILURES as failure:  # reported on every rank below
        error = failure_message(failure)
    _agree_read(error, group, directory)
    planner.finish()
    return assemble()


def _looks_split(saved: Leaves, wanted: Leaves) -> bool:
    """Whether some wanted leaf is the saved one cut into equal chunks along one dimension."""
    for key, (shape, _) in wanted.items():
        full = saved.get(key, (shape, ""))[0]
        differing = [(a, b) for a, b in zip(full, shape) if a != b]
        if (
            len(full) == len(shape)
            and len(differing) == 1
            and differing[0][0] % differing[0][1] == 0
        ):
            return True
    return False


def _leaves_of_ranks(pieces: list[Piece], group: Any) -> Leaves:
    """The full leaves all ranks load into (a rank of a pipeline holds only its stages')."""
    return join_leaves(exchange_or_fail(leaves_of(pieces), group, FINDING, "load"), "load")


def _empty_model(manifest: Manifest, directory: Path) -> tuple[dict, dict]:
    """Empty ``{name: tensor}`` params and buffers of the shapes the checkpoint holds."""
    groups: dict[str, dict[str, torch.Tensor]] = {"params": {}, "buffers": {}}
    for key, (shape, dtype) in manifest.leaves.items():
        group, _, name = key.partition("/")
        if group in groups:
            groups[group][name] = torch.zeros(shape, dtype=dtype_of(dtype))
    if not groups["params"]:
        raise CheckpointError(
            f"load: {str(directory)!r} holds no parameters to initialise `like` from; pass "
            "like=step.init(params, buffers)"
        )
    return groups["params"], groups["buffers"]


def _agree_read(error: str | None, group: Any, directory: Any) -> None:
    try:
        agree(error, group, "reading", caller="load")
    except CheckpointError as failure:
        raise CheckpointError(
            f"load: the checkpoint {str(directory)!r} could not be read (truncated or damaged "
            f"files?): {failure}"
        ) from None
