"""The `fscale demo` command trains, and reports loss, per-rank bytes and the comm ledger."""

import pytest

from fscale import cli


def test_demo_trains_data_parallel_and_reports(capsys):
    results = cli.main(
        [
            "demo",
            "--steps",
            "6",
            "--seconds",
            "60",
            "--no-progress",
            "--d-model",
            "32",
            "--seq-len",
            "16",
            "--batch-size",
            "8",
        ]
    )
    assert results == 0
    out = capsys.readouterr().out
    assert "6 steps" in out
    assert "per-rank model state" in out and "optimizer" in out
    assert "all_reduce  dp" in out  # the ledger of one step
    params_line = next(line for line in out.splitlines() if line.strip().startswith("0 "))
    assert "KiB" in params_line or "MiB" in params_line


def test_demo_rejects_bad_options():
    with pytest.raises(SystemExit, match="divisible"):
        cli.main(["demo", "--world-size", "3", "--batch-size", "16"])
    with pytest.raises(SystemExit, match="unknown strategy"):
        cli.run_demo(cli.DemoConfig(strategy="tensor"))


def test_the_library_imports_without_test_dependencies():
    """hypothesis and pytest are test extras: importing fscale must not need them."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['hypothesis'] = None; sys.modules['pytest'] = None; "
        "import fscale, fscale.cli, fscale.testing; fscale.testing.run_spmd"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
