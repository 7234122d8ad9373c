"""fs.pipeline across processes: exact against unpipelined training for every schedule, the
state's full form, dropout keys, composition with data parallelism and accumulation, and the
errors a wrong pipeline gets."""

from __future__ import annotations

import functools
import pathlib
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fscale as fs
from fscale import random as fsrandom
from fscale.parallel.pipeline import ScheduleError, StageContractError, pipeline, zero_bubble
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd


def _mlp(num_stages: int, width: int, seed: int, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(num_stages):
        layers += [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def _mse(out, targets):
    return ((out - targets) ** 2).mean()


def _batch(seed: int, size: int, width: int):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)


def _reference(model, batch, steps, micro_batches=1, optimizer=None):
    """Unpipelined training, each layer keyed as the pipeline keys it: (micro-batch, layer)."""
    apply_layers = [fs.functionalize(layer) for layer in model]
    names = [name for name, _ in model.named_children()]
    _, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, data, key):
        x = data[0]
        for index, (name, (apply, lp, lb)) in enumerate(zip(names, apply_layers)):
            own = {k: p[f"{name}.{k}"] for k in lp}
            x, _ = apply(
                own, {k: b[f"{name}.{k}"] for k in lb}, x, key=fsrandom.fold_in(key, index)
            )
        return _mse(x, data[1])

    step = fs.train_step(loss_fn, optimizer or fs.optim.adam(1e-2))
    if micro_batches > 1:
        step = fs.accumulate(step, micro_batches)
    state = step.init(params, buffers)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def _two_stages(model, **options):
    """`model` pipelined over 2 ranks, 2 layers per stage, 4 micro-batches, Adam."""
    return pipeline(
        model,
        _mse,
        fs.optim.adam(1e-2),
        fs.Mesh(pp=2),
        micro_batches=4,
        balance=[2, 2],
        **options,
    )


def _train(step, params, buffers, batch, steps):
    state = step.init(params, buffers)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


# ---- exactness -----------------------------------------------------------------------------


def _pipelined_vs_unpipelined(schedule, num_ranks, micro_batches, width, seed, checkpoint):
    virtual = 2 if schedule == "interleaved" else 1
    num_stages = num_ranks * virtual
    model = _mlp(num_stages, width, seed)
    _, params, buffers = fs.functionalize(model)
    batch = _batch(seed, 2 * micro_batches, width)
    step = pipeline(
        model,
        _mse,
        fs.optim.adam(1e-2),
        fs.Mesh(pp=num_ranks),
        micro_batches=micro_batches,
        schedule=schedule,
        balance=[2] * num_stages,
        checkpoint=checkpoint,
    )
    state, losses = _train(step, params, buffers, batch, 3)
    full = fs.consolidate(step, state)
    expected, expected_losses = _reference(model, batch, 3)
    return full.params, expected.params, full.opt_state, expected.opt_state, losses, expected_losses


@given(
    num_ranks=st.sampled_from([2, 4]),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble"]),
    micro_batches=st.sampled_from([1, 2, 4, 8]),
    width=st.integers(2, 9),
    seed=st.integers(0, 2**16),
    checkpoint=st.sampled_from(["always", "except_last", "never"]),
)
def test_pipeline_equals_unpipelined_training(
    num_ranks, schedule, micro_batches, width, seed, checkpoint
):
    if schedule == "interleaved" and micro_batches % num_ranks:
        micro_batches = num_ranks
    results = run_spmd(
        _pipelined_vs_unpipelined,
        num_ranks,
        schedule,
        num_ranks,
        micro_batches,
        width,
        seed,
        checkpoint,
    )
    for params, expected, opt_state, expected_opt, losses, expected_losses in results:
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)
        assert_trees_close(opt_state, expected_opt, rtol=1e-4, atol=1e-7)
        assert losses == pytest.approx(expected_losses, rel=1e-5)


