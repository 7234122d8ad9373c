"""Set-up traffic (fscale.distributed.setup_traffic): exact, not in the ledger, and bounded.

A rank that never reaches a set-up exchange (``step.init`` under ``if rank == 0:``) used to
leave its peers in ``all_gather_object`` until the process group's timeout; now they fail in
about twice the collective timeout, naming where each rank is. `fs.consolidate` made on one
rank only (a save under ``if rank == 0:``) says so too.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fscale as fs
from fscale import spmd
from fscale.ckpt.save import every_rank_arrives
from fscale.distributed import collectives as C
from fscale.distributed import setup_traffic
from fscale.distributed.comm import resolve_comm
from fscale.distributed.hosts import on_one_host
from fscale.parallel.tensor.regions import all_reduce_max
from fscale.testing import RankError, run_spmd

PATIENCE = 1.0


def _objects_of_every_size():
    rank = dist.get_rank()
    mesh = fs.Mesh(dp=2, tp=dist.get_world_size() // 2)
    # Payloads of different lengths on each rank, across the padding's powers of two.
    values = [None, rank, "x" * (100 * rank), {"r": rank, "t": torch.arange(rank + 3)}]
    with fs.distributed.comm_ledger() as ledger:
        gathered = [spmd.all_gather_objects(v, mesh, "dp") for v in values]
        along_tp = spmd.all_gather_objects(rank, mesh, "tp")
        copies = spmd.broadcast_tree({"w": torch.full((2, 3), float(rank))}, mesh, "tp")
        setup_traffic.barrier(resolve_comm("tp", mesh, "test"))
        world = setup_traffic.all_gather_objects_over(-rank, dist.group.WORLD, (0, 1, 2, 3), "w")
    records = len(ledger.records)
    return gathered, along_tp, copies, world, records, on_one_host(mesh, "dp")


def test_objects_and_first_values_arrive_exactly_in_axis_order_without_ledger_records():
    results = run_spmd(_objects_of_every_size, 4)
    for rank, (gathered, along_tp, copies, world, records, one_host) in enumerate(results):
        dp, tp = divmod(rank, 2)
        peers = [tp, 2 + tp]  # the global ranks of this rank's dp axis, in axis order
        assert gathered[0] == [None, None]
        assert gathered[1] == peers
        assert gathered[2] == ["x" * (100 * r) for r in peers]
        for r, got in zip(peers, gathered[3]):
            assert got["r"] == r and torch.equal(got["t"], torch.arange(r + 3))
        assert along_tp == [2 * dp, 2 * dp + 1]
        # Index 0 along tp is global rank 2 * dp.
        assert torch.equal(copies["w"], torch.full((2, 3), float(2 * dp)))
        assert world == [0, -1, -2, -3]
        assert records == 0  # set-up traffic is not a training step's
        assert one_host


def test_a_payload_pads_to_a_power_of_two_of_at_least_64_bytes():
    pads = [setup_traffic._padded_length(n) for n in (1, 64, 65, 128, 129, 5000)]
    assert pads == [64, 64, 128, 128, 256, 8192]


def _one_rank_only(what, directory):
    C.set_debug(False)  # the default path: the one users run
    C.set_collective_timeout(PATIENCE)
    rank, mesh = dist.get_rank(), fs.Mesh(dp=dist.get_world_size())
    apply, params, buffers = fs.functionalize(nn.Linear(4, 2))

    def loss_fn(params, buffers, batch, key):
        out, buffers = apply(params, buffers, batch)
        return out.square().mean(), buffers

    if what in ("data_parallel", "fully_shard"):
        step = getattr(fs, what)(fs.train_step(loss_fn, fs.optim.sgd(0.1)), mesh)
        call = lambda: step.init(params, buffers)  # noqa: E731
    elif what.startswith(("consolidate", "save", "load")):  # every rank trains first
        transform = what.split()[1]
        step = getattr(fs, transform)(fs.train_step(loss_fn, fs.optim.adam(0.1)), mesh)
        state, _ = step(step.init(params, buffers), torch.ones(4, 4))
        if what.startswith("consolidate"):
            call = lambda: fs.consolidate(step, state)  # noqa: E731
        elif what.startswith("save"):
            call = lambda: fs.ckpt.save(directory, state, step=step)  # noqa: E731
        else:
            fs.ckpt.save(directory, state, step=step)  # on every rank
            call = lambda: fs.ckpt.load(directory, state, step=step)  # noqa: E731
    elif what == "barrier":
        call = lambda: setup_traffic.barrier(resolve_comm("dp", mesh, "test"))  # noqa: E731
    elif what == "all_reduce_max":
        call = lambda: all_reduce_max(torch.ones(3), "dp", mesh=mesh)  # noqa: E731
    else:
        comm = resolve_comm("dp", mesh, "test")
        call = lambda: setup_traffic.broadcast_from_first(torch.ones(3), comm)  # noqa: E731
    dist.barrier()  # start together (raw c10d: not counted), so the time is the check's
    if rank == 0:
        call()  # raises; the pool then respawns the ranks, as a collective was left behind


@pytest.mark.parametrize(
    "what",
    [
        "data_parallel",
        "fully_shard",
        "broadcast_from_first",
        "barrier",
        "all_reduce_max",
        "consolidate fully_shard",
        "save shard_optimizer",
        "load fully_shard",
    ],
)
def test_a_set_up_exchange_made_on_one_rank_only_fails_there_in_bounded_time(what, tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_spmd(_one_rank_only, 2, what, str(tmp_path))
    # Within twice the patience (the wait, then the peers' records), plus the pool's restart
    # and building and training a small model; before, the pool's 60 s limit ended the wait.
    assert time.monotonic() - start < 2 * PATIENCE + 8
    assert caught.value.ranks == (0,)
    message = caught.value.failures[0]
    if what.split()[0] in ("consolidate", "save", "load"):
        assert "rank 1: returned from its function after collective #" in message
    else:
        assert "rank 1: in no collective of this group" in message
    if what in ("data_parallel", "fully_shard"):
        assert "all_gather of shape (1,) int64 over axis 'dp'" in message
    if what == "all_reduce_max":
        assert "all_reduce of shape (3,) float32 over axis 'dp'" in message
    if what in ("data_parallel", "fully_shard"):
        assert (
            f"CollectiveTimeoutError: {what}: not every rank along axis 'dp' reached the check "
            "of the parameter and buffer trees" in message
        )
        assert "`if rank == 0:`" in message
    if what.startswith("consolidate"):
        assert "CollectiveTimeoutError: consolidate: a peer did not join this rank's gather" in (
            message
        )
        assert "`if rank == 0:` around the save, not around consolidate" in message
        assert "all_gather of shape (16,) float32 over axis 'dp'" in message
    if what.startswith(("save", "load")):
        verb = what.split()[0]
        assert (
            f"CheckpointError: {verb}: not every rank reached {verb} of step_0000000001" in message
        )
        assert "all_gather of shape (1,) int64 over axis 'world'" in message
        assert "only the work after it belongs under `if rank == 0:`" in message


def _names(names):
    every_rank_arrives("load", names[dist.get_rank()])


def test_ranks_that_name_different_checkpoints_fail_on_every_rank():
    with pytest.raises(RankError) as caught:
        run_spmd(_names, 2, ["step_0000000001", "step_0000000002"])
    assert caught.value.ranks == (0, 1)
    assert (
        "CheckpointError: load: the ranks name different checkpoints (rank 0: step_0000000001; "
        "rank 1: step_0000000002); every rank must load the same one" in caught.value.failures[1]
    )
    run_spmd(_names, 2, ["step_0000000001"] * 2)  # the same name: no error
