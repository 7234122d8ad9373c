"""fscale.parallel.pipeline.simulate: a schedule on a real clock, from each action's cost."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fscale.parallel.pipeline import (
    ScheduleError,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    zero_bubble,
)
from fscale.parallel.pipeline.check import activation_peaks
from fscale.parallel.pipeline.schedule import Action, Schedule


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b, zero_bubble, interleaved])
@pytest.mark.parametrize(("ranks", "micro_batches"), [(2, 4), (4, 8)])
def test_unit_costs_give_back_the_table(builder, ranks, micro_batches):
    table = builder(ranks, micro_batches)
    run = simulate(table, lambda kind, m, s: table.duration(kind))
    assert run.makespan == table.length
    assert {k: int(v) for k, v in run.starts.items()} == {
        (a.kind, a.micro_batch, a.stage): a.tick for a in table.actions
    }
    assert run.bubble == pytest.approx(table.bubble_fraction())


def test_1f1b_with_uneven_stages_waits_where_the_slower_stage_holds_it():
    # Stage 0: F 10, B 17; stage 1 (with the loss): F 10, B 15. Worked by hand: rank 0 runs
    # F0 F1 B0 F2 B1 F3 B2 B3 and waits for the last stage's B3, which ends at 114.
    cost = {"F": (10, 10), "B": (17, 15)}
    run = simulate(one_f_one_b(2, 4), lambda kind, m, s: cost[kind][s])
    assert run.ends[("B", 3, 1)] == 114
    assert run.starts[("B", 3, 0)] == 114
    assert run.makespan == 131
    assert run.rank_busy == (4 * 27, 4 * 25)
    assert run.rank_end == (131, 114)
    assert run.bubble == pytest.approx(1 - (108 + 100) / (2 * 131))


def test_a_backward_that_sends_early_lets_the_stage_before_it_start_sooner():
    # The same costs, but stage 1's B sends the input's gradient 9 into its 15 (its linear
    # layers' weight gradients follow). Worked by hand: rank 0's B0 starts at 29 (not 35),
    # B1 at 56 (rank 0 is busy until then), B2 at 83, and B3 at 95 + 9 = 104; 121 in all.
    cost = {"F": (10, 10), "B": (17, 15)}
    sends = {("B", m, 1): 9.0 for m in range(4)}
    run = simulate(one_f_one_b(2, 4), lambda kind, m, s: cost[kind][s], sends=sends)
    assert [run.starts[("B", m, 0)] for m in range(4)] == [29, 56, 83, 104]
    assert run.makespan == 121
    assert run.rank_end == (121, 110)
    assert run.rank_busy == (4 * 27, 4 * 25)  # the work is the same, only its order moved
    # A send time past the action's end counts as its end.
    late = dict.fromkeys(sends, 99.0)
    assert simulate(one_f_one_b(2, 4), lambda k, m, s: cost[k][s], sends=late).makespan == 131


def test_bad_send_times_get_clear_errors():
    table = gpipe(2, 2)
    with pytest.raises(ValueError, match=r"names \('B', 5, 1\), which the schedule"):
        simulate(table, lambda *_: 1.0, sends={("B", 5, 1): 0.5})
    with pytest.raises(ValueError, match=r"send time of \('B', 0, 1\) must be"):
        simulate(table, lambda *_: 1.0, sends={("B", 0, 1): -0.5})
    with pytest.raises(ValueError, match=r"send time of \('B', 0, 1\) must be"):
        simulate(table, lambda *_: 1.0, sends={("B", 0, 1): True})  # a flag, not seconds
    with pytest.raises(TypeError, match="`sends` must be a mapping"):
        simulate(table, lambda *_: 1.0, sends=[0.5])  # type: ignore[arg-type]


def test_latency_delays_every_cross_rank_input():
    table = gpipe(2, 1)  # F(stage 0), F(stage 1), B(stage 1), B(stage 0): two messages
    run = simulate(table, lambda kind, m, s: 1.0, latency=0.5)
    assert run.makespan == 4 + 2 * 0.5


def test_costs_as_a_mapping_and_bad_costs_get_clear_errors():
    table = gpipe(2, 2)
    costs = {(a.kind, a.micro_batch, a.stage): 1.0 for a in table.actions}
    assert simulate(table, costs).makespan == simulate(table, lambda *_: 1.0).makespan
    missing = dict(costs)
    del missing[("B", 1, 0)]
    with pytest.raises(KeyError, match=r"no entry for B\(m=1, stage 0\)"):
        simulate(table, missing)
    with pytest.raises(ValueError, match=r"cost of F\(m=0, stage 0\) must be"):
        simulate(table, {**costs, ("F", 0, 0): -1.0})
    with pytest.raises(ValueError, match="latency"):
        simulate(table, costs, latency=float("nan"))
    with pytest.raises(TypeError, match="mapping keyed"):
        simulate(table, [1.0])  # type: ignore[arg-type]


def test_a_schedule_that_deadlocks_is_refused():
    # Rank 0 runs its B before the forward it differentiates.
    actions = (Action(0, 0, "B", 0, 0), Action(0, 2, "F", 0, 0))
    table = Schedule("bad", 1, 1, (0,), actions, (1,))
    with pytest.raises(ScheduleError):
        simulate(table, lambda *_: 1.0)


# ---- zero-bubble ordered on measured costs ---------------------------------------------------


def _fscale_1f1b(costs, p, m):
    """fscale's 1F1B on the clock of `costs`: each B costs B + W and, on every stage fed by
    another, sends its input's gradient after B (the weights' products follow)."""
    return simulate(
        one_f_one_b(p, m),
        lambda kind, _, s: costs["F"][s] if kind == "F" else costs["B"][s] + costs["W"][s],
        sends={("B", mb, s): costs["B"][s] for mb in range(m) for s in range(1, p)},
    )


@given(p=st.integers(2, 5), m=st.integers(1, 9), data=st.data())
def test_zero_bubble_on_measured_costs_is_never_slower_than_1f1b_with_the_early_send(p, m, data):
    seconds = st.one_of(st.just(0.0), st.floats(0.0, 5.0, allow_nan=False))
    costs = {kind: data.draw(st.lists(seconds, min_size=p, max_size=p)) for kind in "FBW"}
    clock = lambda kind, _, s: costs[kind][s]  # noqa: E731
    one = _fscale_1f1b(costs, p, m).makespan
    # The unit-clock table runs exactly as fscale's 1F1B, whose B already sends early.
    assert simulate(zero_bubble(p, m), clock).makespan == pytest.approx(one)
    table = zero_bubble(p, m, costs)
    assert simulate(table, clock).makespan <= one + 1e-9
    assert max(activation_peaks(table)) <= min(p, m)  # no rank holds more than 1F1B's peak
    assert zero_bubble(p, m, costs) == table  # every rank given the costs builds this table


def test_zero_bubble_on_measured_costs_holds_weights_back_where_that_is_shorter():
    # The bench GPT's shape at P = 4: stage 0's B computes every gradient (its W is all but
    # free), the others' B sends after 5 of their 8 ms.
    costs = {"F": [5.0] * 4, "B": [7.9, 5.0, 5.0, 5.0], "W": [0.0, 3.0, 3.0, 3.0]}
    table = zero_bubble(4, 4, costs)
    assert simulate(table, lambda kind, _, s: costs[kind][s]).makespan == pytest.approx(72.9)
    assert _fscale_1f1b(costs, 4, 4).makespan == pytest.approx(81.9)
    assert table.activation_bound == (4, 4, 4, 4)
    last = [f"{a.kind}{a.micro_batch}" for a in table.rank_actions(3)]
    assert last == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0", "W1", "W2", "W3"]
    # With no weight work to hold back, holding back gains nothing: the unit table is kept.
    no_weights = {"F": [1.0, 1.0], "B": [2.0, 2.0], "W": [0.0, 0.0]}
    assert zero_bubble(2, 4, no_weights) == zero_bubble(2, 4)
    # On unit costs the later stage's W's wait for its B's: 13 ticks against 14.
    unit = {"F": [1.0, 1.0], "B": [1.0, 1.0], "W": [1.0, 1.0]}
    clock = lambda kind, _, s: unit[kind][s]  # noqa: E731
    assert simulate(zero_bubble(2, 4, unit), clock).makespan == 13
    assert simulate(zero_bubble(2, 4), clock).makespan == 14


def test_bad_costs_for_zero_bubble_get_clear_errors():
    with pytest.raises(ScheduleError, match="must map 'F', 'B' and 'W'"):
        zero_bubble(2, 4, [1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"exactly the keys 'F', 'B' and 'W', got \['B', 'F'\]"):
        zero_bubble(2, 4, {"F": [1.0, 1.0], "B": [1.0, 1.0]})
    with pytest.raises(ScheduleError, match=r"costs\['W'\]` must hold one cost per stage \(2\)"):
        zero_bubble(2, 4, {"F": [1.0, 1.0], "B": [1.0, 1.0], "W": [1.0]})
    with pytest.raises(ScheduleError, match=r"costs\['B'\]\[1\]` must be a finite number"):
        zero_bubble(2, 4, {"F": [1.0, 1.0], "B": [1.0, -1.0], "W": [1.0, 1.0]})
    with pytest.raises(ScheduleError, match=r"costs\['F'\]\[0\]` must be a finite number"):
        zero_bubble(2, 4, {"F": [float("inf"), 1.0], "B": [1.0, 1.0], "W": [1.0, 1.0]})
