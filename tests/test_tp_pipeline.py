"""Tensor parallelism inside pipeline stages: pp=2 x tp=2 on 4 ranks equals one dense process.

A GPT cut into an ``nn.Sequential`` (embeddings, blocks, final norm and output layer) is made
tensor-parallel over "tp" (Megatron's plan: vocab-parallel embedding, column-parallel q/k/v and
first MLP layer, row-parallel output projections, column-parallel output layer gathered for the
loss), then pipelined over "pp". In float64, the parameters and optimizer state after a few
Adam steps equal the dense Sequential trained in one process, as each rank holds them: the pp
ranks gather the stages (`consolidate`), the tp shards stay this rank's (`shard_like` of the
dense result).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fscale as fs
from fscale.models import GPT, GPTConfig, lm_loss
from fscale.parallel import tensor as tpl
from fscale.parallel.pipeline import pipeline
from fscale.testing import assert_trees_close, run_spmd

STEPS = 3
CLOSE = dict(rtol=1e-10, atol=1e-12)
VOCAB, SEQ_LEN, BATCH = 32, 8, 8

# The GPT plan (`fscale.parallel.tensor.gpt_plan`) under the Sequential's names: "0" is the
# embeddings, "1" ... "4" the blocks, "5" the final norm ("5.0") and output layer ("5.1").
PLAN = {
    "0.token": "vocab",
    "*.attn": (tpl.Heads("n_heads"), tpl.Input("replicated")),
    "*.attn.qkv": tpl.Colwise(parts=3),
    "*.attn.proj": "rowwise",
    "*.mlp": tpl.Input("replicated"),
    "*.mlp.fc_in": "colwise",
    "*.mlp.fc_out": "rowwise",
    "5.1": tpl.Colwise(gather_output=True),
}


def _sequential(seed: int) -> nn.Sequential:
    cfg = GPTConfig(
        vocab_size=VOCAB,
        seq_len=SEQ_LEN,
        d_model=16,
        n_heads=4,
        n_layers=4,
        tie_embeddings=False,  # a module pipeline needs untied layers
    )
    gpt = GPT(cfg, seed=seed)
    head = nn.Sequential(gpt.final_norm, gpt.lm_head)
    return nn.Sequential(gpt.embed, *gpt.blocks, head).double()


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _dense(model: nn.Sequential, batch, steps: int):
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, data, key):
        logits, b = apply(p, b, data[0], key=key)
        return lm_loss(logits, data[1]), b

    step = fs.train_step(loss_fn, fs.optim.adam(1e-2))
    state = step.init(params, buffers)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def _tp_pipeline(schedule: str, micro_batches: int, checkpoint: str, seed: int):
    mesh = fs.Mesh(pp=2, tp=2)
    dense = _sequential(seed)
    model = tpl.tensor_parallel(dense, mesh, "tp", PLAN)
    _, params, buffers = fs.functionalize(model)
    step = pipeline(
        model,
        lm_loss,
        fs.optim.adam(1e-2),
        mesh,
        "pp",
        micro_batches=micro_batches,
        schedule=schedule,
        balance=[3, 3],
        checkpoint=checkpoint,
    )
    batch = _batch(seed)
    state = step.init(params, buffers)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    full = fs.consolidate(step, state)
    expected, expected_losses = _dense(dense, batch, STEPS)
    mu, nu = full.opt_state.exp_avg, full.opt_state.exp_avg_sq
    expected_mu, expected_nu = expected.opt_state.exp_avg, expected.opt_state.exp_avg_sq
    return (
        (full.params, mu, nu, losses),
        (
            tpl.shard_like(expected.params, model),
            tpl.shard_like(expected_mu, model),
            tpl.shard_like(expected_nu, model),
            expected_losses,
        ),
    )


@pytest.mark.parametrize(
    ("schedule", "micro_batches", "checkpoint"),
    [("gpipe", 4, "except_last"), ("1f1b", 2, "never"), ("zero_bubble", 4, "always")],
)
def test_tensor_parallel_stages_equal_dense_training(schedule, micro_batches, checkpoint):
    results = run_spmd(_tp_pipeline, 4, schedule, micro_batches, checkpoint, 3)
    for (params, mu, nu, losses), (e_params, e_mu, e_nu, e_losses) in results:
        assert_trees_close(params, e_params, **CLOSE)
        assert_trees_close(mu, e_mu, **CLOSE)
        assert_trees_close(nu, e_nu, **CLOSE)
        assert losses == pytest.approx(e_losses, rel=1e-12)