# The bench GPT's shape at P = 4 (stage 0's W all but free): the later stages hold W's back.
_MEASURED = {"F": [5.0] * 4, "B": [7.9, 5.0, 5.0, 5.0], "W": [0.0, 3.0, 3.0, 3.0]}


def test_a_zero_bubble_table_ordered_on_measured_costs_trains_as_unpipelined():
    builder = functools.partial(zero_bubble, costs=_MEASURED)
    assert builder(4, 4) != zero_bubble(4, 4)  # another order than the unit-clock table's
    for params, expected, opt_state, expected_opt, losses, expected_losses in run_spmd(
        _pipelined_vs_unpipelined, 4, builder, 4, 4, 5, 7, "never"
    ):
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)
        assert_trees_close(opt_state, expected_opt, rtol=1e-4, atol=1e-7)
        assert losses == pytest.approx(expected_losses, rel=1e-5)


def _costs_that_differ_by_rank():
    rank = torch.distributed.get_rank()  # rank 2 builds the unit-clock table, the others not
    model = _mlp(4, 3, 0)
    _, params, buffers = fs.functionalize(model)
    step = pipeline(
        model,
        _mse,
        fs.optim.sgd(0.1),
        fs.Mesh(pp=4),
        micro_batches=4,
        schedule=functools.partial(zero_bubble, costs=_MEASURED if rank != 2 else None),
        balance=[2] * 4,
    )
    try:
        step.init(params, buffers)
    except ValueError as error:
        return str(error)
    return None


def test_ranks_that_build_different_tables_fail_at_init_on_every_rank():
    for rank, message in enumerate(run_spmd(_costs_that_differ_by_rank, 4)):
        assert message is not None, f"rank {rank} raised nothing"
        assert "disagree on the schedule: rank 0 and rank 2 of the axis differ" in message
        # The first line that differs, both ways round.
        assert "'activation bound: (4, 4, 4, 4)' vs 'activation bound: (4, 3, 2, 1)'" in message
        assert "the same costs" in message


# ---- the full state ------------------------------------------------------------------------


def _consolidate_and_continue():
    model = _mlp(2, 5, 0)
    _, params, buffers = fs.functionalize(model)
    batch = _batch(0, 8, 5)
    step = _two_stages(model)
    state, _ = _train(step, params, buffers, batch, 2)
    full = fs.consolidate(step, state)
    again = fs.shard_state(step, full)
    # The full state continues in an unpipelined step.
    reference, _ = _reference(model, batch, 3)
    apply, _, _ = fs.functionalize(model)
    plain = fs.train_step(lambda p, b, d, k: _mse(apply(p, b, d[0])[0], d[1]), fs.optim.adam(1e-2))
    continued, _ = plain(full, batch)
    return sorted(full.params), sorted(params), again, state, continued.params, reference.params


def test_consolidate_gives_the_sequential_names_and_a_state_that_continues():
    for names, expected_names, again, state, continued, reference in run_spmd(
        _consolidate_and_continue, 2
    ):
        assert names == expected_names == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert_trees_equal(again, state)
        assert_trees_close(continued, reference, rtol=1e-5, atol=1e-6)


def _donated_and_pure(schedule):
    model = _mlp(2, 5, 2)
    _, params, buffers = fs.functionalize(model)
    batch = _batch(2, 8, 5)
    results = []
    for donate in (False, True):
        step = _two_stages(model, schedule=schedule, donate=donate)
        state = step.init(params, buffers)
        for _ in range(2):
            before = {t.data_ptr() for t in fs.tree.leaves(state.params)}
            state, _ = step(state, batch)
            after = {t.data_ptr() for t in fs.tree.leaves(state.params)}
        results.append((state, before == after))
    return results


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_donated_pipeline_updates_in_place_and_equals_the_pure_one(schedule):
    for (pure, pure_in_place), (donated, donated_in_place) in run_spmd(
        _donated_and_pure, 2, schedule
    ):
        assert_trees_equal(donated, pure)
        assert donated_in_place and not pure_in_place


