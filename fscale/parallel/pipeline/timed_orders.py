"""Zero-bubble orders chosen on a clock of measured costs (`fscale.parallel.pipeline.zero_bubble`
with ``costs=``).

The unit-clock ZB-H1 table bounds each rank by 1F1B's own count (P − r micro-batches held from
F to W). Under that bound every W follows its B before the next forward, so the table runs
exactly as fscale's 1F1B where that B already sends the input's gradient before the weights'
products (module stages, whose plain linear layers' products wait for the send): for any
action costs the two have the same critical path (``tests/test_pipeline_simulate.py``).
ZB-H1 as Qi et al. define it bounds every rank by 1F1B's peak, the first stage's P
micro-batches: a later stage may then hold a W back while its next B or F goes
first, so gradients travel upstream sooner, at no more peak activation memory than 1F1B's
(every micro-batch's activations are taken to be about the same size on every stage).

Which W to hold back depends on how long the actions take, so these orders are chosen on a
clock where each action costs what it was measured to cost: a rank that is free runs a
backward whose gradient has arrived, else a forward within the bound whose input has arrived,
else its oldest pending W, else it waits for the next action to end anywhere. The orders are
deterministic (ties go to the lower rank), so every rank given the same costs builds the same
table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from fscale.parallel.pipeline.schedule import ScheduleError, Step

__all__ = ["checked_costs", "timed_zero_bubble_orders"]

Cost = Callable[[str, int], float]  # (kind, stage) -> seconds


def checked_costs(costs: object, num_ranks: int) -> Cost:
    """`costs` (a mapping of "F", "B" and "W" to one cost in seconds per stage) as a function
    of (kind, stage); a clear error for anything else."""
    if not isinstance(costs, Mapping):
        raise ScheduleError(
            "zero_bubble: `costs` must map 'F', 'B' and 'W' to a sequence of seconds per stage, "
            f"got {type(costs).__name__}"
        )
    if set(costs) != {"F", "B", "W"}:
        raise ScheduleError(
            f"zero_bubble: `costs` must have exactly the keys 'F', 'B' and 'W', got {sorted(costs)}"
        )
    table: dict[str, list[float]] = {}
    for kind in ("F", "B", "W"):
        seconds = costs[kind]
        if not isinstance(seconds, Sequence) or len(seconds) != num_ranks:
            raise ScheduleError(
                f"zero_bubble: `costs[{kind!r}]` must hold one cost per stage ({num_ranks}), got "
                f"{seconds!r}"
            )
        for stage, value in enumerate(seconds):
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            ):
                raise ScheduleError(
                    f"zero_bubble: `costs[{kind!r}][{stage}]` must be a finite number of seconds "
                    f">= 0, got {value!r}"
                )
        table[kind] = [float(v) for v in seconds]
    return lambda kind, stage: table[kind][stage]


def timed_zero_bubble_orders(p: int, m: int, cost: Cost, bound: Sequence[int]) -> list[list[Step]]:
    """Each rank's order of F, B and W for P = `p` stages (one per rank) and `m` micro-batches,
    rank r holding at most ``bound[r]`` micro-batches from F to W (see the module docstring;
    on unit costs with 1F1B's per-rank bound, the unit-clock ZB-H1 table's orders)."""
    orders: list[list[Step]] = [[] for _ in range(p)]
    ends: dict[Step, float] = {}
    free = [0.0] * p
    next_forward, next_backward, held = [0] * p, [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]

    def arrived(step: Step, now: float) -> bool:
        return ends.get(step, math.inf) <= now

    def choice(r: int, now: float) -> Step | None:
        b = next_backward[r]
        if (
            b < next_forward[r]
            and arrived(("F", b, r), now)
            and (r == p - 1 or arrived(("B", b, r + 1), now))
        ):
            next_backward[r] += 1
            pending_w[r].append(b)
            return ("B", b, r)
        f = next_forward[r]
        if f < m and held[r] < bound[r] and (r == 0 or arrived(("F", f, r - 1), now)):
            next_forward[r] += 1
            held[r] += 1
            return ("F", f, r)
        if pending_w[r]:
            held[r] -= 1
            return ("W", pending_w[r].pop(0), r)
        return None

    while True:
        active = [r for r in range(p) if len(orders[r]) < 3 * m]
        if not active:
            return orders
        now = min(free[r] for r in active)
        moved = False
        for r in active:  # the ranks free at `now`, lowest first
            if free[r] == now and (step := choice(r, now)) is not None:
                ends[step] = free[r] = now + cost(step[0], r)
                orders[r].append(step)
                moved = True
                break
        if not moved:  # nothing has arrived for them: on to the next end
            later = [t for t in ends.values() if t > now]
            if not later:
                raise AssertionError("timed_zero_bubble_orders: no action can run")  # a bug
            for r in active:
                if free[r] == now:
                    free[r] = min(later)
