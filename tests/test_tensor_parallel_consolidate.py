"""`fscale.consolidate(step, state, model=...)` gathers a tensor-parallel state into the dense one;
`fscale.shard_state(step, dense, model=...)` cuts a dense state into a tensor-parallel one.

A tensor-parallel GPT (a fused q/k/v weight split in 3 parts, row-parallel weights split along
their columns, a vocab-split embedding) is trained over "tp" alone and under the data-parallel
strategies over "dp"; its consolidated state is the one the dense GPT holds after the same
steps in one process (parameters and every optimizer-state leaf), on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale.models import GPT, GPTConfig, lm_loss
from fscale.parallel import tensor as tpl
from fscale.testing import assert_trees_close, run_spmd

TRAINED = dict(rtol=1e-4, atol=1e-5)
OPTIMIZERS = {
    # eps well above the round-off of tiny gradients, which Adam would scale up to a whole step
    "adamw": lambda: fs.optim.adamw(1e-2, eps=1e-4, weight_decay=0.1),
    # row and column factors, a full second moment for 1-D leaves, momentum
    "adafactor": lambda: fs.optim.adafactor(1e-2, beta1=0.9),
}
CONFIG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2)


def _state(module, optimizer, batches, wrap=lambda s: s, tensor_parallel=False):
    apply, params, buffers = fs.functionalize(module)

    def loss_fn(params, buffers, tokens, key):
        logits, buffers = apply(params, buffers, tokens[:, :-1], key=key)
        return lm_loss(logits, tokens[:, 1:]), buffers

    if tensor_parallel:
        optimizer = tpl.tensor_parallel_optimizer(optimizer, apply)
    step = wrap(fs.train_step(loss_fn, optimizer))
    state = step.init(params, buffers)
    for batch in batches:
        state, _ = step(state, batch)
    return step, state, apply


def _consolidated(optimizer_name, strategy):
    dense = GPT(CONFIG, seed=3)
    dp = 1 if strategy is None else 2
    mesh = fs.Mesh(dp=dp, tp=dist.get_world_size() // dp)
    model = tpl.tensor_parallel(dense, mesh, "tp", tpl.gpt_plan(vocab_parallel_loss=False))
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, 32, (8, 9), generator=g) for _ in range(3)]
    local = [fs.data.split_batch(b, mesh.rank("dp"), dp) for b in batches]
    wrap = {
        None: lambda s: s,
        "data_parallel": lambda s: fs.data_parallel(s, mesh, "dp"),
        "fully_shard": lambda s: fs.fully_shard(s, mesh, "dp"),
    }[strategy]
    step, state, apply = _state(model, OPTIMIZERS[optimizer_name](), local, wrap, True)
    got = fs.consolidate(step, state, model=apply)
    _, expected, _ = _state(dense, OPTIMIZERS[optimizer_name](), batches)
    return (got.params, got.opt_state), (expected.params, expected.opt_state)


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("world", [2, 4])
def test_the_consolidated_tensor_parallel_state_is_the_dense_state(optimizer_name, world):
    for got, expected in run_spmd(_consolidated, world, optimizer_name, None):
        assert_trees_close(got, expected, **TRAINED)


@pytest.mark.parametrize("strategy", ["data_parallel", "fully_shard"])
def test_tp_by_dp_consolidates_to_the_dense_state(strategy):
    for got, expected in run_spmd(_consolidated, 4, "adamw", strategy):
        assert_trees_close(got, expected, **TRAINED)


def _error_of(call):
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _refusals():
    dense = GPT(CONFIG, seed=3)
    mesh = fs.Mesh(tp=dist.get_world_size())
    model = tpl.tensor_parallel(dense, mesh, "tp", tpl.gpt_plan())
    step, state, _ = _state(model, fs.optim.adamw(1e-2), [])
    linear = torch.nn.Sequential(torch.nn.Linear(4, 4))
    other = tpl.tensor_parallel(linear, mesh, "tp", {"0": "colwise"})
    return [
        _error_of(lambda wrong=wrong: fs.consolidate(step, state, model=wrong))
        for wrong in (dense, other)
    ]


def test_a_model_that_is_not_the_step_s_tensor_parallel_model_is_refused():
    for errors in run_spmd(_refusals, 2):
        assert errors[0].startswith("TypeError: consolidate: `model` must be the module")
        assert errors[1].startswith("ValueError: consolidate: the state's parameters")


def _round_trip(strategy):
    # Dense training for 2 steps, cut into tp shards, 2 more tensor-parallel steps, gathered
    # back: the dense run's 4 steps.
    dp = 1 if strategy is None else 2
    mesh = fs.Mesh(dp=dp, tp=dist.get_world_size() // dp)
    model = tpl.tensor_parallel(GPT(CONFIG, seed=4), mesh, "tp", tpl.gpt_plan())
    g = torch.Generator().manual_seed(12)
    batches = [torch.randint(0, 32, (8, 9), generator=g) for _ in range(4)]
    # (each init takes its module's tensors: one module per run)
    _, started, _ = _state(GPT(CONFIG, seed=4), OPTIMIZERS["adafactor"](), batches[:2])
    _, expected, _ = _state(GPT(CONFIG, seed=4), OPTIMIZERS["adafactor"](), batches)
    wrap = (lambda s: s) if strategy is None else (lambda s: fs.shard_optimizer(s, mesh, "dp"))
    step, _, apply = _state(model, OPTIMIZERS["adafactor"](), [], wrap, True)
    state = fs.shard_state(step, started, model=apply)
    for batch in batches[2:]:
        state, _ = step(state, fs.data.split_batch(batch, mesh.rank("dp"), dp))
    got = fs.consolidate(step, state, model=apply)
    return (got.params, got.opt_state), (expected.params, expected.opt_state)


@pytest.mark.parametrize(("world", "strategy"), [(2, None), (4, "shard_optimizer")])
def test_a_dense_state_cut_into_tensor_parallel_shards_trains_on(world, strategy):
    for got, expected in run_spmd(_round_trip, world, strategy):
        assert_trees_close(got, expected, **TRAINED)
