"""Start processes that run one function as the ranks of a process group.

Two ways in:

- `launch(fn, world_size, *args)` spawns `world_size` local processes, makes them a process
  group (gloo on CPU, NCCL with one GPU per rank), runs ``fn(*args)`` on every rank and returns
  the per-rank results in rank order. This is the embedded default: one call turns a
  single-process program into an N-rank one on the local machine.
- `init()` joins the process group that `torchrun` (or any launcher that sets ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``) prepared. In a single
  process it does nothing, so the same program runs unchanged with and without a launcher.
  `shutdown()` (or leaving ``with fs.init():``) leaves that group cleanly: every rank marks
  itself finished, waits at a barrier for the others, then destroys the group, which avoids
  the gloo teardown race that makes a rank abort at exit ("terminate called without an active
  exception") when ranks exit at different moments.

`rank()` and `world_size()` answer with or without a process group (0 and 1 without one).

`launch` refuses what would silently go wrong: a call inside a job whose ranks already exist
(under torchrun it would start N separate jobs per rank), a call from a main module without a
file (``python -``; spawned ranks cannot re-import it) and a call made while a spawned rank
imports the main module (no ``if __name__ == "__main__":`` guard). Its ranks exit when the
launching process dies, even by SIGKILL.

Failures are loud and fast. An exception on any rank is raised in the caller as `RankError`
with the failing ranks' tracebacks, and the other ranks are terminated at once instead of
sitting in a collective until the process-group timeout. A rank that does not finish within
`timeout` is killed and reported by number. The process-group timeout itself is short
(`DEFAULT_PG_TIMEOUT`, 60 s) because a collective that waits longer than that is almost
always a desynchronised program, not a slow one; fscale's own collectives compare the ranks'
positions well before it (`fscale.distributed.watchdog`), so the error says which rank is where.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fscale.distributed.ranks import (
    RankError,
    RankSetup,
    RankTimeoutError,
    Task,
    check_backend,
    check_seconds,
    check_world_size,
    cuda_device_count,
    error_reply,
    join_group,
    make_task,
    new_store,
    resolve_backend,
    run_task,
    terminate,
)
from fscale.distributed.replies import gather_replies
from fscale.distributed.watchdog import admit, mark_finished, wait

__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "RankError",
    "RankInfo",
    "RankTimeoutError",
    "init",
    "launch",
    "rank",
    "shutdown",
    "world_size",
]

DEFAULT_PG_TIMEOUT = 60.0
"""Seconds a collective may wait for its peers before it fails (the process-group timeout)."""


# A rank that sent its result gets this long to leave the process group and exit by itself.
_EXIT_GRACE_S = 5.0
_ENVIRON_LOCK = threading.Lock()


class RankInfo(NamedTuple):
    """Where this process sits: its global rank, the number of ranks, its rank on this host.

    Returned by `init`; as a context manager (``with fs.init() as info:``) it calls `shutdown`
    when the block ends.
    """

    rank: int
    world_size: int
    local_rank: int

    def __enter__(self) -> RankInfo:
        return self

    def __exit__(self, error_type: object, error: object, trace: object) -> None:
        shutdown(barrier=error_type is None)


# Whether `init` created the default group (so `shutdown` may destroy it).
_JOINED = False


# --------------------------------------------------------------------------------------------
# Public API


def rank() -> int:
    """This process's rank in the default process group, or 0 when there is none."""
    return dist.get_rank() if _group_is_initialized() else 0


def world_size() -> int:
    """The number of ranks in the default process group, or 1 when there is none."""
    return dist.get_world_size() if _group_is_initialized() else 1


