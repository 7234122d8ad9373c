"""The AdaScale gain ratio: noise and signal estimated from gradient norms, smoothed, debiased.

AdaScale (Johnson, Agrawal, Gu & Guestrin, ICML 2020) trains at a batch S times the base batch
with the learning rate multiplied by the gain ratio

    r = (σ² + μ²) / (σ²/S + μ²)  ∈ [1, S],

where σ² is the trace of the covariance of one base-batch gradient and μ² the squared norm of
the true gradient. Both are estimated each step from n ≥ 2 small-batch gradients g_i (one per
replica and micro-batch) and their mean ḡ (paper, Appendix B.3, generalised to S ≠ n as
FairScale 0.4.13 does):

    L = Σ_i ‖g_i‖²,   T = ‖ḡ‖²
    σ̂² = S/(n − 1) · (L/n − T),   μ̂² = T − σ̂²/S,   then σ̂² ≥ 1e-6 and μ̂² ≥ 0.

Each estimate is an exponentially weighted average with factor θ, debiased by the weight the
average has accumulated (``biased / unbias``), so the first steps are not pulled toward the
zero start. FairScale's default is θ = max(1 − n/1000, 0): with many samples a step's estimate
is good enough alone.

Changing S mid-run (`rescale`) multiplies the noise average by S_old / S_new, as FairScale's
``set_scale`` does: σ̂²/S estimates the noise of the step's whole batch, which the new S does
not change.

Everything is float64 (the statistics are a handful of scalars; float32 would lose the
difference L/n − T when the noise is small).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fscale import tree

__all__ = [
    "GainStats",
    "default_smoothing",
    "estimate",
    "gain",
    "init_stats",
    "rescale",
    "update",
]

# FairScale's floor for the noise estimate: a gain of exactly 1 would need σ² = 0.
MIN_VARIANCE = 1e-6


class GainStats(NamedTuple):
    """AdaScale's running estimates, replicated on every rank (float64 scalars).

    Attributes:
        grad_sqr: the biased (not yet debiased) average of μ̂².
        grad_var: the biased average of σ̂², expressed for `scale`.
        unbias: the weight the averages have accumulated, 1 − θ^t for a constant θ.
        progress: Σ r over the steps so far: scale-invariant iterations, in base-batch steps.
        scale: the S that `grad_var` is expressed for.
    """

    grad_sqr: torch.Tensor
    grad_var: torch.Tensor
    unbias: torch.Tensor
    progress: torch.Tensor
    scale: torch.Tensor


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float64)


def init_stats(scale: float) -> GainStats:
    """The statistics before the first step (no weight yet: the first update sets them)."""
    return GainStats(_scalar(0.0), _scalar(0.0), _scalar(0.0), _scalar(0.0), _scalar(scale))


def default_smoothing(samples: int) -> float:
    """FairScale's default factor for `samples` small-batch gradients per step."""
    return max(1.0 - samples / 1000.0, 0.0)


def estimate(local_sqr: float, total_sqr: float, samples: int, scale: float) -> tuple[float, float]:
    """``(μ̂², σ̂²)`` of one step from L (`local_sqr`) and T (`total_sqr`), clamped."""
    grad_var = local_sqr * (scale / samples) / (samples - 1) - total_sqr * scale / (samples - 1)
    grad_sqr = total_sqr - grad_var / scale
    return max(grad_sqr, 0.0), max(grad_var, MIN_VARIANCE)


def update(stats: GainStats, grad_sqr: float, grad_var: float, smoothing: float) -> GainStats:
    """`stats` after one step's estimates, averaged with factor `smoothing`."""
    keep, take = smoothing, 1.0 - smoothing
    return tree.with_fields(
        stats,
        grad_sqr=_scalar(keep * float(stats.grad_sqr) + take * grad_sqr),
        grad_var=_scalar(keep * float(stats.grad_var) + take * grad_var),
        unbias=_scalar(keep * float(stats.unbias) + take),
    )


def gain(stats: GainStats) -> float:
    """r for the current averages and scale; 1.0 before any step has been averaged."""
    unbias = float(stats.unbias)
    if unbias == 0.0:
        return 1.0
    var = float(stats.grad_var) / unbias
    sqr = float(stats.grad_sqr) / unbias
    return (var + sqr) / (var / float(stats.scale) + sqr)


def rescale(stats: GainStats, scale: float) -> GainStats:
    """`stats` for a new S (FairScale's ``set_scale(scale, update_estimate=True)``)."""
    old = float(stats.scale)
    if old == scale:
        return stats
    return tree.with_fields(
        stats, grad_var=_scalar(float(stats.grad_var) * old / scale), scale=_scalar(scale)
    )
