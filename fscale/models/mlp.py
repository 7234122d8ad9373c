"""A multi-layer perceptron: ``Linear`` layers with an activation between them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch import nn

from fscale.models import building

__all__ = ["mlp"]


_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid,
}


def mlp(
    sizes: Sequence[int], *, activation: str = "relu", bias: bool = True, seed: int = 0
) -> nn.Sequential:
    """A multi-layer perceptron: ``Linear`` layers with an activation between them.

    Args:
        sizes: layer widths, input first: ``[4, 8, 2]`` is ``Linear(4, 8), act, Linear(8, 2)``.
        activation: one of ``"relu"``, ``"gelu"``, ``"tanh"``, ``"silu"``, ``"sigmoid"``.
        bias: whether the ``Linear`` layers have a bias.
        seed: the initialisation seed (PyTorch's default ``Linear`` initialisation).

    Returns:
        An ``nn.Sequential``; its parameters are named ``"0.weight"``, ``"0.bias"``,
        ``"2.weight"``, ...

    Raises:
        ValueError: fewer than two sizes, a size that is not a positive int, or an unknown
            activation.
        TypeError: `seed` is not an int.
    """
    sizes = list(sizes)
    if len(sizes) < 2:
        raise ValueError(f"mlp: `sizes` needs at least an input and an output width, got {sizes!r}")
    building.check_positive_ints("mlp", **{f"sizes[{i}]": size for i, size in enumerate(sizes)})
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"mlp: unknown `activation` {activation!r}; choose one of {sorted(_ACTIVATIONS)}"
        )
    layers: list[nn.Module] = []
    with building.seeded_float32_init(seed):
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            if i > 0:
                layers.append(_ACTIVATIONS[activation]())
            layers.append(nn.Linear(fan_in, fan_out, bias=bias))
    return nn.Sequential(*layers)
