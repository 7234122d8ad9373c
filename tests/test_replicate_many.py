"""`fscale.distributed.replicate_many`: `replicate` of many tensors, one all-reduce per dtype."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fscale import distributed as fd
from fscale.testing import assert_trees_equal, run_spmd


def _tensors():
    g = torch.Generator().manual_seed(0)  # the same values on every rank: replicated
    return [
        torch.randn(3, 4, generator=g),
        torch.randn(5, generator=g).double(),
        torch.randn(2, 2, generator=g),
    ]


def _grads(grouped: bool, uses: tuple[bool, ...]):
    mesh = fd.Mesh(dp=dist.get_world_size())
    leaves = [t.requires_grad_(True) for t in _tensors()]
    scale = float(dist.get_rank() + 1)  # each rank's loss differs
    with fd.comm_ledger() as ledger:
        if grouped:
            views = fd.replicate_many(leaves, "dp", "mean", mesh=mesh)
        else:
            views = [fd.replicate(t, "dp", "mean", mesh=mesh) for t in leaves]
        loss = sum(
            (v.sin() * scale).sum().double() for v, use in zip(views, uses) if use
        ) + torch.zeros((), dtype=torch.float64)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return list(grads), ledger.count("all_reduce")


def test_the_gradients_are_those_of_replicate_in_one_all_reduce_per_dtype():
    uses = (True, True, True)
    for (grouped, calls), (single, single_calls) in zip(
        run_spmd(_grads, 2, True, uses), run_spmd(_grads, 2, False, uses)
    ):
        assert_trees_equal(grouped, single)  # 2 ranks: the same sums, bit for bit
        assert (calls, single_calls) == (2, 3)  # float32 and float64 leaves: two all-reduces


def _partly_used():
    # The first tensor is used by rank 0 only, the last by no rank.
    uses = (dist.get_rank() == 0, True, False)
    return _grads(True, uses)[0]


def test_a_tensor_some_ranks_did_not_use_is_averaged_with_zeros_and_one_none_used_has_none():
    expected = 0.5 * torch.cos(_tensors()[0])  # rank 0's gradient (scale 1), halved
    for grads in run_spmd(_partly_used, 2):
        torch.testing.assert_close(grads[0], expected)
        assert grads[1] is not None
        assert grads[2] is None  # as autograd leaves a tensor no loss used


def _under_torch_func():
    mesh = fd.Mesh(dp=dist.get_world_size())
    scale = float(dist.get_rank() + 1)

    def loss(a, b):
        x, y = fd.replicate_many([a, b], "dp", "sum", mesh=mesh)
        return (x * scale).sum() + (y * y).sum()

    a, b = torch.ones(3), torch.arange(2.0)
    return torch.func.grad(loss, argnums=(0, 1))(a, b)


def test_it_is_a_differentiable_collective_under_torch_func():
    for grad_a, grad_b in run_spmd(_under_torch_func, 2):
        assert torch.equal(grad_a, torch.full((3,), 3.0))  # 1 + 2, summed over the ranks
        assert torch.equal(grad_b, 2 * 2 * torch.arange(2.0))


def test_bad_input_is_refused():
    mesh = fd.Mesh(dp=1)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        fd.replicate_many([torch.zeros(2), 3.0], "dp", mesh=mesh)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="op"):
        fd.replicate_many([torch.zeros(2)], "dp", "max", mesh=mesh)
    assert fd.replicate_many([], "dp", mesh=mesh) == []
    one = torch.zeros(2)
    assert fd.replicate_many([one], "dp", mesh=mesh)[0] is one  # one rank: nothing to reduce
