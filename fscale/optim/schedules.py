"""Learning-rate schedules: functions ``count -> value`` usable wherever an `lr` is.

`count` is the number of updates applied before the one being computed (0 for the first), so a
schedule equals ``torch.optim.lr_scheduler.LambdaLR`` with the same function when the optimizer's
base learning rate is 1 and the scheduler steps after every optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["Schedule", "constant", "cosine", "linear_warmup"]

Schedule = Callable[[int], float]


def _check_steps(name: str, arg: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: `{arg}` must be an int >= {minimum}, got {arg}={value!r}")
    return value


def _check_value(name: str, arg: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}: `{arg}` must be a number >= 0, got {arg}={value!r}")
    return float(value)


def constant(value: float) -> Schedule:
    """The schedule that is always `value` (>= 0).

    Example:
        >>> constant(0.1)(1000)
        0.1
    """
    value = _check_value("constant", "value", value)
    return lambda count: value


def linear_warmup(peak: float, warmup_steps: int, start: float = 0.0) -> Schedule:
    """Linear ramp from `start` at count 0 to `peak` at `warmup_steps`, then `peak`.

    Args:
        peak: the value reached after warmup, >= 0.
        warmup_steps: length of the ramp in updates, >= 1.
        start: the value at count 0, >= 0.

    Raises:
        ValueError: for negative values or a `warmup_steps` below 1.

    Example:
        >>> [linear_warmup(1.0, 4)(c) for c in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    peak = _check_value("linear_warmup", "peak", peak)
    start = _check_value("linear_warmup", "start", start)
    warmup_steps = _check_steps("linear_warmup", "warmup_steps", warmup_steps, 1)

    def schedule(count: int) -> float:
        if count >= warmup_steps:
            return peak
        return start + (peak - start) * (count / warmup_steps)

    return schedule


def cosine(peak: float, total_steps: int, warmup_steps: int = 0, final: float = 0.0) -> Schedule:
    """Linear warmup from 0 to `peak`, then cosine decay to `final` at `total_steps`.

    After `total_steps` the value stays at `final` (Loshchilov & Hutter, 2017, without
    restarts).

    Args:
        peak: the value after warmup, >= 0.
        total_steps: the count at which the decay reaches `final`, > `warmup_steps`.
        warmup_steps: length of the linear warmup, >= 0 (0: start at `peak`).
        final: the value at and after `total_steps`, >= 0.

    Raises:
        ValueError: for negative values or ``total_steps <= warmup_steps``.

    Example:
        >>> schedule = cosine(1.0, total_steps=4)
        >>> [round(schedule(c), 3) for c in range(5)]
        [1.0, 0.854, 0.5, 0.146, 0.0]
    """
    peak = _check_value("cosine", "peak", peak)
    final = _check_value("cosine", "final", final)
    warmup_steps = _check_steps("cosine", "warmup_steps", warmup_steps, 0)
    total_steps = _check_steps("cosine", "total_steps", total_steps, warmup_steps + 1)
    decay_steps = total_steps - warmup_steps

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return peak * (count / warmup_steps)
        progress = min(count - warmup_steps, decay_steps) / decay_steps
        return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule
