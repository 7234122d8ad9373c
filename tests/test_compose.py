"""Transformations compose both ways: every built-in wraps any plan, user plans included.

Each composition runs on real gloo ranks against the reference it must equal: data parallelism
over all ranks (what every data-parallel composition computes), or the same plan without
accumulation on the whole batch. The support matrix at the end is checked against the README.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd
from fscale.testing import strategies as fst

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 8
STEPS = 3
N4 = dict(rtol=1e-4, atol=1e-5)  # reductions over 4 ranks associate in another order
ROUND_OFF = dict(rtol=1e-5, atol=1e-6)


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _model(remat=False, kind="gpt"):
    case = fst.ModelCase(kind, width=8, depth=2, seed=3)
    module = case.module()
    if remat:
        for i, block in enumerate(module.blocks):
            module.blocks[i] = fs.checkpoint(block)
    apply, params, buffers = fs.functionalize(module)
    return case, apply, params, buffers


def _sgd():
    return fs.optim.sgd(0.05, momentum=0.9)


def _train(step, params, buffers, case, world, rank, steps=STEPS):
    state = step.init(params, buffers)
    losses = []
    for i in range(steps):
        batch = fs.data.split_batch(case.batch(BATCH, seed=i), rank, world)
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return state, torch.stack(losses)


def _full_params(step, state):
    return fs.consolidate(step, state).params


def _reference(case, apply, params, buffers, optimizer=_sgd):
    """Data parallelism over every rank: what the data-parallel compositions equal."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = fs.data_parallel(fs.train_step(case.loss_fn(apply), optimizer()), fs.Mesh(dp=world))
    state, losses = _train(step, params, buffers, case, world, rank)
    return state.params, losses


# ----------------------------------------------------------------------------- the two phases


def _built_in(name, loss_fn, world):
    mesh = fs.Mesh(dp=world)
    step = fs.train_step(loss_fn, fs.optim.adam(1e-2))
    return {
        "local": lambda: step,
        "data_parallel": lambda: fs.data_parallel(step, mesh),
        "zero1": lambda: fs.shard_optimizer(step, mesh, shard_grads=False),
        "zero2": lambda: fs.shard_optimizer(step, mesh),
        "fully_shard": lambda: fs.fully_shard(step, mesh),
        "fully_shard_remat": lambda: fs.fully_shard(step, mesh, reshard_after_forward="remat"),
        "hsdp": lambda: fs.data_parallel(
            fs.fully_shard(step, fs.Mesh(replica=1, dp=world)),
            fs.Mesh(replica=1, dp=world),
            "replica",
        ),
        "zero_in_replicas": lambda: fs.shard_optimizer(
            fs.data_parallel(step, fs.Mesh(replica=world, dp=1), "replica"),
            fs.Mesh(replica=world, dp=1),
        ),
        "accumulate_ddp": lambda: fs.accumulate(fs.data_parallel(step, mesh), 2),
        "ddp_accumulate": lambda: fs.data_parallel(fs.accumulate(step, 2), mesh),
    }[name]()


def _phases_equal_call(name):
    rank, world = dist.get_rank(), dist.get_world_size()
    case, apply, params, buffers = _model()
    step = _built_in(name, case.loss_fn(apply), world)
    whole, split = step.init(params, buffers), step.init(params, buffers)
    for i in range(2):
        batch = fs.data.split_batch(case.batch(BATCH, seed=i), rank, world)
        whole, metrics = step(whole, batch)
        split, split_metrics = step.apply_gradients(split, *step.gradients(split, batch))
        assert_trees_equal(split_metrics["loss"], metrics["loss"])
    return whole, split


@pytest.mark.parametrize(
    "name",
    [
        "local",
        "data_parallel",
        "zero1",
        "zero2",
        "fully_shard",
        "fully_shard_remat",
        "hsdp",
        "zero_in_replicas",
        "accumulate_ddp",
        "ddp_accumulate",
    ],
)
def test_step_is_apply_gradients_of_gradients(name):
    for whole, split in run_spmd(_phases_equal_call, 2, name):
        assert_trees_equal(split, whole)


