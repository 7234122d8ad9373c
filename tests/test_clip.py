"""clip_by_global_norm: torch's formula bit for bit (local, data_parallel); sharded clipping."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale import optim
from fscale.parallel import consolidate, fully_shard, shard_optimizer
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd
from fscale.testing import strategies as fst

STEPS = 3
BATCH = 8
LR, MOMENTUM = 0.1, 0.9
# Far below the gradient norms of the test models, so every step clips.
MAX_NORM = 0.05


def _grads(dtypes):
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 5), (3,), (), (128,), (7, 9, 3)]
    return {
        f"leaf{i}": (torch.randn(shape, generator=g) * 10).to(dtype)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
    }


def _torch_clipped(grads, max_norm):
    parameters = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(parameters, grads.values()):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return dict(zip(grads, (p.grad for p in parameters)))


MIXED = [torch.float32, torch.bfloat16, torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtypes", [[torch.float32] * 5, MIXED], ids=["float32", "mixed"])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_default_formula_is_clip_grad_norm_bit_for_bit(dtypes, max_norm):
    grads = _grads(dtypes)
    clipped, _ = optim.clip_by_global_norm(max_norm).update(grads, optim.EmptyState())
    assert_trees_equal(clipped, _torch_clipped(grads, max_norm))
    assert all(c.dtype == g.dtype for c, g in zip(clipped.values(), grads.values()))


def test_norms_are_stacked_in_the_order_torch_iterates_the_parameters():
    # optree flattens a dict in sorted key order; torch iterates insertion order, and the norm
    # of the stacked per-tensor norms depends on the order of its summands.
    g = torch.Generator().manual_seed(0)
    flat = {
        f"z{i}" if i % 2 else f"a{i}": torch.randn(3, generator=g)
        * torch.rand((), generator=g).exp()
        * 10
        for i in range(8)
    }
    expected = _torch_clipped(flat, 0.5)
    in_sorted_order = _torch_clipped(dict(sorted(flat.items())), 0.5)
    assert any(not torch.equal(expected[k], in_sorted_order[k]) for k in flat)  # order matters
    names = list(flat)
    grads = {"nested": {k: flat[k] for k in names[:6]}, "list": [flat[k] for k in names[6:]]}
    clipped, _ = optim.clip_by_global_norm(0.5).update(grads, optim.EmptyState())
    assert_trees_equal([*clipped["nested"].values(), *clipped["list"]], list(expected.values()))


def test_sum_of_squares_formula_is_one_sum_of_all_squares():
    grads = _grads([torch.float32] * 5)
    clip = optim.clip_by_global_norm(0.5, formula="sum_of_squares")
    clipped, _ = clip.update(grads, optim.EmptyState())
    squares = sum(torch.dot(g.reshape(-1), g.reshape(-1)) for g in grads.values())
    coefficient = (0.5 / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    assert_trees_equal(clipped, {k: g * coefficient for k, g in grads.items()})
    # The two formulas round differently: this case tells them apart.
    torch_clipped = _torch_clipped(grads, 0.5)
    assert any(not torch.equal(clipped[k], torch_clipped[k]) for k in grads)
    assert_trees_close(clipped, torch_clipped, rtol=1e-6, atol=0)


def test_formula_must_be_known():
    with pytest.raises(ValueError, match=r"`formula` must be one of .*'l2'"):
        optim.clip_by_global_norm(1.0, formula="l2")  # type: ignore[arg-type]
    assert repr(optim.clip_by_global_norm(1.0, formula="sum_of_squares")) == (
        "clip_by_global_norm(max_norm=1.0, formula='sum_of_squares')"
    )


def _optimizer(formula):
    return optim.chain(
        optim.clip_by_global_norm(MAX_NORM, formula=formula), optim.sgd(LR, momentum=MOMENTUM)
    )


def _transform(strategy):
    if strategy == "data_parallel":
        return fs.data_parallel
    if strategy == "zero1":
        return lambda step, mesh: shard_optimizer(step, mesh, shard_grads=False, bucket_mb=1e-3)
    if strategy == "zero2":
        return lambda step, mesh: shard_optimizer(step, mesh, bucket_mb=1e-3)
    return fully_shard


def _fscale_and_ddp(strategy, formula):
    """Train a small GPT under `strategy` and under torch DDP + clip_grad_norm_ + SGD."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = fst.ModelCase("gpt", width=8, depth=2, seed=1)
    module = case.module()
    reference = copy.deepcopy(module)
    apply, params, buffers = fs.functionalize(module)
    step = _transform(strategy)(
        fs.train_step(case.loss_fn(apply), _optimizer(formula)), fs.Mesh(dp=world)
    )
    state = step.init(params, buffers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(reference, broadcast_buffers=False)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    norms = []
    for i in range(STEPS):
        batch = fs.data.split_batch(case.batch(BATCH, seed=i), rank, world)
        state, _ = step(state, batch)
        torch_opt.zero_grad()
        case.loss(ddp(case.inputs(batch)), batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)))
        torch_opt.step()
    ours = consolidate(step, state).params if strategy == "fully_shard" else state.params
    theirs = {n: p.detach() for n, p in reference.named_parameters() if n in ours}
    return ours, theirs, min(norms)


@pytest.mark.parametrize("formula", ["torch", "sum_of_squares"])
def test_data_parallel_clips_as_ddp_with_clip_grad_norm(formula):
    for ours, theirs, smallest_norm in run_spmd(_fscale_and_ddp, 2, "data_parallel", formula):
        assert smallest_norm > MAX_NORM  # every step clipped
        if formula == "torch":
            assert_trees_equal(ours, theirs)
        else:
            assert_trees_close(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fully_shard"])
@pytest.mark.parametrize("formula", ["torch", "sum_of_squares"])
def test_sharded_clipping_completes_the_norm_across_fragments(strategy, formula):
    # A tensor split across ranks has its squared sum completed by the all_reduce, which
    # associates the sum differently from torch's per-tensor norm: fp32 round-off.
    for ours, theirs, smallest_norm in run_spmd(_fscale_and_ddp, 2, strategy, formula):
        assert smallest_norm > MAX_NORM
        assert_trees_close(ours, theirs, rtol=1e-5, atol=1e-7)


def _whole_fragments(world):
    """Each tensor held whole by one rank: torch's norms, exactly, after the all_reduce."""
    rank = dist.get_rank()
    grads = _grads([torch.float32] * 5)
    owner = {name: i % world for i, name in enumerate(grads)}
    leaves, fragments = {}, {}
    for name, g in grads.items():
        mine = owner[name] == rank
        leaves[name] = g.reshape(-1) if mine else g.reshape(-1)[:0]
        fragments[name] = fs.flat.Fragment(g.shape, 0, g.numel() if mine else 0)
    sharding = optim.Sharding(fragments, lambda t: fs.distributed.all_reduce(t, "dp"))
    with fs.Mesh(dp=world):
        clipped, _ = optim.clip_by_global_norm(0.5).update(
            leaves, optim.EmptyState(), sharding=sharding
        )
    expected = {k: v.reshape(-1) for k, v in _torch_clipped(grads, 0.5).items()}
    return {k: v for k, v in clipped.items() if owner[k] == rank}, expected


def test_tensors_held_whole_get_torchs_norm_exactly_under_sharding():
    for clipped, expected in run_spmd(_whole_fragments, 2, 2):
        assert clipped
        assert_trees_equal(clipped, {k: expected[k] for k in clipped})
