"""Process-group ranks on this host: the machinery `launch` and `fscale.testing.RankPool` share.

The caller side pickles a function call once (`make_task`), serves the rendezvous store
(`new_store`), waits for one reply per rank while watching the processes die
(`fscale.distributed.replies`) and stops what is left (`terminate`). The rank side joins the
group (`join_group`), exits with its parent (`exit_with_parent`), runs the call and pickles
its result or traceback (`run_task`). `launch` runs
one call per process; the pool keeps its ranks and runs many.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist

from fscale import tracking
from fscale.distributed.watchdog import mark_finished

if TYPE_CHECKING:
    from typing import TypeAlias

    # The parent's end of a context's `Pipe`: a Connection, or on Windows a PipeConnection with
    # the same methods (the stubs give the two no public common base).
    PipeEnd: TypeAlias = (
        multiprocessing.connection.Connection | multiprocessing.connection.PipeConnection
    )

_BACKENDS = ("gloo", "nccl")
_LOCALHOST = "127.0.0.1"


class RankError(RuntimeError):
    """One or more ranks raised, died, or did not finish in time.

    Attributes:
        failures: rank -> text explaining what went wrong on it (the formatted traceback of
            its exception, or how its process ended), in the order the failures arrived.
        unfinished: ranks that were still running when the call gave up on them.
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[int, str] | None = None,
        unfinished: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.unfinished = tuple(unfinished)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks at fault: those that failed, or else those that did not finish."""
        return tuple(sorted(self.failures)) or self.unfinished

    @property
    def first_failed(self) -> int | None:
        """The rank whose failure was reported first (usually the cause), if any failed."""
        return next(iter(self.failures), None)


class RankTimeoutError(RankError):
    """Some ranks did not finish within the time limit and were killed."""


# --------------------------------------------------------------------------------------------
# Rank side


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """Everything a spawned rank needs to join its process group."""

    rank: int
    world_size: int
    backend: str
    store_port: int
    pg_timeout: float
    env: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Task:
    """A function call to run on every rank, pickled once on the caller's side.

    The pickle refers to functions and classes by module and name, so a rank must be able to
    import `module` before it can unpickle `payload`. When the import by name fails (a test
    file that is not on the rank's ``sys.path``, e.g. under pytest's importlib mode), the rank
    loads the module from `module_file` under the same name instead.
    """

    module: str
    module_file: str | None
    payload: bytes  # pickle of (fn, args, kwargs)

    def load(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        _ensure_importable(self.module, self.module_file)
        return pickle.loads(self.payload)


def make_task(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, caller: str
) -> Task:
    """Check that `fn` and its arguments can travel to another process, and pickle them."""
    if not callable(fn):
        raise TypeError(f"{caller}: `fn` must be callable, got {type(fn).__name__}.")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        kind = "a lambda" if "<lambda>" in qualname else "a nested function"
        raise TypeError(
            f"{caller}: `fn` is {kind} ({qualname}), which other processes cannot import. "
            "Define it at module level (def my_fn(...): ... at the top of a module)."
        )
    module_name = _home_module(fn)
    module = sys.modules.get(module_name)
    module_file = getattr(module, "__file__", None)
    if module_name == "__main__" and module_file is None:
        raise TypeError(
            f"{caller}: `fn` ({qualname}) is defined in an interactive session; other "
            "processes cannot import it. Put it in a module or script file."
        )
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise TypeError(
            f"{caller}: `fn` ({qualname or fn!r}) cannot be sent to other processes: {error}. "
            "Use a module-level function."
        ) from None
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        raise TypeError(
            f"{caller}: the arguments for {qualname} cannot be pickled ({error}); every "
            "argument is sent to each rank and must be picklable."
        ) from None
    return Task(module_name, module_file, payload)


def join_group(setup: RankSetup) -> None:
    """Set this rank's environment, threads and device, and initialise its process group."""
    # Ctrl-C reaches every process in the terminal's process group; the caller handles it and
    # stops the ranks, so the ranks themselves ignore it instead of each printing a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    os.environ.update(setup.env)
    # fscale read its settings (FSCALE_DEBUG, FSCALE_COLLECTIVE_TIMEOUT) when this process
    # imported it, before `env` was set: read them again.
    tracking.reset()
    os.environ.update(
        RANK=str(setup.rank),
        LOCAL_RANK=str(setup.rank),
        WORLD_SIZE=str(setup.world_size),
        LOCAL_WORLD_SIZE=str(setup.world_size),
        MASTER_ADDR=_LOCALHOST,
        MASTER_PORT=str(setup.store_port),
    )
    # The ranks share the host's cores; more threads than that only adds contention.
    torch.set_num_threads(max(1, _cpu_count() // setup.world_size))
    if setup.backend == "nccl":
        torch.cuda.set_device(setup.rank)
    timeout = datetime.timedelta(seconds=setup.pg_timeout)
    store = dist.TCPStore(_LOCALHOST, setup.store_port, setup.world_size, False, timeout=timeout)
    dist.init_process_group(
        setup.backend,
        store=store,
        rank=setup.rank,
        world_size=setup.world_size,
        timeout=timeout,
    )


def run_task(task: Task, connection: Any) -> bool:
    """Run `task` here, send the pickled reply on `connection`; return whether it succeeded.

    The reply is ``("ok", result)`` or ``("error", formatted traceback)``. After a success
    this rank is marked finished for peers still waiting in a collective; the reply goes
    first, so the caller learns that this rank returned before its peers' errors arrive.
    """
    succeeded, reply = _run(task)
    connection.send_bytes(reply)
    if succeeded:
        with contextlib.suppress(Exception):
            mark_finished()
    return succeeded


def _run(task: Task) -> tuple[bool, bytes]:
    try:
        fn, args, kwargs = task.load()
        result = to_host(fn(*args, **kwargs))
        return True, pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        return False, error_reply(skip_frames=1)


def error_reply(skip_frames: int = 0) -> bytes:
    """The pickled reply for the exception being handled.

    Args:
        skip_frames: outermost traceback frames to leave out (this module's own, which say
            nothing about the user's error).
    """
    error_type, error, trace = sys.exc_info()
    for _ in range(skip_frames):
        if trace is not None and trace.tb_next is not None:
            trace = trace.tb_next
    text = "".join(traceback.format_exception(error_type, error, trace))
    return pickle.dumps(("error", text))


def to_host(tree: Any) -> Any:
    """Detach the tensors of a result and move them to the CPU so they can be pickled.

    A view is copied out of its storage first: pickling a view would ship the whole storage.
    """

    def one(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        host = leaf.detach().cpu()
        if host.untyped_storage().nbytes() > host.numel() * host.element_size():
            host = host.clone()
        return host

    return optree.tree_map(one, tree, none_is_leaf=True)


# --------------------------------------------------------------------------------------------
# Caller side


def new_store(pg_timeout: float) -> dist.TCPStore:
    """A rendezvous store served by the calling process on a free localhost port.

    Serving it from the caller means the port is bound before the ranks start, so there is no
    race for a port chosen in advance.
    """
    return dist.TCPStore(
        _LOCALHOST,
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=pg_timeout),
        wait_for_workers=False,
    )


def resolve_backend(backend: str | None, world_size: int) -> str:
    """The backend to use for `world_size` local ranks; checks that NCCL has enough GPUs."""
    check_backend(backend)
    gpus = cuda_device_count()
    if backend is None:
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but this host "
            f"has {gpus} GPU(s). Use backend='gloo' or fewer ranks."
        )
    return backend


def terminate(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Stop every process still alive: SIGTERM, then SIGKILL for any that linger."""
    processes = [process for process in processes if process.pid is not None]  # started only
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 2.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


# --------------------------------------------------------------------------------------------
# Helpers


def _home_module(fn: Callable[..., Any]) -> str:
    """The module a rank must import to unpickle `fn` (its own, or the one it wraps)."""
    if isinstance(fn, functools.partial):
        return _home_module(fn.func)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module


def _ensure_importable(module_name: str, module_file: str | None) -> None:
    """Import `module_name`, from `module_file` when it cannot be imported by name."""
    if module_name in sys.modules:
        return
    try:
        importlib.import_module(module_name)
        return
    except ImportError:
        if module_file is None:
            raise
    spec = importlib.util.spec_from_file_location(module_name, module_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {module_name!r} from {module_file!r}")
    module = importlib.util.module_from_spec(spec)
    # Registered before running it, as a normal import does, so pickles that name the module
    # (the function, classes of its arguments) resolve to this copy.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise


def exit_with_parent() -> None:
    """Make this process exit when the process that started it dies (even by SIGKILL).

    A daemon thread waits on the parent's sentinel (for a fork-server child, the liveness of
    the process that asked for it); on Linux the kernel also delivers SIGKILL when the direct
    parent dies (``PR_SET_PDEATHSIG``), which works even while this process holds the GIL.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="fscale-parent-watch", daemon=True).start()


def cuda_device_count() -> int:
    """GPUs visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_backend(backend: str | None) -> None:
    """Raise unless `backend` is one fscale launches ranks with, or None (choose)."""
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"`backend` must be one of {_BACKENDS} or None, got {backend!r}.")


def check_world_size(size: Any, caller: str) -> None:
    """Raise unless `size` is a number of ranks (an int >= 1)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{caller}: `world_size` must be an integer >= 1, got {size!r}.")


def check_seconds(name: str, value: Any, caller: str) -> None:
    """Raise unless argument `name` is a positive, finite number of seconds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"{caller}: `{name}` must be a positive number of seconds, got {value!r}.")