# ----------------------------------------------------------------------------- data axes


def _two_axes(order, remat):
    rank = dist.get_rank()
    case, apply, params, buffers = _model(remat)
    mesh = fs.Mesh(replica=2, dp=2)
    step = fs.train_step(case.loss_fn(apply), _sgd())
    step = {
        "ddp(fsdp)": lambda: fs.data_parallel(fs.fully_shard(step, mesh, "dp"), mesh, "replica"),
        "fsdp(ddp)": lambda: fs.fully_shard(fs.data_parallel(step, mesh, "replica"), mesh, "dp"),
        "zero(ddp)": lambda: fs.shard_optimizer(fs.data_parallel(step, mesh, "replica"), mesh),
        "ddp(zero)": lambda: fs.data_parallel(fs.shard_optimizer(step, mesh), mesh, "replica"),
        "ddp(ddp)": lambda: fs.data_parallel(fs.data_parallel(step, mesh), mesh, "replica"),
    }[order]()
    state, losses = _train(step, params, buffers, case, 4, rank)
    return _full_params(step, state), losses, _reference(case, apply, params, buffers)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("order", ["ddp(fsdp)", "fsdp(ddp)", "zero(ddp)", "ddp(zero)", "ddp(ddp)"])
def test_two_data_axes_equal_data_parallel_over_all_ranks(order, remat):
    for params, losses, (ref_params, ref_losses) in run_spmd(_two_axes, 4, order, remat):
        assert_trees_close(losses, ref_losses, **N4)
        assert_trees_close(params, ref_params, **N4)


def _hsdp_traffic():
    rank = dist.get_rank()
    case, apply, params, buffers = _model()
    mesh = fs.Mesh(replica=2, dp=2)
    step = fs.data_parallel(
        fs.fully_shard(fs.train_step(case.loss_fn(apply), _sgd()), mesh, "dp"), mesh, "replica"
    )
    state = step.init(params, buffers)
    with fs.distributed.comm_ledger() as ledger:
        step(state, fs.data.split_batch(case.batch(BATCH, seed=0), rank, 4))
    padded = sum(u.numel for u in step.plan.find("fully_shard").layout.units)
    return ledger.total_elements("all_reduce", "replica"), padded


def test_hsdp_all_reduces_the_gradient_shards_once():
    for replica_elements, padded in run_spmd(_hsdp_traffic, 4):
        assert replica_elements == padded // 2 + 1  # every gradient shard, and the loss


# ----------------------------------------------------------------------------- accumulation


def _accumulated(kind, inside, remat):
    rank, world = dist.get_rank(), dist.get_world_size()
    case, apply, params, buffers = _model(remat)
    mesh = fs.Mesh(dp=world)
    plain = fs.train_step(case.loss_fn(apply), _sgd())
    wrap = {
        "local": lambda s: s,
        "data_parallel": lambda s: fs.data_parallel(s, mesh),
        "shard_optimizer": lambda s: fs.shard_optimizer(s, mesh),
        "fully_shard": lambda s: fs.fully_shard(s, mesh),
        "accumulate": lambda s: fs.accumulate(s, 2),
    }[kind]
    accumulated = wrap(fs.accumulate(plain, 2)) if inside else fs.accumulate(wrap(plain), 2)
    reference = wrap(plain)
    results = []
    for step in (accumulated, reference):
        with fs.distributed.comm_ledger() as ledger:
            state, losses = _train(step, params, buffers, case, world, rank)
        results.append((_full_params(step, state), losses, ledger.count()))
    return results


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("kind", ["data_parallel", "shard_optimizer", "fully_shard"])
def test_accumulate_equals_one_step_on_the_whole_batch(kind, inside, remat):
    for (params, losses, collectives), (ref_params, ref_losses, ref_collectives) in run_spmd(
        _accumulated, 2, kind, inside, remat
    ):
        assert_trees_close(losses, ref_losses, **ROUND_OFF)
        assert_trees_close(params, ref_params, **ROUND_OFF)
        if kind != "fully_shard":  # one reduction per step; ZeRO-3 reduce-scatters per slice
            assert collectives == ref_collectives


