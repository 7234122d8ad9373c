"""A GPT with MoE MLPs trained over a dp x ep = 2 x 2 mesh under data_parallel, shard_optimizer
and fully_shard over "dp" with the experts sharded over "ep" equals one process running the
same routing groups with every expert."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale.models import GPTConfig, MoEGPT, MoEGPTConfig, lm_loss
from fscale.testing import run_spmd

WORLD = 4
STEPS = 2
F64 = torch.float64


def config(capacity: str) -> MoEGPTConfig:
    gpt = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=16)
    return MoEGPTConfig(gpt, num_experts=4, moe={"k": 2, "capacity": capacity})


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 32, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_loss(apply):
    def loss_fn(params, buffers, batch, key):
        (logits, aux_loss), _ = apply(params, buffers, batch[0], key=key)
        return lm_loss(logits, batch[1]) + aux_loss

    return loss_fn


def _sharded_case(strategy: str, capacity: str, steps: int = STEPS):
    mesh = fs.Mesh(dp=2, ep=2)
    model = MoEGPT(config(capacity), mesh=mesh, seed=3).double()
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(make_loss(apply), fs.optim.sgd(0.2, momentum=0.9))
    transform = {
        "data_parallel": fs.data_parallel,
        "shard_optimizer": fs.shard_optimizer,
        "fully_shard": fs.fully_shard,
    }[strategy]
    step = fs.expert_parallel(transform(step, mesh, "dp"), mesh, "ep")
    state = step.init(params, buffers)
    expert_shape = tuple(fs.consolidate(step, state).params["blocks.1.mlp.experts.w_in"].shape)
    losses = []
    for i in range(steps):
        state, metrics = step(state, batch(i, dist.get_rank()))
        losses.append(float(metrics["loss"]))
    full = fs.consolidate(step, state)
    return losses, full.params, expert_shape, repr(step.plan)


def reference(capacity: str, steps: int = STEPS):
    model = MoEGPT(config(capacity), seed=3).double()
    apply, params, buffers = fs.functionalize(model)
    per_group = make_loss(apply)

    def loss_fn(params, buffers, batches, key):
        return sum(per_group(params, buffers, b, key) for b in batches) / len(batches)

    step = fs.train_step(loss_fn, fs.optim.sgd(0.2, momentum=0.9))
    state = step.init(params, buffers)
    losses = []
    for i in range(steps):
        state, metrics = step(state, [batch(i, r) for r in range(WORLD)])
        losses.append(float(metrics["loss"]))
    return losses, state.params


@pytest.mark.parametrize(
    ("strategy", "capacity"),
    [("data_parallel", "fixed"), ("shard_optimizer", "dropless"), ("fully_shard", "fixed")],
)
def test_moe_gpt_over_dp_and_ep_equals_one_process(strategy, capacity):
    expected_losses, expected_params = reference(capacity)
    for losses, params, expert_shape, plan in run_spmd(_sharded_case, WORLD, strategy, capacity):
        assert plan.startswith("expert_parallel(axis='ep' of size 2)")
        assert expert_shape == (4, 16, 16)  # consolidated: all four experts
        assert losses == pytest.approx(expected_losses, rel=1e-6)  # metrics reduce in float32
        assert set(params) == set(expected_params)
        for name, value in expected_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")
