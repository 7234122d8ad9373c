"""A persistent pool of gloo ranks that runs many SPMD test functions cheaply.

Spawning processes and forming a process group costs seconds (1.5 s for 2 ranks, 2.4 s for 4
on a small CPU host), which would dominate a suite of many small multi-rank tests. A
`RankPool` pays that once: its ranks join one gloo group and then loop, running one function
per call on every rank, so a call costs milliseconds. The ranks are forked from a server
process that has imported torch once, so even a restart costs a fraction of a second.

Each call is isolated as far as a shared process allows: before the function runs, every rank
resets the seeds of ``random``, ``torch`` and (if imported) ``numpy`` to 1234 and fscale's own
process-wide state to its start-up values with `fscale.tracking.reset` (no current mesh, no
open comm ledger or other accounting block, the debug check as ``FSCALE_DEBUG`` says), so a
function that leaves a ``with mesh:`` or ``set_debug`` behind does not change the next one;
and a call never sees a pool that something went wrong in. A failure on only some ranks
wedges a gloo group (the others sit in a collective until the process-group timeout), so
after ANY failure or timeout the pool is torn down at once and a fresh one is spawned lazily
on the next call.

Functions are sent by reference: they must be defined at module level. A rank imports the
function's module by name, and from its file when the name is not importable there (e.g. a
test file under pytest's ``importlib`` import mode), so module-level functions in test files
work as they are.

Writing a multi-rank test::

    import torch
    import torch.distributed as dist
    from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd


    def _sum_of_ranks():  # runs on every rank
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        return total


    def test_sum_of_ranks():
        for result in run_spmd(_sum_of_ranks, 4):
            assert_trees_equal(result, torch.tensor([6.0]))

Property-testing a strategy with hypothesis: draw the case in the test process and pass the
drawn values to `run_spmd` as arguments, so every rank runs the same case (drawing inside the
ranks would give each rank a different one), and compare with a single-process reference
computed in the test process::

    from hypothesis import given, strategies as st


    def _sharded_sum(values):  # each rank sums its slice, then all-reduce
        rank, size = dist.get_rank(), dist.get_world_size()
        partial = torch.tensor(values[rank::size], dtype=torch.float64).sum()
        dist.all_reduce(partial)
        return partial


    @given(st.lists(st.floats(-1, 1), min_size=1, max_size=32), st.sampled_from([1, 2, 4]))
    def test_sharded_sum_matches_serial(values, world_size):
        expected = torch.tensor(values, dtype=torch.float64).sum()
        for result in run_spmd(_sharded_sum, world_size, values):
            assert_trees_close(result, expected)

Torch tensors, seeds and keys (`fscale.random.key`) can be drawn and passed the same way.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import pickle
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fscale.distributed.ranks import (
    RankError,
    RankSetup,
    Task,
    check_seconds,
    check_world_size,
    error_reply,
    join_group,
    make_task,
    new_store,
    run_task,
    terminate,
)
from fscale.distributed.replies import gather_replies
from fscale.distributed.spawn import DEFAULT_PG_TIMEOUT

if TYPE_CHECKING:
    from fscale.distributed.ranks import PipeEnd

__all__ = ["RankPool", "run_spmd"]

SEED = 1234
"""The seed every rank's ``random``, ``torch`` and ``numpy`` generators get before each call."""

_START_TIMEOUT_S = 120.0  # spawning and joining the group; generous for an oversubscribed host


