"""Non-pointwise optimizers of a tensor-parallel model equal the dense model's optimizer.

`clip_by_global_norm`, `lamb` and `adafactor` take norms, RMS values and row/column means over
whole tensors. Wrapped by `tensor_parallel_optimizer`, a tensor-parallel GPT (a fused q/k/v
weight split in 3 parts, row-parallel weights split along their columns, replicated norms)
trains to the dense GPT's parameters, alone over "tp" and with data_parallel, shard_optimizer
or fully_shard over "dp"; without the wrapper it does not.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale.flat import Fragment, TensorSlice
from fscale.models import GPT, GPTConfig, lm_loss
from fscale.parallel import tensor as tpl
from fscale.testing import assert_trees_close, run_spmd

TRAINED = dict(rtol=1e-4, atol=1e-5)
OPTIMIZERS = {
    # max_norm small enough that every step clips
    "clip": lambda: fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adamw(1e-2)),
    "clip_sum_of_squares": lambda: fs.optim.chain(
        fs.optim.clip_by_global_norm(0.05, formula="sum_of_squares"), fs.optim.sgd(0.5)
    ),
    "lamb": lambda: fs.optim.lamb(1e-2, weight_decay=0.1),
    "adafactor": lambda: fs.optim.adafactor(1e-2, beta1=0.9, weight_decay=0.1),
    # the optimizer on the host, its statistics still over the whole tensors
    "offloaded_lamb": lambda: fs.offload_optimizer(fs.optim.lamb(1e-2, weight_decay=0.1)),
}


def _batches(batch: int, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 32, (batch, 9), generator=g) for _ in range(steps)]


def _trained(module, optimizer, batches, wrap=lambda s: s, tp_model=None):
    apply, params, buffers = fs.functionalize(module)

    def loss_fn(params, buffers, tokens, key):
        logits, buffers = apply(params, buffers, tokens[:, :-1], key=key)
        return lm_loss(logits, tokens[:, 1:]), buffers

    if tp_model is not None:
        optimizer = tpl.tensor_parallel_optimizer(optimizer, apply)
    elif getattr(module, tpl.SPLITS_ATTR, None) is not None:
        # Copies: Step.init refuses the model's own shards with a non-pointwise optimizer
        # unwrapped, and does not see copies of them.
        params = {name: t.clone() for name, t in params.items()}
    step = wrap(fs.train_step(loss_fn, optimizer))
    state = step.init(params, buffers)
    for batch in batches:
        state, _ = step(state, batch)
    return fs.consolidate(step, state).params


def _compare(name, strategy, wrapped):
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2)
    dense = GPT(cfg, seed=5)
    dp = 2 if strategy is not None else 1
    mesh = fs.Mesh(dp=dp, tp=dist.get_world_size() // dp)
    model = tpl.tensor_parallel(dense, mesh, "tp", tpl.gpt_plan())
    batches = _batches(8)
    local = [fs.data.split_batch(b, mesh.rank("dp"), dp) for b in batches]
    wrap = {
        None: lambda s: s,
        "data_parallel": lambda s: fs.data_parallel(s, mesh, "dp"),
        "shard_optimizer": lambda s: fs.shard_optimizer(s, mesh, "dp"),
        "fully_shard": lambda s: fs.fully_shard(s, mesh, "dp"),
    }[strategy]
    got = _trained(model, OPTIMIZERS[name](), local, wrap, model if wrapped else None)
    expected = tpl.shard_like(_trained(dense, OPTIMIZERS[name](), batches), model)
    return got, expected


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_optimizer_equals_the_dense_optimizer(name, world):
    for got, expected in run_spmd(_compare, world, name, None, True):
        assert_trees_close(got, expected, **TRAINED)


@pytest.mark.parametrize("name", ["clip", "adafactor"])
@pytest.mark.parametrize("strategy", ["data_parallel", "shard_optimizer", "fully_shard"])
def test_tp_by_dp_with_a_non_pointwise_optimizer_equals_one_process(name, strategy):
    for got, expected in run_spmd(_compare, 4, name, strategy, True):
        assert_trees_close(got, expected, **TRAINED)


@pytest.mark.parametrize("name", ["clip", "lamb", "adafactor"])
def test_without_the_wrapper_the_statistics_are_the_rank_s_own(name):
    # What the wrapper (and Step.init's refusal) is for: on the rank's leaves alone the
    # results are not the dense ones.
    for got, expected in run_spmd(_compare, 2, name, None, False):
        with pytest.raises(AssertionError):
            assert_trees_close(got, expected, **TRAINED)


def test_a_pointwise_optimizer_is_returned_as_it_is_and_bad_input_is_refused():
    dense = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1), seed=0)
    model = tpl.tensor_parallel(dense, fs.Mesh(tp=1), "tp", tpl.gpt_plan())
    adamw = fs.optim.adamw(1e-3)
    assert tpl.tensor_parallel_optimizer(adamw, model) is adamw
    wrapped = tpl.tensor_parallel_optimizer(fs.optim.lamb(1e-3), model)
    assert repr(wrapped).startswith("tensor_parallel_optimizer(lamb(")
    with pytest.raises(TypeError, match=r"must be the module fscale\.parallel\.tensor"):
        tpl.tensor_parallel_optimizer(fs.optim.lamb(1e-3), dense)
    with pytest.raises(TypeError, match=r"must be an fscale\.optim\.Optimizer"):
        tpl.tensor_parallel_optimizer(torch.optim.SGD, model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not have"):
        wrapped.init({"not_a_parameter": torch.zeros(2)})
    with pytest.raises(ValueError, match="wrap the optimizer once"):
        tpl.tensor_parallel_optimizer(wrapped, model)


def test_element_indices_place_a_shard_s_elements_in_the_full_tensor():
    for shape, split in [
        ((6, 4), (0, 1)),
        ((6, 4), (1, 1)),
        ((12, 4), (0, 3)),
        ((2, 12, 3), (1, 3)),
    ]:
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        for index in range(2):
            shard = tpl.shard_tensor(full, tpl.Split(*split), 2, index).reshape(-1)
            for start, stop in [(0, shard.numel()), (1, shard.numel() - 2)]:
                fragment = Fragment(torch.Size(shape), start, stop, TensorSlice(*split, 2, index))
                assert torch.equal(fragment.element_indices(), shard[start:stop])
                assert not fragment.is_whole
    # 5 rows do not split into 2 chunks
    bad = fs.optim.Sharding(
        {"w": Fragment(torch.Size([5, 4]), 0, 10, TensorSlice(0, 1, 2, 0))}, lambda t: t
    )
    with pytest.raises(ValueError, match="names a shard"):
        fs.optim.adafactor(1e-3).init({"w": torch.zeros(10)}, sharding=bad)


def _unwrapped_init(optimizer_name, adascale=False):
    dense = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1), seed=0)
    mesh = fs.Mesh(dp=1, tp=dist.get_world_size())
    model = tpl.tensor_parallel(dense, mesh, "tp", tpl.gpt_plan())
    apply, params, buffers = fs.functionalize(model)
    make = OPTIMIZERS.get(optimizer_name, lambda: fs.optim.sgd(1e-3))
    step = fs.train_step(lambda p, b, x, k: apply(p, b, x, key=k)[0].sum(), make())
    if adascale:
        step = fs.adascale(fs.accumulate(step, 2), mesh, "dp")
    try:
        step.init(params, buffers)
    except ValueError as error:
        return str(error)
    return None


def test_a_step_refuses_a_non_pointwise_optimizer_on_tensor_parallel_shards_unwrapped():
    for message in run_spmd(_unwrapped_init, 2, "clip"):
        assert "tensor_parallel_optimizer(optimizer, model)" in message
        assert "is not pointwise" in message
    # A pointwise optimizer needs no wrapper, nor does a dense model.
    assert run_spmd(_unwrapped_init, 2, "sgd") == [None, None]
    # AdaScale's gain comes from gradient norms: over tensor-parallel shards it is refused.
    for message in run_spmd(_unwrapped_init, 2, "sgd", True):
        assert "adascale of a tensor-parallel model is not supported" in message
    dense = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1), seed=0)
    _, params, buffers = fs.functionalize(dense)
    fs.train_step(lambda p, b, x, k: 0.0, OPTIMIZERS["lamb"]()).init(params, buffers)


def test_counted_only_zeroes_each_round_of_a_replica_s_entries():
    fragments = [
        Fragment(torch.Size([2]), 0, 2),
        Fragment(torch.Size([3]), 0, 3, counted=False),
        Fragment(torch.Size([4]), 0, 4),
    ]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # two rounds of one per fragment
    assert fs.optim.counted_only(values, fragments).tolist() == [1.0, 0.0, 3.0, 4.0, 0.0, 6.0]
    everyone = [f._replace(counted=True) for f in fragments]
    assert fs.optim.counted_only(values, everyone) is values


def _hsdp_accumulated():
    # 8 ranks: replica 2 x dp 2 (HSDP: fully_shard over dp, replicas averaged) x tp 2, with
    # accumulation inside; Adafactor's statistics summed over dp, then over tp.
    mesh = fs.Mesh(replica=2, dp=2, tp=2)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2)
    model = tpl.tensor_parallel(GPT(cfg, seed=5), mesh, "tp", tpl.gpt_plan())

    def wrap(step):
        sharded = fs.fully_shard(fs.accumulate(step, 2), mesh, "dp")
        return fs.data_parallel(sharded, mesh, "replica")

    slot = mesh.rank("replica") * 2 + mesh.rank("dp")
    local = [fs.data.split_batch(b, slot, 4) for b in _batches(8)]
    got = _trained(model, OPTIMIZERS["adafactor"](), local, wrap, model)
    expected = _trained(GPT(cfg, seed=5), OPTIMIZERS["adafactor"](), _batches(8))
    return got, tpl.shard_like(expected, model)


def test_tp_under_hsdp_with_accumulation_equals_one_process():
    for got, expected in run_spmd(_hsdp_accumulated, 8):
        assert_trees_close(got, expected, **TRAINED)
