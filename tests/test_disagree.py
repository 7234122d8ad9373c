"""Ranks that disagree on a collective fail on every rank in bounded time, on the default path.

The suite runs with ``FSCALE_DEBUG=1`` (tests/conftest.py); every rank function here turns the
debug check off (`set_debug(False)`, restored by the pool before the next call) and shortens
the patience, so each case costs about a second.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fscale as fs
from fscale import distributed as fd
from fscale import spmd
from fscale.distributed import collectives as C
from fscale.distributed.comm import resolve_comm
from fscale.distributed.debug import count
from fscale.testing import RankError, run_spmd

PATIENCE = 1.0


def _default_path(debug=False):
    C.set_debug(debug)
    C.set_collective_timeout(PATIENCE)
    return dist.get_rank(), fs.Mesh(dp=dist.get_world_size())


def _caught(body, *args):
    """Run `body` on this rank; return (error type, message, seconds) or None if it passed."""
    rank, mesh = _default_path()
    dist.barrier()  # start together (raw c10d: not counted), so the time below is the check's
    start = time.monotonic()
    try:
        body(rank, mesh, *args)
    except C.CollectiveMismatchError as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return None


def _shapes_differ(rank, mesh):
    C.all_reduce(torch.ones(4 + rank), "dp", mesh=mesh)


def _dtypes_differ(rank, mesh):
    C.all_gather(torch.ones(4, dtype=torch.float64 if rank else torch.float32), "dp", mesh=mesh)


def _known_shapes_swapped(rank, mesh):
    # Both shapes were agreed on already; only their order differs across the ranks.
    C.all_reduce(torch.ones(4), "dp", mesh=mesh)
    C.all_reduce(torch.ones(5), "dp", mesh=mesh)
    C.all_reduce(torch.ones(4 + rank), "dp", mesh=mesh)


def _buffer_trees_differ(rank, mesh):
    spmd.mean_floating_leaves({"running_mean": torch.zeros(3 + rank)}, mesh, "dp")


def _sent_shape_differs(rank, mesh):
    if rank == 0:
        C.send(torch.ones(3), "dp", to=1, mesh=mesh)
    else:
        C.recv(torch.ones(2), "dp", from_=0, mesh=mesh)


@pytest.mark.parametrize(
    ("body", "shapes"),
    [
        (_shapes_differ, ["all_reduce of shape (4,) float32", "all_reduce of shape (5,) float32"]),
        (_dtypes_differ, ["all_gather of shape (4,) float32", "all_gather of shape (4,) float64"]),
        (
            _known_shapes_swapped,
            ["rank 0: all_reduce of shape (4,)", "rank 1: all_reduce of shape (5,)"],
        ),
        (_buffer_trees_differ, ["all_reduce of shape (3,)", "all_reduce of shape (4,)"]),
        (_sent_shape_differs, ["send/recv of shape (3,)", "send/recv of shape (2,)"]),
    ],
)
def test_signatures_that_differ_raise_on_every_rank_before_anything_is_sent(body, shapes):
    # Before, these hung until the group timeout or made gloo abort the process (dtype).
    for result in run_spmd(_caught, 2, body):
        assert result is not None
        kind, message, seconds = result
        assert kind == "CollectiveMismatchError"
        for shape in shapes:
            assert shape in message
        assert "FSCALE_DEBUG=1" in message
        assert seconds < PATIENCE  # found at once, not by waiting


def _one_more_collective(debug):
    rank, mesh = _default_path(debug)
    for _ in range(3 + rank):
        C.all_reduce(torch.ones(4), "dp", mesh=mesh)
    return rank


@pytest.mark.parametrize("debug", [False, True])
def test_a_rank_that_takes_one_more_collective_is_named_with_the_rank_that_returned(debug):
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_spmd(_one_more_collective, 2, debug)
    assert time.monotonic() - start < 6 * PATIENCE + 5
    error = caught.value
    assert error.first_failed == 1
    message = str(error)
    assert "Rank(s) [0] had returned" in message  # the launcher names the rank that returned
    failure = error.failures[1]
    assert "CollectiveTimeoutError" in failure
    assert "rank 0: returned from its function after collective #" in failure
    assert "rank 1: waits in #" in failure and "all_reduce of shape (4,) float32" in failure
    assert "FSCALE_DEBUG=1" in failure


def _extra_step(steps_by_rank, transform="data_parallel"):
    rank, mesh = _default_path()
    apply, params, buffers = fs.functionalize(nn.Linear(4, 2))

    def loss_fn(params, buffers, batch, key):
        out, buffers = apply(params, buffers, batch)
        return out.square().mean(), buffers

    step = getattr(fs, transform)(fs.train_step(loss_fn, fs.optim.sgd(0.1)), mesh)
    state = step.init(params, buffers)
    for _ in range(steps_by_rank[rank]):
        state, _ = step(state, torch.ones(3, 4))
    return int(state.step)


@pytest.mark.parametrize(
    ("transform", "collective"),
    # ZeRO's reduce-scatter on gloo: sends and receives (fscale.distributed.exchange)
    [("data_parallel", "all_reduce"), ("shard_optimizer", "reduce_scatter")],
)
def test_a_rank_that_takes_one_step_more_names_the_step(transform, collective):
    with pytest.raises(RankError) as caught:
        run_spmd(_extra_step, 2, [2, 3], transform)
    failure = caught.value.failures[1]
    # Rank 1 waits in the step's first collective, or agrees on it where the transition into
    # it is new (after the first step's one-time checks): either way it names the step.
    assert "rank 1: waits in #" in failure or "rank 1: checks the signature of #" in failure
    assert "at step 2" in failure and collective in failure
    assert "rank 0: returned from its function" in failure


def _late_peer(late):
    rank, mesh = _default_path()
    dist.barrier()  # start together, so the lateness is the one below (raw c10d: not counted)
    if rank == 0:
        time.sleep(late * PATIENCE)
    out = C.all_reduce(torch.ones(2), "dp", mesh=mesh)  # the first use: agreed
    dist.barrier()
    if rank == 1:
        time.sleep(late * PATIENCE)
    pending = C.all_reduce_start(torch.ones(2), "dp", mesh=mesh)  # agreed too: a new transition
    again = C.all_reduce(torch.ones(2), "dp", mesh=mesh)
    dist.barrier()
    if rank == 0:
        time.sleep(late * PATIENCE)
    return out, pending.wait(), C.all_reduce(again, "dp", mesh=mesh)  # known: a bounded wait


def test_a_peer_late_by_less_than_twice_the_patience_is_not_an_error():
    for out, waited, last in run_spmd(_late_peer, 2, 1.4):
        assert torch.equal(out, torch.full((2,), 2.0)) and torch.equal(waited, out)
        assert torch.equal(last, torch.full((2,), 4.0))


def test_collective_timeout_is_validated_and_reset():
    with pytest.raises(ValueError, match=r"`seconds` must be positive"):
        C.set_collective_timeout(0)
    with pytest.raises(TypeError, match=r"`seconds` must be a number"):
        C.set_collective_timeout("5")
    with pytest.raises(ValueError, match=r"FSCALE_COLLECTIVE_TIMEOUT='soon'"):
        fs.distributed.watchdog.timeout_from_env({"FSCALE_COLLECTIVE_TIMEOUT": "soon"})
    assert fs.distributed.watchdog.timeout_from_env({}) == 30.0
    C.set_collective_timeout(3)
    assert C.collective_timeout() == 3.0
    fs.tracking.reset()
    assert C.collective_timeout() == fs.distributed.watchdog.timeout_from_env()


def _counted():
    _, mesh = _default_path()
    comm = resolve_comm("dp", mesh, "test")
    with fd.comm_ledger() as ledger:
        first = count(comm, "all_to_all", torch.empty(0, 3))
        second = count(comm, "all_to_all", torch.empty(0, 3))
    return second.seq - first.seq, first.op, tuple(first.shape), len(ledger.records)


def _count_rows_of(rank, mesh):
    # The signature a collective with per-rank row counts is counted under: the row's shape.
    count(resolve_comm("dp", mesh, "test"), "all_to_all", torch.empty(0, 3 + rank))


def test_count_numbers_a_collective_and_agrees_on_it_without_a_ledger_record():
    for counted in run_spmd(_counted, 2):
        assert counted == (1, "all_to_all", (0, 3), 0)
    for caught in run_spmd(_caught, 2, _count_rows_of):
        assert caught is not None and caught[0] == "CollectiveMismatchError", caught
        assert caught[2] < 10
