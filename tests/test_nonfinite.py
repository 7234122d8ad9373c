"""on_nonfinite: a NaN in one rank's gradient is seen by every rank, which all skip or all raise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale import models, nonfinite
from fscale.testing import assert_trees_equal, run_spmd

BAD_STEP = 1
STEPS = 3


def _loss_fn(apply, first, inject_rank):
    def loss_fn(params, buffers, batch, key):
        x, y, step = batch[0], batch[1], int(batch[2][0])
        out, _ = apply(params, buffers, x)
        loss = torch.nn.functional.mse_loss(out, y)
        if step == BAD_STEP:
            # Every rank adds sqrt(0 * w + c) - sqrt(c), which is 0; where c is 0 (the
            # injecting rank) its gradient is 0 * inf = NaN, elsewhere 0. Every rank runs the
            # same ops, so a fully sharded step gathers the same units everywhere.
            bad = inject_rank is None or dist.get_rank() == inject_rank
            c = 0.0 if bad else 1.0
            loss = loss + (params[first].reshape(-1)[0] * 0.0 + c).sqrt() - c**0.5
        return loss

    return loss_fn


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g), torch.full((4,), step)


def _strategy(step, name, mesh):
    if name == "data_parallel":
        return fs.data_parallel(step, mesh)
    if name == "shard_optimizer":
        return fs.shard_optimizer(step, mesh)
    if name == "fully_shard":
        return fs.fully_shard(step, mesh)
    return fs.accumulate(fs.data_parallel(step, mesh), 2)


def _train(strategy, policy, inject_rank):
    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params, buffers = fs.functionalize(models.mlp([6, 8, 3], seed=0))
    first = next(iter(params))
    step = fs.train_step(
        _loss_fn(apply, first, inject_rank), fs.optim.adamw(1e-2), on_nonfinite=policy
    )
    step = _strategy(step, strategy, fs.Mesh(dp=world))
    state = step.init(params, buffers)
    history, skipped = [], []
    for i in range(STEPS):
        history.append(state.params)
        try:
            state, metrics = step(state, _batch(i, rank))
        except nonfinite.NonFiniteGradientError as error:
            return "raised", str(error), int(state.step)
        skipped.append(float(metrics.get("skipped", -1.0)))
    full = fs.consolidate(step, state)
    return history, state.params, skipped, int(state.step), full.params


@pytest.mark.parametrize(
    "strategy", ["data_parallel", "shard_optimizer", "fully_shard", "accumulate"]
)
def test_nan_on_one_rank_is_skipped_by_every_rank(strategy):
    results = run_spmd(_train, 2, strategy, "skip", 1)
    for history, params, skipped, count, _ in results:
        assert skipped == [0.0, 1.0, 0.0]
        assert count == STEPS  # the step counter advances on a skipped step
        assert_trees_equal(history[BAD_STEP + 1], history[BAD_STEP])  # nothing moved
        name = next(iter(history[0]))
        assert not torch.equal(history[1][name], history[0][name])  # a good step does move
        assert all(bool(torch.isfinite(p).all()) for p in params.values())
    assert_trees_equal(results[0][4], results[1][4])  # the replicas agree


def test_a_skipped_step_leaves_the_optimizer_count_where_it_was():
    """Skipping = the step never happened for the optimizer: the run equals one without it."""
    (_, _, _, _, skipped_run), _ = run_spmd(_train, 2, "data_parallel", "skip", 1)
    # The same run where the bad step's gradient is finite but skipped cannot be built, so
    # compare with a local run whose second step is left out by hand.
    apply, params, buffers = fs.functionalize(models.mlp([6, 8, 3], seed=0))
    first = next(iter(params))
    step = fs.train_step(_loss_fn(apply, first, None), fs.optim.adamw(1e-2))
    state = step.init(params, buffers)
    for i in (0, 2):
        x = torch.cat([_batch(i, r)[0] for r in range(2)])
        y = torch.cat([_batch(i, r)[1] for r in range(2)])
        state, _ = step(state, (x, y, torch.full((8,), i)))
    fs.testing.assert_trees_close(skipped_run, state.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "strategy", ["data_parallel", "shard_optimizer", "fully_shard", "accumulate"]
)
def test_raise_raises_on_every_rank(strategy):
    results = run_spmd(_train, 2, strategy, "raise", 1)
    for outcome, message, count in results:
        assert outcome == "raised"
        assert f"step {BAD_STEP}" in message and "on_nonfinite='skip'" in message
        assert count == BAD_STEP  # the state given to the failing step is usable
    if strategy == "shard_optimizer":  # the NaN lands in one rank's shard: that rank is named
        assert "rank(s) 0 " in results[0][1] or "rank(s) 1 " in results[0][1]


def test_propagate_is_the_default_and_spreads_the_nan():
    results = run_spmd(_train, 2, "data_parallel", "propagate", 1)
    for _, params, skipped, _, _ in results:
        assert skipped == [-1.0] * STEPS  # no metric: nothing is checked
        assert not all(bool(torch.isfinite(p).all()) for p in params.values())
    assert fs.train_step(lambda *a: 0, fs.optim.sgd(0.1)).on_nonfinite == "propagate"


def test_local_skip_raise_and_bad_policy():
    apply, params, buffers = fs.functionalize(models.mlp([6, 8, 3], seed=0))
    first = next(iter(params))
    loss_fn = _loss_fn(apply, first, None)
    step = fs.train_step(loss_fn, fs.optim.sgd(0.1, momentum=0.9), on_nonfinite="skip")
    state = step.init(params, buffers)
    state, metrics = step(state, _batch(0, 0))
    before = state
    state, metrics = step(state, _batch(BAD_STEP, 0))
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 2
    assert_trees_equal(state.params, before.params)
    assert_trees_equal(state.opt_state, before.opt_state)
    raising = step.replace(on_nonfinite="raise")
    with pytest.raises(nonfinite.NonFiniteGradientError, match="NaN or infinity"):
        raising(before, _batch(BAD_STEP, 0))
    with pytest.raises(ValueError, match="`on_nonfinite` must be one of"):
        fs.train_step(loss_fn, fs.optim.sgd(0.1), on_nonfinite="ignore")


def test_has_nonfinite_is_exact():
    assert not nonfinite.has_nonfinite({"a": torch.ones(3), "b": torch.zeros(2, 2)})
    # finite values whose sum overflows float32 are finite
    big = torch.full((4,), 3e38)
    assert not nonfinite.has_nonfinite([big])
    flat = torch.zeros(10)
    views = [flat[:4], flat[4:]]  # one memory run
    assert not nonfinite.has_nonfinite(views)
    flat[7] = float("inf")
    assert nonfinite.has_nonfinite(views)
    assert nonfinite.has_nonfinite([torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)])
    assert nonfinite.has_nonfinite([torch.ones(3).expand(2, 3) * float("nan")])


def test_skipped_is_a_reserved_metric_and_the_error_is_exported():
    step = fs.train_step(
        lambda p, b, x, k: (p["w"].sum(), b, {"skipped": torch.ones(())}), fs.optim.sgd(0.1)
    )
    with pytest.raises(ValueError, match="metric named 'skipped'"):
        step(step.init({"w": torch.ones(2)}), None)
    assert fs.NonFiniteGradientError is nonfinite.NonFiniteGradientError


class _InfGradient(torch.autograd.Function):
    """Adds nothing in forward; its backward gives `w` an infinite gradient (and `x` its own)."""

    @staticmethod
    def forward(x, w):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((3, 3), float("inf"))


def _pipeline_stage(params, buffers, x, key):
    return x @ params["w"]


def _poisoned_last_stage(params, buffers, x, key):
    return _InfGradient.apply(x @ params["w"], params["w"])


def _pipeline_with_a_bad_last_stage(policy):
    """Two stages; at BAD_STEP only the last stage's gradient is infinite."""
    rank = dist.get_rank()
    stages = [_pipeline_stage, _pipeline_stage]
    bad = fs.pipeline(
        [_pipeline_stage, _poisoned_last_stage],
        torch.nn.functional.mse_loss,
        fs.optim.sgd(0.1),
        fs.Mesh(pp=2),
        micro_batches=2,
        on_nonfinite=policy,
    )
    good = fs.pipeline(
        stages, torch.nn.functional.mse_loss, fs.optim.sgd(0.1), fs.Mesh(pp=2), micro_batches=2
    )
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(3, 3, generator=g)} for _ in range(2)]
    state = good.init(params, [{}, {}])
    history, skipped = [], []
    for i in range(STEPS):
        history.append(state.params)
        batch = (torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g))
        try:
            state, metrics = (bad if i == BAD_STEP else good)(state, batch)
        except nonfinite.NonFiniteGradientError as error:
            return rank, "raised", str(error)
        skipped.append(float(metrics.get("skipped", 0.0)))
    return rank, history, skipped