@pytest.mark.parametrize("kind", ["local", "accumulate"])
def test_accumulate_in_one_process(kind):
    (result,) = run_spmd(_accumulated, 1, kind, True, False)
    (params, losses, _), (ref_params, ref_losses, _) = result
    assert_trees_close(losses, ref_losses, **ROUND_OFF)
    assert_trees_close(params, ref_params, **ROUND_OFF)


def test_accumulate_refuses_bad_arguments():
    step = fs.train_step(lambda p, b, x, k: p["w"].sum(), fs.optim.sgd(0.1))
    with pytest.raises(ValueError, match="`micro_batches` must be a positive int"):
        fs.accumulate(step, 0)
    with pytest.raises(TypeError, match="`dim` must be an int"):
        fs.accumulate(step, 2, dim="0")
    stepped = fs.accumulate(step, 2)
    state = stepped.init({"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"divisible|divide"):
        stepped(state, torch.ones(3, 3))
    assert "accumulate(micro_batches=2, dim=0) ∘ local" in repr(stepped)


# ----------------------------------------------------------------------------- a user plan


def _diloco_is_data_parallel():
    rank, world = dist.get_rank(), dist.get_world_size()
    case, apply, params, buffers = _model()
    local = fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.05))
    step = _example("diloco").diloco(local, fs.Mesh(dp=world), outer=fs.optim.sgd(1.0), every=1)
    state, losses = _train(step, params, buffers, case, world, rank)
    return (
        fs.consolidate(step, state).params,
        losses,
        _reference(case, apply, params, buffers, lambda: fs.optim.sgd(0.05)),
    )


def test_diloco_every_step_with_outer_sgd_1_is_data_parallel():
    for params, losses, (ref_params, ref_losses) in run_spmd(_diloco_is_data_parallel, 2):
        assert_trees_close(losses, ref_losses, **ROUND_OFF)
        assert_trees_close(params, ref_params, **ROUND_OFF)


def _around_diloco(order):
    rank = dist.get_rank()
    case, apply, params, buffers = _model()
    # Every rank reads its own data, so the layers' data axes must cover all four ranks.
    one_axis = order in ("accumulate(diloco)", "diloco(accumulate)")
    mesh = fs.Mesh(replica=4, dp=1) if one_axis else fs.Mesh(replica=2, dp=2)
    diloco = _example("diloco").diloco
    step = fs.train_step(case.loss_fn(apply), fs.optim.sgd(0.05))
    outer = fs.optim.sgd(1.0)
    step = {
        "zero(diloco)": lambda: fs.shard_optimizer(
            diloco(step, mesh, "replica", outer=outer, every=1), mesh, "dp"
        ),
        "fsdp(diloco)": lambda: fs.fully_shard(
            diloco(step, mesh, "replica", outer=outer, every=1), mesh, "dp"
        ),
        "diloco(zero)": lambda: diloco(
            fs.shard_optimizer(step, mesh, "dp"), mesh, "replica", outer=outer, every=1
        ),
        "ddp(diloco)": lambda: fs.data_parallel(
            diloco(step, mesh, "replica", outer=outer, every=1), mesh, "dp"
        ),
        "accumulate(diloco)": lambda: fs.accumulate(
            diloco(step, mesh, "replica", outer=outer, every=1), 2
        ),
        "diloco(ddp)": lambda: diloco(
            fs.data_parallel(step, mesh, "dp"), mesh, "replica", outer=outer, every=1
        ),
        "diloco(fsdp)": lambda: diloco(
            fs.fully_shard(step, mesh, "dp"), mesh, "replica", outer=outer, every=1
        ),
        "diloco(accumulate)": lambda: diloco(
            fs.accumulate(step, 2), mesh, "replica", outer=outer, every=1
        ),
        "diloco(diloco)": lambda: diloco(
            diloco(step, mesh, "dp", outer=outer, every=1), mesh, "replica", outer=outer, every=1
        ),
    }[order]()
    state, losses = _train(step, params, buffers, case, 4, rank)
    if order == "fsdp(diloco)":  # the anchor is sharded: compare the gathered shards
        layout = step.plan.find("fully_shard").layout
        gathered = {
            n: fs.distributed.all_gather(s, "dp", mesh=mesh) for n, s in state.params.items()
        }
        full = layout.unshard(gathered)
    else:
        full = fs.consolidate(step, state).params
    return full, losses, _reference(case, apply, params, buffers, lambda: fs.optim.sgd(0.05))


