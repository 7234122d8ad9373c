"""train_step: equivalence with eager nn.Module + torch.optim training, purity, errors."""

import copy

import pytest
import torch

import fscale as fs
from fscale import models
from fscale.testing import assert_trees_equal


def _gpt(dropout=0.0):
    cfg = models.GPTConfig(
        vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2, dropout=dropout
    )
    return models.GPT(cfg), cfg


def _tokens(cfg, batch, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)


def _lm_loss_fn(apply):
    def loss_fn(params, buffers, batch, key):
        logits, new_buffers = apply(params, buffers, batch[:, :-1], key=key)
        return models.lm_loss(logits, batch[:, 1:]), new_buffers

    return loss_fn


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_twenty_gpt_steps_equal_eager_module_and_torch_optim(dropout):
    model, cfg = _gpt(dropout)
    eager = copy.deepcopy(model)
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(_lm_loss_fn(apply), fs.optim.adam(1e-2, weight_decay=0.01))
    state = step.init(params, buffers, key=7)
    torch_opt = torch.optim.Adam(eager.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    eager.train()
    for i in range(20):
        batch = _tokens(cfg, 4, i)
        # The step seeds dropout from fold_in(key, step): eager uses the same masks this way.
        torch.manual_seed(fs.random.seed(fs.random.fold_in(fs.random.key(7), i)))
        eager_loss = models.lm_loss(eager(batch[:, :-1]), batch[:, 1:])
        torch_opt.zero_grad()
        eager_loss.backward()
        torch_opt.step()
        state, metrics = step(state, batch)
        assert torch.equal(metrics["loss"], eager_loss.detach()), f"step {i}"
    eager_params = {n: p.detach() for n, p in eager.named_parameters() if n in state.params}
    assert_trees_equal(state.params, eager_params)
    assert int(state.step) == 20


def test_sgd_momentum_on_mlp_equals_torch_optim():
    model = models.mlp([8, 16, 4], seed=1)
    eager = copy.deepcopy(model)
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, batch, key):
        out, _ = apply(p, b, batch[0])
        return torch.nn.functional.mse_loss(out, batch[1])

    step = fs.train_step(loss_fn, fs.optim.sgd(0.05, momentum=0.9, nesterov=True))
    state = step.init(params, buffers)
    torch_opt = torch.optim.SGD(
        eager.parameters(), lr=0.05, momentum=0.9, nesterov=True, fused=True
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        batch = (torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g))
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(eager(batch[0]), batch[1]).backward()
        torch_opt.step()
        state, _ = step(state, batch)
    assert_trees_equal(state.params, {n: p.detach() for n, p in eager.named_parameters()})


def test_input_state_is_never_mutated():
    model, cfg = _gpt()
    apply, params, buffers = fs.functionalize(model)
    step = fs.train_step(_lm_loss_fn(apply), fs.optim.adamw(1e-2))
    state = step.init(params, buffers)
    state, _ = step(state, _tokens(cfg, 2, 0))  # non-trivial optimizer state
    before = fs.tree.map(torch.clone, state)
    new_state, _ = step(state, _tokens(cfg, 2, 1))
    assert_trees_equal(state, before)
    changed = [
        not torch.equal(new, old)
        for new, old in zip(fs.tree.leaves(new_state.params), fs.tree.leaves(state.params))
    ]
    assert all(changed)


def test_donate_gives_identical_results():
    model, cfg = _gpt()
    apply, params, buffers = fs.functionalize(model)
    pure = fs.train_step(_lm_loss_fn(apply), fs.optim.adam(1e-2))
    donating = fs.train_step(_lm_loss_fn(apply), fs.optim.adam(1e-2), donate=True)
    a = pure.init(params, buffers)
    b = donating.init(fs.tree.map(torch.clone, params), buffers)
    for i in range(3):
        a, _ = pure(a, _tokens(cfg, 2, i))
        b, _ = donating(b, _tokens(cfg, 2, i))
    assert_trees_equal(a.params, b.params)
    assert_trees_equal(a.opt_state, b.opt_state)


def test_batchnorm_statistics_come_back_as_new_buffers():
    model = models.resnet(seed=0)
    eager = copy.deepcopy(model)
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(p, b, batch, key):
        logits, new_b = apply(p, b, batch[0])
        return models.classification_loss(logits, batch[1]), new_b, {"logit_mean": logits.mean()}

    step = fs.train_step(loss_fn, fs.optim.sgd(0.1))
    state = step.init(params, buffers)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3])
    eager.train()
    eager(images)
    state, metrics = step(state, (images, labels))
    assert "logit_mean" in metrics
    eager_buffers = dict(eager.named_buffers())
    assert_trees_equal({n: state.buffers[n] for n in eager_buffers}, eager_buffers)


