"""bench/gpu_check.py and bench/gpu_step.py, the prepared GPU runs, smoke-run on the CPU so that
they still work when a GPU is lent (their CUDA-only checks are skipped there)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_gpu_check_passes_its_checks_on_the_cpu():
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_check.py"),
            "--device",
            "cpu",
            "--skip-compile",
            "--quick",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[FAIL]" not in done.stdout
    assert "[ok] remat gradients equal (checkpoint+offload)" in done.stdout
    for schedule in ("1f1b", "zero_bubble"):
        assert f"[ok] pipeline ({schedule}, 2 ranks, messages through host memory)" in done.stdout
    assert done.stdout.rstrip().endswith("all checks passed")


def test_gpu_step_smoke_run_reports_fscale_equal_to_eager(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    gpu_step = importlib.import_module("gpu_step")
    args = ["--device", "cpu", "--quick", "--rounds", "2", "--warmup", "0"]
    payload = gpu_step.main([*args, "--results-dir", str(tmp_path)])
    rows = {row["variant"]: row for row in payload["rows"]}
    assert set(rows) == {
        "eager",
        "fscale",
        "fscale exact=False",
        "eager bf16 autocast",
        "fscale bf16",
    }
    assert rows["fscale"]["bitwise_equal_to_eager"] is True
    assert rows["eager"]["ratio_to_eager"] == 1.0
    assert all(len(row["times_s"]) == 2 for row in rows.values())
    assert (tmp_path / "gpu_step_cpu_smoke.json").exists()
    # The bitwise pass turns deterministic kernels on and puts the caller's setting back.
    assert torch.are_deterministic_algorithms_enabled()
