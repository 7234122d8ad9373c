"""`simulate`: the time a schedule takes when its actions cost what they were measured to cost.

A schedule table places actions on a unit clock. The runtime runs each rank's actions in the
table's order, every one as soon as the rank is free and its inputs have arrived, so given
each action's cost in seconds (measured: `StepTimeline.costs`, or estimated per stage) the
same placement on a real clock gives the step's critical path: the shortest time in which the
schedule can run those actions on those ranks. An action that hands its result on before it
ends (a B that sends the input's gradient, then computes its linear layers' weight gradients:
`StepTimeline.sends`) lets the actions that need it start from that point. Measured step
times over it are the overhead between the actions — sends, receives, the update — which no
schedule removes; the gap between two runtimes that execute the same table with the same
kernels lies there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from fscale.parallel.pipeline.check import check_schedule
from fscale.parallel.pipeline.schedule import Schedule, dependencies

__all__ = ["Simulated", "simulate"]

Key = tuple[str, int, int]  # (kind, micro_batch, stage)


@dataclasses.dataclass(frozen=True)
class Simulated:
    """A schedule run on a real clock.

    Attributes:
        starts / ends: each action's start and end, seconds from the step's start, keyed
            (kind, micro-batch, stage).
        rank_busy: per rank, the seconds its actions cost.
        rank_end: per rank, when its last action ends.
    """

    starts: Mapping[Key, float]
    ends: Mapping[Key, float]
    rank_busy: tuple[float, ...]
    rank_end: tuple[float, ...]

    @property
    def makespan(self) -> float:
        """Seconds from the first action's start to the last one's end."""
        return max(self.rank_end, default=0.0)

    @property
    def bubble(self) -> float:
        """The idle share of all ranks' time over the makespan."""
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.rank_busy) / (len(self.rank_busy) * self.makespan)


def simulate(
    schedule: Schedule,
    costs: Mapping[Key, float] | Callable[[str, int, int], float],
    *,
    latency: float = 0.0,
    sends: Mapping[Key, float] | None = None,
) -> Simulated:
    """Run `schedule` on a clock where action (kind, micro-batch, stage) takes its cost.

    Args:
        schedule: a `Schedule` (checked first, as `fscale.pipeline` checks it).
        costs: seconds per action: a mapping keyed (kind, micro_batch, stage), e.g. a
            `StepTimeline.costs()`, or a function of the three.
        latency: seconds a message takes between ranks (added to every cross-rank input).
        sends: for actions whose result is ready before they end, the seconds from their
            start until it is (e.g. `StepTimeline.sends()`); the others' is ready at their end.
            A figure above the action's cost counts as its cost.

    Raises:
        ScheduleError: the schedule fails `check_schedule`.
        KeyError: `costs` has no entry for one of the schedule's actions (named).
        ValueError: a cost, a send time or the latency is negative or not finite, or `sends`
            names an action the schedule does not have.
    """
    check_schedule(schedule)
    if not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"simulate: `latency` must be finite and >= 0, got {latency!r}")
    cost = _cost_function(costs)
    early = _checked_sends(schedule, sends)
    rank_of = {(a.kind, a.micro_batch, a.stage): a.rank for a in schedule.actions}
    starts: dict[Key, float] = {}
    ends: dict[Key, float] = {}
    ready_at: dict[Key, float] = {}  # when each action's result can be used
    free = [0.0] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    # In tick order every action's inputs come first: the check guarantees they end earlier.
    for action in schedule.actions:
        key = (action.kind, action.micro_batch, action.stage)
        seconds = cost(*key)
        ready = [
            ready_at[need] + (latency if rank_of[need] != action.rank else 0.0)
            for need in dependencies(key, schedule.num_stages)
        ]
        starts[key] = max([free[action.rank], *ready])
        ends[key] = free[action.rank] = starts[key] + seconds
        ready_at[key] = starts[key] + min(early.get(key, seconds), seconds)
        busy[action.rank] += seconds
    return Simulated(starts, ends, tuple(busy), tuple(free))


def _checked_sends(schedule: Schedule, sends: Mapping[Key, float] | None) -> dict[Key, float]:
    if sends is None:
        return {}
    if not isinstance(sends, Mapping):
        raise TypeError(
            "simulate: `sends` must be a mapping keyed (kind, micro_batch, stage), got "
            f"{type(sends).__name__}"
        )
    known = {(a.kind, a.micro_batch, a.stage) for a in schedule.actions}
    for key in sends:
        if key not in known:
            raise ValueError(f"simulate: `sends` names {key!r}, which the schedule does not have")
    return {key: _seconds(seconds, f"send time of {key!r}") for key, seconds in sends.items()}


def _seconds(value: object, what: str) -> float:
    """`value` as seconds: a finite number >= 0, else a ValueError naming `what`."""
    if isinstance(value, bool) or not (
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
    ):
        raise ValueError(
            f"simulate: the {what} must be a finite number of seconds >= 0, got {value!r}"
        )
    return float(value)


def _cost_function(costs: Mapping[Key, float] | Callable[[str, int, int], float]):
    def checked(kind: str, micro_batch: int, stage: int) -> float:
        if callable(costs):
            seconds = costs(kind, micro_batch, stage)
        else:
            try:
                seconds = costs[(kind, micro_batch, stage)]
            except KeyError:
                raise KeyError(
                    f"simulate: `costs` has no entry for {kind}(m={micro_batch}, stage {stage})"
                ) from None
        return _seconds(seconds, f"cost of {kind}(m={micro_batch}, stage {stage})")

    if not callable(costs) and not isinstance(costs, Mapping):
        raise TypeError(
            "simulate: `costs` must be a mapping keyed (kind, micro_batch, stage) or a "
            f"function of them, got {type(costs).__name__}"
        )
    return checked
