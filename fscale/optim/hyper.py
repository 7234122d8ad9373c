"""Hyper-parameter checks shared by the optimizers: numbers, intervals, betas, schedules.

Every check names the optimizer and the argument, so a bad value fails where it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "LearningRate",
    "check_betas",
    "check_bool",
    "check_non_negative",
    "check_unit_interval",
    "learning_rate",
]

LearningRate = float | Callable[[int], float]


def check_non_negative(name: str, arg: str, value: float, *, finite: bool = True) -> float:
    """`value` as a float, or a ValueError naming `name`'s argument `arg` if it is < 0, NaN or
    (unless `finite` is False: a clipping threshold may be infinite) infinite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: `{arg}` must be a number, got {type(value).__name__}")
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"{name}: `{arg}` must be >= 0, got {arg}={value!r}")
    if finite and math.isinf(value):
        raise ValueError(f"{name}: `{arg}` must be finite, got {arg}={value!r}")
    return float(value)


def check_bool(name: str, arg: str, value: object) -> bool:
    """`value` if it is a bool (numpy's included), else a TypeError naming `arg`.

    Truthiness is not enough: ``maximize='False'`` is a true string and would train by ascent.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(
        f"{name}: `{arg}` must be True or False, got {value!r} (a {type(value).__name__})"
    )


def check_unit_interval(name: str, arg: str, value: float) -> float:
    """`value` as a float in [0, 1), else a ValueError naming `arg`."""
    value = check_non_negative(name, arg, value)
    if not value < 1.0:
        raise ValueError(f"{name}: `{arg}` must lie in [0, 1), got {arg}={value!r}")
    return value


def check_betas(name: str, betas: Sequence[float]) -> tuple[float, float]:
    """`betas` as a pair of floats in [0, 1), else a ValueError."""
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"{name}: `betas` must be a pair (beta1, beta2), got {betas!r}")
    return (
        check_unit_interval(name, "betas[0]", betas[0]),
        check_unit_interval(name, "betas[1]", betas[1]),
    )


def learning_rate(name: str, lr: LearningRate) -> Callable[[int], float]:
    """`lr` (a float or a schedule ``count -> float``) as a checked schedule.

    A constant is checked once here. A schedule is called once here, at count 0, so one that
    takes no count or returns something else than a number fails when the optimizer is built;
    its value is checked again at every step, so a schedule that turns negative fails at the
    step where it does instead of silently ascending.
    """
    if callable(lr):
        schedule_name = getattr(lr, "__name__", type(lr).__name__)

        def scheduled(count: int) -> float:
            try:
                value = lr(count)
            except TypeError as error:
                if count != 0:
                    raise
                raise TypeError(
                    f"{name}: the learning-rate schedule {schedule_name} could not be called as "
                    f"{schedule_name}(count) ({error}); a schedule maps the step count to a float"
                ) from None
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not value >= 0
                or math.isinf(value)
            ):
                raise ValueError(
                    f"{name}: the learning-rate schedule {schedule_name} returned {value!r} at "
                    f"count={count}; a schedule must return a finite float >= 0"
                )
            return float(value)

        scheduled(0)
        return scheduled
    constant = check_non_negative(name, "lr", lr)
    return lambda count: constant
