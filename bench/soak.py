"""Soak: 2 ranks trained under torchrun for a long time, killed at random, resumed every time.

The job is `bench/elastic.py`'s worker (ZeRO-2 on a small GPT, a checkpoint every ``--every``
steps, asynchronous by default, ``keep_last=2``), started with ``torchrun --max-restarts``.
This driver SIGKILLs one of its ranks, chosen at random, after a random wait of
``--kill-min``..``--kill-max`` seconds, again and again until the job finishes its steps; a kill
lands wherever the ranks are (mid-step, mid-save, mid-commit, mid-restart). Then it runs the
same job without kills and reports: kills, resumes, steps redone, steps lost beyond the last
committed checkpoint (must be 0), and whether the final parameters equal the uninterrupted
run's bit for bit.

    python bench/soak.py --minutes 30        # the full soak
    python bench/soak.py --minutes 2         # a short one
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import elastic  # bench/ is sys.path[0] when a script in it runs
import torch


def run_killed(root: Path, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1000",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "--monitor-interval",
        "0.2",
        elastic.__file__,
        "worker",
        "--root",
        str(root),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--kill-at",
        "-1",
        "--width",
        str(args.width),
        "--sleep",
        str(args.sleep),
    ] + (["--async"] if not args.sync else [])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rng = random.Random(args.seed)
    job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kills, start = 0, time.monotonic()
    while job.poll() is None:
        deadline = time.monotonic() + rng.uniform(args.kill_min, args.kill_max)
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if job.poll() is not None:
            break
        rank = rng.randrange(2)
        try:
            pid = int((root / "pids" / f"rank{rank}").read_text())
            os.kill(pid, signal.SIGKILL)
            kills += 1
        except (OSError, ValueError):
            pass  # that rank is between lives (restarting): try again later
    if job.returncode != 0:
        raise SystemExit(f"soak: the job failed (exit {job.returncode}) after {kills} kills")
    return {"kills": kills, "seconds": round(time.monotonic() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="about how long to run")
    parser.add_argument("--steps", type=int, default=0, help="default: from --minutes")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=0.25, help="seconds per step")
    parser.add_argument("--kill-min", type=float, default=8.0)
    parser.add_argument("--kill-max", type=float, default=25.0)
    parser.add_argument("--sync", action="store_true", help="synchronous saves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=None)
    args = parser.parse_args()
    # Steps at --sleep each fill about half the time on an idle machine; restarts take the rest.
    if not args.steps:
        args.steps = max(2 * args.every, int(args.minutes * 60 * 0.5 / max(args.sleep, 0.01)))
    base = Path(args.root or tempfile.mkdtemp(prefix="fscale-soak-"))
    killed, clean = base / "killed", base / "uninterrupted"
    report = run_killed(killed, args)
    report.update(elastic.summarize(killed))
    clean_args = argparse.Namespace(
        **{**vars(args), "sleep": 0.0, "verbose": False, "async_": not args.sync}
    )
    elastic.torchrun(clean, clean_args, -1, restarts=0)
    a, b = torch.load(killed / "final.pt"), torch.load(clean / "final.pt")
    report["steps"] = args.steps
    report["final_params_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    print(json.dumps(report, indent=1))
    if report["lost_beyond_last_checkpoint"] or not report["final_params_equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