def test_func_grad_mode_equals_autograd_mode():
    model, cfg = _gpt()
    apply, params, buffers = fs.functionalize(model)
    loss_fn = _lm_loss_fn(apply)
    a = fs.train_step(loss_fn, fs.optim.sgd(0.1))
    b = fs.train_step(loss_fn, fs.optim.sgd(0.1), grad_mode="func")
    sa, sb = a.init(params, buffers), b.init(params, buffers)
    for i in range(2):
        sa, ma = a(sa, _tokens(cfg, 2, i))
        sb, mb = b(sb, _tokens(cfg, 2, i))
    assert torch.equal(ma["loss"], mb["loss"])
    fs.testing.assert_trees_close(sa.params, sb.params, rtol=1e-6, atol=1e-7)


def test_value_and_grad_returns_zeros_for_unused_leaves():
    params = {"used": torch.ones(2), "unused": torch.ones(3)}
    out, grads = fs.value_and_grad(
        lambda p, b, batch, key: (p["used"] * 2).sum(), params, {}, None, fs.random.key(0)
    )
    assert torch.equal(grads["used"], torch.full((2,), 2.0))
    assert torch.equal(grads["unused"], torch.zeros(3))
    assert float(out.loss) == 4.0


def test_errors_are_clear():
    params = {"w": torch.ones(3)}
    opt = fs.optim.sgd(0.1)
    step = fs.train_step(lambda p, b, x, k: p["w"] * x, opt)
    state = step.init(params)
    with pytest.raises(ValueError, match="scalar loss"):
        step(state, torch.ones(3))
    step = fs.train_step(lambda p, b, x, k: [p["w"].sum()], opt)
    state = step.init(params)
    with pytest.raises(TypeError, match="must return the loss"):
        step(state, torch.ones(3))
    step = fs.train_step(lambda p, b, x, k: x.sum(), opt)
    state = step.init(params)
    with pytest.raises(ValueError, match="does not depend on `params`"):
        step(state, torch.ones(3))
    step = fs.train_step(lambda p, b, x, k: p["w"].sum(), opt)
    with pytest.raises(TypeError, match="floating point"):
        step.init({"w": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"nn\.Module"):
        step.init(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="key"):
        step.init(params, key="seed")
    with pytest.raises(TypeError, match="TrainState"):
        step({"w": torch.ones(3)}, None)
    with pytest.raises(TypeError, match="Optimizer"):
        fs.train_step(lambda *a: 0, torch.optim.SGD)
    with pytest.raises(ValueError, match="grad_mode"):
        fs.train_step(lambda *a: 0, opt, grad_mode="jit")


def test_step_repr_shows_the_plan():
    def my_loss(p, b, x, k):
        return p["w"].sum()

    step = fs.train_step(my_loss, fs.optim.sgd(0.1))
    assert "my_loss" in repr(step) and "plan=local" in repr(step)


def _init_with_rank_dependent_lr(world):
    import torch.distributed as dist

    rank = dist.get_rank()
    step = fs.data_parallel(
        fs.train_step(lambda p, b, x, k: p["w"].sum(), fs.optim.adamw(1e-3 * (1 + rank))),
        fs.Mesh(dp=world),
    )
    try:
        step.init({"w": torch.ones(3)})
    except ValueError as error:
        return str(error)
    return None


def test_a_rank_dependent_learning_rate_is_refused_at_init():
    messages = fs.testing.run_spmd(_init_with_rank_dependent_lr, 2, 2)
    for message in messages:
        assert message is not None and "disagree on the optimizer" in message
        assert "rank 0: adamw(lr=0.001)" in message and "rank 1: adamw(lr=0.002)" in message


def _shard_a_rank_dependent_full_state(world, strategy):
    import torch.distributed as dist

    rank = dist.get_rank()
    _, params, buffers = fs.functionalize(models.mlp([4, 3], seed=0))
    local = fs.train_step(lambda p, b, x, k: sum(v.sum() for v in p.values()), fs.optim.sgd(0.1))
    full = local.init({k: v + (rank if "bias" in k else 0) for k, v in params.items()}, buffers)
    mesh = fs.Mesh(dp=world)
    step = fs.shard_optimizer(local, mesh) if strategy == "zero" else fs.fully_shard(local, mesh)
    try:
        fs.shard_state(step, full)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_shard_state_refuses_ranks_given_different_full_states(strategy):
    for message in fs.testing.run_spmd(_shard_a_rank_dependent_full_state, 2, 2, strategy):
        assert message is not None and "were given different full states" in message
        assert "bias" in message and "rank 0:" in message and "rank 1:" in message
