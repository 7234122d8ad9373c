"""`measured_bubble`: each recorded step's bubble as a schedule table counts it, across ranks.

`Schedule.bubble_fraction` and the analytic (P−1)/(M+P−1) count every rank's idle time over the
whole step: from the first action on any rank to the last action's end on any rank. A rank's
own `StepTimeline.bubble` counts from its first action to its own end only, so it leaves out
the time a rank has finished while the others still work: the tail that a zero-bubble table
shortens, by deferring the last stage's weight gradients until the first stage's last backward
runs. This gathers every rank's steps along the axis and counts over their common span.

Ranks booted on one kernel share `time.perf_counter`'s clock (CLOCK_MONOTONIC), so their times
compare as they are. A rank on another machine has its clock set against the axis's first
rank at a barrier, which is as exact as the ranks leave the barrier together (microseconds on
one network, against steps of milliseconds).
"""

from __future__ import annotations

import pathlib
import socket
import time

from fscale import spmd
from fscale.distributed import setup_traffic
from fscale.distributed.comm import resolve_comm
from fscale.distributed.mesh import Mesh
from fscale.parallel.pipeline.timeline import Timeline, check_every_rank_recorded

__all__ = ["measured_bubble"]

_BOOT_ID = pathlib.Path("/proc/sys/kernel/random/boot_id")


def clock_domain() -> str:
    """What names the clock `time.perf_counter` reads here: the kernel's boot id (one per
    booted machine, as CLOCK_MONOTONIC is), or the host name where there is none."""
    try:
        return "boot " + _BOOT_ID.read_text().strip()
    except OSError:
        return "host " + socket.gethostname()


def measured_bubble(timeline: Timeline, mesh: Mesh, axis: str = "pp") -> list[float]:
    """Per step `timeline` recorded, the share of the pipeline's time its ranks were idle:
    ``1 - (sum of the ranks' busy seconds) / (P * span)``, the span from the earliest first
    action of any rank of `axis` to the latest end (see the module docstring). The same list on
    every rank of the axis (a collective: every rank of the axis calls it, after recording the
    same steps).

    Raises:
        ValueError: on every rank of the axis, where some rank's `timeline` holds no step or
            the ranks recorded different numbers of steps.
    """
    setup_traffic.barrier(resolve_comm(axis, mesh, "measured_bubble"))
    clock = time.perf_counter()
    steps = [(s.start, s.end, s.busy) for s in timeline.steps]
    # Gathered before any check, so that every rank raises the same error instead of one
    # leaving the others waiting in the collective.
    gathered = spmd.all_gather_objects((clock_domain(), clock, steps), mesh, axis)
    counts = [len(ranked) for _, _, ranked in gathered]
    check_every_rank_recorded(counts, axis, "measured_bubble")
    if len(set(counts)) > 1:
        raise ValueError(
            f"measured_bubble: the ranks of {axis!r} recorded different numbers of steps "
            f"({counts}, in axis order); record the same steps on every rank"
        )
    first_domain, first_clock = gathered[0][0], gathered[0][1]
    # Seconds to subtract from each rank's times to read them on the first rank's clock.
    offsets = [0.0 if domain == first_domain else at - first_clock for domain, at, _ in gathered]
    bubbles = []
    for i in range(counts[0]):
        starts = [ranked[i][0] - offset for (_, _, ranked), offset in zip(gathered, offsets)]
        ends = [ranked[i][1] - offset for (_, _, ranked), offset in zip(gathered, offsets)]
        busy = sum(ranked[i][2] for _, _, ranked in gathered)
        span = max(ends) - min(starts)
        bubbles.append(1.0 - busy / (len(gathered) * span) if span > 0 else 0.0)
    return bubbles
