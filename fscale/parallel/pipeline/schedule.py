"""`Schedule`: a pipeline schedule as data — a table of (rank, tick, action, micro-batch, stage).

A pipeline of S stages placed on P ranks (``stage_ranks[s]`` is the rank of stage s; with v
virtual stages per rank, S = v·P) runs M micro-batches. Every micro-batch m passes each stage s
through the actions

- ``F``: the forward of stage s on micro-batch m (its input comes from stage s − 1's F),
- ``B``: the backward; in a *split* schedule only the gradient w.r.t. the stage input, sent
  upstream at once (it needs stage s + 1's B), and then
- ``W``: the gradient w.r.t. the stage's weights (split schedules only; needs the same B),
  free to be deferred into a bubble because nothing waits for it.

A table row is an `Action`; `tick` is its start on a unit clock where F and W take one tick
and B two (a whole backward) or one (split: the input half). A builder (`fscale.parallel.
pipeline.builders`) usually writes only each rank's *order* of actions and lets
`from_orders` place them as early as their inputs allow, which is how the runtime executes
them: each rank runs its actions in tick order and waits only to receive. A table is refused
before any collective runs when it does not simulate (`fscale.parallel.pipeline.check`).

The activation bound a schedule states, per rank, is the most (micro-batch, stage) pairs whose
forward has started and whose last backward action (B, or W when split) has not finished:
what the rank holds for backward at the worst tick.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["KINDS", "Action", "Schedule", "ScheduleError", "dependencies", "from_orders"]

KINDS = ("F", "B", "W")


class ScheduleError(ValueError):
    """A schedule that is malformed or would deadlock; the message names the first conflict."""


class Action(NamedTuple):
    """One row of a schedule: `rank` runs `kind` of `stage` on `micro_batch` from `tick`."""

    rank: int
    tick: int
    kind: str
    micro_batch: int
    stage: int

    def label(self) -> str:
        return f"{self.kind}(m={self.micro_batch}, stage {self.stage})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule table; build one with a builder or `from_orders`.

    Attributes:
        name: what built it (``"1f1b"`` ...).
        num_ranks: P, the ranks along the pipeline axis.
        micro_batches: M.
        stage_ranks: the rank of each stage, stage order (len S).
        actions: the table, sorted by (tick, rank).
        activation_bound: per rank, the stated bound on what it holds (see the module docstring).
    """

    name: str
    num_ranks: int
    micro_batches: int
    stage_ranks: tuple[int, ...]
    actions: tuple[Action, ...]
    activation_bound: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def split(self) -> bool:
        """Whether backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for a in self.actions)

    def duration(self, kind: str) -> int:
        """Ticks `kind` takes: F and W one, B two (one when the backward is split)."""
        return 2 if kind == "B" and not self.split else 1

    def end(self, action: Action) -> int:
        return action.tick + self.duration(action.kind)

    @property
    def length(self) -> int:
        """Ticks from the first action's start to the last one's end."""
        return max((self.end(a) for a in self.actions), default=0)

    def rank_actions(self, rank: int) -> list[Action]:
        """`rank`'s actions in the order it runs them."""
        return sorted((a for a in self.actions if a.rank == rank), key=lambda a: a.tick)

    def back_to_back(self, rank: int) -> frozenset[tuple[int, int]]:
        """The (micro-batch, stage) pairs whose forward on `rank` is followed at once by their
        own backward (B, then W when split), with no other action between.

        What such a forward saves for backward is held over none of the rank's other work, so
        recomputing it in backward would lower no peak; the ``"except_last"`` checkpoint mode
        keeps it (GPipe's last micro-batch, every micro-batch of 1F1B's last stage)."""
        order = self.rank_actions(rank)
        kinds = ("F", "B", "W") if self.split else ("F", "B")
        found = set()
        for i in range(len(order) - len(kinds) + 1):
            run = order[i : i + len(kinds)]
            unit = (run[0].micro_batch, run[0].stage)
            if all(a.kind == k and (a.micro_batch, a.stage) == unit for a, k in zip(run, kinds)):
                found.add(unit)
        return frozenset(found)

    def local_stages(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in stage order."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    def busy_fraction(self, rank: int) -> float:
        """The share of `length` that `rank` computes."""
        busy = sum(self.duration(a.kind) for a in self.actions if a.rank == rank)
        return busy / self.length if self.length else 0.0

    def bubble_fraction(self) -> float:
        """The idle share of all ranks' ticks over the schedule's length ((P−1)/(M+P−1) for
        GPipe and 1F1B)."""
        if not self.length:
            return 0.0
        return 1.0 - sum(self.busy_fraction(r) for r in range(self.num_ranks)) / self.num_ranks

    def text(self) -> str:
        """The table drawn as one line per rank, one column per tick (``F3.1`` is the forward
        of micro-batch 3 on the rank's second stage; ``..`` idle; a two-tick B shows twice)."""
        cells: dict[tuple[int, int], str] = {}
        for a in self.actions:
            local = self.local_stages(a.rank)
            chunk = local.index(a.stage) if a.stage in local else 0
            label = f"{a.kind}{a.micro_batch}" + (f".{chunk}" if self._virtual > 1 else "")
            for t in range(a.tick, self.end(a)):
                cells[(a.rank, t)] = label
        width = max((len(c) for c in cells.values()), default=2)
        head = (
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.micro_batches} micro-batches, {self.length} ticks, "
            f"bubble {self.bubble_fraction():.1%}"
        )
        lines = [head]
        for rank in range(self.num_ranks):
            row = [cells.get((rank, t), "." * 2).ljust(width) for t in range(self.length)]
            lines.append(f"rank {rank} | " + " ".join(row))
        return "\n".join(lines)

    @property
    def _virtual(self) -> int:
        return max((len(self.local_stages(r)) for r in range(self.num_ranks)), default=1)

    def __str__(self) -> str:
        return self.text()