def _function_stages():
    torch.manual_seed(0)
    w0, w1 = torch.randn(4, 6), torch.randn(6, 3)

    def first(p, b, x, key):
        return torch.tanh(x @ p["w"]), b

    def last(p, b, x, key):
        return x @ p["w"]  # buffers unchanged: the output alone

    batch = _batch(3, 6, 4)
    targets = torch.randn(6, 3)
    step = pipeline(
        [first, last], _mse, fs.optim.sgd(0.1), fs.Mesh(pp=2), micro_batches=3, schedule="gpipe"
    )
    state, _ = _train(step, [{"w": w0}, {"w": w1}], None, (batch[0], targets), 2)
    full = fs.consolidate(step, state)

    def loss_fn(p, b, data, key):
        return _mse(torch.tanh(data[0] @ p[0]["w"]) @ p[1]["w"], data[1])

    plain = fs.train_step(loss_fn, fs.optim.sgd(0.1))
    expected, _ = _train(plain, [{"w": w0}, {"w": w1}], None, (batch[0], targets), 2)
    return full.params, expected.params


def test_function_stages_hold_their_own_pytrees():
    for params, expected in run_spmd(_function_stages, 2):
        assert isinstance(params, list) and len(params) == 2
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)


def _dropout_any_split(balance, schedule):
    model = _mlp(2, 6, 1, dropout=0.5)
    _, params, buffers = fs.functionalize(model)
    batch = _batch(1, 8, 6)
    step = pipeline(
        model,
        _mse,
        fs.optim.adam(1e-2),
        fs.Mesh(pp=2),
        micro_batches=4,
        balance=balance,
        schedule=schedule,
    )
    state, _ = _train(step, params, buffers, batch, 2)
    expected, _ = _reference(model, batch, 2, micro_batches=4)
    return fs.consolidate(step, state).params, expected.params


def test_dropout_masks_do_not_depend_on_the_balance_or_schedule():
    a = run_spmd(_dropout_any_split, 2, [3, 3], "1f1b")[0]
    b = run_spmd(_dropout_any_split, 2, [1, 5], "zero_bubble")[0]
    assert_trees_close(a[0], a[1], rtol=1e-5, atol=1e-6)  # keyed as (micro-batch, layer)
    assert_trees_close(a[0], b[0], rtol=1e-5, atol=1e-6)


def _recomputed_micro_batches(schedule, checkpoint):
    model = _mlp(2, 4, 3)
    _, params, buffers = fs.functionalize(model)
    step = _two_stages(model, schedule=schedule, checkpoint=checkpoint)
    state = step.init(params, buffers)
    with fs.remat.track() as stats, fs.parallel.pipeline.record_timeline() as timeline:
        _, metrics = step(state, _batch(3, 8, 4))
    return stats.recomputations, timeline.steps[0].activation_peak, float(metrics["loss"])


@pytest.mark.parametrize(
    ("schedule", "except_last"), [("gpipe", [3, 3]), ("1f1b", [3, 0]), ("zero_bubble", [3, 0])]
)
def test_the_checkpoint_mode_says_which_micro_batches_are_recomputed(schedule, except_last):
    # Inside the step's gradient phase, where a plain step's last checkpointed call keeps what
    # it saved (fscale.remat.keep_last), the mode alone decides: every micro-batch; all but the
    # last and those whose backward is the rank's next action (every one on 1F1B's and ZB-H1's
    # last stage), which keep their activations no longer than a recompute would; none.
    runs = {
        mode: run_spmd(_recomputed_micro_batches, 2, schedule, mode)
        for mode in ("always", "except_last", "never")
    }
    assert [r[0] for r in runs["always"]] == [4, 4]
    assert [r[0] for r in runs["except_last"]] == except_last
    assert [r[0] for r in runs["never"]] == [0, 0]
    if except_last[1] == 0:
        # A last stage that recomputes nothing holds what keeping every activation holds (one
        # micro-batch's), below recomputing each (its input and the recomputed activations).
        assert runs["except_last"][1][1] == runs["never"][1][1] < runs["always"][1][1]
    assert len({r[2] for mode in runs.values() for r in mode}) == 1  # the same loss