def init(backend: str | None = None, timeout: float = DEFAULT_PG_TIMEOUT) -> RankInfo:
    """Join the default process group described by the environment, if there is one to join.

    Under `torchrun` (``WORLD_SIZE`` > 1) this reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT``, selects GPU ``LOCAL_RANK`` when the backend is NCCL,
    and initialises the default group. Without a launcher (no ``WORLD_SIZE``, or 1) there is
    nothing to join and no group is created: a one-process program needs none. When a group is
    already initialised (e.g. inside `launch`), it is left as it is.

    Args:
        backend: "gloo" or "nccl"; None picks NCCL when this host has a GPU for LOCAL_RANK,
            else gloo.
        timeout: seconds a collective may wait for its peers before it fails.

    Returns:
        `RankInfo(rank, world_size, local_rank)` of this process.

    Raises:
        ValueError: a bad `backend` or `timeout`, or a launcher environment that is incomplete
            or inconsistent.
    """
    check_backend(backend)
    check_seconds("timeout", timeout, "init")
    if _group_is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0))
    size = _env_int("WORLD_SIZE", 1)
    if size == 1:
        return RankInfo(0, 1, 0)
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(
            f"init: WORLD_SIZE={size} says this is one of several ranks, but {missing} "
            "are not set. Start the program with `torchrun`, or set RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself."
        )
    global_rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 <= global_rank < size:
        raise ValueError(f"init: RANK={global_rank} is outside [0, WORLD_SIZE={size}).")
    if backend is None:
        backend = "nccl" if local_rank < cuda_device_count() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    delta = datetime.timedelta(seconds=timeout)
    store = _attempt_store(delta)
    if store is None:
        dist.init_process_group(
            backend, init_method="env://", rank=global_rank, world_size=size, timeout=delta
        )
    else:
        dist.init_process_group(
            backend, store=store, rank=global_rank, world_size=size, timeout=delta
        )
    global _JOINED
    _JOINED = True
    return RankInfo(global_rank, size, local_rank)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's shared store, scoped to this restart attempt; None when torchrun shares none.

    torchrun's c10d rendezvous keeps one TCPStore for the whole job and hands it to every
    attempt (``TORCHELASTIC_USE_AGENT_STORE``), while `init_process_group`'s keys do not name
    the attempt: after a rank was killed, the keys where the dead attempt's ranks published their
    gloo addresses survive, and a restarted rank that reads one before its peer rewrites it
    connects to a dead process ("Gloo connectFullMesh ... Connection refused"). A prefix per
    restart count keeps the attempts apart (the count is the same on every rank of a node; for
    nodes that join at different counts torch offers TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"fscale/attempt_{attempt}/", shared)