@pytest.mark.parametrize(
    "order",
    [
        "zero(diloco)",
        "fsdp(diloco)",
        "diloco(zero)",
        "ddp(diloco)",
        "accumulate(diloco)",
        "diloco(ddp)",
        "diloco(fsdp)",
        "diloco(accumulate)",
        "diloco(diloco)",
    ],
)
def test_built_ins_compose_with_a_user_plan(order):
    for params, losses, (ref_params, ref_losses) in run_spmd(_around_diloco, 4, order):
        assert_trees_close(losses, ref_losses, **N4)
        assert_trees_close(params, ref_params, **N4)


def test_data_layers_refuse_a_reducer_of_another_kind():
    # A plan that reduces its own way puts its own reducer in the context; data_parallel and
    # shard_optimizer extend only theirs, and say so before any collective.
    from fscale.parallel.reduce import add_mean_axis, add_scatter_axis

    mesh = fs.Mesh(dp=1)
    message = "reducer is a object; data_parallel and shard_optimizer extend only a GradReducer"
    with pytest.raises(TypeError, match=message):
        add_mean_axis(object(), mesh, "dp", 1024)
    with pytest.raises(TypeError, match=message):
        add_scatter_axis(object(), mesh, "dp", 1024, shard_grads=True)


# ----------------------------------------------------------------------------- reduction hooks


def _powersgd(rank_of_hook):
    rank, world = dist.get_rank(), dist.get_world_size()
    case, apply, params, buffers = _model()
    hook = _example("powersgd").PowerSGD(rank=rank_of_hook)
    step = fs.data_parallel(
        fs.train_step(case.loss_fn(apply), _sgd()), fs.Mesh(dp=world), reduce_hook=hook
    )
    with fs.distributed.comm_ledger() as ledger:
        state, losses = _train(step, params, buffers, case, world, rank)
    assert isinstance(state.opt_state, fs.parallel.HookState)
    full = fs.consolidate(step, state)
    assert not isinstance(full.opt_state, fs.parallel.HookState)
    return (
        state.params,
        losses,
        ledger.total_elements("all_reduce"),
        _reference(case, apply, params, buffers),
    )


def test_powersgd_at_full_rank_equals_data_parallel():
    for params, losses, _, (ref_params, ref_losses) in run_spmd(_powersgd, 2, 10_000):
        assert_trees_close(losses, ref_losses, **ROUND_OFF)
        assert_trees_close(params, ref_params, **ROUND_OFF)


def test_powersgd_at_rank_one_compresses():
    full_rank = run_spmd(_powersgd, 2, 10_000)[0]
    rank_one = run_spmd(_powersgd, 2, 1)[0]
    assert rank_one[2] < full_rank[2] / 5  # all-reduced elements: the factors, not the buckets
    assert torch.isfinite(rank_one[1]).all()
    with pytest.raises(AssertionError):  # a rank-1 approximation is not the mean gradient
        assert_trees_close(rank_one[0], full_rank[0], **ROUND_OFF)


