"""loss_scale: torch.amp.GradScaler's numerics, with one skip decision shared by every rank."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale import loss_scaling, models
from fscale.testing import assert_trees_equal, run_spmd

STEPS = 6
BATCH = 4  # per rank
# Scales stay above 2**28 through a run (init 2**40, at most STEPS halvings), so an injected
# gradient of 2**100 overflows float32 whenever it is scaled: every injected step is skipped.
INIT = 2.0**40
INJECTED = 2.0**100
GROWTH_INTERVAL = 2


# ---------------------------------------------------------------------------------- arguments


def _loss(params, buffers, batch, key):
    return (params["w"] * batch).sum() ** 2


def _step(**kwargs):
    return fs.train_step(_loss, fs.optim.sgd(0.1), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"init": 0.0}, ValueError, "`init` must be > 0"),
        ({"init": -1.0}, ValueError, "`init` must be > 0"),
        ({"init": 1e39}, ValueError, "finite in float32"),
        ({"init": float("nan")}, ValueError, "`init` must be finite"),
        ({"growth_factor": 1.0}, ValueError, "`growth_factor` must be > 1"),
        ({"growth_factor": 0.5}, ValueError, "`growth_factor` must be > 1"),
        ({"backoff_factor": 0.0}, ValueError, r"`backoff_factor` must lie in \(0, 1\)"),
        ({"backoff_factor": 1.0}, ValueError, r"`backoff_factor` must lie in \(0, 1\)"),
        ({"backoff_factor": 1.5}, ValueError, r"`backoff_factor` must lie in \(0, 1\)"),
        ({"growth_interval": 0}, ValueError, "`growth_interval` must be in"),
        ({"growth_interval": 2.0}, TypeError, "`growth_interval` must be an int"),
        ({"growth_interval": True}, TypeError, "`growth_interval` must be an int"),
        ({"init": "big"}, TypeError, "`init` must be a number"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        fs.loss_scale(_step(), **kwargs)


def test_compositions_that_cannot_work_are_refused():
    with pytest.raises(TypeError, match="`step` must be a Step"):
        fs.loss_scale(_loss)
    with pytest.raises(ValueError, match="already scales its loss"):
        fs.loss_scale(fs.accumulate(fs.loss_scale(_step()), 2))
    for policy in ("skip", "raise"):
        with pytest.raises(ValueError, match=f"on_nonfinite='{policy}'"):
            fs.loss_scale(_step(on_nonfinite=policy))


def test_a_state_without_the_scaler_is_refused():
    step = _step()
    state = step.init({"w": torch.ones(3)})
    with pytest.raises(ValueError, match="not the LossScaleState"):
        fs.loss_scale(step)(state, torch.ones(3))


def test_plan_is_described():
    step = fs.loss_scale(_step(), init=1024.0, growth_interval=5)
    assert (
        "loss_scale(init=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=5)"
        in repr(step)
    )


# ---------------------------------------------------------------------------------- unscale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_unscale_rounds_as_grad_scaler(dtype, in_place):
    gen = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(37, generator=gen).to(dtype), "b": torch.randn(3, 5).to(dtype)}
    scale = torch.tensor(3000.0)  # not a power of two: the reciprocal rounds
    expected = {k: v.clone() for k, v in grads.items()}
    torch._amp_foreach_non_finite_check_and_unscale_(
        list(expected.values()), torch.zeros(()), scale.double().reciprocal().float()
    )
    given = {k: v.clone() for k, v in grads.items()}
    out = loss_scaling.unscale(given, scale, in_place=in_place)
    assert_trees_equal(out, expected)
    assert_trees_equal(given, expected if in_place else grads)
    with pytest.raises(ValueError, match="`scale` must be a positive, finite number"):
        loss_scaling.unscale(grads, 0.0)


# ---------------------------------------------------------------- one process vs GradScaler


def _half_forward_loss(module, params, x, y):
    """float16 forward and backward on float32 master params; the loss in float32."""
    half = {name: p.half() for name, p in params.items()}
    out = torch.func.functional_call(module, half, (x.half(),))
    return torch.nn.functional.mse_loss(out.float(), y)


def _fp16_batches(steps):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(steps)
    ]


def test_float16_training_equals_grad_scaler_with_clipping():
    """Real overflows: at 2**24 the float16 backward overflows until the scale backs off, and
    with growth every 2 steps it overflows again; fscale skips, scales and updates as torch."""
    steps = 14
    module = models.mlp([6, 8, 3], seed=0)
    _, params, buffers = fs.functionalize(models.mlp([6, 8, 3], seed=0))
    reference = {n: torch.nn.Parameter(p.detach().clone()) for n, p in module.named_parameters()}
    torch_opt = torch.optim.AdamW(list(reference.values()), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)

    def loss_fn(p, b, batch, key):
        return _half_forward_loss(module, p, *batch)

    optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(1e-2))
    step = fs.loss_scale(fs.train_step(loss_fn, optimizer), init=2.0**24, growth_interval=2)
    state = step.init(params, buffers)
    ours, theirs = [], []
    for batch in _fp16_batches(steps):
        before = state
        state, metrics = step(state, batch)
        ours.append((float(metrics["skipped"]), metrics["loss_scale"]))
        if metrics["skipped"]:
            assert_trees_equal(state.params, before.params)
            assert_trees_equal(state.opt_state.inner, before.opt_state.inner)
        torch_opt.zero_grad()
        old_scale = scaler.get_scale()
        scaler.scale(_half_forward_loss(module, reference, *batch)).backward()
        scaler.unscale_(torch_opt)
        torch.nn.utils.clip_grad_norm_(list(reference.values()), 0.5)
        scaler.step(torch_opt)
        scaler.update()
        theirs.append((float(scaler.get_scale() < old_scale), scaler.get_scale()))
        assert_trees_equal(state.params, {n: p.detach() for n, p in reference.items()})
    assert ours == theirs
    skipped = [s for s, _ in ours]
    assert 0.0 in skipped and 1.0 in skipped and skipped[0] == 1.0  # overflows, then trains
    assert int(state.opt_state.growth_tracker) == int(scaler._growth_tracker)


@pytest.mark.parametrize(
    "options", [{}, {"donate": True}, {"grad_mode": "func"}], ids=["pure", "donate", "func"]
)
def test_finite_run_equals_the_run_without_scaling_and_the_loss_is_unscaled(options):
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, generator=gen) for _ in range(4)]
    plain = _step(**options)
    scaled = fs.loss_scale(_step(**options), init=2.0**10, growth_interval=3)
    a, b = plain.init({"w": torch.ones(3)}), scaled.init({"w": torch.ones(3)})
    for batch in batches:
        a, ma = plain(a, batch)
        b, mb = scaled(b, batch)
        assert torch.equal(ma["loss"], mb["loss"])
        assert_trees_equal(a.params, b.params)
    assert mb["loss_scale"] == 2.0**11  # grew once, after 3 good steps
    assert int(b.opt_state.growth_tracker) == 1


def test_state_saves_and_loads(tmp_path):
    step = fs.loss_scale(_step(), init=8.0, growth_interval=1)
    state = step.init({"w": torch.ones(3)})
    state, _ = step(state, torch.ones(3))
    fs.save(tmp_path, state, step=step)
    loaded = fs.load(tmp_path, state, step=step)
    assert_trees_equal(loaded, state)
    assert float(loaded.opt_state.scale) == 16.0


# ------------------------------------------------------------------- two ranks vs torch DDP


def _batch(index, rank, injected):
    gen = torch.Generator().manual_seed(100 * index + rank)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)
    inject = torch.zeros(BATCH)
    if injected:
        inject[-1] = INJECTED  # one sample: under accumulation, the last micro-batch only
    return x, y, inject


def _loss_with_injection(out, y, first_weight, inject):
    loss = torch.nn.functional.mse_loss(out, y)
    # Value 0 (x - x), gradient mean(inject) on one element: it overflows once scaled.
    term = (first_weight.reshape(-1)[0] * inject).mean()
    return loss + (term - term.detach())


def _fscale_step(apply, first, strategy, mesh):
    def loss_fn(params, buffers, batch, key):
        out, _ = apply(params, buffers, batch[0])
        return _loss_with_injection(out, batch[1], params[first], batch[2])

    step = fs.train_step(loss_fn, fs.optim.adamw(1e-2))
    scaled = {"init": INIT, "growth_interval": GROWTH_INTERVAL}
    if strategy == "data_parallel":
        return fs.loss_scale(fs.data_parallel(step, mesh), **scaled)
    if strategy == "shard_optimizer (inside)":
        return fs.shard_optimizer(fs.loss_scale(step, **scaled), mesh)
    if strategy == "shard_optimizer":
        return fs.loss_scale(fs.shard_optimizer(step, mesh), **scaled)
    if strategy == "fully_shard":
        return fs.loss_scale(fs.fully_shard(step, mesh), **scaled)
    return fs.loss_scale(fs.accumulate(fs.data_parallel(step, mesh), 2), **scaled)


STRATEGIES = (
    "data_parallel",
    "shard_optimizer",
    "shard_optimizer (inside)",
    "fully_shard",
    "accumulate",
)


def _train_fscale(strategy, injections, inject_rank):
    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params, buffers = fs.functionalize(models.mlp([6, 8, 3], seed=0))
    first = next(iter(params))
    step = _fscale_step(apply, first, strategy, fs.Mesh(dp=world))
    state = step.init(params, buffers)
    history = []
    for i in range(STEPS):
        batch = _batch(i, rank, i in injections and rank == inject_rank)
        state, metrics = step(state, batch)
        history.append((float(metrics["skipped"]), metrics["loss_scale"]))
    full = fs.consolidate(step, state)
    assert_trees_equal(fs.shard_state(step, full), state)
    return history, full


def _train_torch_ddp(injections, inject_rank, micro_batches):
    rank = dist.get_rank()
    module = models.mlp([6, 8, 3], seed=0)
    first = next(iter(dict(module.named_parameters())))
    with warnings.catch_warnings():  # the flag is deprecated in favour of one without this meaning
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(module, broadcast_buffers=False)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=GROWTH_INTERVAL)
    history = []
    for i in range(STEPS):
        x, y, inject = _batch(i, rank, i in injections and rank == inject_rank)
        opt.zero_grad()
        size = BATCH // micro_batches
        for m in range(micro_batches):
            part = slice(m * size, (m + 1) * size)
            last = m == micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                weight = dict(module.named_parameters())[first]
                loss = _loss_with_injection(ddp(x[part]), y[part], weight, inject[part])
                scaler.scale(loss / micro_batches).backward()
        old = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        history.append((float(scaler.get_scale() < old), scaler.get_scale()))
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return history, params, float(scaler.get_scale()), int(scaler._growth_tracker)


def _train_all(injections, inject_rank):
    reference = _train_torch_ddp(injections, inject_rank, 1)
    accumulated = _train_torch_ddp(injections, inject_rank, 2)
    ours = {s: _train_fscale(s, injections, inject_rank) for s in STRATEGIES}
    return reference, accumulated, ours


@settings(max_examples=examples(6))  # each example trains seven runs on two ranks
@given(
    injections=st.sets(st.integers(0, STEPS - 1), max_size=3),
    inject_rank=st.integers(0, 1),
)
def test_two_ranks_skip_and_scale_as_grad_scaler_with_ddp(injections, inject_rank):
    """Infinities on one rank only: every rank and strategy skips exactly the injected steps,
    with GradScaler's scales, and ends with torch DDP's params bit for bit (at two ranks every
    strategy here sums the same two gradients as DDP, and scaling by powers of two is exact)."""
    for reference, accumulated, ours in run_spmd(_train_all, 2, injections, inject_rank):
        expected_skips = [float(i in injections) for i in range(STEPS)]
        assert [s for s, _ in reference[0]] == expected_skips
        for strategy, (history, full) in ours.items():
            torch_run = accumulated if strategy == "accumulate" else reference
            torch_history, torch_params, torch_scale, torch_tracker = torch_run
            assert history == torch_history, strategy
            assert_trees_equal(full.params, torch_params, msg=strategy)
            assert float(full.opt_state.scale) == torch_scale
            assert int(full.opt_state.growth_tracker) == torch_tracker


def _skips_on_a_mesh_with_another_axis(inject_rank):
    # data_parallel over "dp" only: the ranks along "other" are separate replica groups, which
    # the skip decision must reach too, as every rank of a job steps together.
    mesh = fs.Mesh(dp=2, other=2)
    apply, params, buffers = fs.functionalize(models.mlp([6, 8, 3], seed=0))
    first = next(iter(params))
    step = fs.loss_scale(
        fs.data_parallel(
            fs.train_step(
                lambda p, b, batch, key: _loss_with_injection(
                    apply(p, b, batch[0])[0], batch[1], p[first], batch[2]
                ),
                fs.optim.sgd(0.1),
            ),
            mesh,
            "dp",
        ),
        init=INIT,
    )
    state = step.init(params, buffers)
    skipped = []
    for i in range(2):
        state, metrics = step(
            state, _batch(i, dist.get_rank(), i == 1 and dist.get_rank() == inject_rank)
        )
        skipped.append(float(metrics["skipped"]))
    return skipped, metrics["loss_scale"]


def test_every_axis_of_the_mesh_skips_together():
    for skipped, scale in run_spmd(_skips_on_a_mesh_with_another_axis, 4, 3):
        assert skipped == [0.0, 1.0]
        assert scale == INIT / 2


def _save_or_load(strategy, root, save):
    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params, buffers = fs.functionalize(models.mlp([6, 8, 3], seed=0))
    step = _fscale_step(apply, next(iter(params)), strategy, fs.Mesh(dp=world))
    state = step.init(params, buffers)
    if save:
        for i in range(3):
            state, _ = step(state, _batch(i, rank, i == 1 and rank == 1))
        fs.save(root, state, step=step)
    else:
        state = fs.load(root, state, step=step)
    return fs.consolidate(step, state)


def test_scale_saves_under_one_plan_and_loads_under_another(tmp_path):
    saved = run_spmd(_save_or_load, 2, "shard_optimizer", str(tmp_path), True)[0]
    assert float(saved.opt_state.scale) == INIT / 2
    for loaded in run_spmd(_save_or_load, 2, "fully_shard", str(tmp_path), False):
        assert_trees_equal(loaded, saved)
