"""fscale.testing.strategies: every drawn case builds, trains, and matches its torch twin."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis_budget import examples

import fscale as fs
from fscale.testing import strategies as fst


@settings(max_examples=examples(6))
@given(case=fst.model_cases())
def test_model_cases_build_and_give_a_scalar_loss(case):
    apply, params, buffers = fs.functionalize(case.module())
    batch = case.batch(4, seed=0)
    loss, new_buffers = case.loss_fn(apply)(params, buffers, batch, fs.random.key(0))
    assert loss.shape == () and torch.isfinite(loss)
    assert set(new_buffers) == set(buffers)
    split = fs.data.split_batch(batch, 1, 2)
    assert fs.tree.leaves(split)[0].shape[0] == 2


@settings(max_examples=examples(8))
@given(opt=fst.optimizer_cases())
def test_optimizer_cases_match_their_torch_counterpart_for_a_step(opt):
    params = {"w": torch.linspace(-1, 1, 7), "b": torch.ones(3)}
    grads = {"w": torch.linspace(0.5, -0.3, 7), "b": torch.full((3,), 0.2)}
    fs_opt = opt.fscale()
    new_params, _ = fs.optim.step(fs_opt, grads, fs_opt.init(params), params)
    torch_params = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = opt.torch(list(torch_params.values()))
    for k, p in torch_params.items():
        p.grad = grads[k].clone()
    torch_opt.step()
    for k in params:
        assert torch.equal(new_params[k], torch_params[k].detach()), k


def test_frozen_parameters_and_errors():
    case = fst.ModelCase("mlp", freeze=("0.bias",))
    _, params, buffers = fs.functionalize(case.module())
    assert "0.bias" in buffers and "0.bias" not in params
    with pytest.raises(ValueError, match="cannot freeze"):
        fst.ModelCase("mlp", freeze=("nope",)).module()
    with pytest.raises(ValueError, match="unknown kind"):
        fst.ModelCase("rnn").module()
    with pytest.raises(ValueError, match="no counterpart"):
        fst.OptimizerCase("lamb").torch([])


def test_unknown_names_are_refused_when_the_strategy_is_built():
    with pytest.raises(ValueError, match="unknown \\['lion'\\]"):
        fst.optimizer_cases(names=("sgd", "lion"))
    with pytest.raises(ValueError, match="unknown \\['rnn'\\]"):
        fst.model_cases(kinds=("rnn",))
    with pytest.raises(ValueError, match="empty"):
        fst.model_cases(kinds=())


def test_on_gradient_reports_the_gradient_in_backward_and_changes_nothing():
    from fscale.testing import on_gradient

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    seen = []
    y = on_gradient(x, lambda g: seen.append(g.clone()))
    assert torch.equal(y, x) and seen == []
    (grad,) = torch.autograd.grad((y * torch.tensor([3.0, 4.0])).sum(), x)
    assert torch.equal(grad, torch.tensor([3.0, 4.0])) and torch.equal(seen[0], grad)
    with pytest.raises(TypeError, match="callable"):
        on_gradient(x, None)


@pytest.mark.parametrize("kind", ["mlp", "gpt", "cnn"])
def test_a_model_case_in_float64_builds_module_and_batch_in_it(kind):
    case = fst.ModelCase(kind, width=4, depth=1, dtype=torch.float64)
    module, batch = case.module(), case.batch(4, seed=0)
    assert {p.dtype for p in module.parameters()} == {torch.float64}
    floats = [t for t in fs.tree.leaves(batch) if t.is_floating_point()]
    assert all(t.dtype == torch.float64 for t in floats)
    if kind == "gpt":
        assert batch.dtype == torch.int64  # token ids stay integers
    apply, params, buffers = fs.functionalize(module)
    loss, _ = case.loss_fn(apply)(params, buffers, batch, fs.random.key(0))
    assert loss.dtype == torch.float64
    # The same draws as in float32, cast.
    assert torch.equal(
        fs.tree.leaves(batch)[0],
        fs.tree.leaves(fst.ModelCase(kind).batch(4, 0))[0].to(fs.tree.leaves(batch)[0].dtype),
    )
