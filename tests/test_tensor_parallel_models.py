"""Tensor-parallel GPT and Llama equal their dense models; tp x dp equals one process.

For a drawn model and batch, every rank of the tensor-parallel axis computes the outputs, the
gradients of every parameter and the parameters after a few optimizer steps; each is compared
with the dense model's, sharded the way this rank holds it (`shard_like`): split parameters are
this rank's slice of the dense value, replicated ones (the norms) the dense value itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

import fscale as fs
from fscale.models import GPT, GPTConfig, lm_loss
from fscale.parallel import tensor as tpl
from fscale.testing import assert_trees_close, assert_trees_equal, run_spmd

STEPS = 3
OUT = dict(rtol=1e-5, atol=1e-6)
TRAINED = dict(rtol=1e-4, atol=1e-5)


def _loss_fn(apply, mesh, vocab_parallel, logits_of=lambda out: out):
    def loss_fn(params, buffers, tokens, key):
        out, buffers = apply(params, buffers, tokens[:, :-1], key=key)
        logits, targets = logits_of(out), tokens[:, 1:]
        if vocab_parallel:
            return tpl.vocab_parallel_cross_entropy(logits, targets, "tp", mesh=mesh), buffers
        return lm_loss(logits, targets), buffers

    return loss_fn


def _run(module, mesh, step_of, batches, vocab_parallel, logits_of):
    """Logits, gradients at the first batch, losses and params after training, for `module`."""
    apply, params, buffers = fs.functionalize(module)
    step = step_of(fs.train_step(_loss_fn(apply, mesh, vocab_parallel, logits_of), _sgd()))
    state = step.init(params, buffers)
    logits = logits_of(apply(params, buffers, batches[0][:, :-1], key=state.key)[0])
    grads, _ = step.gradients(state, batches[0])
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return logits.detach(), grads, torch.stack(losses), fs.consolidate(step, state).params


def _sgd():
    return fs.optim.sgd(0.1, momentum=0.9)


def _batches(vocab, seq_len, batch=4, steps=STEPS):
    g = torch.Generator().manual_seed(seq_len)
    return [torch.randint(0, vocab, (batch, seq_len + 1), generator=g) for _ in range(steps)]


def _compare_on_rank(dense, model, dense_run, tp_run, vocab_parallel):
    """The dense results as this rank holds them, beside the rank's own."""
    logits, grads, losses, params = dense_run
    if vocab_parallel:
        logits = logits.chunk(dist.get_world_size(), -1)[dist.get_rank()]
    expected = (logits, tpl.shard_like(grads, model), losses, tpl.shard_like(params, model))
    return tp_run, expected


# ----------------------------------------------------------------------------- fscale's GPT


def _gpt(case):
    width, heads, layers, seed, sequence_parallel, vocab_parallel, dropout = case
    cfg = GPTConfig(
        vocab_size=32, seq_len=8, d_model=width, n_heads=heads, n_layers=layers, dropout=dropout
    )
    dense = GPT(cfg, seed=seed)
    mesh = fs.Mesh(tp=dist.get_world_size())
    plan = tpl.gpt_plan(sequence_parallel=sequence_parallel, vocab_parallel_loss=vocab_parallel)
    model = tpl.tensor_parallel(dense, mesh, "tp", plan)
    batches = _batches(32, 8)
    dense_run = _run(dense, None, lambda s: s, batches, False, lambda out: out)
    tp_run = _run(model, mesh, lambda s: s, batches, vocab_parallel, lambda out: out)
    return _compare_on_rank(dense, model, dense_run, tp_run, vocab_parallel)


@settings(deadline=None)
@given(
    world=st.sampled_from([2, 4]),
    width_per_head=st.sampled_from([2, 4]),
    layers=st.integers(1, 2),
    seed=st.integers(0, 50),
    sequence_parallel=st.booleans(),
    vocab_parallel=st.booleans(),
    dropout=st.sampled_from([0.0, 0.2]),
)
def test_tensor_parallel_gpt_equals_the_dense_gpt(
    world, width_per_head, layers, seed, sequence_parallel, vocab_parallel, dropout
):
    # Dropout outside the regions draws the dense masks; under sequence parallelism the
    # stream's dropout is per rank (see TensorParallelDropout), so it is compared without.
    dropout = 0.0 if sequence_parallel else dropout
    case = (width_per_head * 4, 4, layers, seed, sequence_parallel, vocab_parallel, dropout)
    for got, expected in run_spmd(_gpt, world, case):
        assert_trees_close(got[:2], expected[:2], **OUT)
        assert_trees_close(got[2:], expected[2:], **TRAINED)


def _gpt_remat():
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2)
    dense = GPT(cfg, seed=4)
    mesh = fs.Mesh(tp=dist.get_world_size())
    model = tpl.tensor_parallel(dense, mesh, "tp", tpl.gpt_plan(sequence_parallel=True))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = fs.checkpoint(block)
    batches = _batches(32, 8, steps=1)
    plain = _run(
        tpl.tensor_parallel(dense, mesh, "tp", tpl.gpt_plan(sequence_parallel=True)),
        mesh,
        lambda s: s,
        batches,
        False,
        lambda out: out,
    )
    return _run(model, mesh, lambda s: s, batches, False, lambda out: out)[1], plain[1]


def test_remat_of_tensor_parallel_blocks_changes_no_gradient():
    for remat, plain in run_spmd(_gpt_remat, 2):
        assert_trees_equal(remat, plain)


