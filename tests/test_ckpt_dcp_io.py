"""`fscale.ckpt.dcp_io`: DCP's write and read, by all ranks together or by one process alone."""

import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from fscale.ckpt import dcp_io
from fscale.testing import run_spmd


def _values(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3, 4, generator=g), "b": torch.arange(5, dtype=torch.int64) + seed}


def _round_trip(directory, seed, group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notice that it runs in one process
        dcp_io.write(_values(seed), FileSystemWriter(directory), DefaultSavePlanner(), group)
        read = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int64)}
        dcp_io.read(read, FileSystemReader(directory), DefaultLoadPlanner(), group)
    return read


@pytest.mark.parametrize("public", [True, False], ids=["dcp.save/load", "torch-2.6 path"])
def test_one_process_writes_and_reads_back_exactly(tmp_path, monkeypatch, public):
    # The functions torch 2.6 needs are there in later releases too: both paths run here.
    takes_no_dist = dcp_io._takes_no_dist
    monkeypatch.setattr(dcp_io, "_takes_no_dist", lambda fn: public and takes_no_dist(fn))
    read = _round_trip(str(tmp_path), 7, None)
    expected = _values(7)
    assert all(torch.equal(read[k], expected[k]) for k in expected)


def _alone_then_together(root):
    rank = dist.get_rank()
    # One rank alone, while the world is up: no collective, so the other rank is never awaited
    # (rank 1 does nothing here, and would leave rank 0 waiting if a collective ran).
    alone = _round_trip(f"{root}/alone", 11, None) if rank == 0 else None
    together = _round_trip(f"{root}/together", 13, dist.group.WORLD)
    return alone, together


def test_one_rank_alone_and_all_ranks_together_round_trip():
    with tempfile.TemporaryDirectory() as root:
        (alone, together0), (none, together1) = run_spmd(_alone_then_together, 2, root)
    assert none is None
    for read, seed in ((alone, 11), (together0, 13), (together1, 13)):
        expected = _values(seed)
        assert all(torch.equal(read[k], expected[k]) for k in expected)
