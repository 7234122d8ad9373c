"""`save` and `wait_saves`: every rank writes its own pieces, and the ranks commit together.

First the ranks describe their pieces to each other (`describe_ranks`): the manifest lists the
leaves of all of them (a pipeline rank holds only its stages'), and a box that several ranks
hold must hold the same values on all of them; a rank that fails to find its pieces sends its
error in that exchange instead (`tell_peers`), so its peers raise it at once. Then a save has
three phases, each ending in an agreement among all ranks (an all-gather of every rank's
error, or None), so that one rank's failure makes every rank raise the same `CheckpointError`
and no rank waits in a collective the others never reach:

1. *prepare*: rank 0 removes what killed saves left (``.tmp-*``) and creates
   ``root/.tmp-step_<n>``; agreement.
2. *write*: DCP writes every rank's pieces (`fscale.ckpt.planner`) and then its metadata; DCP
   itself gathers the ranks' write results and raises on every rank if one failed.
3. *commit*: rank 0 writes the manifest, renames the directory to ``root/step_<n>``
   (`fscale.ckpt.directory.commit`) and prunes to `keep_last`; agreement.

With ``async_=True`` the caller returns once every rank has copied its pieces (so later steps,
which may update the state's buffers in place, never change what is written); a thread then
writes the copies with DCP and commits, on a process group of its own, so that its collectives
never interleave with the training step's. Saves run one at a time: a save first waits for the
previous one; `wait_saves` waits for all.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fscale.ckpt import dcp_io
from fscale.ckpt import directory as dirs
from fscale.ckpt.boxes import Piece
from fscale.ckpt.manifest import (
    CheckpointError,
    Leaves,
    Manifest,
    join_leaves,
    leaves_of,
    model_entry,
    write_manifest,
)
from fscale.ckpt.pieces import pieces_of
from fscale.ckpt.planner import PieceSavePlanner, piece_name
from fscale.distributed import setup_traffic
from fscale.distributed.watchdog import CollectiveTimeoutError
from fscale.plan import TrainState
from fscale.train import Step

__all__ = [
    "FAILURES",
    "FINDING",
    "agree",
    "checkpoint_group",
    "describe_ranks",
    "distributed",
    "every_rank_arrives",
    "exchange_or_fail",
    "failure_message",
    "save",
    "single_process_quiet",
    "tell_peers",
    "wait_saves",
]

# Long enough for a large write on a slow disk; a killed peer is noticed at once regardless
# (its sockets close).
_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
_groups: dict[int, Any] = {}
_pending: list[Future] = []
_pending_lock = threading.Lock()
# What a failed save raises: DCP reports the ranks' errors as a CheckpointException, which is a
# BaseException.
FAILURES = (Exception, CheckpointException)
# The phase in which each rank finds the pieces it holds and describes them to the others.
FINDING = "finding the pieces"
_committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fscale-ckpt-commit")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process (a one-process run is no mistake)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def checkpoint_group() -> Any:
    """The gloo group checkpoints use (None without torch.distributed); made once per world.

    Every rank must call it the first time (it is a collective); `save` and `load` do.
    """
    if not distributed():
        return None
    world = dist.group.WORLD
    key = id(world)
    if key not in _groups:
        _groups.clear()  # a new default group: the old one's groups are gone with it
        _groups[key] = (world, dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT))
    return _groups[key][1]


def every_rank_arrives(caller: str, checkpoint: str) -> None:
    """Raise unless every rank called `caller` for the same `checkpoint` (its directory name).

    The first exchange of a save or load, over the default group and bounded like a step's
    collectives (`fscale.distributed.setup_traffic`): a call made on some ranks only, as under
    ``if rank == 0:``, fails within twice the collective timeout instead of waiting for the
    checkpoint group's ten minutes, and ranks naming different checkpoints fail on every rank.
    """
    if not distributed():
        return
    world = dist.get_world_size()
    try:
        names = setup_traffic.all_gather_objects_over(
            checkpoint, dist.group.WORLD, tuple(range(world)), "world"
        )
    except CollectiveTimeoutError as error:
        raise CheckpointError(
            f"{caller}: not every rank reached {caller} of {checkpoint} (a rank that did not "
            "call it, or failed before its first exchange: see that rank's error). Every rank "
            f"calls {caller}, each {'writing' if caller == 'save' else 'reading'} the pieces it "
            "holds; only the work after it belongs under `if rank == 0:`."
            f"\n{error}"
        ) from error
    if len(set(names)) > 1:
        ranks = "; ".join(f"rank {r}: {name}" for r, name in enumerate(names))
        raise CheckpointError(
            f"{caller}: the ranks name different checkpoints ({ranks}); every rank must "
            f"{caller} the same one (the same state.step on every rank)."
        )


def agree(error: str | None, group: Any, phase: str, caller: str = "save") -> None:
    """Raise on every rank if any rank's `error` is set (a collective over `group`)."""
    exchange_or_fail(error, group, phase, caller)


