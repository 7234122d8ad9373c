"""fscale.parallel.pipeline.simulate: a schedule on a real clock, from each action's cost."""

from __future__ import annotations

import pytest

from fscale.parallel.pipeline import (
    ScheduleError,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    zero_bubble,
)
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
