"""fscale.distributed.spawn (launch, init): spawned ranks, their results and failures.

init: joining a launcher's group.
"""

import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fscale.distributed import collective_timeout
from fscale.distributed.spawn import (
    RankError,
    RankInfo,
    RankTimeoutError,
    init,
    launch,
    rank,
    world_size,
)

# Functions run on the ranks; module level so that the ranks can import them.


def _report(offset, big):
    total = torch.tensor([float(rank() + offset)])
    dist.all_reduce(total)
    view = big[rank() :: 100]  # a view into a large storage
    return {
        "rank": rank(),
        "world_size": world_size(),
        "total": total,
        "view": view,
        "threads": torch.get_num_threads(),
        "env": os.environ.get("FSCALE_TEST_VALUE"),
        "patience": collective_timeout(),
        "backend": dist.get_backend(),
    }


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that never comes
    return "unreachable"


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def _rejoin_with_init(port):
    # Leave the group `launch` made and join a new one the way a rank under torchrun does.
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    info = init(backend="gloo", timeout=30)
    again = init()  # already initialised: unchanged
    total = torch.tensor([info.rank + 1.0])
    dist.all_reduce(total)
    return info, again, total, dist.get_world_size()


def _nested_owner():
    def nested():
        return 0

    return nested


# Tests


def test_launch_returns_each_rank_result_in_rank_order():
    big = torch.arange(1000.0)
    env = {"FSCALE_TEST_VALUE": "seen", "FSCALE_COLLECTIVE_TIMEOUT": "7"}
    results = launch(_report, 2, 10.0, big, env=env)

    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["backend"] == "gloo" for r in results)
    assert all(torch.equal(r["total"], torch.tensor([21.0])) for r in results)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert all(r["threads"] == max(1, cpus // 2) for r in results)
    assert all(r["env"] == "seen" for r in results)
    assert all(r["patience"] == 7.0 for r in results)  # settings read again after `env`
    for rank_id, result in enumerate(results):
        assert torch.equal(result["view"], big[rank_id::100])
        # The view was copied out of its storage before pickling, not shipped with all of it.
        assert result["view"].untyped_storage().nbytes() == 10 * 4


def _rss_after_a_free():
    """How much resident memory this rank gave back when it freed a 16 MiB tensor, and its
    startup environment as the kernel recorded it (what glibc read when the process started)."""

    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

    torch.ones(1).add_(1.0)  # torch's lazy start-up first, outside the measurement
    block = torch.ones(4 << 20)  # 16 MiB, touched
    resident = rss()
    del block
    returned = resident - rss()
    with open("/proc/self/environ", "rb") as environ:
        at_start = dict(
            entry.decode().split("=", 1) for entry in environ.read().split(b"\0") if b"=" in entry
        )
    return returned, at_start.get("MALLOC_MMAP_THRESHOLD_")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_env_is_in_each_rank_from_its_start_and_the_caller_keeps_its_own():
    keep = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    before = dict(os.environ)
    (kept,) = launch(_rss_after_a_free, 1, env=keep)
    (given_back,) = launch(_rss_after_a_free, 1)
    assert dict(os.environ) == before
    assert kept[1] == str(32 << 20) and given_back[1] is None
    # glibc read the thresholds at start-up: the freed block stays in the heap for reuse
    # (KiB); with its defaults a block this large is a mapping of its own, returned on free.
    assert kept[0] < 2 << 10
    assert given_back[0] > 12 << 10


def test_launch_with_one_rank_still_forms_a_group():
    (result,) = launch(_report, 1, 1.0, torch.zeros(1))
    assert result["rank"] == 0 and result["world_size"] == 1
    assert torch.equal(result["total"], torch.tensor([1.0]))


def test_exception_on_one_rank_is_raised_promptly_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 failed") as caught:
        launch(_raise_on_rank_1, 2, pg_timeout=120.0)
    elapsed = time.monotonic() - start

    error = caught.value
    assert error.first_failed == 1
    assert "ValueError: bad input on rank 1" in error.failures[1]
    assert "_raise_on_rank_1" in error.failures[1]  # the user's frame is in the traceback
    assert "ValueError: bad input on rank 1" in str(error)
    # Rank 0 was blocked in a barrier: it must be stopped, not left to the 120 s group timeout.
    assert elapsed < 60


def test_hanging_rank_is_killed_at_the_timeout_and_named():
    start = time.monotonic()
    pattern = r"rank\(s\) \[(0, )?1\] of 2 did not finish"
    with pytest.raises(RankTimeoutError, match=pattern) as caught:
        launch(_hang_on_rank_1, 2, timeout=6.0)
    elapsed = time.monotonic() - start

    # Rank 0 is listed too only if this host was too busy to start it within the timeout;
    # the pool's test checks the exact list (its timeout excludes start-up).
    assert 1 in caught.value.unfinished
    assert isinstance(caught.value, RankError)
    assert elapsed < 6.0 + 10.0


def test_init_joins_the_group_a_launcher_describes():
    with socket.socket() as probe:  # a free port for the new group's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = launch(_rejoin_with_init, 2, port)
    for rank_id, (info, again, total, size) in enumerate(results):
        assert info == RankInfo(rank=rank_id, world_size=2, local_rank=rank_id)
        assert again == info
        assert torch.equal(total, torch.tensor([3.0]))
        assert size == 2


def test_init_without_a_launcher_is_a_single_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init() == RankInfo(rank=0, world_size=1, local_rank=0)
    assert not dist.is_initialized()
    assert rank() == 0
    assert world_size() == 1


def test_init_reports_an_incomplete_launcher_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=r"init: WORLD_SIZE=2 .*MASTER_ADDR.*torchrun"):
        init()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not an integer"):
        init()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"RANK=5 is outside \[0, WORLD_SIZE=2\)"):
        init()
    with pytest.raises(ValueError, match=r"`backend` must be one of"):
        init(backend="mpi")