def test_back_to_back_names_the_forwards_the_rank_differentiates_next():
    from fscale.parallel.pipeline import builders

    assert [builders.gpipe(2, 4).back_to_back(r) for r in range(2)] == [{(3, 0)}, {(3, 1)}]
    last = {(m, 3) for m in range(8)}
    assert [builders.one_f_one_b(4, 8).back_to_back(r) for r in range(4)] == [set()] * 3 + [last]
    # Split: F, B and W of the micro-batch in a row (ZB-H1's last stage).
    zb = builders.zero_bubble(2, 4)
    assert [zb.back_to_back(r) for r in range(2)] == [set(), {(m, 1) for m in range(4)}]
    # Interleaved: only the rank holding the last stage, for that stage.
    chunks = builders.interleaved(2, 4)
    assert [chunks.back_to_back(r) for r in range(2)] == [set(), {(m, 3) for m in range(4)}]


def test_one_process_is_the_one_stage_case():
    model = _mlp(1, 4, 2)
    _, params, buffers = fs.functionalize(model)
    batch = _batch(2, 6, 4)
    step = pipeline(model, _mse, fs.optim.adam(1e-2), fs.Mesh(pp=1), micro_batches=3, balance=[2])
    state, losses = _train(step, params, buffers, batch, 3)
    expected, expected_losses = _reference(model, batch, 3)
    assert_trees_close(fs.consolidate(step, state).params, expected.params, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    assert "pipeline(axis='pp' of size 1, schedule='1f1b'" in repr(step)


# ---- composition ---------------------------------------------------------------------------


def _pp_dp(kind):
    mesh = fs.Mesh(dp=2, pp=2)
    model = _mlp(2, 5, 4)
    _, params, buffers = fs.functionalize(model)
    data = _batch(4, 16, 5)
    dp_rank = mesh.rank("dp")
    local = (data[0][dp_rank * 8 : (dp_rank + 1) * 8], data[1][dp_rank * 8 : (dp_rank + 1) * 8])
    if kind == "outer_data_parallel":
        step = pipeline(model, _mse, fs.optim.adam(1e-2), mesh, micro_batches=4, balance=[2, 2])
        step = fs.data_parallel(step, mesh, "dp")
    elif kind == "accumulate":
        step = pipeline(
            model,
            _mse,
            fs.optim.adam(1e-2),
            mesh,
            micro_batches=2,
            balance=[2, 2],
            per_stage=lambda s: fs.data_parallel(s, mesh, "dp"),
        )
        step = fs.accumulate(step, 2)
    else:
        wrap = {
            "data_parallel": fs.data_parallel,
            "shard_optimizer": fs.shard_optimizer,
            "fully_shard": fs.fully_shard,
        }[kind]
        step = pipeline(
            model,
            _mse,
            fs.optim.adam(1e-2),
            mesh,
            micro_batches=4,
            balance=[2, 2],
            per_stage=lambda s: wrap(s, mesh, "dp"),
        )
    state, losses = _train(step, params, buffers, local, 3)
    expected, expected_losses = _reference(model, data, 3)
    return fs.consolidate(step, state), expected, losses, expected_losses


@pytest.mark.parametrize(
    "kind", ["data_parallel", "shard_optimizer", "fully_shard", "outer_data_parallel", "accumulate"]
)
def test_pipeline_times_data_parallel_on_2x2_equals_one_process(kind):
    for full, expected, losses, expected_losses in run_spmd(_pp_dp, 4, kind):
        assert sorted(full.params) == sorted(expected.params)
        assert_trees_close(full.params, expected.params, rtol=1e-5, atol=1e-6)
        assert_trees_close(full.opt_state, expected.opt_state, rtol=1e-4, atol=1e-7)
        assert losses == pytest.approx(expected_losses, rel=1e-5)


# ---- bad input -----------------------------------------------------------------------------


def _mismatched_stages():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(6, 3))  # 5 out, 6 in: disagree
    _, params, buffers = fs.functionalize(model)
    step = pipeline(model, _mse, fs.optim.sgd(0.1), fs.Mesh(pp=2), micro_batches=2, balance=[1, 1])
    state = step.init(params, buffers)
    try:
        step(state, (torch.randn(4, 4), torch.randn(4, 3)))
    except StageContractError as error:
        return str(error)
    return None


