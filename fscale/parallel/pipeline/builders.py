"""The four schedule builders: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1.

Each is a pure function ``(num_ranks, micro_batches, ...) -> Schedule`` that writes every
rank's order of actions and lets `fscale.parallel.pipeline.schedule.from_orders` place them on
the clock. A schedule of one's own is written the same way (see ``tests/test_pipeline_
schedule.py``) and passed to `fscale.pipeline` as ``schedule=`` (a `Schedule`, or a builder
``(num_ranks, micro_batches) -> Schedule``).

With P ranks and M micro-batches (rank r):

- **gpipe** (fill-drain; Huang et al. 2019): all M forwards, then all M backwards in reverse.
  Holds M micro-batches; bubble (P−1)/(M+P−1).
- **1f1b** (PipeDream-flush; Narayanan et al. 2021): P−r−1 warm-up forwards, then one forward
  and one backward in turn, then the remaining backwards. Same bubble as GPipe, holds at most
  min(P−r, M) micro-batches.
- **interleaved** (Megatron-LM's interleaved 1F1B): each rank holds v stages, stage
  c·P + r on rank r, so a micro-batch loops v times over the ranks; the warm-up is
  2·(P−r−1) + (v−1)·P forwards. The bubble shrinks by v; M must be a multiple of P.
- **zero_bubble** (ZB-H1; Qi et al. 2023): backward split into B (input gradient, sent upstream
  at once) and W (weight gradient). Each rank takes, at every tick, a ready B, else a forward
  while it holds fewer than min(P−r, M) micro-batches (1F1B's bound, counted until W: the
  runtime keeps a micro-batch's graph until its W), else its oldest pending W. The W's so fill
  ticks where 1F1B waits for a gradient (at P = 4, M = 8: 20% of the clock idle against 1F1B's
  27%), with 1F1B's activation memory. On module stages fscale's 1F1B sends a B's input
  gradient before its linear layers' weight products, so there, on any clock, this table runs
  as fast as 1F1B, no faster. Given the
  measured cost of each stage's F, B and W (``costs=``), the builder also orders the actions on
  that clock with every rank bounded by 1F1B's peak, min(P, M) (ZB-H1 as Qi et al. define it:
  a later stage may hold a W back so its next B goes upstream sooner; `timed_orders`), and
  returns whichever of the two tables `simulate` finds shorter on those costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fscale.parallel.pipeline.schedule import Schedule, ScheduleError, Step, from_orders
from fscale.parallel.pipeline.simulate import simulate
from fscale.parallel.pipeline.timed_orders import checked_costs, timed_zero_bubble_orders

__all__ = ["BUILDERS", "gpipe", "interleaved", "one_f_one_b", "zero_bubble"]


def _check(name: str, num_ranks: object, micro_batches: object) -> tuple[int, int]:
    for arg, value in (("num_ranks", num_ranks), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: `{arg}` must be a positive int, got {value!r}")
    return num_ranks, micro_batches  # type: ignore[return-value]


def gpipe(num_ranks: int, micro_batches: int) -> Schedule:
    """Fill-drain: every forward, then every backward in reverse micro-batch order."""
    p, m = _check("gpipe", num_ranks, micro_batches)
    orders = [
        [("F", i, r) for i in range(m)] + [("B", i, r) for i in reversed(range(m))]
        for r in range(p)
    ]
    return from_orders(
        "gpipe", orders, micro_batches=m, stage_ranks=range(p), activation_bound=[m] * p
    )


def one_f_one_b(num_ranks: int, micro_batches: int) -> Schedule:
    """1F1B: warm up with P−r−1 forwards, then alternate one forward and one backward."""
    p, m = _check("1f1b", num_ranks, micro_batches)
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order: list[Step] = [("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, r), ("B", i, r)]
        order += [("B", i, r) for i in range(m - warmup, m)]
        orders.append(order)
    bound = [min(p - r, m) for r in range(p)]
    return from_orders(
        "1f1b", orders, micro_batches=m, stage_ranks=range(p), activation_bound=bound
    )


def interleaved(num_ranks: int, micro_batches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B with `virtual` stages per rank (stage c·P + r on rank r)."""
    p, m = _check("interleaved", num_ranks, micro_batches)
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError(f"interleaved: `virtual` must be a positive int, got {virtual!r}")
    if m % p:
        raise ScheduleError(
            f"interleaved: `micro_batches`={m} must be a multiple of the {p} ranks (each round "
            f"of the loop over the ranks carries {p} micro-batches); use {m + p - m % p}"
        )
    total = m * virtual

    def unit(k: int, forward: bool) -> tuple[int, int]:
        """(micro_batch, chunk) of a rank's k-th forward (or backward)."""
        chunk = (k // p) % virtual
        micro = (k // (p * virtual)) * p + k % p
        return micro, chunk if forward else virtual - 1 - chunk

    orders, bound = [], []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (virtual - 1) * p, total)
        order: list[Step] = []

        def forward(k: int, rank: int = r) -> Step:
            micro, chunk = unit(k, True)
            return ("F", micro, chunk * p + rank)

        def backward(k: int, rank: int = r) -> Step:
            micro, chunk = unit(k, False)
            return ("B", micro, chunk * p + rank)

        order += [forward(k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [forward(warmup + i), backward(i)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders.append(order)
        bound.append(min(warmup + 1, total))
    stage_ranks = [s % p for s in range(p * virtual)]
    return from_orders(
        "interleaved", orders, micro_batches=m, stage_ranks=stage_ranks, activation_bound=bound
    )


def zero_bubble(
    num_ranks: int,
    micro_batches: int,
    costs: Mapping[str, Sequence[float]] | None = None,
) -> Schedule:
    """ZB-H1: split backward, weight gradients deferred into the bubbles, 1F1B's memory.

    `costs`, if given, maps "F", "B" and "W" to the seconds each stage's action takes (one per
    stage, e.g. from `measured_costs`, the same on every rank): the result is the
    shorter on that clock of the unit-clock table and the one ordered on it (see the module
    docstring); every rank must pass the same costs, as every rank must run the same table.
    """
    p, m = _check("zero_bubble", num_ranks, micro_batches)
    unit = _unit_zero_bubble(p, m)
    if costs is None:
        return unit
    cost = checked_costs(costs, p)
    bound = min(p, m)
    timed = from_orders(
        "zero_bubble",
        timed_zero_bubble_orders(p, m, cost, [bound] * p),
        micro_batches=m,
        stage_ranks=range(p),
        activation_bound=[bound] * p,
    )

    def clock(kind: str, _micro_batch: int, stage: int) -> float:
        return cost(kind, stage)

    # Ties keep the unit table: it holds fewer micro-batches on the later stages.
    if simulate(timed, clock).makespan < simulate(unit, clock).makespan:
        return timed
    return unit


def _unit_zero_bubble(p: int, m: int) -> Schedule:
    bound = [min(p - r, m) for r in range(p)]
    orders = timed_zero_bubble_orders(p, m, lambda kind, stage: 1.0, bound)
    return from_orders(
        "zero_bubble", orders, micro_batches=m, stage_ranks=range(p), activation_bound=bound
    )


BUILDERS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zero_bubble": zero_bubble,
}
