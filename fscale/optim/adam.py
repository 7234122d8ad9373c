"""Adam and AdamW on torch's fused kernels, bit-exact with ``torch.optim.Adam(fused=True)``.

Why per-tensor lists and not one call on a flat buffer: the fused CPU kernel runs a vectorised
body and a scalar tail on each tensor it is given, and the two round differently (the body uses
FMA). One call on a flat buffer puts each parameter's last ``numel % vector_width`` elements into
the vectorised body, so it differs from torch.optim in the last bit there (measured on torch
2.13, AVX512). One call on the list of per-leaf views of the flat buffers runs exactly torch's
arithmetic and costs the same on one thread (the kernel is memory-bound); the views keep state
in one buffer per dtype, which is what makes copies, checkpoints and sharding cheap.

``exact=False`` opts out of that: one call on the flat buffers themselves
(`fscale.optim.flat_group`), within rounding of torch.optim instead of equal to it. The kernel
runs faster on one buffer than on many small tensors (measured on torch 2.13 with one thread,
AVX2: 0.88x the per-tensor call on 200 tensors of 25,000 elements, 0.40x on 2,000 of 1,000);
it applies when the gradients lie in a few flat buffers (a flat gradient buffer, the reduced
buckets of `fscale.data_parallel` and `fscale.shard_optimizer`), and the layout is decided
once per set of tensors, not once per step (``bench/optim.py`` has both paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fscale.optim import core, flat_group, hyper
from fscale.optim.base import Optimizer, described

__all__ = ["AdamState", "adam", "adamw"]

PyTree = Any


class AdamState(NamedTuple):
    """State of `adam` / `adamw`; field names follow torch.optim's state keys.

    Attributes:
        count: number of updates applied so far (a host int64 scalar; torch's ``step``).
        exp_avg: first moment, one tensor per param, views of one buffer per dtype.
        exp_avg_sq: second moment, likewise.
        max_exp_avg_sq: running max of the second moment when ``amsgrad``, else None.
    """

    count: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree
    max_exp_avg_sq: PyTree


@described
def adam(
    lr: hyper.LearningRate = 1e-3,
    *,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    exact: bool = True,
) -> Optimizer:
    """Adam (Kingma & Ba, 2015), equal bit for bit to ``torch.optim.Adam(..., fused=True)``.

    Matches torch's fused implementation (``torch._fused_adam_``), called once per device and
    dtype on the list of per-parameter views of flat state buffers. `weight_decay` is L2
    regularisation added to the gradient, as in torch.optim.Adam.

    Args:
        lr: learning rate, or a schedule ``count -> lr`` (see `fscale.optim.schedules`).
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to the denominator for stability, >= 0.
        weight_decay: L2 penalty coefficient, >= 0.
        amsgrad: use the running maximum of the second moment (Reddi et al., 2018).
        maximize: ascend the objective instead of descending.
        exact: True (default): bit for bit torch.optim's fused Adam, one kernel call on the
            list of per-parameter views. False: one call on one span per gradient buffer (see
            `fscale.optim.flat_group`) when the gradients lie in few buffers (a flat gradient
            buffer, data_parallel's or shard_optimizer's buckets), else the per-parameter
            call (autograd's separate gradients); not bit-identical to torch.optim (last-bit
            differences, a few 1e-6 after 50 steps) nor between sharded and unsharded runs.

    Returns:
        An `Optimizer` whose state is an `AdamState`.

    Raises:
        ValueError: for a negative `lr`, `eps` or `weight_decay`, or betas outside [0, 1).

    Example:
        >>> import torch, fscale.optim as optim
        >>> params = {"w": torch.ones(3)}
        >>> opt = optim.adam(0.1)
        >>> state = opt.init(params)
        >>> params, state = optim.step(opt, {"w": torch.ones(3)}, state, params)
        >>> params["w"]
        tensor([0.9000, 0.9000, 0.9000])
    """
    return _adam_family(
        "adam", torch._fused_adam_, lr, betas, eps, weight_decay, amsgrad, maximize, exact
    )


@described
def adamw(
    lr: hyper.LearningRate = 1e-3,
    *,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    exact: bool = True,
) -> Optimizer:
    """AdamW (Loshchilov & Hutter, 2019), equal bit for bit to ``torch.optim.AdamW(fused=True)``.

    Matches torch's fused implementation (``torch._fused_adamw_``): decoupled weight decay,
    ``param *= 1 - lr * weight_decay`` before the Adam step. Arguments as in `adam`.
    """
    return _adam_family(
        "adamw", torch._fused_adamw_, lr, betas, eps, weight_decay, amsgrad, maximize, exact
    )


def _adam_family(
    name: str,
    kernel: Any,
    lr: hyper.LearningRate,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    exact: bool,
) -> Optimizer:
    lr_at = hyper.learning_rate(name, lr)
    beta1, beta2 = hyper.check_betas(name, betas)
    eps = hyper.check_non_negative(name, "eps", eps)
    weight_decay = hyper.check_non_negative(name, "weight_decay", weight_decay)
    amsgrad = hyper.check_bool(name, "amsgrad", amsgrad)
    maximize = hyper.check_bool(name, "maximize", maximize)
    exact = hyper.check_bool(name, "exact", exact)

    def update_group(group: core.Group) -> None:
        if not exact:
            group = flat_group.flattened(group) or group
        kernel(
            group.params,
            group.grads,
            group.buffers["exp_avg"],
            group.buffers["exp_avg_sq"],
            group.buffers["max_exp_avg_sq"] if amsgrad else [],
            core.fused_steps(group),
            lr=group.lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=amsgrad,
            maximize=maximize,
        )

    buffers = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    return core.pointwise_optimizer(
        name, AdamState, buffers, update_group, lr=lr_at, packed=not exact
    )
