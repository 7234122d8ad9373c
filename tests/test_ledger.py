"""The comm ledger: exact ring-model bytes per collective, totals, summary, zero cost when off."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fscale import distributed as fd
from fscale.distributed import ledger as ledger_module
from fscale.distributed.ledger import CommRecord, ring_bytes
from fscale.testing.pool import run_spmd


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("all_reduce", 2 * 3 * 40 / 4),
        ("all_gather", 3 * 40 / 4),
        ("reduce_scatter", 3 * 40 / 4),
        ("all_to_all", 3 * 40 / 4),
        ("send", 40.0),
        ("ppermute", 40.0),
        ("recv", 0.0),
    ],
)
def test_ring_bytes_formulas(op, expected):
    assert ring_bytes(op, 10, torch.float32, 4) == expected


def test_ring_bytes_is_exact_when_divisible_and_fractional_otherwise():
    assert ring_bytes("all_reduce", 6, torch.bfloat16, 3) == 16.0  # 2 * 2/3 * 12 bytes
    assert ring_bytes("all_gather", 1, torch.float64, 3) == pytest.approx(16 / 3)
    with pytest.raises(ValueError, match=r"unknown op 'gather'"):
        ring_bytes("gather", 1, torch.float32, 2)


def _records() -> list[CommRecord]:
    return [
        CommRecord("all_reduce", "dp", torch.float32, 8, 48.0, 4),
        CommRecord("all_reduce", "dp", torch.float32, 4, 24.0, 4),
        CommRecord("all_gather", "tp", torch.float64, 8, 32.0, 2),
        CommRecord("send", "pp", torch.float16, 3, 6.0, 2),
    ]


def test_totals_counts_and_filters():
    ledger = fd.CommLedger()
    ledger.records.extend(_records())
    assert ledger.count() == 4 and ledger.count("all_reduce") == 2 and ledger.count(axis="tp") == 1
    assert ledger.total_bytes() == 110.0
    assert ledger.total_bytes("all_reduce", "dp") == 72.0
    assert ledger.total_bytes(axis="pp") == 6.0
    assert ledger.total_elements("all_reduce") == 18.0  # 72 bytes of float32
    assert ledger.total_elements(axis="tp") == 4.0
    assert ledger.records[3].elements == 3.0
    assert ledger.total_bytes("all_to_all") == 0
    with pytest.raises(ValueError, match=r"`op` must be one of .* got 'allreduce'"):
        ledger.total_bytes("allreduce")


def test_summary_groups_by_op_and_axis():
    ledger = fd.CommLedger()
    ledger.records.extend(_records())
    ledger.records.append(CommRecord("all_gather", "tp", torch.float32, 2**20, 3 * 2**20, 4))
    lines = ledger.summary().splitlines()
    assert lines[0].split() == ["op", "axis", "calls", "elements", "bytes"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["all_gather", "tp", "2", "786,436", "3.00", "MiB"]
    assert lines[3].split() == ["all_reduce", "dp", "2", "18", "72", "B"]
    assert lines[4].split() == ["send", "pp", "1", "3", "6", "B"]
    assert lines[5].split() == ["total", "5", "3.00", "MiB"]
    assert repr(ledger) == "CommLedger(5 records, 3.00 MiB)"


def test_ledgers_nest_and_cost_nothing_when_closed():
    assert ledger_module.open_ledgers() == ()
    ledger_module.record("all_reduce", "dp", torch.float32, 4, 2)  # nobody listening: dropped
    with fd.comm_ledger() as outer:
        ledger_module.record("all_reduce", "dp", torch.float32, 4, 2)
        with fd.comm_ledger() as inner:
            ledger_module.record("all_gather", "dp", torch.float32, 4, 2)
        assert ledger_module.open_ledgers() == (outer,)
    assert ledger_module.open_ledgers() == ()
    assert [r.op for r in outer.records] == ["all_reduce", "all_gather"]
    assert [r.op for r in inner.records] == ["all_gather"]
    assert outer.records[0] == CommRecord("all_reduce", "dp", torch.float32, 4, 16.0, 2)


# ---- records of real collectives --------------------------------------------------------------


def _every_collective() -> list[tuple]:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = fd.Mesh(dp=n, tp=1)
    x32 = torch.ones(4 * n, dtype=torch.float32)
    x64 = torch.ones(2, 3, dtype=torch.float64)
    with fd.comm_ledger() as ledger:
        fd.all_reduce(x32, "dp", "mean", mesh=mesh)
        fd.all_gather(x64, "dp", dim=1, mesh=mesh)
        fd.reduce_scatter(x32, "dp", mesh=mesh)
        fd.all_to_all(x32, "dp", mesh=mesh)
        fd.ppermute(x64, "dp", [(0, 1)], mesh=mesh)
        fd.all_reduce_start(x64, "dp", mesh=mesh).wait()
        fd.all_reduce(x32, "tp", mesh=mesh)  # size 1: nothing moves, nothing recorded
        fd.all_gather(x64, "tp", mesh=mesh)
        if n == 2:
            if rank == 0:
                fd.send(x64, "dp", to=1, mesh=mesh)
            else:
                fd.recv(x64, "dp", from_=0, mesh=mesh)
    return [tuple(record) for record in ledger.records]


@pytest.mark.parametrize("world", [2, 4])
def test_each_collective_records_exact_ring_bytes(world):
    n = world
    f32, f64 = torch.float32, torch.float64
    for rank, records in enumerate(run_spmd(_every_collective, world)):
        expected = [
            ("all_reduce", "dp", f32, 4 * n, 2 * (n - 1) * 16 * n / n, n),
            ("all_gather", "dp", f64, 6 * n, (n - 1) * 48 * n / n, n),
            ("reduce_scatter", "dp", f32, 4 * n, (n - 1) * 16 * n / n, n),
            ("all_to_all", "dp", f32, 4 * n, (n - 1) * 16 * n / n, n),
            # Only index 0 sends; the others record the exchange with nothing sent.
            ("ppermute", "dp", f64, 6 if rank == 0 else 0, 48.0 if rank == 0 else 0.0, n),
            ("all_reduce", "dp", f64, 6, 2 * (n - 1) * 48 / n, n),
        ]
        if n == 2:
            sent = ("send", "dp", f64, 6, 48.0, 2)
            expected.append(sent if rank == 0 else ("recv", "dp", f64, 6, 0.0, 2))
        assert records == expected


def _data_parallel_step() -> tuple[float, float, str]:
    """DDP's traffic: one all-reduce of every gradient, 2 * psi * (N - 1) / N elements."""
    n = dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    params = [torch.ones(3, 5, requires_grad=True), torch.ones(7, requires_grad=True)]
    with fd.comm_ledger() as ledger:
        replicated = [fd.replicate(p, "dp", "mean", mesh=mesh) for p in params]
        loss = sum((p * p).sum() for p in replicated)
        torch.autograd.grad(loss, params)
    psi = sum(p.numel() for p in params)
    return ledger.total_elements(axis="dp"), 2 * psi * (n - 1) / n, ledger.summary()


def _fully_sharded_step() -> tuple[float, float]:
    """A ZeRO-3 step without re-gathering: all-gather forward, reduce-scatter backward."""
    n = dist.get_world_size()
    mesh = fd.Mesh(dp=n)
    shard = torch.ones(6, requires_grad=True)
    with fd.comm_ledger() as ledger:
        full = fd.all_gather(shard, "dp", op="mean", mesh=mesh)
        torch.autograd.grad((full * full).sum(), shard)
    psi = 6 * n
    return ledger.total_elements(), 2 * psi * (n - 1) / n


@pytest.mark.parametrize("world", [2, 4])
def test_strategy_traffic_matches_the_analysis(world):
    for elements, expected, summary in run_spmd(_data_parallel_step, world):
        assert elements == expected
        assert summary.splitlines()[2].split()[:3] == ["all_reduce", "dp", "2"]
    for elements, expected in run_spmd(_fully_sharded_step, world):
        assert elements == expected