def test_a_nan_in_one_pipeline_stage_skips_or_raises_on_every_stage():
    for rank, history, skipped in run_spmd(_pipeline_with_a_bad_last_stage, 2, "skip"):
        assert skipped == [0.0, 1.0, 0.0], rank
        assert_trees_equal(history[BAD_STEP + 1], history[BAD_STEP])  # no stage moved
        (before,), (after,) = fs.tree.leaves(history[0]), fs.tree.leaves(history[1])
        assert not torch.equal(after, before)  # this rank's stage, trained by a good step
    for rank, outcome, message in run_spmd(_pipeline_with_a_bad_last_stage, 2, "raise"):
        assert outcome == "raised", rank
        assert "rank(s) 1 of the step's mesh" in message


def _agree_over_more_axes_than_the_data_axes():
    rank = dist.get_rank()
    mesh = fs.Mesh(pp=2, dp=2)  # rank = 2 * pp index + dp index
    used = [rank == 0, rank == 3, False]
    together = nonfinite.agree(rank == 3, used, mesh, ("dp",), verdict_axes=("dp",))
    apart = nonfinite.agree(rank == 3, used, mesh, ("dp",), verdict_axes=("pp", "dp"))
    return rank, together, apart


def test_the_verdict_spans_its_axes_and_the_usage_mask_the_data_axes():
    for rank, together, apart in run_spmd(_agree_over_more_axes_than_the_data_axes, 4):
        # Over the data axis alone, only rank 3's dp group (ranks 2 and 3) sees the NaN.
        assert together.nonfinite_ranks == ((1,) if rank >= 2 else ())
        # Over the whole mesh every rank sees it, at rank 3's row-major index.
        assert apart.nonfinite_ranks == (3,)
        # The usage mask is agreed over "dp" only, in both: ranks 0-1 used leaf 0, ranks 2-3 leaf 1.
        expected = (True, False, False) if rank < 2 else (False, True, False)
        assert together.used == apart.used == expected
