"""Test session setup: deterministic torch, a bounded hypothesis profile for CI."""

import atexit
import os
import shutil
import sys
from pathlib import Path

# Every collective first checks that all ranks pass the same shapes and dtypes (the ranks of the
# test pool inherit this environment).
os.environ.setdefault("FSCALE_DEBUG", "1")
# Deterministic cuBLAS, should the suite run on a GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis_budget import CI_EXAMPLES, THOROUGH_EXAMPLES, profile

# Where PYTHONDONTWRITEBYTECODE is set (some CI images set it), every interpreter the suite
# starts (the xdist workers, each spawned rank, each CLI and script run: about seventy) compiled
# fscale from source again, 0.5 s of CPU each, and each worker rewrote every test module, 7 s.
# The session writes the project's bytecode caches and removes the ones it made at exit, so the
# tree is left as the setting wants it. (Installed packages have theirs from pip; a cache
# prefix would move those too, and compile torch from source.) Set here, in the first process,
# so that every process started after it inherits it.
_SOURCES = [Path(__file__).resolve().parents[1] / name for name in ("fscale", "tests", "bench")]


def _remove_new_caches(before: set[Path]) -> None:
    for directory in _SOURCES:
        for cache in directory.rglob("__pycache__"):
            if cache not in before:
                shutil.rmtree(cache, ignore_errors=True)


if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    atexit.register(_remove_new_caches, {c for d in _SOURCES for c in d.rglob("__pycache__")})
    sys.dont_write_bytecode = False

# CI (and the default) runs a bounded, derandomized profile so the suite is fast and repeatable;
# `HYPOTHESIS_PROFILE=thorough` explores more examples locally (tests with a count of their own
# take it through `hypothesis_budget.examples`, which scales it the same way).
settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=THOROUGH_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(profile())

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


@pytest.fixture
def kernel_calls(monkeypatch):
    """``kernel_calls(name)`` records, per call of torch's fused kernel ``torch.<name>``, the
    numel of each param it is given (the list it returns fills as the kernel runs)."""

    def record(name: str) -> list[list[int]]:
        calls: list[list[int]] = []
        kernel = getattr(torch, name)

        def recording(params, *args, **kwargs):
            calls.append([p.numel() for p in params])
            return kernel(params, *args, **kwargs)

        monkeypatch.setattr(torch, name, recording)
        return calls

    return record
