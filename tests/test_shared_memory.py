"""Collectives through shared memory between the ranks of one host: gloo's bits, bounded waits.

Inputs are heavy-tailed, so a sum of four terms in another order shows in the last bits of most
elements; equality is checked on the raw bits against gloo's own all-reduce of the same buffer.
The sizes cover one window, many windows, and gloo's two ways of cutting a buffer (past 2N MiB).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import datetime
import os
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from summation import SIZES, bits, heavy_tailed

import fscale as fs
from fscale import distributed as fd
from fscale.distributed import collectives as C
from fscale.distributed import hosts, shared_arena, shared_regions
from fscale.distributed import shared_memory as shm
from fscale.distributed.comm import resolve_comm
from fscale.distributed.shared_memory import (
    WINDOW_BYTES,
    SharedWork,
    set_shared_memory,
    shared_all_gather,
    shared_all_reduce,
    shared_all_to_all,
    shared_all_to_all_uneven,
    shared_memory_enabled,
    shared_reduce_scatter,
    shares_memory,
)
from fscale.parallel.bucket_collectives import all_reduce_bucket_start
from fscale.testing import RankError, run_spmd


def _collectives_case(trailing: int) -> list[dict[str, bool]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = resolve_comm("dp", fd.Mesh(dp=world), "test")
    out = []
    for size in SIZES:
        numel = size // world * world
        x = heavy_tailed(rank, numel + trailing)
        reduced = x.clone()
        dist.all_reduce(reduced)  # the reference: gloo's all-reduce of the same buffer
        summed = x.clone()
        shared_all_reduce(summed, comm).wait()
        flat = x.clone()
        work, part = shared_reduce_scatter(flat, comm, trailing)
        work.wait()
        mine = slice(rank * (numel // world), (rank + 1) * (numel // world))
        gathered = torch.full((numel,), float("nan"))
        gathered[mine] = reduced[mine]
        shared_all_gather(gathered, comm).wait()
        out.append(
            {
                "shares": shares_memory(comm, x, sums=True),
                "all_reduce": torch.equal(bits(summed), bits(reduced)),
                "reduce_scatter": torch.equal(bits(part), bits(reduced[mine])),
                "trailing": torch.equal(bits(flat[numel:]), bits(reduced[numel:])),
                "parts read only": torch.equal(flat[:numel], x[:numel]),
                "all_gather": torch.equal(bits(gathered), bits(reduced[:numel])),
            }
        )
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("trailing", [0, 3])
def test_shared_memory_collectives_give_gloo_sbits(world, trailing):
    for per_rank in run_spmd(_collectives_case, world, trailing, timeout=180):
        for checks in per_rank:
            assert all(checks.values()), checks


def _dtypes_case() -> list[bool]:
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = resolve_comm("dp", fd.Mesh(dp=world), "test")
    out = []
    for dtype in (torch.float64, torch.bfloat16, torch.int32):
        numel = WINDOW_BYTES // 2 + 6  # one window and a part of another at any element size
        x = (heavy_tailed(rank, numel) * 100).to(dtype)
        reduced = x.clone()
        dist.all_reduce(reduced)
        summed = x.clone()
        shared_all_reduce(summed, comm).wait()
        out.append(torch.equal(summed, reduced))
    return out


def test_other_dtypes_are_summed_as_gloo_sums_them():
    for checks in run_spmd(_dtypes_case, 2):
        assert all(checks), checks


def _in_flight_case() -> list[bool]:
    # Two collectives started before either is waited for, a gloo collective between them:
    # each runs in turn on the group's worker, in the order started on every rank.
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(dp=world)
    first, second = heavy_tailed(rank, 3 * WINDOW_BYTES // 4), heavy_tailed(rank + 10, 5000)
    expected = [x.clone() for x in (first, second)]
    for x in expected:
        dist.all_reduce(x)
    a = all_reduce_bucket_start(first.clone(), "dp", mesh, divided=True)
    b = all_reduce_bucket_start(second.clone(), "dp", mesh, divided=True)
    between = C.all_reduce(torch.ones(3), "dp", mesh=mesh)
    return [
        torch.equal(b.wait(), expected[1]),
        torch.equal(a.wait(), expected[0]),
        torch.equal(between, torch.full((3,), float(world))),
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_in_flight_complete_in_the_order_started(world):
    for checks in run_spmd(_in_flight_case, world):
        assert all(checks), checks


def _regions_case() -> dict[str, bool]:
    world = dist.get_world_size()
    comm = resolve_comm("dp", fd.Mesh(dp=world), "test")
    x = torch.ones(10)
    decided = shares_memory(comm, x, sums=True)  # the first call maps every rank's region
    arena = shm._ARENAS[comm.group]
    assert arena is not None
    path = arena._path
    named_before = path is not None and os.path.exists(path)
    shared_all_reduce(x, comm).wait()
    return {
        "decided": decided,
        "named until the first window": named_before,
        "unnamed after it": path is not None and not os.path.exists(path),
        "summed": torch.equal(x, torch.full((10,), float(world))),
        "meta tensors keep the backend": not shares_memory(comm, x.to("meta"), sums=True),
    }


def test_each_rank_s_region_is_unnamed_once_every_peer_has_mapped_it():
    for checks in run_spmd(_regions_case, 2):
        assert all(checks.values()), checks


def _setting_case(setting_on_rank_0: bool) -> bool:
    rank = dist.get_rank()
    set_shared_memory(setting_on_rank_0 if rank == 0 else True)
    comm = resolve_comm("dp", fd.Mesh(dp=dist.get_world_size()), "test")
    return shares_memory(comm, torch.ones(4), sums=False)


def test_the_setting_decides_and_must_agree_across_the_ranks_of_one_host():
    assert run_spmd(_setting_case, 2, True) == [True, True]
    with pytest.raises(RankError, match=r"share a host but not the setting: ranks \[1\]"):
        run_spmd(_setting_case, 2, False)


def _other_host_case() -> tuple[bool, bool]:
    if dist.get_rank() == 1:
        # restored below; the pool's ranks live on
        shared_regions.host_id = lambda: "host:elsewhere"
    try:
        comm = resolve_comm("dp", fd.Mesh(dp=2), "test")
        x = torch.ones(4)
        shared = shares_memory(comm, x, sums=True)
        pending = all_reduce_bucket_start(x, "dp", comm.mesh, divided=True)
        return shared, torch.equal(pending.wait(), torch.full((4,), 2.0))
    finally:
        shared_regions.host_id = hosts.host_id


def test_ranks_on_different_hosts_keep_gloo():
    assert run_spmd(_other_host_case, 2) == [(False, True), (False, True)]


def _single_rank_case() -> list[bool]:
    comm = resolve_comm("dp", fd.Mesh(dp=1), "test")
    return [shares_memory(comm, torch.ones(3), sums=True)]


def test_a_group_of_one_rank_does_not_share_memory_and_shared_calls_say_so():
    assert run_spmd(_single_rank_case, 1) == [[False]]
    with pytest.raises(TypeError, match="`enabled` must be a bool"):
        set_shared_memory(1)  # type: ignore[arg-type]
    assert fd.set_shared_memory is set_shared_memory  # the package's own name for it
    assert fd.shared_memory_enabled() == shared_memory_enabled()


def _unshared_call() -> None:
    set_shared_memory(False)
    comm = resolve_comm("dp", fd.Mesh(dp=2), "test")
    shared_all_reduce(torch.ones(3), comm)


def test_a_shared_call_where_the_group_keeps_gloo_names_the_check():
    with pytest.raises(RankError, match=r"check shares_memory\(comm, flat, sums=...\) first"):
        run_spmd(_unshared_call, 2)


def _late_peer(late: float) -> bool:
    C.set_debug(False)
    C.set_collective_timeout(1.0)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(dp=world)
    x = heavy_tailed(rank, 3 * WINDOW_BYTES // 4)
    expected = x.clone()
    dist.all_reduce(expected)
    for _ in range(2):  # the signature and its repetition agreed: the next wait is the bound's
        all_reduce_bucket_start(x.clone(), "dp", mesh, divided=True).wait()
    dist.barrier()
    if rank == 0:
        time.sleep(late)
    reduced = all_reduce_bucket_start(x.clone(), "dp", mesh, divided=True).wait()
    return torch.equal(reduced, expected)


def test_a_late_peer_is_no_error():
    # Later than the watchdog's patience (1 s): the ranks compare records, find every peer in
    # the collective or arriving, and wait on.
    assert run_spmd(_late_peer, 2, 1.5) == [True, True]


def _absent_peer() -> tuple[str, float] | None:
    C.set_debug(False)
    C.set_collective_timeout(1.0)
    rank = dist.get_rank()
    mesh = fd.Mesh(dp=2)
    for _ in range(2):
        all_reduce_bucket_start(torch.ones(8), "dp", mesh, divided=True).wait()
    dist.barrier()
    if rank == 1:
        return None  # returns from its function instead of reducing once more
    start = time.monotonic()
    try:
        all_reduce_bucket_start(torch.ones(8), "dp", mesh, divided=True).wait()
    except fd.CollectiveTimeoutError as error:
        return str(error), time.monotonic() - start
    return "completed", 0.0


def test_a_peer_that_never_arrives_is_reported_in_bounded_time():
    caught, absent = run_spmd(_absent_peer, 2, timeout=60)
    assert absent is None and caught is not None
    message, seconds = caught
    assert "rank 1: returned from its function" in message, message
    assert seconds < 10
    # The pool resets every rank before its next call: the group's regions are closed and the
    # next call maps new ones.
    assert run_spmd(_regions_case, 2)[0]["summed"]


def test_shared_work_bounds_its_wait_as_c10d_work_does():
    never: concurrent.futures.Future = concurrent.futures.Future()
    work = SharedWork(never)
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait(datetime.timedelta(seconds=0.05))
    assert not work.is_completed()
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(ValueError("regions closed"))
    with pytest.raises(RuntimeError, match="failed: regions closed"):
        SharedWork(failed).wait()
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(None)
    assert SharedWork(done, [torch.ones(2)]).wait() and SharedWork(done).is_completed()


def _differentiable_case(shared: bool) -> tuple[bool, list[torch.Tensor]]:
    """all_gather and reduce_scatter forward and backward (each the other's dual), all_reduce
    and replicate (whose backward all-reduces), all_to_all (its own dual), with grad mode on,
    from one window to several; whether they went through shared memory."""
    set_shared_memory(shared)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = fd.Mesh(dp=world)
    out: list[torch.Tensor] = []
    # Up to 8 MiB: several windows, and segments of gloo's 1 MiB on every rank at world 2
    # and 4; the largest size's regime is the plain collectives' test above.
    for size in SIZES[1:-1]:
        numel = size // world * world
        x = heavy_tailed(rank, numel).requires_grad_()
        weight = heavy_tailed(rank + world, numel)
        gathered = C.all_gather(x[: numel // world], "dp", mesh=mesh)
        reduced = C.reduce_scatter(x, "dp", op="mean", mesh=mesh)
        summed = C.all_reduce(x, "dp", mesh=mesh)
        averaged = C.all_reduce(x, "dp", op="mean", mesh=mesh)
        shared_use = C.replicate(x, "dp", mesh=mesh)
        exchanged = C.all_to_all(x, "dp", mesh=mesh)
        loss = (gathered * weight).sum() + (reduced * weight[: numel // world]).sum()
        loss = loss + (exchanged * weight).sum()
        # A loss that differs across the ranks: replicate's backward sums the ranks' weights.
        loss = loss + (summed * weight).sum() + (averaged * weight).sum()
        loss = loss + (shared_use * weight).sum()
        (grad,) = torch.autograd.grad(loss, x)
        out += [gathered.detach(), reduced.detach(), summed.detach(), averaged.detach()]
        out += [exchanged.detach(), grad]
    comm = resolve_comm("dp", mesh, "test")
    return shares_memory(comm, torch.ones(world), sums=True), out


@pytest.mark.parametrize("world", [2, 4])
def test_the_differentiable_collectives_give_gloo_s_bits(world):
    through_memory = run_spmd(_differentiable_case, world, True, timeout=120)
    over_gloo = run_spmd(_differentiable_case, world, False, timeout=120)
    for (shared, ours), (plain, theirs) in zip(through_memory, over_gloo):
        assert shared and not plain
        for a, b in zip(ours, theirs):
            assert torch.equal(bits(a), bits(b))


def _windows_of_the_differentiable_all_reduce() -> list[int]:
    """The windows the group's arena ran for an all-reduce of three windows and a bit, and for
    replicate's backward of the same size, and whether both sums are right."""
    world = dist.get_world_size()
    mesh = fd.Mesh(dp=world)
    comm = resolve_comm("dp", mesh, "test")
    x = torch.ones(3 * WINDOW_BYTES // 4 + 5, requires_grad=True)
    assert shares_memory(comm, x.detach(), sums=True)
    arena = shm._ARENAS[comm.group]
    assert arena is not None
    before = arena.seq
    summed = C.all_reduce(x, "dp", mesh=mesh)
    forward = arena.seq - before
    (grad,) = torch.autograd.grad(C.replicate(x, "dp", mesh=mesh).sum(), x)
    backward = arena.seq - before - forward
    right = bool((summed == world).all()) and bool((grad == world).all())
    return [forward, backward, int(right)]


def test_the_differentiable_all_reduce_and_replicate_s_backward_run_through_the_windows():
    # Tensor parallelism's activation all-reduces (Megatron's g and the gradient of f).
    for windows in run_spmd(_windows_of_the_differentiable_all_reduce, 2):
        assert windows == [4, 4, 1]


def _late_worker_case() -> list[bool]:
    """The differentiable gather, reduce-scatter and all-reduce when the worker writes their
    results after their Functions returned and before the wait, and with an expanded gradient
    (a sum's)."""
    world = dist.get_world_size()
    mesh = fd.Mesh(dp=world)
    comm = resolve_comm("dp", mesh, "test")
    x = torch.ones(world * 8, requires_grad=True)
    assert shares_memory(comm, x.detach(), sums=True)
    arena = shm._ARENAS[comm.group]
    assert arena is not None
    out = []
    for start, expected in (
        (lambda: C.reduce_scatter_start(x * 1.0, "dp", mesh=mesh), float(world)),
        (lambda: C.all_gather_start(x * 1.0, "dp", mesh=mesh), 1.0),
        (lambda: C.all_reduce_start(x * 1.0, "dp", mesh=mesh), float(world)),
    ):
        pending = start()
        arena.submit(lambda: None).result(timeout=60)  # the worker has written the result
        result = pending.wait()
        (grad,) = torch.autograd.grad(result.sum(), x)
        out.append(bool((result == expected).all()) and grad.shape == x.shape)
    return out


def test_results_written_after_their_functions_return_are_no_autograd_error():
    for checks in run_spmd(_late_worker_case, 2):
        assert all(checks), checks


def _resident(arena: shared_arena.Arena) -> int:
    """The resident bytes of this process's mappings of the group's regions."""
    starts = [ctypes.addressof(ctypes.c_char.from_buffer(region)) for region in arena._maps]
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                counting = int(head.split("-")[0], 16) in starts
            elif counting and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def _resident_window_bytes() -> list[int]:
    """The windows' resident bytes after a collective, while a release waits behind another
    collective, and once it ran."""
    world = dist.get_world_size()
    comm = resolve_comm("dp", fd.Mesh(dp=world), "test")
    flat = torch.ones(4 * WINDOW_BYTES // 4)
    assert shares_memory(comm, flat, sums=True)
    arena = shm._ARENAS[comm.group]
    assert arena is not None
    shared_all_reduce(flat, comm).wait()
    after_collective = _resident(arena)
    # Queued behind a collective held back until the release is queued too: the release waits
    # for it, then unmaps.
    go = threading.Event()
    arena.submit(go.wait)
    work = shared_all_reduce(flat, comm)
    shm.release_windows()
    go.set()
    work.wait()
    arena.submit(lambda: None).result(timeout=60)  # the release has run
    released = _resident(arena)
    shared_all_reduce(flat, comm).wait()
    ok = torch.equal(flat, torch.full_like(flat, float(world**3)))  # contents kept throughout
    return [after_collective, released, _resident(arena), int(ok)]


def test_release_windows_unmaps_them_once_the_collectives_before_it_are_done():
    for after_collective, released, used_again, summed in run_spmd(_resident_window_bytes, 2):
        # Both ranks' two windows (4 MiB) were touched by an all-reduce of 4 MiB; after the
        # release only the counter pages (one per region) stay mapped, until the next one.
        assert after_collective >= 4 * WINDOW_BYTES, after_collective
        assert released <= 2 * 4096, released
        assert used_again >= 4 * WINDOW_BYTES, used_again
        assert summed


def _resident_at_the_loss_s_gradient() -> list[int]:
    """The windows' resident bytes when each step's backward starts (the loss's gradient, an
    LM's activation peak) under fully_shard, and once the step is done."""
    world = dist.get_world_size()
    mesh = fd.Mesh(dp=world)
    params = {"a": torch.randn(700, 1024), "b": torch.randn(300, 1024)}
    seen: list[int] = []

    def arena() -> shared_arena.Arena:
        return next(a for a in shm._ARENAS.values() if a is not None)

    def measure(grad: torch.Tensor) -> None:
        arena().submit(lambda: None).result(timeout=60)  # what was queued before has run
        seen.append(_resident(arena()))

    def loss_fn(p, buffers, batch, key):
        loss = (torch.tanh(batch @ p["a"].T) @ p["a"] @ p["b"].T).square().mean()
        loss.register_hook(measure)
        return loss

    step = fs.fully_shard(fs.train_step(loss_fn, fs.optim.adamw(1e-3)), mesh, units=["a", "b"])
    state = step.init(params)
    for _ in range(2):
        state, _ = step(state, torch.randn(4, 1024))
    arena().submit(lambda: None).result(timeout=60)
    return [*seen, _resident(arena())]


def test_fully_shard_releases_the_windows_for_the_loss_and_its_gradient():
    for at_first, at_second, after in run_spmd(_resident_at_the_loss_s_gradient, 2):
        # Only the counter pages (one per region) stay mapped from the end of the forward's
        # gathers to the backward's first; the backward's reduce-scatters map them again.
        assert at_first <= 2 * 4096 and at_second <= 2 * 4096, (at_first, at_second)
        assert after >= 2 * WINDOW_BYTES, after


def _steps_case(strategy: str, shared: bool) -> list[torch.Tensor]:
    set_shared_memory(shared)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    # Two buckets of several windows each, and a small one.
    params = {
        "a": torch.randn(700, 1024, generator=g),
        "b": torch.randn(300, 1024, generator=g),
        "c": torch.randn(37, generator=g),
    }

    def loss_fn(p, buffers, batch, key):
        h = torch.tanh(batch @ p["a"].T) @ p["a"]
        return (h @ p["b"].T).square().mean() + (p["c"] * batch[:, :37]).sum() ** 2

    wrap = {
        "ddp": fs.data_parallel,
        "zero2": fs.shard_optimizer,
        # Its gathers and gradient reduce-scatters are the differentiable collectives.
        "zero3": lambda step, mesh: fs.fully_shard(step, mesh, units=["a", "b"]),
    }[strategy]
    step = wrap(fs.train_step(loss_fn, fs.optim.adamw(1e-3)), fd.Mesh(dp=world))
    state = step.init(params)
    batch = torch.randn(4, 1024, generator=torch.Generator().manual_seed(rank)) * 3
    for _ in range(2):
        state, _ = step(state, batch)
    return list(fs.consolidate(step, state).params.values())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_training_step_is_the_same_through_shared_memory_and_gloo(world, strategy):
    for shared, plain in zip(
        run_spmd(_steps_case, world, strategy, True, timeout=120),
        run_spmd(_steps_case, world, strategy, False, timeout=120),
    ):
        for a, b in zip(shared, plain):
            assert torch.equal(bits(a), bits(b))


def _absent_peer_in_a_job() -> None:
    mesh = fd.Mesh(dp=2)
    all_reduce_bucket_start(torch.ones(8), "dp", mesh, divided=True).wait()
    if dist.get_rank() == 0:
        all_reduce_bucket_start(torch.ones(8), "dp", mesh, divided=True).wait()


def test_a_job_whose_peer_never_arrives_fails_and_its_processes_exit():
    # The waiting rank's worker polls on after the error; it must not keep its process alive.
    start = time.monotonic()
    with pytest.raises(fd.RankError, match="CollectiveTimeoutError"):
        fs.launch(
            _absent_peer_in_a_job,
            2,
            env={"FSCALE_COLLECTIVE_TIMEOUT": "1", "FSCALE_DEBUG": "0"},
            timeout=60,
        )
    assert time.monotonic() - start < 45


@pytest.mark.parametrize(
    ("value", "enabled"), [("0", False), ("off", False), ("1", True), ("", True)]
)
def test_the_environment_sets_the_default_and_a_reset_restores_it(monkeypatch, value, enabled):
    monkeypatch.setenv("FSCALE_SHARED_MEMORY", value)
    set_shared_memory(not enabled)
    fs.tracking.reset()  # what the ranks of a pool run between calls
    assert shared_memory_enabled() is enabled
    monkeypatch.delenv("FSCALE_SHARED_MEMORY")
    fs.tracking.reset()
    assert shared_memory_enabled()


def _buffers_released() -> list[bool]:
    world = dist.get_world_size()
    mesh = fd.Mesh(dp=world)
    comm = resolve_comm("dp", mesh, "test")
    out = []
    for start in (
        lambda x: all_reduce_bucket_start(x, "dp", mesh, divided=True),
        lambda x: shared_reduce_scatter(x, comm, 0)[0],
        lambda x: shared_all_gather(x, comm),
        lambda x: shared_all_to_all(x, comm, torch.empty_like(x)),
    ):
        flat = torch.ones(3 * WINDOW_BYTES // 8)
        alive = weakref.ref(flat)
        work = start(flat)
        work.wait()
        del work, flat
        # Nothing of the transport's holds a finished collective's buffer.
        out.append(alive() is None)
    return out


def test_a_finished_collective_leaves_no_reference_to_its_buffers():
    for checks in run_spmd(_buffers_released, 2):
        assert all(checks), checks


def _bad_input() -> list[str]:
    comm = resolve_comm("dp", fd.Mesh(dp=2), "test")
    calls = [
        lambda: shared_all_reduce(torch.ones(4, 2), comm),
        lambda: shared_all_reduce(torch.ones(8)[::2], comm),
        lambda: shared_reduce_scatter(torch.ones(7), comm, 0),
        lambda: shared_reduce_scatter(torch.ones(7), comm, 9),
        lambda: shared_reduce_scatter(torch.ones(7), comm, True),
        lambda: shared_all_gather(torch.ones(5), comm),
        lambda: shared_all_gather("flat", comm),  # type: ignore[arg-type]
        lambda: shared_reduce_scatter(torch.ones(8), comm, 0, out=torch.empty(5)),
        lambda: shared_reduce_scatter(torch.ones(8), comm, 0, out=torch.empty(8)[::2]),
        lambda: shared_reduce_scatter(
            torch.ones(8), comm, 0, out=torch.empty(4, dtype=torch.int32)
        ),
        lambda: shared_all_to_all(torch.ones(7), comm, torch.empty(7)),
        lambda: shared_all_to_all(torch.ones(8), comm, torch.empty(6)),
        lambda: shared_all_to_all(torch.ones(8), comm, torch.empty(16)[::2]),
        lambda: shared_all_to_all(torch.ones(8), comm, torch.empty(8, dtype=torch.int32)),
    ]
    return [_refusal(call) for call in calls]


def _refusal(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "accepted"


def test_bad_buffers_are_refused_before_anything_is_sent():
    messages = run_spmd(_bad_input, 2)[0]
    assert "`flat` must be a contiguous 1-D tensor, got shape (4, 2)" in messages[0]
    assert "contiguous 1-D" in messages[1]
    assert "must leave a multiple of the 2 ranks" in messages[2]
    assert "must leave a multiple" in messages[3]
    assert "`trailing` must be an int" in messages[4]
    assert "must leave a multiple of the 2 ranks" in messages[5]
    assert "got str" in messages[6]
    # An `out` that cannot hold this rank's part: its size, layout or dtype.
    for message in messages[7:10]:
        assert "`out` must be a contiguous 4-element torch.float32 tensor" in message, message
    assert "must leave a multiple of the 2 ranks" in messages[10]
    # The all-to-all's `out` holds what every rank sends this one: `flat`'s size and dtype.
    for message in messages[11:]:
        assert "`out` must be a contiguous 8-element torch.float32 tensor" in message, message


def _bad_uneven_counts() -> list[str]:
    comm = resolve_comm("ep", fd.Mesh(ep=2), "test")
    calls = [
        lambda: shared_all_to_all_uneven(torch.ones(6), comm, [2, 3], torch.empty(5), [2, 3], 3),
        lambda: shared_all_to_all_uneven(torch.ones(6), comm, [6], torch.empty(6), [3, 3], 6),
        lambda: shared_all_to_all_uneven(torch.ones(6), comm, [3, 3], torch.empty(6), [6], 6),
        lambda: shared_all_to_all_uneven(torch.ones(6), comm, [3, 3], torch.empty(5), [2, 4], 4),
        lambda: shared_all_to_all_uneven(
            torch.ones(6), comm, [3, 3], torch.empty(6, dtype=torch.float64), [3, 3], 3
        ),
        lambda: shared_all_to_all_uneven(torch.ones(6, 1), comm, [3, 3], torch.empty(6), [3, 3], 3),
        lambda: shared_all_to_all_uneven(torch.ones(6), comm, [3, 3], torch.empty(6), [2, 4], 3),
    ]
    return [_refusal(call) for call in calls]


def test_counts_that_do_not_fit_the_buffers_are_refused_before_anything_is_sent():
    messages = run_spmd(_bad_uneven_counts, 2)[0]
    for message in messages[:3]:
        assert "must hold one count per rank of axis 'ep' (2) summing to `flat`'s 6" in message
    for message in messages[3:5]:
        assert "`out` must be a contiguous 6-element torch.float32 tensor" in message, message
    assert "`flat` must be a contiguous 1-D tensor, got shape (6, 1)" in messages[5]
    assert "`largest` 3 is below this rank's own counts [3, 3] / [2, 4]" in messages[6]


def _full_shm_case() -> tuple[bool, bool, list[str]]:
    rank = dist.get_rank()
    reserve = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    if rank == 1:
        os.posix_fallocate = full  # restored below; the pool's ranks live on
    try:
        comm = resolve_comm("dp", fd.Mesh(dp=2), "test")
        x = torch.ones(4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shared = shares_memory(comm, x, sums=True)
        reduced = all_reduce_bucket_start(x, "dp", comm.mesh, divided=True).wait()
        return shared, torch.equal(reduced, torch.full((4,), 2.0)), [str(w.message) for w in caught]
    finally:
        os.posix_fallocate = reserve


def test_a_full_dev_shm_keeps_gloo_with_a_warning_instead_of_faulting_later():
    (shared0, summed0, warned0), (shared1, summed1, warned1) = run_spmd(_full_shm_case, 2)
    assert not shared0 and not shared1 and summed0 and summed1
    assert any("keeps gloo, rank 1" in w and "No space left" in w for w in warned0), warned0
    assert not warned1  # one warning per group, from its first rank
