"""The all-to-alls through shared memory: every row where it belongs, the windows they run,
gloo's results, a bounded wait, sizes that disagree refused (bad buffers: test_shared_memory)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from summation import heavy_tailed

from fscale import distributed as fd
from fscale.distributed import collectives as C
from fscale.distributed import shared_memory as shm
from fscale.distributed.comm import resolve_comm
from fscale.distributed.shared_memory import (
    WINDOW_BYTES,
    set_shared_memory,
    shares_memory,
)
from fscale.testing import run_spmd


def _windows_of_the_all_to_all(world: int) -> list[int]:
    """The windows the group's arena ran for an all-to-all whose parts each fill two windows
    and a bit, forward and backward, and whether every row went where it belongs."""
    rank = dist.get_rank()
    mesh = fd.Mesh(dp=world)
    comm = resolve_comm("dp", mesh, "test")
    step = WINDOW_BYTES // (4 * world)  # elements of one part that one window carries
    part = 2 * step + 5
    # Row j holds (this rank, j) in every element: rank j must receive rank i's at row i.
    sent = torch.tensor([[rank * world + j] * part for j in range(world)], dtype=torch.float32)
    x = sent.requires_grad_()
    assert shares_memory(comm, x.detach().view(-1), sums=False)
    arena = shm._ARENAS[comm.group]
    assert arena is not None
    before = arena.seq
    received = C.all_to_all(x, "dp", mesh=mesh)
    forward = arena.seq - before
    weight = torch.arange(world * part, dtype=torch.float32).view(world, part)
    (grad,) = torch.autograd.grad((received * weight).sum(), x)
    backward = arena.seq - before - forward
    rows = all(bool((received[i] == i * world + rank).all()) for i in range(world))
    # The gradient of row j comes back from rank j, which weighted it by its row `rank`.
    back = all(torch.equal(grad[j], weight[rank]) for j in range(world))
    return [forward, backward, int(rows), int(back)]


@pytest.mark.parametrize("world", [2, 4])
def test_the_all_to_all_runs_through_the_windows_and_moves_every_row_where_it_belongs(world):
    # Mixture-of-experts dispatch and combine.
    for windows in run_spmd(_windows_of_the_all_to_all, world, world):
        assert windows == [3, 3, 1, 1]


def _uneven_sizes(world: int, step: int) -> list[list[int]]:
    """Rows rank i sends rank j: none for some pairs, one window's worth and a bit for others,
    up to two windows and a bit for the largest (rows of 3 elements)."""
    rows = (2 * step + 7) // 3
    return [
        [(0 if (i + j) % 3 == 0 else rows // (1 + (i * world + j) % 4)) for j in range(world)]
        for i in range(world)
    ]


def _uneven_case(shared: bool, with_table: bool = False) -> tuple[bool, int, list[torch.Tensor]]:
    """all_to_all_uneven forward and backward over rows of 3 elements: whether it went through
    shared memory, the windows the arena ran, the rows received and the input's gradient
    (`with_table`: every rank's sizes given as `all_sizes`, the debug check off)."""
    set_shared_memory(shared)
    C.set_debug(not with_table)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(ep=world)
    comm = resolve_comm("ep", mesh, "test")
    sizes = _uneven_sizes(world, WINDOW_BYTES // (4 * world))
    send, recv = sizes[rank], [sizes[i][rank] for i in range(world)]
    x = heavy_tailed(rank, sum(send) * 3).view(-1, 3).requires_grad_()
    through = shares_memory(comm, x.detach().view(-1), sums=False)
    arena = shm._ARENAS[comm.group]
    before = arena.seq if arena is not None else 0
    table = sizes if with_table else None
    received = fd.all_to_all_uneven(x, "ep", send, recv, mesh=mesh, all_sizes=table)
    weight = heavy_tailed(rank + world, received.numel()).view_as(received)
    (grad,) = torch.autograd.grad((received * weight).sum(), x)
    windows = arena.seq - before if arena is not None else 0
    return through, windows, [received.detach(), grad]


@pytest.mark.parametrize("world", [2, 4])
def test_the_uneven_all_to_all_gives_gloo_s_rows_and_gradients(world):
    through_memory = run_spmd(_uneven_case, world, True, timeout=120)
    over_gloo = run_spmd(_uneven_case, world, False, timeout=120)
    step = WINDOW_BYTES // (4 * world)
    sizes = _uneven_sizes(world, step)
    largest = max(max(row) for row in sizes) * 3
    for (shared, windows, ours), (plain, _, theirs) in zip(through_memory, over_gloo):
        assert shared and not plain
        # Forward and backward: one window gathers every rank's sizes, then the largest
        # pair's count of windows (every rank runs them, sending or not).
        assert windows == 2 * (1 + -(-largest // step)), windows
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_s_sizes_given_spare_their_gather_and_change_no_bit(world):
    # The mixture-of-experts exchange holds the whole table already: no window gathers it.
    given = run_spmd(_uneven_case, world, True, True, timeout=120)
    gathered = run_spmd(_uneven_case, world, True, False, timeout=120)
    step = WINDOW_BYTES // (4 * world)
    largest = max(max(row) for row in _uneven_sizes(world, step)) * 3
    for (shared, windows, ours), (_, _, theirs) in zip(given, gathered):
        assert shared
        assert windows == 2 * -(-largest // step), windows
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def _exchanged_or_refused(send: list[int], recv: list[int], table: Any = None) -> str:
    """An uneven all-to-all of 4 rows of 2 over two ranks: its `ValueError`'s message, or
    "exchanged"."""
    try:
        fd.all_to_all_uneven(
            torch.ones(4, 2), "ep", send, recv, mesh=fd.Mesh(ep=2), all_sizes=table
        )
    except ValueError as error:
        return str(error)
    return "exchanged"


def _tables_that_differ_between_ranks() -> str:
    rank = dist.get_rank()
    # Each rank's table fits its own sizes, but rank 1 expects 2 rows where rank 0 sends 3.
    send, recv = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [2, 2])
    table = [[1, 3], [2, 2]] if rank == 0 else [[1, 2], [2, 2]]
    return _exchanged_or_refused(send, recv, table)


def test_with_the_debug_check_on_tables_that_differ_between_ranks_are_refused_on_every_rank():
    for message in run_spmd(_tables_that_differ_between_ranks, 2):
        assert "rank 0 (ep=0) sends 3 rows to ep=1, which expects 2 from it" in message, message


def _table_that_disagrees() -> list[str]:
    send, recv = ([1, 3], [1, 2]) if dist.get_rank() == 0 else ([2, 2], [3, 2])
    tables = ([[1, 3], [2, 2]], [[1, 3]], [[1, 3], [2, -2]], [[1, 2], [3, 2]])
    return [_exchanged_or_refused(send, recv, table) for table in tables]


def test_a_table_of_sizes_that_does_not_fit_is_refused_before_anything_is_sent():
    for rank, (fits, short, negative, swapped) in enumerate(run_spmd(_table_that_disagrees, 2)):
        assert fits == "exchanged"
        assert "`all_sizes` must hold 2 rows" in short, short
        assert "`all_sizes[1]` must hold 2 non-negative ints" in negative, negative
        assert f"`all_sizes` says ep={rank} sends" in swapped, swapped


def _absent_peer_uneven() -> tuple[str, float] | None:
    C.set_debug(False)
    C.set_collective_timeout(1.0)
    rank = dist.get_rank()
    mesh = fd.Mesh(ep=2)
    x = torch.ones(4, 2)
    sizes = [1, 3] if rank == 0 else [3, 1]  # rank 0 keeps 1 row and sends 3, rank 1 too
    for _ in range(2):
        fd.all_to_all_uneven(x, "ep", sizes, sizes, mesh=mesh)
    dist.barrier()
    if rank == 1:
        return None  # returns from its function instead of exchanging once more
    start = time.monotonic()
    try:
        fd.all_to_all_uneven(x, "ep", sizes, sizes, mesh=mesh)
    except fd.CollectiveTimeoutError as error:
        return str(error), time.monotonic() - start
    return "completed", 0.0


def test_a_peer_that_never_comes_to_the_uneven_all_to_all_is_reported_in_bounded_time():
    caught, absent = run_spmd(_absent_peer_uneven, 2, timeout=60)
    assert absent is None and caught is not None
    message, seconds = caught
    assert "rank 1: returned from its function" in message, message
    assert seconds < 10


def _disagreeing_sizes() -> str:
    # Rank 0 sends rank 1 three rows; rank 1 expects two from it.
    send, recv = ([1, 3], [1, 3]) if dist.get_rank() == 0 else ([3, 1], [2, 1])
    return _exchanged_or_refused(send, recv)


def test_sizes_the_ranks_disagree_on_are_refused_on_every_rank_through_shared_memory():
    for message in run_spmd(_disagreeing_sizes, 2):
        assert "rank 0 (ep=0) sends 3 rows to ep=1, which expects 2 from it" in message, message
