"""Build reference models reproducibly: seeded float32 initialisation and argument checks.

Each model is built on the CPU in float32 from an explicit ``seed`` without touching the
caller's RNG (only the CPU generator is forked), so two processes that build the same model hold
the same weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["check_positive_ints", "seeded_float32_init"]


@contextlib.contextmanager
def seeded_float32_init(seed: int) -> Iterator[None]:
    """Build modules on the CPU in float32 from `seed`; the caller's RNG and dtype are restored."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"`seed` must be an int, got {type(seed).__name__}")
    previous_dtype = torch.get_default_dtype()
    # Only the CPU generator is forked and seeded: modules are built on the CPU, and seeding
    # accelerator generators here would change the caller's RNG on those devices.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def check_positive_ints(owner: str, **values: object) -> None:
    """Raise unless every value is a positive int (not a bool), naming `owner` and the argument."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")