def _sequence_dropout_masks():
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1, dropout=0.5)
    mesh = fs.Mesh(tp=dist.get_world_size())
    model = tpl.tensor_parallel(GPT(cfg), mesh, "tp", tpl.gpt_plan(sequence_parallel=True))
    apply, params, buffers = fs.functionalize(model)
    block = model.blocks[0].mlp.dropout
    assert isinstance(block, tpl.TensorParallelDropout)
    seen = []
    handle = block.register_forward_hook(lambda m, args, out: seen.append(out / args[0]))
    tokens = torch.randint(0, 32, (2, 8))
    for _ in range(2):
        apply(params, buffers, tokens, key=fs.random.key(3))
    handle.remove()
    return seen


def test_sequence_parallel_dropout_differs_per_rank_and_follows_the_key():
    (a_first, a_again), (b_first, _) = run_spmd(_sequence_dropout_masks, 2)
    assert_trees_equal(a_first, a_again)
    assert not torch.equal(a_first.nan_to_num(), b_first.nan_to_num())


def _grad_modes(sequence_parallel, vocab_parallel):
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1, dropout=0.1)
    mesh = fs.Mesh(tp=dist.get_world_size())
    plan = tpl.gpt_plan(sequence_parallel=sequence_parallel, vocab_parallel_loss=vocab_parallel)
    apply, params, buffers = fs.functionalize(
        tpl.tensor_parallel(GPT(cfg, seed=3), mesh, "tp", plan)
    )
    grads = []
    for mode in ("autograd", "func"):
        loss_fn = _loss_fn(apply, mesh, vocab_parallel)
        step = fs.train_step(loss_fn, _sgd(), grad_mode=mode)
        grads.append(step.gradients(step.init(params, buffers), _batches(32, 8, steps=1)[0])[0])
    return grads


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_func_gradients_equal_autograd_gradients(sequence_parallel):
    for autograd_grads, func_grads in run_spmd(_grad_modes, 2, sequence_parallel, True):
        assert_trees_close(func_grads, autograd_grads, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- HF Llama


def _llama(case):
    from transformers import LlamaConfig, LlamaForCausalLM

    kv_heads, layers, seed, sequence_parallel, vocab_parallel, tie = case
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    dense = LlamaForCausalLM(config).float()
    with torch.no_grad():  # random norm weights, so their gradients are not symmetric
        for name, param in dense.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    mesh = fs.Mesh(tp=dist.get_world_size())
    plan = tpl.llama_plan(sequence_parallel=sequence_parallel, vocab_parallel_loss=vocab_parallel)
    model = tpl.tensor_parallel(dense, mesh, "tp", plan)
    batches = _batches(32, 8)
    logits_of = lambda out: out.logits  # noqa: E731
    dense_run = _run(dense, None, lambda s: s, batches, False, logits_of)
    tp_run = _run(model, mesh, lambda s: s, batches, vocab_parallel, logits_of)
    return _compare_on_rank(dense, model, dense_run, tp_run, vocab_parallel)


# Fewer examples than the GPT's: each rank imports transformers on first use (seconds), and the
# plan is the same code path as the GPT's.
@settings(deadline=None, max_examples=examples(4))
@given(
    world=st.sampled_from([2, 4]),
    layers=st.integers(1, 2),
    seed=st.integers(0, 50),
    sequence_parallel=st.booleans(),
    vocab_parallel=st.booleans(),
    tie=st.booleans(),
)
def test_tensor_parallel_llama_equals_the_dense_llama(
    world, layers, seed, sequence_parallel, vocab_parallel, tie
):
    pytest.importorskip("transformers", reason="the Llama plan is tested on HF transformers")
    kv_heads = 2 if world == 2 else 4  # grouped-query attention where the heads allow it
    case = (kv_heads, layers, seed, sequence_parallel, vocab_parallel, tie)
    for got, expected in run_spmd(_llama, world, case, timeout=300):
        assert_trees_close(got[:2], expected[:2], **OUT)
        assert_trees_close(got[2:], expected[2:], **TRAINED)


# ----------------------------------------------------------------------------- tp x dp


def _tp_dp(strategy, sequence_parallel):
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2)
    dense = GPT(cfg, seed=5)
    mesh = fs.Mesh(dp=2, tp=2)
    model = tpl.tensor_parallel(
        dense, mesh, "tp", tpl.gpt_plan(sequence_parallel=sequence_parallel)
    )
    dp = mesh.rank("dp")
    batches = _batches(32, 8, batch=8)
    local_batches = [fs.data.split_batch(b, dp, 2) for b in batches]
    wrap = {
        "data_parallel": lambda s: fs.data_parallel(s, mesh, "dp"),
        "shard_optimizer": lambda s: fs.shard_optimizer(s, mesh, "dp"),
        "fully_shard": lambda s: fs.fully_shard(s, mesh, "dp"),
    }[strategy]
    _, _, losses, params = _run(model, mesh, wrap, local_batches, False, lambda out: out)
    _, _, dense_losses, dense_params = _run(dense, None, lambda s: s, batches, False, lambda o: o)
    return (losses, params), (dense_losses, tpl.shard_like(dense_params, model))


@pytest.mark.parametrize("strategy", ["data_parallel", "shard_optimizer", "fully_shard"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_by_dp_equals_one_process(strategy, sequence_parallel):
    for got, expected in run_spmd(_tp_dp, 4, strategy, sequence_parallel):
        assert_trees_close(got, expected, **TRAINED)
