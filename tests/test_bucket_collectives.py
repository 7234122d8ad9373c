"""The in-place bucket collectives equal the differentiable ones bit for bit, and are recorded so.

Inputs are heavy-tailed random values (magnitudes over many binades), so a different order of
summation would show in the last bits; equality is checked on the raw bits.
"""

from __future__ import annotations

import pytest
import torch

from fscale import distributed as fd
from fscale.parallel.bucket_collectives import (
    all_gather_bucket_start,
    all_reduce_bucket_start,
    folds_trailing,
    reduce_scatter_bucket_start,
)
from fscale.testing.pool import run_spmd

SIZES = (64, 4096, 3 * (1 << 16) + 448)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _bucket(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + numel)
    return torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 5)


def _compare_case() -> list[dict[str, bool]]:
    world = fd.world_size()
    mesh = fd.Mesh(dp=world)
    rank = mesh.rank("dp")
    out = []
    for size in SIZES:
        numel = size // world * world
        x = _bucket(rank, numel)
        own = slice(rank * (numel // world), (rank + 1) * (numel // world))
        with fd.comm_ledger() as expected:
            mean = fd.all_reduce(x, "dp", "mean", mesh=mesh)
            shard = fd.reduce_scatter(x, "dp", 0, "mean", mesh=mesh)
            gathered = fd.all_gather(x[own], "dp", mesh=mesh)
        with fd.comm_ledger() as ledger:
            in_place_mean = all_reduce_bucket_start(x.clone(), "dp", mesh).wait()
            in_place_shard = reduce_scatter_bucket_start(x.clone(), "dp", mesh).wait()
            target = torch.full_like(x, float("nan"))
            target[own] = x[own]
            in_place_gathered = all_gather_bucket_start(target, "dp", mesh).wait()
        # Divided by its writer already (GradBuckets' divide_by): only the sum is left.
        divided_mean = all_reduce_bucket_start(x / world, "dp", mesh, divided=True).wait()
        out.append(
            {
                "all_reduce": torch.equal(_bits(in_place_mean), _bits(mean)),
                "divided": torch.equal(_bits(divided_mean), _bits(mean)),
                "reduce_scatter": torch.equal(_bits(in_place_shard), _bits(shard)),
                "all_gather": torch.equal(_bits(in_place_gathered), _bits(gathered)),
                "in_place": in_place_gathered.data_ptr() == target.data_ptr(),
                "ledger": [(r.op, r.bytes) for r in ledger.records]
                == [(r.op, r.bytes) for r in expected.records],
                "ops": [r.op for r in ledger.records]
                == ["all_reduce", "reduce_scatter", "all_gather"],
            }
        )
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_bucket_collectives_equal_the_differentiable_ones(world):
    for per_rank in run_spmd(_compare_case, world):
        for checks in per_rank:
            assert all(checks.values()), checks


def _error(call, value, mesh) -> str:
    try:
        call(value, "dp", mesh)
    except ValueError as error:
        return str(error)
    return "no error"


def _bad_input_case() -> list[str]:
    mesh = fd.Mesh(dp=fd.world_size())
    return [
        _error(all_reduce_bucket_start, torch.zeros(2, 2), mesh),
        _error(reduce_scatter_bucket_start, torch.zeros(3), mesh),
        _error(all_gather_bucket_start, torch.zeros(5), mesh),
    ]


def test_bucket_collectives_refuse_bad_buckets():
    for messages in run_spmd(_bad_input_case, 2):
        assert "`flat` must be a contiguous 1-D" in messages[0]
        assert "do not divide" in messages[1] and "do not divide" in messages[2]


def _trailing_case() -> dict[str, bool]:
    world = fd.world_size()
    mesh = fd.Mesh(dp=world)
    rank = mesh.rank("dp")
    numel = 4096 // world * world
    x = _bucket(rank, numel)
    scalars = _bucket(rank + 100, 3)
    own = slice(rank * (numel // world), (rank + 1) * (numel // world))
    with fd.comm_ledger() as expected:
        mean = fd.all_reduce(x, "dp", "mean", mesh=mesh)
        shard = fd.reduce_scatter(x, "dp", 0, "mean", mesh=mesh)
        scalar_mean = fd.all_reduce(scalars, "dp", "mean", mesh=mesh)
        fd.all_reduce(scalars, "dp", "mean", mesh=mesh)  # they travel with both buckets
    with fd.comm_ledger() as ledger:
        reduced = all_reduce_bucket_start(torch.cat([x, scalars]), "dp", mesh, trailing=3)
        scattered = reduce_scatter_bucket_start(torch.cat([x, scalars]), "dp", mesh, trailing=3)
        reduced_flat = reduced.wait()
        scattered_shard = scattered.wait()
    return {
        "all_reduce": torch.equal(_bits(reduced_flat[:numel]), _bits(mean)),
        "reduce_scatter": torch.equal(_bits(scattered_shard), _bits(shard)),
        "shard_size": scattered_shard.numel() == numel // world and bool(own.stop),
        "trailing": all(
            p.trailing is not None and torch.equal(_bits(p.trailing), _bits(scalar_mean))
            for p in (reduced, scattered)
        ),
        "ledger_bytes": sum(r.bytes for r in ledger.records)
        == sum(r.bytes for r in expected.records),
        "folds": folds_trailing("dp", mesh),
    }


def test_trailing_elements_are_averaged_in_the_bucket_collective():
    # At two ranks every element's sum has two terms, the same in any order and any buffer
    # length; at more, the ring's segments (and so the order) follow the buffer's length.
    for result in run_spmd(_trailing_case, 2):
        assert all(result.values()), result


def _bad_trailing() -> str:
    mesh = fd.Mesh(dp=fd.world_size())
    try:
        all_reduce_bucket_start(torch.zeros(4), "dp", mesh, trailing=5)
    except ValueError as error:
        return str(error)
    return ""


def test_trailing_outside_the_buffer_is_refused():
    assert all("`trailing`=5 is outside [0, 4]" in m for m in run_spmd(_bad_trailing, 2))
