"""Test session setup: deterministic torch, a bounded hypothesis profile for CI."""

import os

# Every collective first checks that all ranks pass the same shapes and dtypes (the ranks of the
# test pool inherit this environment).
os.environ.setdefault("FSCALE_DEBUG", "1")
# Deterministic cuBLAS, should the suite run on a GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis_budget import CI_EXAMPLES, THOROUGH_EXAMPLES, profile

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