def shutdown(barrier: bool = True) -> None:
    """Leave the process group `init` joined: mark this rank finished, barrier, destroy.

    Call it on every rank at the end of a program started by `torchrun` (or leave a
    ``with fs.init():`` block). The barrier makes the ranks leave together, so none tears
    the group down while a peer still talks to it. A group that `init` did not create (one
    `launch` or a test pool made, or your own) is left as it is; without a group this does
    nothing.

    Args:
        barrier: wait for every rank first. Pass False after an error, when the peers may
            never arrive.
    """
    global _JOINED
    if isinstance(barrier, bool) is False:
        raise TypeError(f"shutdown: `barrier` must be a bool, got {barrier!r}")
    if not (_JOINED and _group_is_initialized()):
        return
    try:
        if barrier:
            mark_finished()
            # Counted and bounded like any collective: a peer that never comes is named.
            size = dist.get_world_size()
            ticket = admit(
                dist.group.WORLD, lambda: tuple(range(size)), "world", "barrier",
                torch.zeros(0), 0, False,
            )  # fmt: skip
            wait(dist.barrier(async_op=True), ticket)
    finally:
        _JOINED = False
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 300.0,
    pg_timeout: float = DEFAULT_PG_TIMEOUT,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on `world_size` new local processes forming a process group.

    Each rank is a fresh process (the multiprocessing "spawn" method, safe with CUDA) that
    sets ``torch.set_num_threads(max(1, cpus // world_size))``, initialises the default
    process group on a free localhost port, runs `fn` and sends its result back. Inside `fn`,
    `rank()`, `world_size()` and `torch.distributed` work as under `torchrun`.

    Every rank imports the program's main module again (the spawn start method), so a script
    must call `launch` under ``if __name__ == "__main__":``.

    Args:
        fn: a module-level function (ranks import it by reference, so lambdas and nested
            functions cannot be sent).
        world_size: number of ranks, at least 1.
        *args: arguments for `fn`, the same on every rank; must be picklable.
        backend: "gloo" (CPU) or "nccl" (one GPU per rank, rank r on GPU r). None picks NCCL
            when CUDA has at least `world_size` GPUs, else gloo.
        timeout: seconds the whole call may take, start-up included; ranks still running
            then are killed and reported.
        pg_timeout: seconds a collective may wait for its peers before it fails.
        env: environment variables every rank starts with: a rank's process is started with
            them, so what reads its settings when a process starts takes them too (glibc's
            ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_``, OpenMP's
            ``OMP_NUM_THREADS``); this process's own environment is left as it was.

    Returns:
        The return value of `fn` on each rank, in rank order. Tensors in the results (at any
        depth of a pytree) come back detached and on the CPU; results must be picklable.

    Raises:
        TypeError: `fn` is not a module-level callable, or `args` cannot be pickled.
        ValueError: a bad `world_size`, `backend`, timeout or `env`.
        RankError: a rank raised or died (the message carries each failing rank's traceback;
            the other ranks are terminated at once).
        RankTimeoutError: ranks were still running after `timeout` seconds (they are named).
    """
    _check_launch_context()
    task = make_task(fn, args, {}, caller="launch")
    check_world_size(world_size, "launch")
    check_seconds("timeout", timeout, "launch")
    check_seconds("pg_timeout", pg_timeout, "launch")
    env = _check_env(env)
    backend = resolve_backend(backend, world_size)
    deadline = time.monotonic() + timeout
    store = new_store(pg_timeout)
    context = multiprocessing.get_context("spawn")
    processes, connections = [], []
    try:
        for rank_id in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            setup = RankSetup(rank_id, world_size, backend, store.port, pg_timeout, env)
            process = context.Process(
                target=_launched_rank_main,
                args=(setup, task, sender),
                name=f"fscale-rank-{rank_id}",
                # Not a daemon, so that `fn` may start processes of its own (DataLoader workers).
                daemon=False,
            )
            connections.append(receiver)
            with _started_with(env):
                process.start()
            processes.append(process)
            sender.close()  # the parent keeps only the reading end, so EOF means the rank died
        replies = gather_replies(connections, processes, deadline)
        if replies.complete:
            # Every rank sent its result; let them leave the group and exit by themselves.
            _join(processes, _EXIT_GRACE_S)
    finally:
        terminate(processes)
        for connection in connections:
            connection.close()
    return replies.results_or_raise(timeout)


# --------------------------------------------------------------------------------------------
# Internals


def _launched_rank_main(
    setup: RankSetup, task: Task, sender: multiprocessing.connection.Connection
) -> None:
    """Entry point of a process started by `launch`: join the group, run, reply, leave."""
    try:
        join_group(setup)
    except BaseException:
        sender.send_bytes(error_reply())
        return
    succeeded = run_task(task, sender)
    if succeeded and _group_is_initialized():
        # After a failure the group may be wedged; the caller terminates this process instead.
        dist.destroy_process_group()


def _check_launch_context() -> None:
    """Refuse a `launch` that cannot work, or would silently run N separate jobs."""
    main = sys.modules.get("__main__")
    # A spawned child first runs the parent's main module as "__mp_main__"; only once that is
    # done does the name refer to its __main__.
    importing = sys.modules.get("__mp_main__")
    if importing is not None and importing is not main:
        raise RuntimeError(
            "launch: called while a spawned rank was importing the main module. Spawned ranks "
            "import the main module again, so a launch call at module level runs in every "
            'rank; put it under `if __name__ == "__main__":`.'
        )
    if _group_is_initialized() or _env_int("WORLD_SIZE", 1) > 1:
        where = (
            f"rank {rank()} of {world_size()}"
            if _group_is_initialized()
            else (f"RANK={os.environ.get('RANK')} of WORLD_SIZE={os.environ.get('WORLD_SIZE')}")
        )
        raise RuntimeError(
            f"launch: this process is already one of several ranks ({where}; torchrun or "
            "another launcher started it), so launch would start a separate job on every "
            "rank. Under torchrun call your function directly inside `with fs.init():`; "
            "use fs.launch only from a plain `python script.py`."
        )
    main_file = getattr(main, "__file__", None)
    main_spec = getattr(main, "__spec__", None)
    # An interactive session has no __file__ and spawns fine; `python -` has "<stdin>".
    if main_spec is None and main_file is not None and not os.path.isfile(main_file):
        raise RuntimeError(
            f"launch: the main module has no file ({main_file}, e.g. "
            "`python -` or code piped to python), and spawned ranks start by importing it. "
            "Save the program as a file and run `python train.py`, or run it under torchrun "
            "with fs.init()."
        )


@contextlib.contextmanager
def _started_with(env: Mapping[str, str]) -> Iterator[None]:
    """Inside: `env` in this process's environment, which a process started now inherits.

    A spawned process is a new program that inherits the environment; what reads its settings
    at start-up (glibc's malloc) would miss variables set only once it runs Python. The lock
    keeps launches from other threads from starting ranks with this launch's variables.
    """
    if not env:
        yield
        return
    with _ENVIRON_LOCK:
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _join(processes: Sequence[multiprocessing.process.BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _group_is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"init: environment variable {name}={text!r} is not an integer.") from None


def _check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in env.items()
    ):
        raise ValueError(f"launch: `env` must map str to str, got {env!r}.")
    return dict(env)
