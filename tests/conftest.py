"""Test session setup: deterministic torch, a bounded hypothesis profile for CI."""

import os

import torch
from hypothesis import HealthCheck, settings

# CI (and the default) runs a bounded, derandomized profile so the suite is fast and repeatable;
# `HYPOTHESIS_PROFILE=thorough` explores more examples locally.
settings.register_profile(
    "ci",
    max_examples=8,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
