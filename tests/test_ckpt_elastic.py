"""Restarts under torchrun: `fs.init` in a restarted attempt joins its group whatever the killed
one left in torchrun's shared store."""

import subprocess
import sys
import textwrap

# Rank 1 is SIGKILLed in the first attempt; in the second it joins 3 s late, so rank 0 reads
# rank 1's address key first: without a store scoped to the attempt, that key is the dead
# rank's and the join fails ("Gloo connectFullMesh ... Connection refused").
_WORKER = """
import os, signal, sys, time
import torch.distributed as dist
import fscale as fs

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(3)
{join}
dist.barrier()
if attempt == 0:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.barrier()
    finally:
        os._exit(1)
print(f"attempt {{attempt}} rank {{rank}} joined", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _run(tmp_path, join):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(_WORKER.format(join=join)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint"]
    command += ["localhost:0", "--monitor-interval", "0.2", str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_restarted_attempt_joins_after_a_rank_was_killed(tmp_path):
    done = _run(tmp_path, "fs.init(backend='gloo', timeout=30)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attempt 1 rank 0 joined" in done.stdout
    assert "attempt 1 rank 1 joined" in done.stdout
