"""`measured_costs`: each stage's F, B and W seconds from recorded steps, the same on every rank.

`zero_bubble(..., costs=)` orders its actions on a clock of these costs, and every rank of the
pipeline must build the same table from the same numbers: each rank measures its own stages
(`record_timeline`), and the ranks exchange what they measured.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from fscale import spmd
from fscale.distributed.mesh import Mesh
from fscale.parallel.pipeline.timeline import Timeline, check_every_rank_recorded

__all__ = ["measured_costs"]


def measured_costs(timeline: Timeline, mesh: Mesh, axis: str = "pp") -> dict[str, list[float]]:
    """The `costs` of `zero_bubble(..., costs=)`: per stage, the median busy seconds of its F, B
    and W over the steps `timeline` recorded on this rank, gathered from every rank of `axis`
    (a collective: every rank of the axis calls it).

    Steps of a split schedule (zero-bubble) give W directly. In an unsplit one, a B that sent
    its input's gradient before its weights' products counts as B up to the send and W after
    it, and any other B as B alone (W 0): the split the runtime would make.

    Raises:
        ValueError: on every rank of the axis, where some rank's `timeline` holds no step or no
            rank measured some stage.
    """
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for step in timeline.steps:
        for action in step.actions:
            if action.kind == "B" and action.sent is not None:
                samples[("B", action.stage)].append(action.sent)
                samples[("W", action.stage)].append(action.busy - action.sent)
            else:
                samples[(action.kind, action.stage)].append(action.busy)
    mine = {key: statistics.median(seconds) for key, seconds in samples.items()}
    # Gathered before any check, so that every rank raises the same error instead of one
    # leaving the others waiting in the collective.
    gathered = spmd.all_gather_objects((len(timeline.steps), mine), mesh, axis)
    check_every_rank_recorded([count for count, _ in gathered], axis, "measured_costs")
    merged: dict[tuple[str, int], float] = {}
    for _, theirs in gathered:
        merged.update(theirs)
    num_stages = 1 + max(stage for _, stage in merged)
    for stage in range(num_stages):
        if ("F", stage) not in merged:
            raise ValueError(f"measured_costs: no rank of {axis!r} measured stage {stage}")
    return {
        kind: [merged.get((kind, stage), 0.0) for stage in range(num_stages)]
        for kind in ("F", "B", "W")
    }
