"""`pipeline_chart(schedule, path)`: a schedule drawn as a Gantt chart, one row per rank (PNG).

Each action is a box from its tick to its end, coloured by kind (forward, backward — the input
half when split — and weight gradient), lighter for a rank's later virtual stages, and labelled
with its micro-batch; idle ticks are the gaps. The title gives the bubble fraction. Drawn with
matplotlib's headless Agg backend, so it works without a display. `chart_command` is the
handler of the ``fscale pipeline-chart`` command.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from fscale.parallel.pipeline.builders import BUILDERS, interleaved
from fscale.parallel.pipeline.check import check_schedule
from fscale.parallel.pipeline.schedule import Schedule

__all__ = ["chart_arguments", "chart_command", "pipeline_chart"]

_COLOURS = {"F": (0.27, 0.51, 0.71), "B": (0.20, 0.63, 0.17), "W": (0.93, 0.55, 0.13)}


def pipeline_chart(schedule: Schedule, path: str | pathlib.Path, *, dpi: int = 120) -> pathlib.Path:
    """Draw `schedule` to the PNG file `path` and return the path.

    Raises:
        TypeError: `schedule` is not a Schedule.
        ScheduleError: the schedule does not pass `check_schedule`.
        ImportError: matplotlib is not installed.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"pipeline_chart: `schedule` must be a Schedule, got {type(schedule).__name__}"
        )
    check_schedule(schedule)
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    path = pathlib.Path(path)
    width = max(6.0, min(24.0, 0.3 * schedule.length))
    figure, axes = plt.subplots(figsize=(width, 0.6 * schedule.num_ranks + 1.2))
    for action in schedule.actions:
        local = schedule.local_stages(action.rank)
        chunk = local.index(action.stage)
        colour = _lighter(_COLOURS[action.kind], chunk / max(len(local), 1))
        duration = schedule.duration(action.kind)
        axes.broken_barh(
            [(action.tick, duration)],
            (action.rank - 0.4, 0.8),
            facecolors=colour,
            edgecolors="white",
        )
        axes.text(
            action.tick + duration / 2,
            action.rank,
            str(action.micro_batch),
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    axes.set_yticks(range(schedule.num_ranks), [f"rank {r}" for r in range(schedule.num_ranks)])
    axes.invert_yaxis()
    axes.set_xlim(0, schedule.length)
    axes.set_xlabel("tick")
    axes.set_title(
        f"{schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.micro_batches} micro-batches, bubble {schedule.bubble_fraction():.1%}"
    )
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=_COLOURS[k])
        for k in ("F", "B", "W")
        if any(a.kind == k for a in schedule.actions)
    ]
    labels = [
        {"F": "forward", "B": "backward (input)" if schedule.split else "backward", "W": "weights"}[
            k
        ]
        for k in ("F", "B", "W")
        if any(a.kind == k for a in schedule.actions)
    ]
    axes.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def _lighter(colour: tuple[float, float, float], amount: float) -> tuple[float, ...]:
    return tuple(c + (1 - c) * 0.45 * amount for c in colour)


def chart_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fscale pipeline-chart`` arguments."""
    parser.add_argument("schedule", choices=sorted(BUILDERS))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--virtual", type=int, default=2, help="stages per rank (interleaved)")
    parser.add_argument("--output", default="pipeline.png", help="the PNG file to write")


def chart_command(args: Any) -> int:
    """Print the schedule as text and draw it to ``args.output``."""
    if args.schedule == "interleaved":
        schedule = interleaved(args.ranks, args.micro_batches, args.virtual)
    else:
        schedule = BUILDERS[args.schedule](args.ranks, args.micro_batches)
    print(schedule.text())
    print(f"wrote {pipeline_chart(schedule, args.output)}")
    return 0
