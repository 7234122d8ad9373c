"""`check_schedule`: simulate a schedule table and refuse it, naming the first conflict.

The runtime runs each rank's actions in tick order, posts every send without waiting and
blocks only to receive. Such a run cannot deadlock when every action starts no earlier than
the end of the actions it consumes — received or local — because then every wait is for an
action at an earlier tick, and ticks are a total order. So the check is a simulation of the
table on its own clock:

1. the table is complete and well placed: F and B of every (micro-batch, stage) exactly once
   (and W, if any W appears), each on the rank that holds the stage, each micro-batch and
   stage in range, no two actions of one rank overlapping in time;
2. every consumer starts after its producer ends. Each cross-rank edge is one send (posted
   when the producer ends) and its matching recv (waited at the consumer's start): a recv
   whose send comes later is a rank waiting on another that has not sent yet; a consumer on
   the producer's own rank that starts first is a rank waiting on itself;
3. at every tick, what each rank holds for backward (forwards started whose last backward
   action has not ended) stays within the schedule's `activation_bound`.

The first conflict in tick order is reported, with the rank, the tick and both actions.
"""

from __future__ import annotations

import itertools

from fscale.parallel.pipeline.schedule import KINDS, Action, Schedule, ScheduleError, dependencies

__all__ = ["activation_peaks", "check_schedule"]


def check_schedule(schedule: Schedule) -> None:
    """Raise `ScheduleError` naming the first conflict unless `schedule` simulates cleanly."""
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"check_schedule: `schedule` must be a Schedule, got {type(schedule).__name__}"
        )
    _check_table(schedule)
    _check_order(schedule)
    peaks = activation_peaks(schedule)
    for rank, (peak, bound) in enumerate(zip(peaks, schedule.activation_bound)):
        if peak > bound:
            raise ScheduleError(
                f"schedule {schedule.name!r}: rank {rank} holds activations of {peak} "
                f"micro-batch stages at once, above the schedule's stated bound of {bound}"
            )


def activation_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (micro-batch, stage) pairs held for backward at any tick."""
    release = "W" if schedule.split else "B"
    events: list[list[tuple[int, int]]] = [[] for _ in range(schedule.num_ranks)]
    for a in schedule.actions:
        if a.kind == "F":
            events[a.rank].append((a.tick, 1))
        elif a.kind == release:
            events[a.rank].append((schedule.end(a), -1))
    peaks = []
    for rank_events in events:
        held = peak = 0
        # At one tick, releases come before new forwards (a freed buffer is reused at once).
        for _, change in sorted(rank_events):
            held += change
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def _check_table(schedule: Schedule) -> None:
    name = schedule.name
    p, m, s = schedule.num_ranks, schedule.micro_batches, schedule.num_stages
    if len(schedule.activation_bound) != p:
        raise ScheduleError(
            f"schedule {name!r}: `activation_bound` has {len(schedule.activation_bound)} "
            f"entries for {p} ranks"
        )
    for stage, rank in enumerate(schedule.stage_ranks):
        if not 0 <= rank < p:
            raise ScheduleError(f"schedule {name!r}: stage {stage} is placed on rank {rank} of {p}")
    seen: dict[tuple[str, int, int], Action] = {}
    for a in sorted(schedule.actions, key=lambda a: (a.tick, a.rank)):
        if a.kind not in KINDS:
            raise ScheduleError(f"schedule {name!r}: {a} has kind {a.kind!r}, not one of {KINDS}")
        if not (0 <= a.micro_batch < m and 0 <= a.stage < s and a.tick >= 0):
            raise ScheduleError(
                f"schedule {name!r}: {a} is outside the {m} micro-batches and {s} stages "
                "(or starts before tick 0)"
            )
        if schedule.stage_ranks[a.stage] != a.rank:
            raise ScheduleError(
                f"schedule {name!r}: rank {a.rank} runs {a.label()} at tick {a.tick}, but "
                f"stage {a.stage} is held by rank {schedule.stage_ranks[a.stage]}"
            )
        key = (a.kind, a.micro_batch, a.stage)
        if key in seen:
            raise ScheduleError(
                f"schedule {name!r}: {a.label()} runs twice (ticks {seen[key].tick} and {a.tick})"
            )
        seen[key] = a
    kinds = ("F", "B", "W") if schedule.split else ("F", "B")
    for kind in kinds:
        for stage in range(s):
            for micro in range(m):
                if (kind, micro, stage) not in seen:
                    raise ScheduleError(
                        f"schedule {name!r}: {kind}(m={micro}, stage {stage}) never runs "
                        f"(rank {schedule.stage_ranks[stage]} must run it)"
                    )
    for rank in range(p):
        actions = schedule.rank_actions(rank)
        for before, after in itertools.pairwise(actions):
            if after.tick < schedule.end(before):
                raise ScheduleError(
                    f"schedule {name!r}: rank {rank} runs {after.label()} at tick {after.tick} "
                    f"while {before.label()} (from tick {before.tick}) is still running"
                )


def _check_order(schedule: Schedule) -> None:
    name = schedule.name
    index = {(a.kind, a.micro_batch, a.stage): a for a in schedule.actions}
    for a in sorted(schedule.actions, key=lambda a: (a.tick, a.rank)):
        for need in dependencies((a.kind, a.micro_batch, a.stage), schedule.num_stages):
            producer = index[need]
            if schedule.end(producer) <= a.tick:
                continue
            if producer.rank == a.rank:
                raise ScheduleError(
                    f"schedule {name!r} deadlocks: rank {a.rank} waits on itself: "
                    f"{a.label()} at tick {a.tick} needs {producer.label()}, which the same "
                    f"rank runs at tick {producer.tick}"
                )
            what = "activation" if a.kind == "F" else "gradient"
            raise ScheduleError(
                f"schedule {name!r} deadlocks: rank {a.rank} receives the {what} for "
                f"{a.label()} at tick {a.tick}, but rank {producer.rank} sends it only after "
                f"{producer.label()} ends at tick {schedule.end(producer)}"
            )
