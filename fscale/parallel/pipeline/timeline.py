"""`record_timeline`: each rank's pipeline steps as measured: action times, waits, activations.

Inside ``with record_timeline() as timeline:`` every pipeline step this process runs appends
one `StepTimeline` to ``timeline.steps``:

- the wall time of the rank's part of the schedule (from its first action's start to the end
  of the step's final drain of sends), and each action's start and end (``time.perf_counter``);
- the time each action spent in receives (an activation from the previous stage or a
  gradient from the next: blocked until it arrived, and taking it in, which through shared
  memory is a copy of 0.01-0.1 ms), and the time the final drain waited on sends. The rank was
  *busy* for the actions' time less those waits, and idle for ``1 - busy / wall`` of its own
  part (`StepTimeline.bubble`); the figure `Schedule.bubble_fraction` predicts from unit costs
  counts over the whole step, from the first rank's start to the last rank's end, and
  `fscale.parallel.pipeline.measured_bubble` measures it from every rank's timeline;
- for an action that sent its result to another rank before it ended (a B that sends the
  input's gradient before its linear layers' weight gradients), the busy seconds until that
  send;
- the peak bytes of the activations the step holds for its backward: every tensor autograd
  saves, and every input a deferred linear layer keeps for W, is counted
  (`fscale.memory.LiveBytes`, one count per storage, until freed) unless it shares storage
  with a parameter or buffer of the step, so the figure is what the schedule's in-flight
  micro-batches cost, sampled at each save. Counting costs time at every save (a
  forward's actions take longer under it), so ``record_timeline(activations=False)`` leaves
  it out when the times are what is measured; the peak is then None.

`StepTimeline.costs` gives each action's busy seconds and `StepTimeline.sends` the busy
seconds until its early send, which `fscale.parallel.pipeline.simulate` turns into the time
the schedule would take with no overhead between the actions.

Recording is off unless a block is open; a step then pays one truth test per action.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fscale import tracking
from fscale.memory import LiveBytes

__all__ = ["ActionTime", "StepTimeline", "Timeline", "check_every_rank_recorded", "record_timeline"]

_TIMELINES = tracking.stack("fscale.parallel.pipeline.timeline")


@dataclasses.dataclass(frozen=True)
class ActionTime:
    """One action of the schedule as it ran: kind ("F", "B", "W"), micro-batch, stage, its start
    and end (seconds, ``time.perf_counter``), the seconds of it spent in receives,
    and, if it sent its result to another rank before it ended, the busy seconds until then
    (`sent`; None otherwise)."""

    kind: str
    micro_batch: int
    stage: int
    start: float
    end: float
    waited: float
    sent: float | None = None

    @property
    def busy(self) -> float:
        """Seconds spent computing: the action's time less its waits on receives."""
        return self.end - self.start - self.waited


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """One rank's part of one pipeline step (see the module docstring)."""

    actions: tuple[ActionTime, ...]
    start: float
    end: float
    drain_wait: float
    activation_peak: int | None

    @property
    def wall(self) -> float:
        """Seconds from the first action's start to the end of the final drain."""
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Seconds spent computing: the actions' time less their waits on receives."""
        return sum(a.busy for a in self.actions)

    @property
    def bubble(self) -> float:
        """The fraction of `wall` the rank was not busy: its own part of the step only, which
        leaves out the time it had finished while other ranks still worked (the pipeline's
        bubble over the whole step is `fscale.parallel.pipeline.measured_bubble`'s)."""
        return 1.0 - self.busy / self.wall if self.wall > 0 else 0.0

    def costs(self) -> dict[tuple[str, int, int], float]:
        """Each action's busy seconds (its time less its waits), keyed (kind, micro-batch,
        stage): the costs `fscale.parallel.pipeline.simulate` takes."""
        return {(a.kind, a.micro_batch, a.stage): a.busy for a in self.actions}

    def sends(self) -> dict[tuple[str, int, int], float]:
        """The busy seconds until each action that sent its result early did so, keyed as
        `costs`: the `sends` `fscale.parallel.pipeline.simulate` takes."""
        return {
            (a.kind, a.micro_batch, a.stage): a.sent for a in self.actions if a.sent is not None
        }


