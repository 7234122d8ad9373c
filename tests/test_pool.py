"""fscale.testing.pool: the persistent pool of ranks behind run_spmd."""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from fscale.distributed.spawn import rank, world_size
from fscale.testing import (
    RankError,
    RankPool,
    RankTimeoutError,
    assert_trees_close,
    assert_trees_equal,
    run_spmd,
)

# Functions run on the ranks; module level so that the ranks can import them.


def _sum_of_ranks(offset, *, scale=1.0):
    total = torch.tensor([float(dist.get_rank()) + offset]) * scale
    dist.all_reduce(total)
    return rank(), world_size(), total


def _identity(value):
    return value


def _pid():
    return os.getpid()


def _environment_value(name):
    return os.environ.get(name)


def _rank():
    return dist.get_rank()


def _draws():
    import random

    return random.random(), torch.rand(2)


def _fail_on_rank_1_while_rank_0_waits():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 rejects its input")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: its peer never joins


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def _nested_owner():
    def nested():
        return 0

    return nested


def _exit_without_result():
    os._exit(3)


def _unpicklable_result():
    return lambda: None


def _sharded_sum(values):
    rank, size = dist.get_rank(), dist.get_world_size()
    partial = torch.tensor(values[rank::size], dtype=torch.float64).sum()
    dist.all_reduce(partial)
    return partial


# Tests


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_run_spmd_returns_each_rank_result_in_rank_order(world_size):
    results = run_spmd(_sum_of_ranks, world_size, 1.0, scale=2.0)
    expected_total = torch.tensor([2.0 * sum(r + 1.0 for r in range(world_size))])
    assert [rank for rank, _, _ in results] == list(range(world_size))
    assert all(size == world_size for _, size, _ in results)
    for _, _, total in results:
        assert_trees_equal(total, expected_total)


def test_calls_reuse_the_ranks_and_dispatch_fast():
    first_pids = run_spmd(_pid, 2)  # warm-up: the pool may have to start
    start = time.monotonic()
    calls = 20
    for _ in range(calls):
        results = run_spmd(_sum_of_ranks, 2, 0.0)
    per_call = (time.monotonic() - start) / calls
    assert run_spmd(_pid, 2) == first_pids  # the same processes served every call
    assert len(set(first_pids)) == 2 and os.getpid() not in first_pids
    assert_trees_equal(results[0][2], torch.tensor([1.0]))
    assert per_call < 0.5, f"{per_call:.3f} s per call"


def test_arguments_and_results_round_trip():
    value = {"w": torch.randn(3, 2), "steps": [1, 2.5, None], "name": "x"}
    for result in run_spmd(_identity, 2, value):
        assert_trees_equal(result, value)


def test_seeds_are_reset_before_every_call():
    first = run_spmd(_draws, 2)
    second = run_spmd(_draws, 2)
    assert_trees_equal(first, second)
    assert_trees_equal(first[0], first[1])  # every rank starts from the same seed