Step = tuple[str, int, int]  # (kind, micro_batch, stage): one entry of a rank's order


def dependencies(step: Step, num_stages: int) -> list[Step]:
    """What ``(kind, micro_batch, stage)`` waits for: the producer of its input (F of the stage
    before; B of the stage after) and, for B and W, the same micro-batch's earlier action."""
    kind, m, s = step
    if kind == "F":
        return [("F", m, s - 1)] if s > 0 else []
    if kind == "B":
        return [("F", m, s)] + ([("B", m, s + 1)] if s < num_stages - 1 else [])
    return [("B", m, s)]


def from_orders(
    name: str,
    orders: Sequence[Sequence[Step]],
    *,
    micro_batches: int,
    stage_ranks: Sequence[int],
    activation_bound: Sequence[int],
) -> Schedule:
    """The table in which each rank runs `orders[rank]` in order, every action as early as its
    inputs and the rank allow (how the runtime runs it).

    Raises:
        ScheduleError: the orders deadlock (a rank waits for an action that cannot run before
            it); the message names each stuck rank's next action and what it waits for.
    """
    split = any(kind == "W" for order in orders for kind, _, _ in order)
    num_stages = len(stage_ranks)
    durations = {"F": 1, "B": 1 if split else 2, "W": 1}
    ends: dict[Step, int] = {}
    placed: list[Action] = []
    position = [0] * len(orders)
    free = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, m, s = order[position[rank]]
                step = (kind, m, s)
                needs = dependencies(step, num_stages)
                if any(need not in ends for need in needs):
                    break
                start = max([free[rank], *(ends[need] for need in needs)])
                placed.append(Action(rank, start, kind, m, s))
                ends[step] = start + durations[kind]
                free[rank] = ends[step]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock_message(name, orders, position, ends, num_stages))
    placed.sort(key=lambda a: (a.tick, a.rank))
    return Schedule(
        name,
        len(orders),
        micro_batches,
        tuple(stage_ranks),
        tuple(placed),
        tuple(activation_bound),
    )


def _deadlock_message(
    name: str,
    orders: Sequence[Sequence[Step]],
    position: list[int],
    ends: dict[Step, int],
    num_stages: int,
) -> str:
    lines = [f"schedule {name!r} deadlocks: no rank can run its next action"]
    where = {tuple(step): rank for rank, order in enumerate(orders) for step in order}
    for rank, order in enumerate(orders):
        if position[rank] >= len(order):
            continue
        kind, m, s = order[position[rank]]
        for need in dependencies((kind, m, s), num_stages):
            if need in ends:
                continue
            owner = where.get(need)
            need_label = f"{need[0]}(m={need[1]}, stage {need[2]})"
            if owner is None:
                reason = "which no rank runs"
            elif owner == rank:
                reason = "which it runs itself only later (the rank waits on itself)"
            else:
                reason = f"which rank {owner} runs only after an action that waits in turn"
            lines.append(
                f"  - rank {rank}: {kind}(m={m}, stage {s}) waits for {need_label}, {reason}"
            )
            break
    return "\n".join(lines)