def test_stages_that_disagree_fail_on_every_rank_naming_both():
    for message in run_spmd(_mismatched_stages, 2):
        assert message is not None
        assert "stage 1 (rank 1 along 'pp') failed on stage 0's output (a tensor of shape " in (
            message
        )
        assert "(2, 5) and dtype torch.float32)" in message and "mat1 and mat2" in message


def test_bad_arguments_get_clear_errors():
    model = _mlp(2, 4, 0)
    mesh = fs.Mesh(pp=1)
    opt = fs.optim.sgd(0.1)
    with pytest.raises(ValueError, match=r"`balance` \[1, 2\] sums to 3, but the model has 4"):
        pipeline(model, _mse, opt, mesh, micro_batches=2, balance=[1, 2])
    with pytest.raises(ValueError, match="needs `balance`"):
        pipeline(model, _mse, opt, mesh, micro_batches=2)
    with pytest.raises(ValueError, match=r"2 stages were given but the schedule '1f1b' on 1 ranks"):
        pipeline(model, _mse, opt, mesh, micro_batches=2, balance=[2, 2])
    with pytest.raises(ValueError, match="`checkpoint` must be one of"):
        pipeline(model, _mse, opt, mesh, micro_batches=2, balance=[4], checkpoint="sometimes")
    with pytest.raises(ValueError, match="`micro_batches` must be a positive int"):
        pipeline(model, _mse, opt, mesh, micro_batches=0, balance=[4])
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        pipeline(model, _mse, opt, mesh, micro_batches=2, balance=[4], schedule="pipedream")
    with pytest.raises(ValueError, match="axis"):
        pipeline(model, _mse, opt, fs.Mesh(dp=1), micro_batches=2, balance=[4])
    step = pipeline(model, _mse, opt, mesh, micro_batches=4, balance=[4])
    state = step.init(*fs.functionalize(model)[1:])
    with pytest.raises(
        ValueError, match=r"batch of 6 samples does not split into `micro_batches`=4"
    ):
        step(state, (torch.randn(6, 4), torch.randn(6, 4)))
    with pytest.raises(TypeError, match=r"a pair \(inputs, targets\)"):
        step(state, torch.randn(8, 4))


def test_a_deadlocking_schedule_is_refused_before_any_collective():
    from fscale.parallel.pipeline import Schedule, gpipe

    table = gpipe(1, 2)
    forward = next(a for a in table.actions if a.kind == "F" and a.micro_batch == 0)
    bad = Schedule(
        "mine",
        1,
        2,
        (0,),
        tuple(a._replace(tick=9) if a == forward else a for a in table.actions),
        (2,),
    )
    with pytest.raises(ScheduleError, match="schedule 'mine' deadlocks: rank 0 waits on itself"):
        pipeline(
            _mlp(1, 4, 0),
            _mse,
            fs.optim.sgd(0.1),
            fs.Mesh(pp=1),
            micro_batches=2,
            balance=[2],
            schedule=bad,
        )


def _fully_sharded_stages_hold_shards():
    mesh = fs.Mesh(dp=2, pp=2)
    model = _mlp(2, 5, 4)
    _, params, buffers = fs.functionalize(model)
    step = pipeline(
        model,
        _mse,
        fs.optim.adam(1e-2),
        mesh,
        micro_batches=2,
        balance=[2, 2],
        per_stage=lambda s: fs.fully_shard(s, mesh, "dp"),
    )
    state = step.init(params, buffers)
    again = fs.shard_state(step, fs.consolidate(step, state))
    return {name: tuple(shard.shape) for name, shard in state.params.items()}, state, again


