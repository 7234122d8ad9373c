"""Elastic training under ``torchrun --max-restarts``: a rank killed mid-run, everyone resumes.

Two parts in one file:

- ``worker`` (run by torchrun on every rank): a small GPT trained with ZeRO-2
  (`fscale.shard_optimizer`) on 2 gloo ranks, joined through a store scoped to torchrun's
  restart attempt (`join`), resuming from `fscale.latest` at start,
  checkpointing every ``--every`` steps (asynchronously with ``--async``). In torchrun's first
  attempt, rank 1 SIGKILLs itself after step ``--kill-at``; torchrun then restarts every rank,
  and each resumes from the newest complete checkpoint. Rank 0 logs every step it finishes to
  ``ROOT/log.jsonl`` (attempt, resume point, steps, committed checkpoints) and finally writes
  the full parameters to ``ROOT/final.pt``.
- the driver (``python bench/elastic.py``): runs the worker once with a kill and once without,
  then reports the resume points, the steps redone (those after the last checkpoint, which a
  crash loses by design), the steps lost beyond the last committed checkpoint (must be 0) and
  whether the final parameters are bit-identical.

Batches depend only on the step count, so a resumed run sees exactly the batches the
uninterrupted one does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fscale as fs


def build(width: int):
    case = fs.testing.strategies.ModelCase("gpt", width=width, depth=2, seed=11)
    apply, params, buffers = fs.functionalize(case.module())
    step = fs.train_step(case.loss_fn(apply), fs.optim.adamw(1e-2))
    step = fs.shard_optimizer(step, fs.Mesh(dp=dist.get_world_size()))
    return case, apply, step, step.init(params, buffers)


def log(root: Path, **entry) -> None:
    with open(root / "log.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def join(seconds: float = 30.0) -> None:
    """Join torchrun's group: `fs.init` scopes torchrun's shared store to the restart attempt,
    so a restarted rank never reads a killed attempt's gloo address (see `fs.init`)."""
    fs.init(backend="gloo", timeout=seconds)


def worker(args: argparse.Namespace) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    join()
    rank, root = dist.get_rank(), Path(args.root)
    (root / "pids").mkdir(parents=True, exist_ok=True)
    (root / "pids" / f"rank{rank}").write_text(str(os.getpid()))
    case, apply, step, state = build(args.width)
    if fs.latest(root / "ckpt") is not None:
        state = fs.load(root / "ckpt", state, step=step)
    if rank == 0:
        log(root, attempt=attempt, resumed_at=int(state.step))
    while int(state.step) < args.steps:
        index = int(state.step)
        batch = fs.data.split_batch(case.batch(8, seed=index), rank, dist.get_world_size())
        state, _ = step(state, batch)
        if rank == 0:
            log(root, attempt=attempt, step=int(state.step))
        if int(state.step) % args.every == 0:
            done = fs.save(
                root / "ckpt", state, step=step, model=apply, keep_last=2, async_=args.async_
            )
            if rank == 0:
                saved = int(state.step)
                if isinstance(done, Path):
                    log(root, attempt=attempt, saved=saved)
                else:  # logged once committed (a kill before that may lose it, and says so)
                    done.add_done_callback(
                        lambda f, s=saved: f.exception() or log(root, attempt=attempt, saved=s)
                    )
        if args.sleep:
            time.sleep(args.sleep)
        if attempt == 0 and rank == 1 and int(state.step) == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    fs.wait_saves()
    full = fs.consolidate(step, state)
    if rank == 0:
        torch.save(full.params, root / "final.pt")
    dist.barrier()
    dist.destroy_process_group()


def torchrun(root: Path, args: argparse.Namespace, kill_at: int, restarts: int) -> float:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "--monitor-interval",
        "0.2",
        __file__,
        "worker",
        "--root",
        str(root),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--kill-at",
        str(kill_at),
        "--width",
        str(args.width),
        "--sleep",
        str(args.sleep),
    ] + (["--async"] if args.async_ else [])
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(
        command,
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=None if args.verbose else subprocess.DEVNULL,
    )
    return time.monotonic() - start


def summarize(root: Path) -> dict:
    """Attempts, resume points, steps run, and steps lost beyond the last committed checkpoint."""
    entries = [json.loads(line) for line in (root / "log.jsonl").read_text().splitlines()]
    resumes, lost, committed = [], 0, 0
    for entry in entries:
        if "saved" in entry:
            committed = max(committed, entry["saved"])
        elif "resumed_at" in entry:
            resumes.append(entry["resumed_at"])
            # Resuming before the newest committed checkpoint would lose the steps between.
            lost += max(0, committed - entry["resumed_at"])
    steps_run = sum("step" in e for e in entries)
    return {
        "attempts": len(resumes),
        "resumed_at": resumes,
        "steps_run": steps_run,
        "steps_redone": steps_run - max(e.get("step", 0) for e in entries),
        "lost_beyond_last_checkpoint": lost,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="driver", choices=["driver", "worker"])
    parser.add_argument("--root", default=None)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (soak)")
    parser.add_argument("--async", dest="async_", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args)
        return
    base = Path(args.root or tempfile.mkdtemp(prefix="fscale-elastic-"))
    killed, clean = base / "killed", base / "uninterrupted"
    seconds = torchrun(killed, args, args.kill_at, restarts=3)
    seconds_clean = torchrun(clean, args, -1, restarts=0)
    report = summarize(killed)
    a = torch.load(killed / "final.pt")
    b = torch.load(clean / "final.pt")
    report["final_params_equal"] = all(torch.equal(a[k], b[k]) for k in b) and a.keys() == b.keys()
    report["seconds"] = {"killed run": round(seconds, 1), "uninterrupted": round(seconds_clean, 1)}
    print(json.dumps(report, indent=1))
    if report["lost_beyond_last_checkpoint"] or not report["final_params_equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