def exchange_or_fail(mine: Any, group: Any, phase: str, caller: str = "save") -> list[Any]:
    """Every rank's `mine` over `group` (None: this rank alone); a str is a rank's failure,
    raised on every rank as a CheckpointError that names the rank.

    One all-gather carries either what the phase exchanges or why a rank could not produce it,
    so a rank that fails on its own before the exchange is reported on all ranks at once.
    """
    everyone: list[Any] = [mine]
    if group is not None:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    failed = [(rank, e) for rank, e in enumerate(everyone) if isinstance(e, str)]
    if failed:
        detail = "; ".join(f"rank {rank}: {e}" for rank, e in failed)
        raise CheckpointError(f"{caller}: {phase} failed on {len(failed)} rank(s): {detail}")
    return everyone


def tell_peers(error: BaseException, group: Any, phase: str, caller: str = "save") -> None:
    """Hand this rank's `error` to the `exchange_or_fail` its peers wait in, for `phase`.

    They raise it at once, naming this rank, instead of waiting out the group's timeout for a
    rank that left; this rank goes on to raise `error` itself.
    """
    if group is not None:
        with contextlib.suppress(CheckpointError):
            exchange_or_fail(failure_message(error), group, phase, caller)


def describe_ranks(pieces: list[Piece], group: Any) -> Leaves:
    """The full leaves of every rank's `pieces` (a collective over `group`).

    A rank that failed to find its pieces takes part through `tell_peers` instead.

    Raises, on every rank, a CheckpointError if two ranks disagree on a leaf's shape, or hold
    different values for the same box: DCP writes a box that several ranks hold once, so they
    must be equal. A model whose parameters are per-rank shards the checkpoint is not told of
    (a `tensor_parallel` model saved without ``model=``; expert slices outside
    `expert_parallel`) would otherwise be saved as one rank's shard, silently.
    """
    mine = leaves_of(pieces)
    if group is None:
        return dict(sorted(mine.items()))
    everyone = exchange_or_fail((mine, _checksums(pieces)), group, FINDING)
    leaves = join_leaves([leaves for leaves, _ in everyone], "save")
    boxes = set().union(*(rank_sums for _, rank_sums in everyone))
    for index in sorted(boxes):
        held = {
            r: rank_sums[index] for r, (_, rank_sums) in enumerate(everyone) if index in rank_sums
        }
        if len(set(held.values())) > 1:
            key, offsets = index
            raise CheckpointError(
                f"save: the ranks hold different values for the box at {list(offsets)} of "
                f"{key!r} (sum, |sum| per rank: {held}); a checkpoint stores one copy of it. "
                "Its values are per-rank shards the checkpoint was not told of (a "
                "tensor-parallel model: pass model=, the module fscale.tensor_parallel "
                "returned), or the replicas have diverged."
            )
    return leaves


def _checksums(pieces: list[Piece]) -> dict[Any, tuple[str, str]]:
    """``(sum, sum of magnitudes)`` of each piece, in float64, read back once per device."""
    by_device: dict[torch.device, list[tuple[Any, torch.Tensor]]] = {}
    with torch.no_grad():
        for piece in pieces:
            wide = piece.values.detach().to(torch.float64)
            pair = torch.stack([wide.sum(), wide.abs().sum()])
            by_device.setdefault(pair.device, []).append((piece.index, pair))
    sums = {}
    for items in by_device.values():
        values = torch.stack([pair for _, pair in items]).tolist()
        # As text, so that equal non-finite sums compare equal.
        sums.update((index, (repr(a), repr(b))) for (index, _), (a, b) in zip(items, values))
    return sums


