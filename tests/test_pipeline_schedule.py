"""Pipeline schedules as data: the four builders, the text table, the simulation check, and a
schedule written by the user."""

from __future__ import annotations

import pytest

from fscale.parallel.pipeline.builders import gpipe, interleaved, one_f_one_b, zero_bubble
from fscale.parallel.pipeline.check import activation_peaks, check_schedule
from fscale.parallel.pipeline.schedule import Action, Schedule, ScheduleError, from_orders

CASES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 4, 5, 8)]


@pytest.mark.parametrize(("p", "m"), CASES)
def test_builders_simulate_and_meet_their_bounds(p, m):
    for build in (gpipe, one_f_one_b, zero_bubble):
        schedule = build(p, m)
        check_schedule(schedule)
        assert activation_peaks(schedule) == schedule.activation_bound
        assert len(schedule.actions) == (3 if schedule.split else 2) * p * m
    if m % p == 0:
        for v in (1, 2, 3):
            schedule = interleaved(p, m, v)
            check_schedule(schedule)
            assert schedule.num_stages == p * v
            assert schedule.stage_ranks == tuple(s % p for s in range(p * v))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4), (3, 6)])
def test_bubbles_and_memory_as_stated(p, m):
    analytic = (p - 1) / (m + p - 1)
    assert gpipe(p, m).bubble_fraction() == pytest.approx(analytic)
    assert one_f_one_b(p, m).bubble_fraction() == pytest.approx(analytic)
    assert zero_bubble(p, m).bubble_fraction() < one_f_one_b(p, m).bubble_fraction()
    assert interleaved(p, m, 2).bubble_fraction() < one_f_one_b(p, m).bubble_fraction()
    # 1F1B and ZB-H1 hold at most P - r micro-batches, GPipe all M.
    assert activation_peaks(one_f_one_b(p, m)) == tuple(min(p - r, m) for r in range(p))
    assert activation_peaks(zero_bubble(p, m)) == activation_peaks(one_f_one_b(p, m))
    assert activation_peaks(gpipe(p, m)) == (m,) * p


def test_text_shows_one_row_per_rank():
    text = one_f_one_b(2, 4).text()
    lines = text.splitlines()
    assert lines[0].startswith("1f1b: 2 ranks, 2 stages, 4 micro-batches, 15 ticks, bubble 20.0%")
    assert lines[1] == "rank 0 | F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3"
    assert lines[2] == "rank 1 | .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. .."
    assert str(one_f_one_b(2, 4)) == text
    assert "F0.1" in interleaved(2, 2, 2).text()


def _replace(schedule: Schedule, old: Action, new: Action) -> Schedule:
    actions = tuple(new if a == old else a for a in schedule.actions)
    return Schedule(
        schedule.name,
        schedule.num_ranks,
        schedule.micro_batches,
        schedule.stage_ranks,
        actions,
        schedule.activation_bound,
    )


def test_a_late_send_is_named():
    schedule = gpipe(2, 2)
    first = next(a for a in schedule.actions if a.rank == 1 and a.kind == "F")
    early = first._replace(tick=0)
    bad = _replace(schedule, first, early)
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 receives the activation for F\(m=0, stage 1\) "
        r"at tick 0, but rank 0 sends it only after F\(m=0, stage 0\) ends at tick 1",
    ):
        check_schedule(bad)


def test_a_rank_waiting_on_itself_is_named():
    schedule = gpipe(1, 1)
    forward = next(a for a in schedule.actions if a.kind == "F")
    bad = _replace(schedule, forward, forward._replace(tick=5))  # after its own backward
    with pytest.raises(
        ScheduleError,
        match=r"rank 0 waits on itself: B\(m=0, stage 0\) at tick "
        r"1 needs F\(m=0, stage 0\), which the same rank runs at tick 5",
    ):
        check_schedule(bad)


def test_missing_duplicate_and_misplaced_actions_are_refused():
    schedule = one_f_one_b(2, 2)
    dropped = Schedule("x", 2, 2, (0, 1), schedule.actions[1:], (2, 1))
    with pytest.raises(ScheduleError, match=r"never runs"):
        check_schedule(dropped)
    moved = _replace(schedule, schedule.actions[0], schedule.actions[0]._replace(rank=1))
    with pytest.raises(ScheduleError, match="stage 0 is held by rank 0"):
        check_schedule(moved)
    tight = Schedule("tight", 2, 2, (0, 1), schedule.actions, (1, 1))
    with pytest.raises(ScheduleError, match="above the schedule's stated bound of 1"):
        check_schedule(tight)


def test_deadlocking_orders_name_the_first_conflict():
    # Rank 1 wants the backward of micro-batch 0 before running its forward: it waits on itself.
    orders = [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 1), ("F", 0, 1)]]
    with pytest.raises(
        ScheduleError,
        match=r"rank 1: B\(m=0, stage 1\) waits for F\(m=0, "
        r"stage 1\), which it runs itself only later",
    ):
        from_orders("bad", orders, micro_batches=1, stage_ranks=[0, 1], activation_bound=[1, 1])


def eager_1f1b(num_ranks: int, micro_batches: int) -> Schedule:
    """A schedule of one's own: 1F1B whose every rank warms up with as many forwards as it may
    (P − r), trading memory for an earlier start of the steady state."""
    orders = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r, micro_batches)
        order = [("F", i, r) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            order += [("B", i, r), ("F", warmup + i, r)]
        order += [("B", i, r) for i in range(micro_batches - warmup, micro_batches)]
        orders.append(order)
    bound = [min(num_ranks - r, micro_batches) for r in range(num_ranks)]
    return from_orders(
        "eager_1f1b",
        orders,
        micro_batches=micro_batches,
        stage_ranks=range(num_ranks),
        activation_bound=bound,
    )


def test_a_user_builder_is_a_schedule_like_the_others():
    schedule = eager_1f1b(4, 8)
    check_schedule(schedule)
    assert schedule.name == "eager_1f1b"
    assert schedule.bubble_fraction() == pytest.approx(one_f_one_b(4, 8).bubble_fraction())


def test_builder_arguments_are_checked():
    with pytest.raises(ScheduleError, match="`micro_batches` must be a positive int"):
        gpipe(2, 0)
    with pytest.raises(ScheduleError, match="must be a multiple of the 2 ranks"):
        interleaved(2, 3)
    with pytest.raises(TypeError, match="`schedule` must be a Schedule"):
        check_schedule("1f1b")  # type: ignore[arg-type]