class RankPool:
    """`world_size` processes in one gloo group that run module-level functions on demand.

    The processes are spawned on the first `run` (not at construction) and reused by later
    calls. After any failure or timeout they are terminated and the next `run` spawns new
    ones. Not for concurrent use from several threads: calls are serialised by a lock.

    Args:
        world_size: number of ranks, at least 1 (a 1-rank pool still runs in its own process
            with a real process group, so code paths match the multi-rank ones).
        timeout: default seconds one `run` may take before the pool is killed.
        pg_timeout: seconds a collective waits for its peers before it fails on the ranks.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 60.0,
        pg_timeout: float = DEFAULT_PG_TIMEOUT,
    ) -> None:
        check_world_size(world_size, "RankPool")
        check_seconds("timeout", timeout, "RankPool")
        check_seconds("pg_timeout", pg_timeout, "RankPool")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.pg_timeout = float(pg_timeout)
        self._ranks: _Ranks | None = None
        self._lock = threading.Lock()
        _LIVE_POOLS.add(self)

    @property
    def started(self) -> bool:
        """Whether rank processes are running (False before the first call and after a failure)."""
        return self._ranks is not None

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results in rank order.

        Args:
            fn: a module-level function; inside it, `fscale.distributed.rank()` /
                ``world_size()`` and ``torch.distributed`` see this pool's group.
            *args: positional arguments, the same on every rank; must be picklable.
            timeout: seconds this call may take (the pool's `timeout` when None). It does not
                include starting the pool, which has its own limit of 120 s.
            **kwargs: keyword arguments for `fn` (a keyword named `timeout` cannot be passed).

        Returns:
            Each rank's return value, tensors detached and on the CPU.

        Raises:
            TypeError: `fn` is not a module-level callable, or the arguments cannot be pickled.
            ValueError: a bad `timeout`.
            RankError: a rank raised or died, or the pool failed to start; the pool is torn
                down and respawns on the next call.
            RankTimeoutError: ranks did not finish within `timeout` (they are named); the pool
                is torn down and respawns on the next call.
        """
        return self._run(fn, args, kwargs, timeout, caller="RankPool.run")

    def close(self) -> None:
        """Stop the rank processes. The pool stays usable: the next `run` respawns them."""
        with self._lock:
            ranks, self._ranks = self._ranks, None
            if ranks is not None:
                ranks.kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "started" if self.started else "not started"
        return f"RankPool(world_size={self.world_size}, timeout={self.timeout:g}, {state})"

    def _run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        *,
        caller: str,
    ) -> list[Any]:
        timeout = self.timeout if timeout is None else timeout
        check_seconds("timeout", timeout, caller)
        task = pickle.dumps(make_task(fn, args, kwargs, caller=caller))
        with self._lock:
            ranks = self._ranks or self._start()
            try:
                _send_to_all(ranks, task)
                replies = gather_replies(
                    ranks.connections, ranks.processes, time.monotonic() + timeout
                )
            except BaseException:
                self._discard()  # e.g. KeyboardInterrupt mid-call: the ranks' state is unknown
                raise
            if not replies.complete:
                self._discard()
            return replies.results_or_raise(timeout)

    def _start(self) -> _Ranks:
        ranks = _Ranks(self.pg_timeout)
        try:
            ranks.spawn(self.world_size)
            replies = gather_replies(
                ranks.connections, ranks.processes, time.monotonic() + _START_TIMEOUT_S
            )
        except BaseException:
            ranks.kill()
            raise
        if not replies.complete:
            ranks.kill()
            try:
                replies.results_or_raise(_START_TIMEOUT_S)
            except RankError as error:
                raise type(error)(
                    f"a pool of {self.world_size} rank(s) failed to start: {error}",
                    error.failures,
                    error.unfinished,
                ) from None
        self._ranks = ranks
        return ranks

    def _discard(self) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.kill()


