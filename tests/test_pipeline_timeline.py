"""fscale.parallel.pipeline.record_timeline: each rank's actions as they ran, the time they waited,
the measured bubble and activation peak; recording changes no result."""

from __future__ import annotations

import functools
import importlib
import time
import types

import pytest
import torch
from torch import nn

import fscale as fs
from fscale.parallel.pipeline import (
    ActionTime,
    StepTimeline,
    Timeline,
    measured_bubble,
    measured_costs,
    pipeline,
    record_timeline,
    zero_bubble,
)
from fscale.testing import assert_trees_equal, run_spmd

MICRO_BATCHES = 4
# The module, whose clock the cross-machine test replaces (the package's name is the function).
bubble_module = importlib.import_module("fscale.parallel.pipeline.measured_bubble")


def _step(schedule: str, model: nn.Module | None = None, balance: tuple[int, ...] = (2, 2)):
    """`model` (default: two tanh linear layers, 6 wide) on 2 ranks, its state and a batch."""
    torch.manual_seed(0)
    if model is None:
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
    _, params, buffers = fs.functionalize(model)
    step = pipeline(
        model,
        lambda out, targets: ((out - targets) ** 2).mean(),
        fs.optim.sgd(0.1),
        fs.Mesh(pp=2),
        micro_batches=MICRO_BATCHES,
        schedule=schedule,
        balance=list(balance),
        checkpoint="never",
    )
    width = [m for m in model if isinstance(m, nn.Linear)][-1].out_features
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(16, 6, generator=g), torch.randn(16, width, generator=g))
    return step, step.init(params, buffers), batch


def _recorded(schedule: str):
    step, state, batch = _step(schedule)
    plain, _ = step(state, batch)  # also the first step, whose contract check is not recorded
    with record_timeline() as outer:
        with record_timeline() as inner:
            recorded, _ = step(state, batch)
        step(state, batch)
    step(state, batch)  # no block open: recorded nowhere
    rank = fs.Mesh(pp=2).rank("pp")
    expected = [(a.kind, a.micro_batch, a.stage) for a in step.plan.schedule.rank_actions(rank)]
    return plain.params, recorded.params, inner.steps, len(outer.steps), expected


def test_each_rank_records_its_actions_and_waits_without_changing_results():
    for rank, (plain, recorded, steps, outer_count, expected) in enumerate(
        run_spmd(_recorded, 2, "1f1b")
    ):
        assert_trees_equal(recorded, plain)
        assert len(steps) == 1 and outer_count == 2
        step = steps[0]
        assert [(a.kind, a.micro_batch, a.stage) for a in step.actions] == expected
        starts = [a.start for a in step.actions]
        assert starts == sorted(starts) and step.start == starts[0]
        assert all(0.0 <= a.waited <= a.end - a.start for a in step.actions)
        assert 0.0 < step.busy <= step.wall and 0.0 <= step.bubble < 1.0
        assert step.activation_peak is not None and step.activation_peak > 0
        if rank == 0:  # stage 0 waits for every gradient the last stage sends back
            assert sum(a.waited for a in step.actions if a.kind == "B") > 0.0


def _peaks(schedule: str) -> int:
    step, state, batch = _step(schedule)
    step(state, batch)
    with record_timeline() as timeline:
        step(state, batch)
    peak = timeline.steps[0].activation_peak
    assert peak is not None  # counted: the block counts activations
    return peak


def test_1f1b_holds_fewer_activations_than_gpipe():
    gpipe = run_spmd(_peaks, 2, "gpipe")
    one = run_spmd(_peaks, 2, "1f1b")
    # Stage 0 of GPipe holds all 4 micro-batches, of 1F1B 2 (P) beside the whole batch's
    # inputs (one storage); the last stage of GPipe holds 4, of 1F1B one.
    assert one[0] < gpipe[0]
    assert one[1] * MICRO_BATCHES <= gpipe[1] * 1.05


def test_zero_bubble_holds_what_1f1b_holds():
    # ZB-H1 keeps a micro-batch's graph from its B to its W, within 1F1B's bound; the part of
    # the graph only B runs is freed with it at W, not at the step's end.
    one = run_spmd(_peaks, 2, "1f1b")
    zero = run_spmd(_peaks, 2, "zero_bubble")
    assert all(z <= o * 1.05 for z, o in zip(zero, one)), (zero, one)


def _deferred_input_peak() -> int:
    # Stage 1 is one linear layer; under zero-bubble its B computes the input's gradient only,
    # so the layer runs on detached weights and keeps its input outside autograd for W.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    step, state, batch = _step("zero_bubble", model, balance=(2, 1))
    state, _ = step(state, batch)
    with record_timeline() as timeline:
        step(state, batch)
    peak = timeline.steps[0].activation_peak
    assert peak is not None
    return peak


def test_the_inputs_deferred_linear_layers_keep_are_counted():
    _, last = run_spmd(_deferred_input_peak, 2)
    # At least one micro-batch in flight on the last stage: its input, 4 samples of 16 floats
    # (256 bytes), is counted beside what autograd saves for the loss (4 x 2 floats).
    assert last >= 4 * 16 * 4


def _times_only():
    step, state, batch = _step("1f1b")
    step(state, batch)
    with record_timeline(activations=False) as timeline:
        step(state, batch)
    return timeline.steps[0]


def test_times_can_be_recorded_without_counting_activations_and_give_the_costs():
    for step in run_spmd(_times_only, 2):
        assert step.activation_peak is None
        costs = step.costs()
        assert list(costs) == [(a.kind, a.micro_batch, a.stage) for a in step.actions]
        assert all(c == a.end - a.start - a.waited for c, a in zip(costs.values(), step.actions))
        assert all(a.busy == a.end - a.start - a.waited for a in step.actions)
        assert sum(costs.values()) == pytest.approx(step.busy)
    with pytest.raises(TypeError, match="activations"), record_timeline(activations=1):  # type: ignore[arg-type]
        pass


