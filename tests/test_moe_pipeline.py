"""Expert parallelism inside pipeline stages: pp=2 x ep=2 on 4 ranks equals one process.

A GPT with MoE MLPs in every other block is cut into an ``nn.Sequential`` whose layers pass
``(hidden, aux_loss)`` on, so the MoE layers' router losses reach the loss on the last stage.
Pipelined over "pp" with each stage `expert_parallel` over "ep" (every ep rank reads its own
batch; each rank holds half of every expert leaf), three steps in float64 equal one process
that runs every expert on the same routing groups: each (ep rank, micro-batch) slice is one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fscale as fs
from fscale.models import GPTConfig, MoEGPT, MoEGPTConfig, lm_loss
from fscale.models.moe_gpt import MoEBlock
from fscale.parallel.pipeline import pipeline
from fscale.testing import assert_trees_close, run_spmd

STEPS, MICRO_BATCHES, EP = 3, 2, 2


class _Embed(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        return x, x.new_zeros(())


class _Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, carried: tuple[torch.Tensor, torch.Tensor]):
        x, aux = carried
        if isinstance(self.block, MoEBlock):
            x, block_aux = self.block(x)
            return x, aux + block_aux
        return self.block(x), aux


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, carried: tuple[torch.Tensor, torch.Tensor]):
        x, aux = carried
        return self.head(self.norm(x)), aux


def _sequential(mesh=None) -> nn.Sequential:
    gpt = GPTConfig(
        vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=4, d_ff=16, tie_embeddings=False
    )
    cfg = MoEGPTConfig(gpt, num_experts=4, moe={"k": 2, "capacity": "dropless"})
    model = MoEGPT(cfg, mesh=mesh, seed=2).double()
    blocks = [_Block(b) for b in model.blocks]
    return nn.Sequential(_Embed(model.embed), *blocks, _Head(model.final_norm, model.lm_head))


def _loss(outputs, targets):
    logits, aux = outputs
    return lm_loss(logits, targets) + aux


def _batch(step: int, ep_rank: int):
    g = torch.Generator().manual_seed(100 * step + ep_rank)
    tokens = torch.randint(0, 32, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _pipelined(schedule: str):
    mesh = fs.Mesh(pp=2, ep=EP)
    model = _sequential(mesh)
    _, params, buffers = fs.functionalize(model)
    step = pipeline(
        model,
        _loss,
        fs.optim.adam(1e-2),
        mesh,
        "pp",
        micro_batches=MICRO_BATCHES,
        schedule=schedule,
        balance=[3, 3],
        per_stage=lambda s: fs.expert_parallel(s, mesh, "ep"),
    )
    state = step.init(params, buffers)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i, mesh.rank("ep")))
        losses.append(float(metrics["loss"]))
    return losses, fs.consolidate(step, state).params


def _one_process():
    model = _sequential()
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, groups, key):
        losses = [_loss(apply(params, buffers, x, key=key)[0], y) for x, y in groups]
        return sum(losses) / len(losses), buffers

    step = fs.train_step(loss_fn, fs.optim.adam(1e-2))
    state = step.init(params, buffers)
    losses = []
    for i in range(STEPS):
        groups = []
        for r in range(EP):
            x, y = _batch(i, r)
            size = x.shape[0] // MICRO_BATCHES
            groups += [
                (x[j * size : (j + 1) * size], y[j * size : (j + 1) * size])
                for j in range(MICRO_BATCHES)
            ]
        state, metrics = step(state, groups)
        losses.append(float(metrics["loss"]))
    return losses, state.params


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_expert_parallel_stages_equal_one_process(schedule):
    expected_losses, expected = _one_process()
    for losses, params in run_spmd(_pipelined, 4, schedule):
        assert losses == pytest.approx(expected_losses, rel=1e-6)
        assert params["2.block.mlp.experts.w_in"].shape[0] == 4  # consolidated: every expert
        assert_trees_close(params, expected, rtol=1e-9, atol=1e-11)


def _outside():
    mesh = fs.Mesh(pp=2, ep=EP)
    model = _sequential(mesh)
    step = pipeline(model, _loss, fs.optim.adam(1e-2), mesh, "pp", micro_batches=2, balance=[3, 3])
    with pytest.raises(ValueError, match="make each stage expert-parallel instead"):
        fs.expert_parallel(step, mesh, "ep")
    return True


def test_expert_parallel_around_a_pipeline_is_refused_with_the_fix():
    # Its gradient maps wrap the step's loss function, which a pipeline's stages never call:
    # the replicated leaves would not be averaged over "ep" (measured: every leaf differed).
    assert run_spmd(_outside, 4) == [True] * 4