def test_fully_sharded_stages_hold_one_shard_of_each_layer():
    results = run_spmd(_fully_sharded_stages_hold_shards, 4)
    for rank, (shapes, state, again) in enumerate(results):
        # pp index = rank % 2 (dp outermost): stage 0 holds layer "0", stage 1 layer "2";
        # each Linear(5, 5) (30 values) is a unit split over the two dp ranks (each shard
        # padded to the flat layout's alignment).
        ((name, (size,)),) = shapes.items()
        assert name == str(2 * (rank % 2)) and 2 * size >= 30
        assert_trees_equal(again, state)


def test_accumulating_inside_a_stage_is_refused_with_the_fix():
    model = _mlp(1, 4, 0)
    with pytest.raises(ValueError, match=r"accumulate around the pipeline instead"):
        pipeline(
            model,
            _mse,
            fs.optim.sgd(0.1),
            fs.Mesh(pp=1),
            micro_batches=2,
            balance=[2],
            per_stage=lambda s: fs.accumulate(s, 2),
        )


def test_sharding_outside_the_pipeline_is_refused_with_the_fix():
    model = _mlp(1, 4, 0)
    mesh = fs.Mesh(pp=1, dp=1)
    step = pipeline(model, _mse, fs.optim.sgd(0.1), mesh, micro_batches=2, balance=[2])
    step = fs.shard_optimizer(step, mesh, "dp")
    with pytest.raises(ValueError, match="shard each stage instead"):
        step.init(*fs.functionalize(model)[1:])


def _token_weighted():
    model = _mlp(2, 4, 5)
    _, params, buffers = fs.functionalize(model)
    x, t = _batch(5, 8, 4)
    mask = torch.zeros(8, 4)
    mask[0, :1] = 1  # micro-batches hold 1, 8, 3 and 16 items: uneven on purpose
    mask[2:4, :] = 1
    mask[4:6, :2] = 1
    mask[4, 2] = 0
    mask[5, :] = 0
    mask[4, :3] = 1
    mask[6:, :] = 1

    def masked(out, targets):
        target, weights = targets
        count = weights.sum()
        return (((out - target) ** 2) * weights).sum() / count, count

    step = pipeline(
        model, masked, fs.optim.sgd(0.1), fs.Mesh(pp=2), micro_batches=4, balance=[2, 2]
    )
    state, losses = _train(step, params, buffers, (x, (t, mask)), 2)
    apply, _, _ = fs.functionalize(model)

    def global_mean(p, b, data, key):
        out = apply(p, b, data[0])[0]
        return (((out - data[1]) ** 2) * mask).sum() / mask.sum()

    expected, expected_losses = _train(
        fs.train_step(global_mean, fs.optim.sgd(0.1)), params, buffers, (x, t), 2
    )
    return fs.consolidate(step, state).params, expected.params, losses, expected_losses


def test_a_loss_that_counts_its_tokens_is_reduced_by_the_global_count():
    for params, expected, losses, expected_losses in run_spmd(_token_weighted, 2):
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)
        assert losses == pytest.approx(expected_losses, rel=1e-5)


def _user_schedule():
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from test_pipeline_schedule import eager_1f1b  # the builder the schedule tests define

    model = _mlp(2, 4, 6)
    _, params, buffers = fs.functionalize(model)
    batch = _batch(6, 8, 4)
    step = _two_stages(model, schedule=eager_1f1b)
    state, _ = _train(step, params, buffers, batch, 2)
    expected, _ = _reference(model, batch, 2)
    return fs.consolidate(step, state).params, expected.params, repr(step)


def test_a_schedule_of_ones_own_runs_like_the_built_in_ones():
    for params, expected, description in run_spmd(_user_schedule, 2):
        assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)
        assert "schedule='eager_1f1b'" in description