def _costs_of(schedule: str):
    step, state, batch = _step(schedule)
    state, _ = step(state, batch)
    with record_timeline(activations=False) as timeline:
        for _ in range(2):
            state, _ = step(state, batch)
    mesh = fs.Mesh(pp=2)
    costs = measured_costs(timeline, mesh)
    with record_timeline() as empty:
        pass
    refused = ""
    # Only rank 1 recorded nothing: rank 0 raises too, instead of waiting for it.
    try:
        measured_costs(empty if mesh.rank("pp") == 1 else timeline, mesh)
    except ValueError as error:
        refused = str(error)
    # Every rank builds the same table from them: the agreement check in `init` passes.
    _step(functools.partial(zero_bubble, costs=costs))
    return costs, refused


@pytest.mark.parametrize("schedule", ["zero_bubble", "1f1b"])
def test_measured_costs_give_every_rank_the_same_costs_per_stage(schedule):
    (costs, refused), (other, refused_too) = run_spmd(_costs_of, 2, schedule)
    assert refused == refused_too
    assert costs == other  # gathered: the same numbers on both ranks
    assert sorted(costs) == ["B", "F", "W"]
    assert all(len(seconds) == 2 for seconds in costs.values())
    assert all(s > 0 for s in costs["F"] + costs["B"])
    # Stage 1 (fed by the other rank) leaves its linear layers' products to W or, under 1F1B,
    # computes them after the early send; stage 0's B keeps every gradient.
    assert costs["W"][1] > 0
    if schedule == "1f1b":
        assert costs["W"][0] == 0
    assert "rank 1 of 'pp' recorded no pipeline step" in refused


def _by_hand(rank: int, steps: int, clock_shift: float) -> Timeline:
    """Two ranks' steps with known times: in each, rank 0 runs 100-110 s, busy 8 s, and rank 1
    102-112 s, busy 9 s (step k later by 50 k s), on a clock `clock_shift` s ahead."""
    timeline = Timeline(activations=False)
    for k in range(steps):
        t = 50.0 * k + clock_shift
        if rank == 0:
            actions = (
                ActionTime("F", 0, 0, t + 100, t + 104, 0.0),
                ActionTime("B", 0, 0, t + 106, t + 110, 0.0),
            )
            end = t + 110
        else:
            actions = (
                ActionTime("F", 0, 1, t + 102, t + 106, 1.0),
                ActionTime("B", 0, 1, t + 106, t + 112, 0.0),
            )
            end = t + 112
        timeline.steps.append(StepTimeline(actions, actions[0].start, end, 0.0, None))
    return timeline


def _bubbles_by_hand(other_machine: bool) -> list[float]:
    """`measured_bubble` of `_by_hand`'s steps; with `other_machine`, rank 1 reads a clock of
    its own, 1000 s ahead, as a rank booted elsewhere would."""
    rank = fs.Mesh(pp=2).rank("pp")
    shift = 1000.0 if other_machine and rank == 1 else 0.0
    domain, clock = bubble_module.clock_domain, bubble_module.time
    if other_machine:
        bubble_module.clock_domain = lambda: f"machine {rank}"  # type: ignore[assignment]
        bubble_module.time = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + shift)  # type: ignore[assignment]
    try:
        return measured_bubble(_by_hand(rank, 2, shift), fs.Mesh(pp=2))
    finally:
        bubble_module.clock_domain, bubble_module.time = domain, clock


@pytest.mark.parametrize("other_machine", [False, True])
def test_measured_bubble_counts_every_rank_over_the_whole_step(other_machine):
    # The span is 100-112 s; rank 0 was busy 8 s, rank 1 9 s (its F waited 1 s of its 4).
    expected = 1.0 - (8.0 + 9.0) / (2 * 12.0)
    for bubbles in run_spmd(_bubbles_by_hand, 2, other_machine):
        assert bubbles == pytest.approx([expected, expected], abs=1e-3)
    assert bubble_module.clock_domain().startswith(("boot ", "host "))


def _refusals() -> list[str]:
    rank = fs.Mesh(pp=2).rank("pp")
    # Only rank 1 recorded nothing: rank 0 raises too, instead of waiting for it.
    nothing = Timeline() if rank == 1 else _by_hand(rank, 1, 0.0)
    return [_refusal(_by_hand(rank, 1 + rank, 0.0)), _refusal(nothing)]


def _refusal(timeline: Timeline) -> str:
    try:
        measured_bubble(timeline, fs.Mesh(pp=2))
    except ValueError as error:
        return str(error)
    return ""


def test_measured_bubble_refuses_ranks_that_recorded_different_steps_on_every_rank():
    for messages in run_spmd(_refusals, 2):
        assert "different numbers of steps ([1, 2]" in messages[0]
        assert "rank 1 of 'pp' recorded no pipeline step" in messages[1]


def _recorded_bubbles():
    step, state, batch = _step("1f1b")
    state, _ = step(state, batch)
    with record_timeline(activations=False) as timeline:
        for _ in range(3):
            state, _ = step(state, batch)
    return measured_bubble(timeline, fs.Mesh(pp=2)), [s.bubble for s in timeline.steps]


def test_measured_bubble_of_a_pipeline_is_at_least_its_ranks_own_bubbles():
    (bubbles, own_0), (same, own_1) = run_spmd(_recorded_bubbles, 2)
    assert bubbles == same and len(bubbles) == 3
    for common, mine, theirs in zip(bubbles, own_0, own_1):
        # Each rank's own part of a step lies within the step's span.
        assert (mine + theirs) / 2 - 1e-9 <= common < 1.0
