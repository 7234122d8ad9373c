"""Tensor and expert parallelism together: tp=2 x ep=2 on 4 ranks equals one process.

A GPT with MoE MLPs (built over the mesh, so its MoE layers hold it) is made tensor-parallel
over "tp" in its attention (heads split, q/k/v column-parallel in 3 parts, the projection
row-parallel) and expert-parallel over "ep". `tensor_parallel` copies the model it splits: the
copy shares the mesh (a handle on process groups) and keeps its parameters' attributes (the
expert leaves' local shapes, which `apply` checks).
"""

from __future__ import annotations

import copy

import torch

import fscale as fs
from fscale.models import GPTConfig, MoEGPT, MoEGPTConfig, lm_loss
from fscale.parallel import tensor as tpl
from fscale.testing import assert_trees_close, run_spmd

STEPS = 2


def _config() -> MoEGPTConfig:
    gpt = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=16)
    return MoEGPTConfig(gpt, num_experts=4, moe={"k": 2, "capacity": "dropless"})


def _batch(step: int, ep_rank: int):
    g = torch.Generator().manual_seed(1000 * step + ep_rank)
    tokens = torch.randint(0, 32, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(apply):
    def loss_fn(params, buffers, batch, key):
        (logits, aux_loss), _ = apply(params, buffers, batch[0], key=key)
        return lm_loss(logits, batch[1]) + aux_loss

    return loss_fn


def _tp_ep():
    mesh = fs.Mesh(ep=2, tp=2)
    plan = {
        "blocks.*.attn": tpl.Heads("n_heads"),
        "blocks.*.attn.qkv": tpl.Colwise(parts=3),
        "blocks.*.attn.proj": "rowwise",
    }
    model = tpl.tensor_parallel(MoEGPT(_config(), mesh=mesh, seed=3).double(), mesh, "tp", plan)
    apply, params, buffers = fs.functionalize(model)
    step = fs.expert_parallel(fs.train_step(_loss(apply), fs.optim.adam(1e-2)), mesh, "ep")
    state = step.init(params, buffers)
    for i in range(STEPS):
        state, _ = step(state, _batch(i, mesh.rank("ep")))
    return fs.consolidate(step, state, model=apply).params


def _one_process():
    apply, params, buffers = fs.functionalize(MoEGPT(_config(), seed=3).double())
    per_group = _loss(apply)

    def loss_fn(params, buffers, groups, key):
        return sum(per_group(params, buffers, g, key) for g in groups) / len(groups)

    step = fs.train_step(loss_fn, fs.optim.adam(1e-2))
    state = step.init(params, buffers)
    for i in range(STEPS):
        state, _ = step(state, [_batch(i, r) for r in range(2)])
    return state.params


def test_tensor_parallel_attention_with_expert_parallel_mlps_equals_one_process():
    expected = _one_process()
    for params in run_spmd(_tp_ep, 4):
        assert params["blocks.0.attn.qkv.weight"].shape == (48, 16)  # gathered over "tp"
        assert params["blocks.1.mlp.experts.w_in"].shape[0] == 4  # gathered over "ep"
        assert_trees_close(params, expected, rtol=1e-9, atol=1e-11)


def test_a_copied_module_shares_its_mesh_and_keeps_its_parameters_attributes():
    mesh = fs.Mesh(tp=1)
    assert copy.deepcopy(mesh) is mesh
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    dense[0].weight.note = "kept"  # type: ignore[attr-defined]
    model = tpl.tensor_parallel(dense, mesh, "tp", {"0": "replicate"})
    assert model[0].weight.note == "kept"
    assert model[0].weight is not dense[0].weight
