"""Set-up traffic (metadata and first values) between the ranks of a group, counted and bounded.

`torch.distributed.all_gather_object` and a bare `broadcast` wait until the process group's
timeout (gloo's default is 30 minutes) when a peer never issues them: a rank that skipped
`Step.init` behind an ``if rank == 0``, or raised in a check of its own before the exchange.
These go through the same three steps as a training step's collectives
(`fscale.distributed.watchdog`): counted, agreed once per new signature through the store,
and waited on for at most `collective_timeout()` before the ranks compare where they are, so
such a rank's peers fail within twice that, naming each rank's position.

They are not recorded in the comm ledger, which counts what a training step moves.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from fscale.distributed import debug, watchdog
from fscale.distributed.comm import Comm, all_gather_flat
from fscale.readback import to_list

__all__ = ["all_gather_objects", "all_gather_objects_over", "barrier", "broadcast_from_first"]

# Payloads are padded to a power of two of at least this many bytes, so a run's set-up
# exchanges reuse a few signatures instead of agreeing on a new one per payload size.
_SMALLEST_PAYLOAD = 64


def all_gather_objects(value: Any, comm: Comm) -> list[Any]:
    """Every rank's picklable `value` along `comm`'s axis, in axis order.

    Two all-gathers: the payload sizes, then the payloads padded to the longest.

    Raises:
        CollectiveTimeoutError: a peer did not reach the exchange within twice
            `collective_timeout()` (the message names where each rank is).
    """
    if comm.size == 1:
        return [value]
    return all_gather_objects_over(value, comm.group, comm.mesh.peers(comm.axis), comm.axis)


def all_gather_objects_over(
    value: Any, group: Any, ranks: tuple[int, ...], label: str
) -> list[Any]:
    """`all_gather_objects` over any process `group` whose global ranks are `ranks` (in group
    order); `label` names the group in messages, as an axis name does."""
    if len(ranks) == 1:
        return [value]
    device = _device_of(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = to_list(_gather(group, ranks, label, size))
    padded = torch.zeros(_padded_length(max(sizes)), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(device)
    rows = _gather(group, ranks, label, padded).view(len(ranks), -1).cpu()
    return [pickle.loads(rows[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]


def broadcast_from_first(tensor: torch.Tensor, comm: Comm) -> None:
    """Overwrite `tensor` on every rank with index 0's along `comm`'s axis (in place)."""
    if comm.size == 1:
        return
    source = comm.mesh.global_rank(comm.axis, 0)
    ticket = debug.count(comm, "broadcast", tensor, source)
    watchdog.wait(dist.broadcast(tensor, src=source, group=comm.group, async_op=True), ticket)


def barrier(comm: Comm) -> None:
    """Return once every rank of `comm`'s axis has called it."""
    if comm.size == 1:
        return
    ticket = debug.count(comm, "barrier", torch.zeros(0))
    watchdog.wait(dist.barrier(group=comm.group, async_op=True), ticket)


def _gather(group: Any, ranks: tuple[int, ...], label: str, mine: torch.Tensor) -> torch.Tensor:
    out = mine.new_empty(len(ranks) * mine.numel())
    # Counted as `debug.count` counts a mesh axis's collectives: agreed through the store on
    # the default path, and not checked again under the debug flag (it is this exchange).
    agree = not debug.debug_enabled()
    ticket = watchdog.admit(group, lambda: ranks, label, "all_gather", mine, 0, agree)
    watchdog.wait(all_gather_flat(out, mine, group=group, async_op=True), ticket)
    return out


def _padded_length(longest: int) -> int:
    return max(_SMALLEST_PAYLOAD, 1 << (longest - 1).bit_length())


def _device_of(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the host, unless it has only NCCL."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "cpu" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
