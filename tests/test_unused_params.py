"""A parameter the loss does not use is left as it was, as torch.optim and torch DDP leave it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fscale as fs
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd

STEPS = 4


class Net(torch.nn.Module):
    """`unused` never takes part; `sometimes` only when the batch's flag says so."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)
        self.sometimes = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        out = self.b(h)
        if bool(flag.any()):
            out = out + self.sometimes(h)
        return out


def _batch(step: int, rank: int, flag: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g), torch.tensor([flag])


def _loss_fn(apply):
    def loss_fn(params, buffers, batch, key):
        out, _ = apply(params, buffers, batch[0], batch[2])
        return torch.nn.functional.mse_loss(out, batch[1])

    return loss_fn


OPTIMIZERS = {
    "sgd": (
        lambda: fs.optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, fused=True),
    ),
    "adam": (
        lambda: fs.optim.adam(1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "adamw": (
        lambda: fs.optim.adamw(1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
}


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unused_parameter_equals_torch_optim(name, donate):
    make_fscale, make_torch = OPTIMIZERS[name]
    model = Net()
    eager = copy.deepcopy(model)
    apply, params, buffers = fs.functionalize(model)
    initial = {k: v.detach().clone() for k, v in params.items()}
    step = fs.train_step(_loss_fn(apply), make_fscale(), donate=donate)
    state = step.init(params, buffers)
    torch_opt = make_torch(list(eager.parameters()))
    for i in range(STEPS):
        # `sometimes` is used at steps 0 and 1 only: afterwards torch keeps it (and its state)
        # as they were, although momentum would still move it.
        batch = _batch(i, 0, flag=i < 2)
        torch_opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(eager(batch[0], batch[2]), batch[1]).backward()
        torch_opt.step()
        state, _ = step(state, batch)
    assert_trees_equal(state.params, {n: p.detach() for n, p in eager.named_parameters()})
    assert torch.equal(state.params["unused.weight"], initial["unused.weight"])


def test_zero_mode_moves_unused_parameters_by_weight_decay():
    apply, params, buffers = fs.functionalize(Net())
    initial = params["unused.weight"].detach().clone()
    step = fs.train_step(_loss_fn(apply), fs.optim.adamw(1e-2), unused_params="zero")
    state, _ = step(step.init(params, buffers), _batch(0, 0, flag=False))
    assert not torch.equal(state.params["unused.weight"], initial)
    with pytest.raises(ValueError, match="`unused_params` must be one of"):
        fs.train_step(_loss_fn(apply), fs.optim.adamw(1e-2), unused_params="ignore")


def _train_with_ddp(strategy: str, name: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    make_fscale, make_torch = OPTIMIZERS[name]
    model = Net()
    reference = copy.deepcopy(model)
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(_loss_fn(apply), make_fscale(), unused_params="skip")
    mesh = fs.Mesh(dp=world)
    step = fs.data_parallel(step, mesh) if strategy == "ddp" else fs.shard_optimizer(step, mesh)
    state = step.init(params, buffers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(
            reference, broadcast_buffers=False, find_unused_parameters=True
        )
    torch_opt = make_torch(list(ddp.parameters()))
    for i in range(STEPS):
        # `sometimes` is used on rank 0 only, at the first two steps: used by the step there
        batch = _batch(i, rank, flag=rank == 0 and i < 2)
        torch_opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(batch[0], batch[2]), batch[1]).backward()
        torch_opt.step()
        state, _ = step(state, batch)
    full = fs.consolidate(step, state)
    return full.params, {n: p.detach() for n, p in reference.named_parameters()}


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_data_parallel_skips_like_ddp_find_unused_parameters(name):
    for ours, ddp in run_spmd(_train_with_ddp, 2, "ddp", name):
        assert_trees_equal(ours, ddp)


def test_shard_optimizer_skips_like_ddp_find_unused_parameters():
    for ours, ddp in run_spmd(_train_with_ddp, 2, "zero", "adamw"):
        assert_trees_close(ours, ddp, rtol=1e-6, atol=1e-7)
        assert torch.equal(ours["unused.weight"], Net().unused.weight.detach())


def test_value_and_grad_reports_usage():
    params = {"used": torch.ones(2), "unused": torch.ones(3)}
    out, _ = fs.value_and_grad(
        lambda p, b, batch, key: (p["used"] * 2).sum(), params, {}, None, fs.random.key(0)
    )
    assert out.used == (False, True)  # leaf order: "unused", "used"


def test_accumulate_counts_a_parameter_used_by_any_micro_batch():
    apply, params, buffers = fs.functionalize(Net())
    initial = {k: v.detach().clone() for k, v in params.items()}
    step = fs.accumulate(fs.train_step(_loss_fn(apply), fs.optim.adamw(1e-2)), 2)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g))
    # the flag splits into 4 x True and 4 x False: `sometimes` is used by the first slice only
    flag = torch.tensor([True] * 4 + [False] * 4)
    state, _ = step(step.init(params, buffers), (*batch, flag))
    assert not torch.equal(state.params["sometimes.weight"], initial["sometimes.weight"])
    assert torch.equal(state.params["unused.weight"], initial["unused.weight"])