def run_spmd(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` gloo ranks of a shared, persistent pool.

    One `RankPool` per world size is kept for the whole process and closed at interpreter
    exit, so tests at the same world size share the spawn cost.

    Args:
        fn: a module-level function, run on every rank.
        world_size: number of ranks, at least 1.
        *args: positional arguments, the same on every rank; must be picklable.
        timeout: seconds the call may take, pool start-up excluded.
        **kwargs: keyword arguments for `fn`.

    Returns:
        Each rank's return value in rank order, tensors detached and on the CPU.

    Raises:
        TypeError, ValueError, RankError, RankTimeoutError: as `RankPool.run`.
    """
    check_world_size(world_size, "run_spmd")
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is None:
            pool = _POOLS[world_size] = RankPool(world_size)
    return pool._run(fn, args, kwargs, timeout, caller="run_spmd")


# --------------------------------------------------------------------------------------------
# Internals

_POOLS: dict[int, RankPool] = {}
_POOLS_LOCK = threading.Lock()
_LIVE_POOLS: weakref.WeakSet[RankPool] = weakref.WeakSet()


# Rank processes are not daemons (so test functions may start DataLoader workers), which means
# multiprocessing would wait for them at exit; stop them first. atexit runs handlers in reverse
# order of registration, and multiprocessing registered its own when this module imported it.
@atexit.register
def _close_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


class _Ranks:
    """The processes of one incarnation of a pool, the pipes to them and their rendezvous."""

    def __init__(self, pg_timeout: float) -> None:
        self.pg_timeout = pg_timeout
        self.store = new_store(pg_timeout)  # serves the group's rendezvous; outlives the ranks
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.connections: list[PipeEnd] = []

    def spawn(self, world_size: int) -> None:
        context = _process_context()
        for rank_id in range(world_size):
            here, there = context.Pipe(duplex=True)
            # The fork server's environment is the caller's when the server started; pass the
            # caller's current one so that ranks see what spawned processes would.
            environment = dict(os.environ)
            setup = RankSetup(
                rank_id, world_size, "gloo", self.store.port, self.pg_timeout, environment
            )
            process = context.Process(
                target=_pool_rank_main,
                args=(setup, there),
                name=f"fscale-pool{world_size}-rank-{rank_id}",
                daemon=False,
            )
            self.connections.append(here)
            self.processes.append(process)
            process.start()
            there.close()  # only the rank holds its end now, so its death reads as EOF here

    def kill(self) -> None:
        # Ranks hold no state worth a graceful exit, and a graceful one (leaving the group)
        # takes about a second where a signal takes milliseconds.
        terminate(self.processes)
        for connection in self.connections:
            connection.close()


def _process_context() -> (
    multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
):
    """Where rank processes come from: a fork server that has already imported torch.

    A fresh interpreter spends about a second importing torch; forking from a server that
    did so once makes starting (and, after a failure, restarting) a pool take ~0.1 s instead
    of seconds. The server has run no torch code, so its children are as clean as spawned
    ones (no threads, no CUDA context). Where there is no fork server (Windows), spawn.

    The server imports Dynamo too, which `import fscale` leaves to first use
    (`fscale.outside_graph`): the modules it brings (sympy, the FX and DTensor layers) are
    most of what `torch.distributed.checkpoint` and `torch.compile` import, 1.3 s a rank
    otherwise, paid again after each restart.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", __name__])
    return context


def _send_to_all(ranks: _Ranks, task: bytes) -> None:
    for rank_id in range(len(ranks.connections)):
        _send_task(ranks, rank_id, task)


def _send_task(ranks: _Ranks, rank_id: int, task: bytes) -> None:
    try:
        ranks.connections[rank_id].send_bytes(task)
    except OSError:
        # Ranks are idle between calls, so a rank that is gone was killed from outside
        # (e.g. by the out-of-memory killer).
        process = ranks.processes[rank_id]
        process.join(1.0)
        raise RankError(
            f"rank {rank_id} of {len(ranks.processes)} had ended (exit code "
            f"{process.exitcode}) before this call; the pool respawns on the next call.",
            {rank_id: "the process ended between calls"},
        ) from None


def _pool_rank_main(setup: RankSetup, connection: multiprocessing.connection.Connection) -> None:
    """Entry point of a pool rank: join the group once, then run tasks until the pool is gone."""
    try:
        join_group(setup)
    except BaseException:
        connection.send_bytes(error_reply())
        return
    connection.send_bytes(pickle.dumps(("ok", None)))  # ready
    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):
            return  # the pool's process is gone: nobody is left to serve
        task: Task = pickle.loads(message)
        _reset_rank_state()
        run_task(task, connection)


def _reset_rank_state() -> None:
    # fscale's process-wide state (open ledgers and meshes, the debug flag, accounting stacks)
    # is registered with fscale.tracking by the modules that own it, so one reset reaches all
    # of it, whatever the previous task imported.
    from fscale import tracking

    tracking.reset()
    random.seed(SEED)
    torch.manual_seed(SEED)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(SEED)