def test_lambda_and_nested_functions_are_refused_before_spawning():
    with pytest.raises(TypeError, match=r"launch: `fn` is a lambda .*module level"):
        launch(lambda: 0, 2)
    with pytest.raises(TypeError, match=r"launch: `fn` is a nested function"):
        launch(_nested_owner(), 2)
    with pytest.raises(TypeError, match=r"`fn` must be callable"):
        launch(42, 2)


def test_bad_arguments_are_refused_before_spawning():
    with pytest.raises(TypeError, match=r"arguments for _report cannot be pickled"):
        launch(_report, 2, threading.Lock(), torch.zeros(1))
    with pytest.raises(ValueError, match=r"`world_size` must be an integer >= 1, got 0"):
        launch(_report, 0)
    with pytest.raises(ValueError, match=r"`timeout` must be a positive number"):
        launch(_report, 2, timeout=0)
    with pytest.raises(ValueError, match=r"`pg_timeout` must be a positive number"):
        launch(_report, 2, pg_timeout=float("inf"))
    with pytest.raises(ValueError, match=r"`env` must map str to str"):
        launch(_report, 2, env={"X": 1})
    with pytest.raises(ValueError, match=r"`backend` must be one of \('gloo', 'nccl'\)"):
        launch(_report, 2, backend="mpi")


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer GPUs than ranks")
def test_nccl_without_enough_gpus_is_refused():
    with pytest.raises(ValueError, match=r"backend='nccl' needs one GPU per rank"):
        launch(_report, 64, backend="nccl")


# Launcher faults and teardown


def _run_python(args, *, cwd, stdin=None, timeout=120):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent

_TORCHRUN_PROGRAM = """
import os
import torch
import fscale as fs
from fscale.distributed import all_reduce

with fs.init() as info:
    total = all_reduce(torch.ones(1), "dp", mesh=fs.Mesh(dp=info.world_size))
    assert total.item() == info.world_size
    os.write(1, f"rank {info.rank} done\\n".encode())  # one write: ranks' lines never interleave
assert not torch.distributed.is_initialized()
fs.shutdown()  # nothing left to leave: a no-op
"""


def test_init_as_a_context_manager_leaves_the_torchrun_group_cleanly(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(_TORCHRUN_PROGRAM)
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = _run_python(args, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    assert "rank 0 done" in done.stdout and "rank 1 done" in done.stdout


def _shutdown_leaves_a_group_init_did_not_make():
    info = init()
    with info:
        pass
    total = torch.ones(1)
    dist.all_reduce(total)  # the pool's group is still there
    return total.item()


def test_shutdown_leaves_groups_that_init_did_not_create():
    from fscale.testing import run_spmd

    assert run_spmd(_shutdown_leaves_a_group_init_did_not_make, 2) == [2.0, 2.0]
    with pytest.raises(TypeError, match=r"shutdown: `barrier` must be a bool"):
        fs_shutdown(barrier="no")


def fs_shutdown(**kwargs):
    from fscale.distributed import shutdown

    return shutdown(**kwargs)


def _launch_from_a_rank():
    try:
        launch(_report, 2, 0.0, torch.zeros(200))
    except RuntimeError as error:
        return str(error)
    return "launched"


def test_launch_inside_a_job_whose_ranks_exist_is_refused(monkeypatch):
    from fscale.testing import run_spmd

    for message in run_spmd(_launch_from_a_rank, 2):
        assert "already one of several ranks (rank" in message and "fs.init()" in message
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"RANK=1 of WORLD_SIZE=2; torchrun"):
        launch(_report, 2, 0.0, torch.zeros(200))


_STDIN_PROGRAM = """
import operator
import fscale as fs
print(fs.launch(operator.add, 1, 1, 2))
"""


def test_launch_from_a_main_module_without_a_file_says_what_to_do(tmp_path):
    done = _run_python(["-"], cwd=tmp_path, stdin=_STDIN_PROGRAM)
    assert done.returncode == 1
    assert "the main module has no file (<stdin>" in done.stderr
    assert "python train.py" in done.stderr
    assert "without returning a result" not in done.stderr


_UNGUARDED_PROGRAM = """
import operator
import fscale as fs
print(fs.launch(operator.add, 1, 1, 2))
"""


def test_launch_without_the_main_guard_surfaces_the_real_cause(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_PROGRAM)
    done = _run_python([str(script)], cwd=tmp_path)
    assert done.returncode == 1
    assert "can only join a started process" not in done.stderr
    assert "while a spawned rank was importing the main module" in done.stderr
    assert 'under `if __name__ == "__main__":`' in done.stderr


_ORPHANED_PROGRAM = """
import os, sys, time
import fscale as fs

def work(folder):
    open(os.path.join(folder, f"{os.getpid()}.pid"), "w").close()
    time.sleep(600)

if __name__ == "__main__":
    fs.launch(work, 2, sys.argv[1], timeout=900)
"""


def test_ranks_exit_when_the_launching_process_is_killed(tmp_path):
    import signal
    import subprocess
    import sys

    script = tmp_path / "orphans.py"
    script.write_text(_ORPHANED_PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], env=env, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(path.stem) for path in tmp_path.glob("*.pid")]
        assert len(pids) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        launcher.kill()
        for path in tmp_path.glob("*.pid"):
            if _alive(int(path.stem)):
                os.kill(int(path.stem), signal.SIGKILL)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited, even if unreaped
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True