def save(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    step: Step,
    model: Any = None,
    keep_last: int | None = None,
    async_: bool = False,
) -> Path | Future:
    """Write `state` as the checkpoint ``path/step_<n>`` (n = ``state.step``); all ranks call it.

    Every rank writes only the pieces of the full state it holds (`fscale.ckpt.pieces`); the
    directory appears under its final name only when complete (see the module docstring).

    Args:
        path: the checkpoint root directory (created if missing).
        state: this rank's state.
        step: the step that made `state` (its plan says how the state is sharded).
        model: the `FunctionalModule` from `fscale.functionalize` (or the ``nn.Module``), to
            record its ``state_dict`` names for ``fscale consolidate``; optional, except for a
            `tensor_parallel` model, whose splits say where each rank's shards go.
        keep_last: keep only the newest this many checkpoints under `path` (None: all).
        async_: return as soon as the pieces are staged; the write and commit continue in the
            background (`wait_saves` waits for them).

    Returns:
        The committed directory, or (async) a Future of it.

    Raises:
        TypeError / ValueError: bad arguments (named).
        CheckpointError: the save failed on some rank; it is raised on every rank, and the
            previous checkpoints are untouched.
    """
    _check_arguments(path, state, step, keep_last, async_)
    wait_saves()
    number = int(state.step)
    every_rank_arrives("save", dirs.step_name(number))
    group = checkpoint_group()
    world_size = dist.get_world_size() if distributed() else 1
    rank = dist.get_rank() if distributed() else 0
    root = Path(path)
    try:
        layout, pieces = pieces_of(step, state, model)
    except FAILURES as error:
        tell_peers(error, group, FINDING)
        raise
    leaves = describe_ranks(pieces, group)
    params = {key.removeprefix("params/") for key in leaves if key.startswith("params/")}
    manifest = Manifest(
        step=number,
        world_size=world_size,
        plan=repr(step.plan),
        layout=layout.kind,
        leaves=leaves,
        model=model_entry(model, params),
        placements=layout.placements,
    )
    tmp = root / f"{dirs.TMP_PREFIX}{dirs.step_name(number)}"
    final = root / dirs.step_name(number)

    error = None
    if rank == 0:
        error = _attempt(lambda: _prepare(root, tmp))
    agree(error, group, "prepare")

    values = {piece_name(p): p.values for p in pieces if p.values.numel()}
    writer = FileSystemWriter(tmp, overwrite=True)
    planner = PieceSavePlanner(pieces)
    if not async_:
        _write(values, writer, planner, group)
        _commit(manifest, tmp, final, root, keep_last, rank, group)
        return final
    # Staged here, not by DCP, so a failure to copy (out of memory) is agreed on before any
    # rank starts the upload's collectives.
    staged: dict[str, torch.Tensor] = {}
    error = _attempt(lambda: staged.update(_stage(values)))
    agree(error, group, "staging")

    # The commit thread writes the copies, then commits (DCP's own `async_save` would run the
    # same write in a thread of its own, after staging the copies again unless told otherwise).
    def finish() -> Path:
        _write(staged, writer, planner, group)
        _commit(manifest, tmp, final, root, keep_last, rank, group)
        return final

    future = _committer.submit(finish)
    with _pending_lock:
        _pending.append(future)
    return future


def wait_saves() -> list[Path]:
    """Wait for every asynchronous save of this process; their directories, oldest first.

    Raises:
        CheckpointError: a save failed (the first failure is raised, after all have ended).
    """
    with _pending_lock:
        pending = list(_pending)
        _pending.clear()
    futures.wait(pending)
    for future in pending:
        error = future.exception()
        if error is not None:  # the first failure, now that every save has ended
            raise error
    return [future.result() for future in pending]


# ---- the phases ---------------------------------------------------------------------------


def _prepare(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    dirs.remove_partial(root)
    tmp.mkdir()


def _write(values: dict[str, torch.Tensor], writer: Any, planner: Any, group: Any) -> None:
    try:
        with single_process_quiet():
            dcp_io.write(values, writer, planner, group)
    except FAILURES as error:  # DCP raised it on every rank
        raise CheckpointError(f"save: writing the pieces failed: {error}") from error


def _commit(
    manifest: Manifest,
    tmp: Path,
    final: Path,
    root: Path,
    keep_last: int | None,
    rank: int,
    group: Any,
) -> None:
    error = None
    if rank == 0:

        def commit() -> None:
            write_manifest(tmp, manifest)
            dirs.commit(tmp, final)
            if keep_last is not None:
                dirs.prune(root, keep_last)

        error = _attempt(commit)
    agree(error, group, "commit")


def _stage(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies on the CPU that the training steps after the save cannot change."""
    return {key: value.detach().to("cpu", copy=True) for key, value in values.items()}


def _attempt(action: Any) -> str | None:
    """Run `action`; its error as a message for the agreement, or None."""
    try:
        action()
    except FAILURES as error:  # every rank is told, and raises
        return failure_message(error)
    return None


def failure_message(error: BaseException) -> str:
    """How a rank's failure travels to its peers: the exception's type and message."""
    return f"{type(error).__name__}: {error}"


def _check_arguments(path: Any, state: Any, step: Any, keep_last: Any, async_: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save: `path` must be a str or path, got {type(path).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"save: `state` must be a TrainState, got {type(state).__name__}")
    if not isinstance(step, Step):
        raise TypeError(f"save: `step` must be the Step of `state`, got {type(step).__name__}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"save: `keep_last` must be a positive int or None, got {keep_last!r}")
    if not isinstance(async_, bool):
        raise TypeError(f"save: `async_` must be a bool, got {async_!r}")
    if Path(path).is_file():
        raise CheckpointError(
            f"save: `path` {str(path)!r} is a file; a checkpoint root is a directory"
        )
