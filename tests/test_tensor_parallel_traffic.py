"""bench/tensor.py's analytical traffic: what fscale's comm ledger records for one step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fscale.testing import run_spmd

_BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def _ledger_and_analytical(sequence_parallel: bool) -> tuple[float, float]:
    import torch.distributed as dist

    import fscale as fs

    if _BENCH not in sys.path:  # the bench's modules import `_util` by name
        sys.path.insert(0, _BENCH)
    import _util

    spec = importlib.util.spec_from_file_location("bench_tensor", Path(_BENCH) / "tensor.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = _util.gpt_config(quick=True)
    world = dist.get_world_size()
    batches = [_util.lm_batch(cfg, bench.BATCH, 0)]
    mesh = fs.Mesh(tp=world)
    variant = bench.FscaleVariant(cfg, batches, mesh, sequence_parallel)
    variant()  # the first step's checks are not the step's traffic
    with fs.distributed.comm_ledger() as ledger:
        variant()
    return ledger.total_bytes(), bench.analytical_bytes(cfg, bench.BATCH, world, sequence_parallel)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_a_tensor_parallel_step_moves_exactly_the_analytical_bytes(sequence_parallel, world):
    for recorded, analytical in run_spmd(_ledger_and_analytical, world, sequence_parallel):
        assert recorded == analytical
