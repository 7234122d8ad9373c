"""Bad input meets a clear error at the boundary, naming the argument or the leaf.

Each case here once reached a fused kernel, ran on with a wrong result, or failed deep inside.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fscale as fs
from fscale import optim


def _loss(params, buffers, batch, key):
    return (params["w"] * batch).sum() ** 2


# ----------------------------------------------------------------------------- state vs params


@pytest.mark.parametrize(
    "make", [lambda: optim.adam(0.1), lambda: optim.sgd(0.1, momentum=0.9), lambda: optim.lamb()]
)
def test_a_state_of_other_shapes_is_refused_before_any_kernel(make):
    opt = make()
    state = opt.init({"w": torch.zeros(3)})  # the layer was widened since
    params = {"w": torch.ones(4)}
    with pytest.raises(
        ValueError, match=r"state\.\w+ leaf 'w' is \(3,\).*param is \(4,\).*step\.init"
    ):
        optim.step(opt, {"w": torch.ones(4)}, state, params)


def test_a_state_of_another_dtype_is_refused():
    opt = optim.adam(0.1)
    state = opt.init({"w": torch.zeros(3)})
    params = {"w": torch.ones(3, dtype=torch.float64)}  # params cast after init
    with pytest.raises(ValueError, match=r"leaf 'w' is \(3,\) torch.float32.*torch.float64"):
        optim.step(opt, {"w": torch.ones(3, dtype=torch.float64)}, state, params)


def test_gradients_on_another_device_are_refused():
    opt = optim.sgd(0.1)
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match=r"grads leaf 'w' is \(3,\) torch.float32 on meta"):
        optim.step(opt, {"w": torch.ones(3, device="meta")}, opt.init(params), params)


def test_a_state_built_with_other_flags_names_the_missing_buffer():
    params = {"w": torch.ones(3)}
    state = optim.adam(0.1).init(params)  # no amsgrad buffer
    with pytest.raises(TypeError, match=r"adam: the state's `max_exp_avg_sq` is None"):
        optim.step(optim.adam(0.1, amsgrad=True), {"w": torch.ones(3)}, state, params)


def test_a_step_with_a_state_from_other_params_says_how_to_rebuild():
    step = fs.train_step(_loss, optim.adam(0.1))
    state = step.init({"w": torch.ones(3)})
    widened = state._replace(params={"w": torch.ones(5)})
    with pytest.raises(ValueError, match=r"fscale\.shard_state"):
        step(widened, torch.ones(5))


def test_params_on_the_meta_device_are_refused_at_init():
    step = fs.train_step(_loss, optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"params leaf `w` is on the meta device.*to_empty"):
        step.init({"w": torch.ones(3, device="meta")})


# ----------------------------------------------------------------------------- flags


FLAGS = [
    (optim.sgd, "nesterov", {"momentum": 0.9}),
    (optim.sgd, "maximize", {}),
    (optim.adam, "amsgrad", {}),
    (optim.adam, "maximize", {}),
    (optim.adamw, "amsgrad", {}),
    (optim.adamw, "maximize", {}),
    (optim.rmsprop, "centered", {}),
    (optim.rmsprop, "maximize", {}),
    (optim.adagrad, "maximize", {}),
    (optim.adadelta, "maximize", {}),
    (optim.adamax, "maximize", {}),
]


@pytest.mark.parametrize(("make", "flag", "extra"), FLAGS)
@pytest.mark.parametrize("value", ["False", "no", 0, None])
def test_boolean_flags_take_only_booleans(make, flag, extra, value):
    with pytest.raises(TypeError, match=rf"`{flag}` must be True or False, got {value!r}"):
        make(0.1, **extra, **{flag: value})


@pytest.mark.parametrize(("make", "flag", "extra"), FLAGS)
def test_numpy_booleans_are_booleans(make, flag, extra):
    opt = make(0.1, **extra, **{flag: np.False_})
    assert repr(opt).startswith(make.__name__)


@pytest.mark.parametrize("value", ["no", 1, "False"])
def test_donate_takes_only_a_boolean(value):
    with pytest.raises(TypeError, match=r"train_step: `donate` must be True or False, got"):
        fs.train_step(_loss, optim.sgd(0.1), donate=value)


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda v: optim.sgd(v), "lr"),
        (lambda v: optim.adam(v), "lr"),
        (lambda v: optim.adam(0.1, eps=v), "eps"),
        (lambda v: optim.adamw(0.1, weight_decay=v), "weight_decay"),
        (lambda v: optim.sgd(0.1, momentum=v), "momentum"),
        (lambda v: optim.rmsprop(0.1, eps=v), "eps"),
        (lambda v: optim.lamb(v), "lr"),
        (lambda v: optim.adagrad(0.1, lr_decay=v), "lr_decay"),
    ],
)
def test_infinite_hyper_parameters_are_refused(make, arg):
    with pytest.raises(ValueError, match=rf"`{arg}` must be finite, got {arg}=inf"):
        make(math.inf)


def test_an_infinite_clipping_threshold_means_no_clipping():
    clip = optim.clip_by_global_norm(math.inf)
    grads = {"w": torch.full((3,), 1e6)}
    updates, _ = clip.update(grads, clip.init(grads))
    assert torch.equal(updates["w"], grads["w"])


# ----------------------------------------------------------------------------- schedules


def test_a_schedule_is_checked_when_the_optimizer_is_built():
    def warmup():  # forgot the count argument
        return 0.1

    with pytest.raises(TypeError, match=r"sgd: the learning-rate schedule warmup could not be"):
        optim.sgd(warmup)
    with pytest.raises(
        ValueError, match=r"schedule <lambda> returned tensor\(\[0\.1000, 0\.2000\]\)"
    ):
        optim.adam(lambda count: torch.tensor([0.1, 0.2]))
    with pytest.raises(
        ValueError, match=r"returned inf at count=0; a schedule must return a finite"
    ):
        optim.sgd(lambda count: math.inf)


# ----------------------------------------------------------------------------- loss functions


def test_a_loss_fn_returning_a_model_output_is_told_to_return_its_loss():
    class ModelOutput(dict):  # what transformers models return
        def __init__(self, loss):
            super().__init__(loss=loss)
            self.loss = loss

    step = fs.train_step(lambda p, b, x, k: ModelOutput(_loss(p, b, x, k)), optim.sgd(0.1))
    state = step.init({"w": torch.ones(3)})
    with pytest.raises(TypeError, match=r"a ModelOutput .*`return out\.loss`"):
        step(state, torch.ones(3))


@pytest.mark.parametrize("name", ["loss", "grad_bytes", "grad_peak_bytes"])
def test_a_loss_fn_metric_may_not_take_a_reserved_name(name):
    def loss_fn(params, buffers, batch, key):
        loss = _loss(params, buffers, batch, key)
        return loss, buffers, {name: loss * 0}

    step = fs.train_step(loss_fn, optim.sgd(0.1))
    state = step.init({"w": torch.ones(3)})
    with pytest.raises(ValueError, match=rf"metric named '{name}', which the step reports itself"):
        step(state, torch.ones(3))


@pytest.mark.parametrize("value", ["x", 0, -1.0, True])
def test_bucket_sizes_are_checked_under_their_public_name(value):
    step = fs.train_step(_loss, optim.sgd(0.1))
    for transform in (fs.data_parallel, fs.shard_optimizer):
        with pytest.raises(ValueError, match=r"`bucket_mb` must be a positive number"):
            transform(step, fs.Mesh(dp=1), bucket_mb=value)


def test_a_loss_fn_that_calls_the_module_itself_is_refused():
    module = torch.nn.Linear(3, 1)
    _apply, params, buffers = fs.functionalize(module)

    def loss_fn(params, buffers, batch, key):  # forgot `apply`: trains nothing
        return module(batch).square().mean()

    step = fs.train_step(loss_fn, optim.sgd(0.1))
    state = step.init(params, buffers)
    with pytest.raises(ValueError, match=r"does not depend on any of the `params`.*apply\(params"):
        step(state, torch.ones(2, 3))
