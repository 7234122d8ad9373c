"""Deferred linear layers: B is the whole backward less the linear weights, W their products."""

import pytest
import torch
from torch import nn

from fscale.parallel.pipeline.deferred_linear import deferring, linear_layers, recording


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inner(x)))
        # `out.weight` also used outside its layer: B owns that part of its gradient.
        return self.out(h) + (h @ self.out.weight.T).sin()


@pytest.mark.parametrize("seed", [0, 1])
def test_deferred_backward_equals_the_whole_backward_bit_for_bit(seed):
    torch.manual_seed(seed)
    stage = _Stage()
    weights = list(stage.parameters())
    x = torch.randn(2, 3, 6, requires_grad=True)
    grad_y = torch.randn(2, 3, 6)
    expected = torch.autograd.grad(stage(x), [x, *weights], grad_y)

    linears = linear_layers(stage)
    with deferring(weights) as store, recording(linears):
        y = stage(x)
    assert len(store.entries) == 2
    in_b = torch.autograd.grad([y], [x, *weights], [grad_y], allow_unused=True)
    index = {id(w): j for j, w in enumerate(weights)}
    assert in_b[1 + index[id(stage.inner.weight)]] is None  # left to W
    assert in_b[1 + index[id(stage.inner.bias)]] is None
    assert in_b[1 + index[id(stage.norm.weight)]] is not None  # B's own
    in_w: list[torch.Tensor | None] = [None] * len(weights)
    store.add_weight_grads(in_w)
    total = [b if w is None else w if b is None else b + w for b, w in zip(in_b[1:], in_w)]
    assert torch.equal(in_b[0], expected[0])
    for got, want in zip(total, expected[1:]):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("features", "bias"), [((128, 512), True), ((512, 128), False)])
def test_the_weight_gradients_come_in_the_weights_layout_with_autograd_s_bits(features, bias):
    # A transposed product would be a view read across the grain by every later sum (1.8x
    # slower for the bench GPT's head at 128 rows); W gives what autograd accumulates.
    torch.manual_seed(3)
    layer = nn.Linear(*features, bias=bias)
    weights = list(layer.parameters())
    x = torch.randn(2, 64, features[0], requires_grad=True)
    grad_y = torch.randn(2, 64, features[1])
    expected = torch.autograd.grad(layer(x), weights, grad_y)
    with deferring(weights) as store, recording([layer]):
        y = layer(x)
    torch.autograd.grad([y], [x], [grad_y])
    found: list[torch.Tensor | None] = [None] * len(weights)
    store.add_weight_grads(found)
    for got, want, weight in zip(found, expected, weights):
        assert got is not None and got.stride() == weight.stride()
        assert torch.equal(got, want)


class _Twice(nn.Module):
    """One linear layer applied twice: two recorded uses of the same weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.layer(x)))


def _summed_over_micro_batches(module, inputs, grads):
    """The weights' gradients summed over micro-batches by `add_weight_grads`, and the tensors
    that held the sums after the first micro-batch."""
    weights = list(module.parameters())
    sums: list[torch.Tensor | None] = [None] * len(weights)
    first = None
    for x, grad_y in zip(inputs, grads):
        with deferring(weights) as store, recording(linear_layers(module)):
            y = module(x)
        torch.autograd.grad([y], [x], [grad_y])
        store.add_weight_grads(sums)
        first = list(sums) if first is None else first
    return sums, first


@pytest.mark.parametrize("rows", [2, 128, 1024])
@pytest.mark.parametrize("module", [nn.Linear(96, 160), _Twice()], ids=["once", "twice"])
def test_micro_batches_add_into_the_sums_in_place_equal_to_autograd_s_sums(rows, module):
    # Each later product is accumulated into the sum by the product itself (addmm): the sums
    # stay the tensors the first micro-batch made, and equal autograd's accumulation into
    # .grad (product, then add) within fp32 rounding.
    torch.manual_seed(5)
    features = 24 if isinstance(module, _Twice) else module.in_features
    out = 24 if isinstance(module, _Twice) else module.out_features
    inputs = [torch.randn(rows, features, requires_grad=True) for _ in range(3)]
    grads = [torch.randn(rows, out) for _ in range(3)]
    weights = list(module.parameters())
    for w in weights:
        w.grad = None
    for x, grad_y in zip(inputs, grads):
        torch.autograd.backward(module(x), grad_y, inputs=weights)
    sums, first = _summed_over_micro_batches(module, inputs, grads)
    assert all(a is b for a, b in zip(sums, first))  # the same tensors, added into in place
    for got, weight in zip(sums, weights):
        assert got is not None and got.stride() == weight.stride()
        torch.testing.assert_close(got, weight.grad, rtol=2e-6, atol=2e-6 * rows**0.5)


def test_recording_changes_nothing_outside_a_deferring_block_and_restores_the_layers():
    stage = _Stage()
    linears = linear_layers(stage)
    with recording(linears):
        assert "forward" not in stage.inner.__dict__
    with deferring(list(stage.parameters())), recording(linears):
        assert "forward" in stage.inner.__dict__
    assert all("forward" not in layer.__dict__ for layer in linears)


def test_layers_on_other_tensors_or_without_grad_are_not_deferred():
    stage = _Stage()
    x = torch.randn(4, 6)
    with deferring([stage.inner.weight]) as store, recording(linear_layers(stage)):
        stage(x)  # inner's bias and out's weight are not among the weights
        with torch.no_grad():
            stage(x)
    assert store.entries == []


class _Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_linear_subclass_is_left_alone():
    model = nn.Sequential(_Scaled(3, 3), nn.Linear(3, 3))
    assert linear_layers(model) == [model[1]]


class _InPlaceAfterUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2  # saves nothing
        y = self.inner(h)
        h.add_(1)  # the layer's input, changed after the layer used it
        return y + h


def test_an_input_changed_in_place_after_use_is_refused_not_used():
    stage = _InPlaceAfterUse()
    weights = list(stage.parameters())
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(stage(x).sum(), weights)  # autograd's own check, undeferred
    with deferring(weights) as store, recording(linear_layers(stage)):
        y = stage(x)
    torch.autograd.grad([y.sum()], [x], allow_unused=True)  # B: the input's gradient only
    with pytest.raises(RuntimeError, match="modified in place after the layer used it"):
        store.add_weight_grads([None] * len(weights))


def test_a_layer_under_autocast_is_left_to_autograd():
    # Autocast computes the layer on cast copies; its weight gradient is autograd's (cast back
    # to the weight's dtype), so the layer is not recorded.
    stage = _Stage()
    weights = list(stage.parameters())
    x = torch.randn(4, 6, requires_grad=True)
    with (
        deferring(weights) as store,
        recording(linear_layers(stage)),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        y = stage(x)
    assert store.entries == []
    grads = torch.autograd.grad([y.float().sum()], weights)
    assert all(g.dtype == torch.float32 for g in grads)


def test_positions_name_the_weights_and_biases_the_recorded_layers_add_to():
    stage = _Stage()
    weights = list(stage.parameters())  # inner.weight, inner.bias, norm.weight, norm.bias, out
    x = torch.randn(2, 6, requires_grad=True)
    with deferring(weights) as store, recording(linear_layers(stage)):
        y = stage(x)
    assert store.positions() == set()  # no gradient has reached the layers yet
    torch.autograd.grad([y.sum()], [x])
    assert store.positions() == {0, 1, 4}
    store.add_weight_grads([None] * len(weights))
    assert store.positions() == set()  # added: the entries are gone
