"""Inputs for the tests that pin the order in which a collective adds its terms.

Heavy-tailed values (magnitudes over many binades) make a sum of four terms in another order
show in the last bits of most elements, so equality is checked on the raw bits. The sizes cover
gloo's two regimes: at most 2N segments of under 1 MiB, and buffers cut into 1 MiB segments.
"""

from __future__ import annotations

import torch

# Small, uneven, one just past 2N MiB (1 MiB segments), and several MiB segments per rank.
SIZES = (8, 4100, 3 * (1 << 16) + 448, 2 * 4 * (1 << 18) + 8, 6_292_692)


def bits(x: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's raw bits, for equality that tells -0.0 and every rounding apart."""
    return x.contiguous().view(torch.int32)


def heavy_tailed(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s terms: normal values scaled by e to a normal power of 5."""
    g = torch.Generator().manual_seed(7919 * rank + numel)
    return torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 5)