class Timeline:
    """The `StepTimeline` of every pipeline step run while the block was open.

    Attributes:
        steps: one entry per step, in the order they ran.
        activations: whether the activations' peak is counted (see `record_timeline`).
    """

    def __init__(self, activations: bool = True) -> None:
        self.steps: list[StepTimeline] = []
        self.activations = activations

    def __repr__(self) -> str:
        return f"Timeline({len(self.steps)} steps)"


def check_every_rank_recorded(counts: list[int], axis: str, caller: str) -> None:
    """Raise, naming the first rank, if a rank of `axis` recorded no step (`counts`: each rank's
    number of recorded steps, gathered, so every rank raises the same error)."""
    if 0 in counts:
        raise ValueError(
            f"{caller}: rank {counts.index(0)} of {axis!r} recorded no pipeline step; run a few "
            "steps inside `with record_timeline() as timeline:` on every rank first"
        )


@contextlib.contextmanager
def record_timeline(*, activations: bool = True) -> Iterator[Timeline]:
    """Record the pipeline steps run inside the block (see the module docstring).

    Args:
        activations: count the bytes autograd saves for backward (each step's
            ``activation_peak``); False when only the times matter, which counting inflates.
    """
    if not isinstance(activations, bool):
        raise TypeError(
            f"record_timeline: `activations` must be a bool, got {type(activations).__name__}"
        )
    with _TIMELINES.open(Timeline(activations)) as timeline:
        yield timeline


def recording() -> bool:
    """Whether a `record_timeline` block is open."""
    return bool(_TIMELINES)


class StepRecorder:
    """Collects one step's `StepTimeline` while it runs; `finish` hands it to the open blocks.

    The runner wraps each action in `action` and the step's saves in `saving`; the transport
    reports the time of its receives through `waited`, the runner an action's early send
    through `sent`.
    """

    def __init__(self, state: Iterable[torch.Tensor]) -> None:
        self._actions: list[ActionTime] = []
        self._live = LiveBytes()
        self.counts_activations = any(t.activations for t in _TIMELINES.active())
        # The step's parameters and buffers are state, not activations, when autograd saves
        # them (looked up only when activations are counted).
        self._state_storages = (
            {t.untyped_storage().data_ptr() for t in state} if self.counts_activations else set()
        )
        self._waited = 0.0
        self._sent: float | None = None
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def action(self, kind: str, micro_batch: int, stage: int) -> Iterator[None]:
        """Time the block as action (kind, micro_batch, stage)."""
        waited_before, start = self._waited, time.perf_counter()
        self._sent = None
        yield
        sent = None if self._sent is None else self._sent - start + waited_before
        self._actions.append(
            ActionTime(
                kind,
                micro_batch,
                stage,
                start,
                time.perf_counter(),
                self._waited - waited_before,
                sent,
            )
        )

    def waited(self, seconds: float) -> None:
        """Count `seconds` spent in a receive in the current action."""
        self._waited += seconds

    def sent(self) -> None:
        """Note that the current action has sent its result and goes on with other work."""
        # Busy time until now: the waits so far are subtracted when the action closes.
        self._sent = time.perf_counter() - self._waited

    def saving(self) -> Any:
        """A context under which the activations autograd saves are counted (if any open block
        counts them)."""
        if not self.counts_activations:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors the step keeps for its backward outside autograd's saved tensors
        (the inputs of linear layers whose weight gradient waits for W), as `saving` counts
        autograd's, until they are freed."""
        if self.counts_activations:
            for tensor in tensors:
                self._pack(tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in self._state_storages:
            self._live.track(tensor)
        # Not the tensor itself: a saved output would then hold its own graph through its
        # grad_fn, a cycle autograd never frees, and what a backward does not release (a
        # split backward's input half) would stay alive.
        return tensor.detach()

    def finish(self, drain_wait: float) -> None:
        """Close the step: its timeline goes to every open `record_timeline` block."""
        start = self._actions[0].start if self._actions else self._start
        peak = self._live.peak if self.counts_activations else None
        step = StepTimeline(tuple(self._actions), start, time.perf_counter(), drain_wait, peak)
        for timeline in _TIMELINES.active():
            timeline.steps.append(step)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