def test_failure_on_one_rank_raises_promptly_and_the_pool_respawns():
    pids_before = run_spmd(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 failed") as caught:
        run_spmd(_fail_on_rank_1_while_rank_0_waits, 2)
    elapsed = time.monotonic() - start

    assert caught.value.first_failed == 1
    assert "ValueError: rank 1 rejects its input" in caught.value.failures[1]
    assert "_fail_on_rank_1_while_rank_0_waits" in str(caught.value)
    assert elapsed < 10  # not the 60 s process-group timeout rank 0 was waiting on
    # The wedged pool is not reused: fresh processes give correct results.
    results = run_spmd(_sum_of_ranks, 2, 0.0)
    assert_trees_equal([total for _, _, total in results], [torch.tensor([1.0])] * 2)
    assert set(run_spmd(_pid, 2)).isdisjoint(pids_before)


def test_hanging_call_is_killed_at_its_timeout_and_the_pool_respawns():
    run_spmd(_pid, 2)  # start the pool outside the timed call
    start = time.monotonic()
    pattern = r"rank\(s\) \[0\] of 2 did not finish within 1\.5 s"
    with pytest.raises(RankTimeoutError, match=pattern):
        run_spmd(_hang_on_rank_0, 2, timeout=1.5)
    assert time.monotonic() - start < 10
    assert run_spmd(_rank, 2) == [0, 1]


def test_functions_from_modules_the_ranks_cannot_import_by_name(tmp_path):
    # A module that is not on the ranks' sys.path (like a test file under pytest's importlib
    # mode): the ranks must load it from its file, classes of its arguments included.
    source = textwrap.dedent(
        """
        import dataclasses
        import torch.distributed as dist

        @dataclasses.dataclass
        class Point:
            x: int
            y: int

        def shifted(point):
            return Point(point.x + dist.get_rank(), point.y), __file__
        """
    )
    path = tmp_path / "pool_probe_module.py"
    path.write_text(source)
    name = f"pool_probe_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        results = run_spmd(module.shifted, 2, module.Point(10, 20))
    finally:
        del sys.modules[name]
    assert [point for point, _ in results] == [module.Point(10, 20), module.Point(11, 20)]
    assert all(file == str(path) for _, file in results)


@given(
    values=st.lists(st.floats(-1, 1), min_size=1, max_size=16),
    world_size=st.sampled_from([1, 2, 4]),
)
def test_hypothesis_cases_drawn_on_the_host_reach_every_rank(values, world_size):
    expected = torch.tensor(values, dtype=torch.float64).sum()
    for result in run_spmd(_sharded_sum, world_size, values):
        assert_trees_close(result, expected, rtol=1e-12, atol=1e-12)


def test_bad_calls_are_refused_before_dispatch():
    with pytest.raises(TypeError, match=r"run_spmd: `fn` is a lambda"):
        run_spmd(lambda: 0, 2)
    with pytest.raises(ValueError, match=r"run_spmd: `world_size` must be an integer >= 1"):
        run_spmd(_pid, 0)
    with pytest.raises(ValueError, match=r"run_spmd: `timeout` must be a positive number"):
        run_spmd(_pid, 2, timeout=-1)
    with pytest.raises(ValueError, match=r"RankPool: `timeout` must be a positive number"):
        RankPool(2, timeout=0)
    with pytest.raises(TypeError, match=r"RankPool.run: `fn` is a nested function"):
        RankPool(2).run(_nested_owner())
    with pytest.raises(ValueError, match=r"RankPool.run: `timeout` must be a positive number"):
        RankPool(2).run(_pid, timeout=float("nan"))


def test_rank_pool_starts_on_first_call_and_stops_on_exit(monkeypatch):
    monkeypatch.setenv("FSCALE_POOL_PROBE", "set before the pool started")
    with RankPool(1, timeout=30) as pool:
        assert not pool.started
        assert "not started" in repr(pool)
        first = pool.run(_pid)
        assert pool.started
        assert pool.run(_pid) == first
        assert pool.run(_environment_value, "FSCALE_POOL_PROBE") == ["set before the pool started"]
    assert not pool.started


def test_pools_are_stopped_at_interpreter_exit():
    # Rank processes are not daemons; without the exit hook the interpreter would wait for
    # them forever.
    script = (
        "import os\nfrom fscale.testing import run_spmd\n"
        "print('rank pid', run_spmd(os.getpid, 1)[0])\n"
    )
    finished = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    # The rank's own output (gloo's connection notice on some torch releases) shares stdout.
    rank_pid = int(re.findall(r"^rank pid (\d+)$", finished.stdout, re.MULTILINE)[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(rank_pid, 0)


def test_rank_that_dies_without_a_result_is_reported():
    with pytest.raises(RankError, match=r"rank 0 of 1 failed(.|\n)*exit code 3"):
        run_spmd(_exit_without_result, 1)


def test_unpicklable_result_is_reported_as_a_rank_failure():
    with pytest.raises(RankError, match=r"rank 0 of 1 failed(.|\n)*(pickle|Pickl)"):
        run_spmd(_unpicklable_result, 1)


# Context managers a rank function entered and never exited; a generator-based one that is
# garbage-collected runs its exit, so the rank keeps them here to really leave them open.
_left_open: list = []


def _leave_fscale_state_behind():
    import fscale as fs

    fs.distributed.set_debug(not fs.distributed.debug_enabled())
    fs.Mesh(dp=dist.get_world_size()).__enter__()  # never exited
    _left_open.append(fs.distributed.comm_ledger())
    _left_open[-1].__enter__()  # never closed


def _fscale_state():
    import fscale as fs
    from fscale.distributed import ledger

    return (
        fs.distributed.debug_enabled(),
        fs.distributed.current_mesh() is None,
        len(ledger.open_ledgers()),
    )


def test_fscale_state_left_by_one_call_does_not_reach_the_next():
    from fscale.distributed import debug

    run_spmd(_leave_fscale_state_behind, 2)
    debug_at_start = debug.debug_from_env()  # ranks get this process's environment
    assert run_spmd(_fscale_state, 2) == [(debug_at_start, True, 0)] * 2


def _open_ledger_then(fail):
    import fscale as fs

    _left_open.append(fs.distributed.comm_ledger())  # held, so never closed by collection
    _left_open[-1].__enter__()
    fs.Mesh(dp=dist.get_world_size()).__enter__()  # never exited
    if fail:
        raise RuntimeError("a failing test left its ledger open")
    return len(fs.distributed.ledger.open_ledgers())


def _collect_a_collective():
    import torch

    import fscale as fs
    from fscale import tracking

    open_before = tracking.active("fscale.distributed.ledger")
    mesh = fs.Mesh(dp=dist.get_world_size())
    with fs.distributed.comm_ledger() as ledger:
        fs.distributed.all_reduce(torch.ones(4), "dp", mesh=mesh)
    return len(open_before), fs.distributed.current_mesh() is None, ledger.count()


@pytest.mark.parametrize("fail", [False, True])
def test_a_ledger_left_open_does_not_record_the_next_call(fail):
    if fail:
        with pytest.raises(RankError, match="left its ledger open"):
            run_spmd(_open_ledger_then, 2, True)
    else:
        assert run_spmd(_open_ledger_then, 2, False) == [1, 1]
    assert run_spmd(_collect_a_collective, 2) == [(0, True, 1)] * 2