def test_reduction_hook_refusals():
    step = fs.train_step(lambda p, b, x, k: p["w"].sum(), fs.optim.sgd(0.1))
    mesh = fs.Mesh(dp=1)
    with pytest.raises(TypeError, match="`reduce_hook` must be callable"):
        fs.data_parallel(step, mesh, reduce_hook=3)
    with pytest.raises(ValueError, match=r"torch\.func gradients"):
        fs.data_parallel(step.replace(grad_mode="func"), mesh, reduce_hook=lambda g, b, s: g)
    with pytest.raises(ValueError, match="reduce-scatters"):
        fs.data_parallel(
            fs.shard_optimizer(step, fs.Mesh(dp=1, r=1)),
            fs.Mesh(dp=1, r=1),
            "r",
            reduce_hook=lambda g, b, s: g,
        )


# ----------------------------------------------------------------------------- the matrix

# Cell (outer, inner): outer(inner(step)). "works" cells name the test above that runs them;
# "refused" cells hold the message fragment the transformation raises.
NAMES = ("data_parallel", "shard_optimizer", "fully_shard", "accumulate", "user plan (DiLoCo)")
MATRIX = {
    ("data_parallel", "data_parallel"): (
        "works",
        "test_two_data_axes_equal_data_parallel_over_all_ranks",
    ),
    ("data_parallel", "shard_optimizer"): (
        "works",
        "test_two_data_axes_equal_data_parallel_over_all_ranks",
    ),
    ("data_parallel", "fully_shard"): (
        "works",
        "test_two_data_axes_equal_data_parallel_over_all_ranks",
    ),
    ("data_parallel", "accumulate"): (
        "works",
        "test_accumulate_equals_one_step_on_the_whole_batch",
    ),
    ("data_parallel", "user plan (DiLoCo)"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("shard_optimizer", "data_parallel"): (
        "works",
        "test_two_data_axes_equal_data_parallel_over_all_ranks",
    ),
    ("shard_optimizer", "shard_optimizer"): ("refused", "already shards its optimizer state"),
    ("shard_optimizer", "fully_shard"): ("refused", "already shards its optimizer state"),
    ("shard_optimizer", "accumulate"): (
        "works",
        "test_accumulate_equals_one_step_on_the_whole_batch",
    ),
    ("shard_optimizer", "user plan (DiLoCo)"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("fully_shard", "data_parallel"): (
        "works",
        "test_two_data_axes_equal_data_parallel_over_all_ranks",
    ),
    ("fully_shard", "shard_optimizer"): ("refused", "already shards its state"),
    ("fully_shard", "fully_shard"): ("refused", "already shards its state"),
    ("fully_shard", "accumulate"): ("works", "test_accumulate_equals_one_step_on_the_whole_batch"),
    ("fully_shard", "user plan (DiLoCo)"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("accumulate", "data_parallel"): (
        "works",
        "test_accumulate_equals_one_step_on_the_whole_batch",
    ),
    ("accumulate", "shard_optimizer"): (
        "works",
        "test_accumulate_equals_one_step_on_the_whole_batch",
    ),
    ("accumulate", "fully_shard"): ("works", "test_accumulate_equals_one_step_on_the_whole_batch"),
    ("accumulate", "accumulate"): ("works", "test_accumulate_in_one_process"),
    ("accumulate", "user plan (DiLoCo)"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("user plan (DiLoCo)", "data_parallel"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("user plan (DiLoCo)", "shard_optimizer"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("user plan (DiLoCo)", "fully_shard"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("user plan (DiLoCo)", "accumulate"): ("works", "test_built_ins_compose_with_a_user_plan"),
    ("user plan (DiLoCo)", "user plan (DiLoCo)"): (
        "works",
        "test_built_ins_compose_with_a_user_plan",
    ),
}
SAME_AXIS = "refused on one axis: each data axis belongs to one layer (use two mesh axes)"


def _transform(name, step, mesh, axis):
    if name == "data_parallel":
        return fs.data_parallel(step, mesh, axis)
    if name == "shard_optimizer":
        return fs.shard_optimizer(step, mesh, axis)
    if name == "fully_shard":
        return fs.fully_shard(step, mesh, axis)
    if name == "accumulate":
        return fs.accumulate(step, 2)
    return _example("diloco").diloco(step, mesh, axis, outer=fs.optim.sgd(1.0))


def test_refused_cells_are_refused_and_works_cells_are_tested():
    mesh = fs.Mesh(replica=1, dp=1)
    step = fs.train_step(lambda p, b, x, k: p["w"].sum(), fs.optim.sgd(0.1))
    for (outer, inner), (verdict, detail) in MATRIX.items():
        if verdict == "works":
            assert callable(globals().get(detail)), (outer, inner, detail)
            _transform(outer, _transform(inner, step, mesh, "dp"), mesh, "replica")
        else:
            with pytest.raises(ValueError, match=detail):
                _transform(outer, _transform(inner, step, mesh, "dp"), mesh, "replica")
    # The same axis for two layers that split the batch is refused whatever the pair.
    with pytest.raises(ValueError, match="already splits its batch over axis 'dp'"):
        fs.data_parallel(fs.fully_shard(step, mesh, "dp"), mesh, "dp")


def support_matrix() -> str:
    """The README's support matrix, rendered from `MATRIX`."""
    lines = ["| outer ∘ inner | " + " | ".join(NAMES) + " |", "|---|" + "---|" * len(NAMES)]
    for outer in NAMES:
        cells = []
        for inner in NAMES:
            verdict, detail = MATRIX.get((outer, inner), ("untested", ""))
            if verdict == "works":
                cells.append(f"works: `tests/test_compose.py::{detail}`")
            elif verdict == "refused":
                cells.append(f"refused: {detail}")
            else:
                cells.append("not tested yet")
        lines.append(f"| **{outer}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_readme_support_matrix_is_current():
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
    assert begin in readme and end in readme, "README.md lost its support-matrix markers"
    current = readme.split(begin)[1].split(end)[0].strip()
    assert current == support_matrix(), (
        "README.md's support matrix is stale; paste the output of "
        "`python -c 'import tests.test_compose as t; print(t.support_matrix())'`"
    )


def test_a_hooked_data_parallel_layer_is_the_only_one():
    step = fs.train_step(lambda p, b, x, k: p["w"].sum(), fs.optim.sgd(0.1))
    mesh = fs.Mesh(replica=1, dp=1)
    hook = _example("powersgd").PowerSGD(rank=1)
    with pytest.raises(ValueError, match="already data parallel over another axis"):
        fs.data_parallel(fs.data_parallel(step, mesh), mesh, "replica", reduce_hook=hook)
    with pytest.raises(ValueError, match="use a single data_parallel layer when it has a hook"):
        fs.data_parallel(fs.data_parallel(step, mesh, reduce_hook=hook), mesh, "replica")
    # HSDP with compression of the gradient shards is fine.
    fs.data_parallel(fs.fully_shard(step, mesh, "dp"), mesh, "replica", reduce_hook=hook)


def test_accumulate_splits_time_major_batches_along_dim_1():
    case, apply, params, buffers = _model()
    time_major_loss = case.loss_fn(apply)

    def loss_fn(params, buffers, batch, key):  # the batch is [T, B]; the model reads [B, T]
        return time_major_loss(params, buffers, batch.T, key)

    whole = fs.train_step(loss_fn, _sgd())
    split = fs.accumulate(whole, 4, dim=1)
    results = []
    for step in (split, whole):
        state = step.init(params, buffers)
        for i in range(STEPS):
            state, metrics = step(state, case.batch(BATCH, seed=i).T)
        results.append((state.params, metrics["loss"]))
    assert_trees_close(results[0], results[1], **ROUND_OFF)
