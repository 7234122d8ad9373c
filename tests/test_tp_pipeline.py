"""Tensor parallelism inside pipeline stages: pp=2 x tp=2 on 4 ranks equals one dense process.

A GPT cut into an ``nn.Sequential`` (embeddings, blocks, final norm and output layer) is made
tensor-parallel over "tp" (Megatron's plan: vocab-parallel embedding, column-parallel q/k/v and
first MLP layer, row-parallel output projections, column-parallel output layer, its logits
gathered or left split for the vocab-parallel loss; optionally sequence parallel, so that the
stages pass sequence shards), then pipelined over "pp" under each schedule. In float64, the
losses, parameters and Adam moments after three steps equal the dense Sequential trained in
one process, as each rank holds them: `consolidate` gathers the stages over "pp" but leaves the
tp shards this rank's (compared with `shard_like` of the dense result), and `shard_state` of
that state continues the run."""

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


def _plan(sequence_parallel: bool, vocab_parallel: bool) -> dict:
    """`fscale.parallel.tensor.gpt_plan` under the Sequential's names: "0" is the embeddings,
    "1" ... "4" the blocks, "5" the final norm ("5.0") and the output layer ("5.1")."""
    how = "sequence" if sequence_parallel else "replicated"
    plan = {
        "0.token": "vocab",
        "*.attn": (tpl.Heads("n_heads"), tpl.Input(how)),
        "*.attn.qkv": tpl.Colwise(parts=3),
        "*.attn.proj": tpl.Rowwise(output=how),
        "*.mlp": tpl.Input(how),
        "*.mlp.fc_in": "colwise",
        "*.mlp.fc_out": tpl.Rowwise(output=how),
        "5.1": tpl.Colwise(input=how, gather_output=not vocab_parallel),
    }
    if sequence_parallel:  # the stages pass sequence shards to each other
        plan["0"] = tpl.Output("split")
        for name in ("attn_norm", "mlp_norm", "attn.dropout", "mlp.dropout"):
            plan[f"*.{name}"] = "sequence"
        plan["5.0"] = "sequence"
    return plan


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


def _tp_pipeline(case):
    schedule, micro_batches, checkpoint, sequence_parallel, vocab_parallel, seed = case
    mesh = fs.Mesh(pp=2, tp=2)
    dense = _sequential(seed)
    model = tpl.tensor_parallel(dense, mesh, "tp", _plan(sequence_parallel, vocab_parallel))
    _, params, buffers = fs.functionalize(model)

    def loss_fn(logits, targets):
        if vocab_parallel:
            return tpl.vocab_parallel_cross_entropy(logits, targets, "tp", mesh=mesh)
        return lm_loss(logits, targets)

    step = pipeline(
        model,
        loss_fn,
        fs.optim.adam(1e-2),
        mesh,
        "pp",
        micro_batches=micro_batches,
        schedule=schedule,
        balance=[2, 1, 1, 2] if schedule == "interleaved" else [3, 3],
        checkpoint=checkpoint,
    )
    batch = _batch(seed)
    state = step.init(params, buffers)
    losses = []
    for i in range(STEPS):
        if i == STEPS - 1:  # the full form (of this tp rank's shards) continues the run
            state = fs.shard_state(step, fs.consolidate(step, state))
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    full = fs.consolidate(step, state)
    expected, expected_losses = _dense(dense, batch, STEPS)
    got = (full.params, full.opt_state.exp_avg, full.opt_state.exp_avg_sq, losses)
    want = (
        tpl.shard_like(expected.params, model),
        tpl.shard_like(expected.opt_state.exp_avg, model),
        tpl.shard_like(expected.opt_state.exp_avg_sq, model),
        expected_losses,
    )
    return got, want


CASES = [
    # schedule, micro_batches, checkpoint, sequence_parallel, vocab_parallel
    ("gpipe", 4, "except_last", False, False),
    ("1f1b", 4, "never", True, True),
    ("zero_bubble", 2, "always", False, True),
    ("interleaved", 2, "except_last", True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_tensor_parallel_stages_equal_dense_training(case):
    for got, want in run_spmd(_tp_pipeline, 4, (*case, 3)):
        params, mu, nu, losses = got
        # consolidate gathers the stages over "pp" but not the shards over "tp": each rank's
        # full state holds its tp shards under the dense names (half the MLP's hidden units).
        assert params["1.mlp.fc_in.weight"].shape == (32, 16)
        assert_trees_close(params, want[0], **CLOSE)
        assert_trees_close(mu, want[1], **CLOSE)
        assert_trees_close(nu, want[2], **CLOSE)
        assert losses == pytest.approx(want[3], rel=1e-12)


def _dense_with(model: nn.Sequential, batch, steps: int, optimizer):
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, data, key):
        logits, b = apply(p, b, data[0], key=key)
        return lm_loss(logits, data[1]), b

    step = fs.train_step(loss_fn, optimizer)
    state = step.init(params, buffers)
    for _ in range(steps):
        state, _ = step(state, batch)
    return state


def _pp_tp_dp(per_stage_kind, optimizer_name):
    mesh = fs.Mesh(dp=2, pp=2, tp=2)
    dense = _sequential(5)
    model = tpl.tensor_parallel(dense, mesh, "tp", _plan(False, False))
    apply, params, buffers = fs.functionalize(model)
    make = {
        "adam": lambda: fs.optim.adam(1e-2),
        "adafactor": lambda: fs.optim.adafactor(1e-2, beta1=0.9),
    }[optimizer_name]
    per_stage = {
        "data_parallel": lambda s: fs.data_parallel(s, mesh, "dp"),
        "shard_optimizer": lambda s: fs.shard_optimizer(s, mesh, "dp"),
    }[per_stage_kind]
    step = pipeline(
        model,
        lm_loss,
        tpl.tensor_parallel_optimizer(make(), apply),
        mesh,
        "pp",
        micro_batches=2,
        schedule="1f1b",
        balance=[3, 3],
        per_stage=per_stage,
    )
    batch = _batch(5)
    local = fs.data.split_batch(batch, mesh.rank("dp"), 2)
    state = step.init(params, buffers)
    for _ in range(STEPS):
        state, _ = step(state, local)
    full = fs.consolidate(step, state, model=apply)
    expected = _dense_with(dense, batch, STEPS, make())
    return (full.params, full.opt_state), (expected.params, expected.opt_state)


@pytest.mark.parametrize(
    ("per_stage_kind", "optimizer_name"),
    [("data_parallel", "adam"), ("shard_optimizer", "adafactor")],
)
def test_pp_by_tp_by_dp_consolidates_to_dense_training(per_stage_kind, optimizer_name):
    # 8 ranks: each stage tensor-parallel over "tp" and data-parallel (or ZeRO) over "dp";
    # consolidate(model=) gathers the stages over "pp" and the shards over "tp".
    for got, want in run_spmd(_pp_tp_dp, 8, per_stage_kind, optimizer_name):
        assert_trees_close(got, want, **CLOSE)
