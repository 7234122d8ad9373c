"""What a recompute restores so that it runs as its forward did: the random generators' state
(`fscale.random.RngState`, so dropout draws the same masks) and the autocast settings of every
device type involved (so it computes in the same precision).

`fscale.remat.engine` captures one `ExecutionState` when a checkpointed call's forward runs and
enters `restored()` around every rerun of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from fscale.random import RngState

__all__ = ["ExecutionState"]


@dataclasses.dataclass
class ExecutionState:
    """What makes the recompute draw the same random numbers and use the same precision."""

    rng: RngState
    autocast: dict[str, tuple[bool, torch.dtype]]

    @classmethod
    def capture(cls, tensors: list[torch.Tensor]) -> ExecutionState:
        rng = RngState.capture(tensors)
        device_types = ["cpu"] + (["cuda"] if rng.cuda else [])
        return cls(
            rng=rng,
            autocast={
                t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in device_types
            },
        )

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with self.rng.restored(), contextlib.ExitStack() as stack:
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield
