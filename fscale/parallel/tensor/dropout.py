"""Dropout whose mask differs across the ranks of the tensor-parallel axis.

Dropout outside a tensor-parallel region acts on a replicated activation, and every rank must
draw the same mask: it does, because each rank's call is seeded by the same key (the step's key
is folded only by the data-parallel coordinate) and draws the same numbers. Inside a region (a
shard of the heads, or a shard of the sequence) each rank holds a different part of the
activation and must draw its own mask. `TensorParallelDropout` derives that mask from an
explicit key: it draws one key from the call's generator (advancing it identically on every
rank, so the masks drawn after it stay equal across ranks), folds in this rank's coordinate on
the axis with `fscale.random.fold_in`, and samples the mask from a generator seeded by the
folded key. No global RNG tracker is involved, and rematerialisation, which replays the call's
generator, draws the same mask again.
"""

from __future__ import annotations

import torch
from torch import nn

from fscale import random as fsrandom
from fscale.parallel.tensor.layers import TensorAxis

__all__ = ["TensorParallelDropout"]

_INT64_MAX = (1 << 63) - 1


class TensorParallelDropout(nn.Module):
    """Inverted dropout with probability `p`, its mask folded by this rank's tensor coordinate.

    Args:
        p: the probability of zeroing an element, in [0, 1).
        tp: the axis whose coordinate is folded into the key.

    Raises:
        ValueError: `p` is outside [0, 1).
    """

    def __init__(self, p: float, tp: TensorAxis) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"TensorParallelDropout: `p` must be in [0, 1), got {p!r}")
        self.p = p
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        drawn = torch.randint(-_INT64_MAX, _INT64_MAX, (2,), dtype=torch.int64)
        rank_key = fsrandom.fold_in(drawn, self.tp.index)
        generator = torch.Generator(device=x.device).manual_seed(fsrandom.seed(rank_key))
        keep = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        keep.bernoulli_(1.0 - self.p, generator=generator)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, axis={self.tp.axis!r}"
