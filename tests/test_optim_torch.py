"""fscale.optim equals torch.optim bit for bit: params and every state tensor, 50 real steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fscale.optim as optim
from fscale import tree
from fscale.optim import schedules

STEPS = 50


class SmallNet(torch.nn.Module):
    """Conv + MLP with leaves of 27, 3, 288, 6, 18 and 3 elements: all but one end in a
    partial vector, where a kernel's scalar tail and vectorised body could round differently."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.fc1 = torch.nn.Linear(3 * 4 * 4, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 1, 6, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen))
        for _ in range(STEPS)
    ]


BATCHES = _batches()


def _loss(model: torch.nn.Module, params: dict, batch: tuple, sign: float = 1.0) -> torch.Tensor:
    x, y = batch
    logits = torch.func.functional_call(model, params, (x,))
    return sign * torch.nn.functional.cross_entropy(logits, y)


def _run_both(
    torch_opt_cls, torch_kwargs, fscale_opt, *, schedule=None, donate=False, flat_grads=False
):
    """Train two copies of SmallNet, one with torch.optim and one with fscale.optim.

    `flat_grads`: fscale gets its gradients as views of one buffer, in its leaf order.
    """
    torch.manual_seed(0)
    model = SmallNet()
    reference = {k: torch.nn.Parameter(v.detach().clone()) for k, v in model.named_parameters()}
    torch_opt = torch_opt_cls(list(reference.values()), **torch_kwargs)
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(torch_opt, schedule) if schedule is not None else None
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fscale_opt.init(params)
    # With maximize=True both optimizers ascend: ascend the negated loss, so the run stays
    # finite and keeps comparing real numbers (maximising cross-entropy diverges to NaN).
    sign = -1.0 if torch_kwargs.get("maximize", False) else 1.0
    for batch in BATCHES:
        torch_opt.zero_grad()
        _loss(model, reference, batch, sign).backward()
        torch_opt.step()
        if scheduler is not None:
            scheduler.step()
        live = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = _loss(model, live, batch, sign)
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        if flat_grads:
            grads = _flat_views(grads)
        params, state = optim.step(fscale_opt, grads, state, params, donate=donate)
    return reference, torch_opt, params, state


def _flat_views(tensors: dict) -> dict:
    leaves, treedef = tree.flatten(tensors)
    flat = torch.cat([t.reshape(-1) for t in leaves])
    views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in leaves]), leaves)]
    return tree.unflatten(treedef, views)


def _assert_equal(reference, torch_opt, params, state) -> None:
    for name, param in reference.items():
        assert torch.isfinite(param).all(), (
            f"the reference run diverged ({name}): nothing to compare"
        )
        assert torch.equal(params[name], param.detach()), f"param {name} differs"
        for key, value in torch_opt.state[param].items():
            if key == "step":
                assert int(state.count) == int(value), f"step of {name}"
                continue
            ours = getattr(state, key)
            if value is None:
                assert ours is None, f"{key} should be None"
                continue
            assert torch.equal(ours[name], value), f"state {key} of {name} differs"


lrs = st.sampled_from([1e-3, 1e-2, 0.1])
decays = st.sampled_from([0.0, 0.05])
flags = st.booleans()


@given(
    lr=lrs,
    betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95)]),
    wd=decays,
    eps=st.sampled_from([1e-8, 1e-3]),
    amsgrad=flags,
    maximize=flags,
    donate=flags,
    decoupled=flags,
    flat_grads=flags,
)
def test_adam_and_adamw_equal_fused_torch(
    lr, betas, wd, eps, amsgrad, maximize, donate, decoupled, flat_grads
):
    """The default (exact) path, with gradients in separate tensors or in one buffer."""
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    torch_cls, factory = (
        (torch.optim.AdamW, optim.adamw) if decoupled else (torch.optim.Adam, optim.adam)
    )
    ours = factory(lr, **{k: v for k, v in kwargs.items() if k != "lr"})
    _assert_equal(
        *_run_both(torch_cls, dict(kwargs, fused=True), ours, donate=donate, flat_grads=flat_grads)
    )


@given(
    lr=lrs,
    betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95)]),
    wd=decays,
    amsgrad=flags,
    maximize=flags,
    donate=flags,
    decoupled=flags,
)
def test_non_exact_adam_and_adamw_are_close_to_fused_torch(
    lr, betas, wd, amsgrad, maximize, donate, decoupled
):
    """``exact=False``: one kernel call per flat buffer, within rounding of torch after 50 steps.

    Tolerance: rtol 1e-4, atol 1e-5 on params and moments. Each element takes the kernel's
    vectorised (FMA) body where torch's per-tensor call may take its scalar tail: one rounding
    of a moment or a param per step (1e-7 relative), which 50 steps at lr up to 0.1 grow to a
    few 1e-6 on params of O(0.1) (measured: up to 2e-6).
    """
    kwargs = dict(lr=lr, betas=betas, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    torch_cls, factory = (
        (torch.optim.AdamW, optim.adamw) if decoupled else (torch.optim.Adam, optim.adam)
    )
    ours = factory(lr, exact=False, **{k: v for k, v in kwargs.items() if k != "lr"})
    reference, torch_opt, params, state = _run_both(
        torch_cls, dict(kwargs, fused=True), ours, donate=donate, flat_grads=True
    )
    for name, param in reference.items():
        assert torch.isfinite(param).all()
        torch.testing.assert_close(params[name], param.detach(), rtol=1e-4, atol=1e-5)
        for key, value in torch_opt.state[param].items():
            if key == "step":
                assert int(state.count) == int(value)
            elif value is not None:
                torch.testing.assert_close(getattr(state, key)[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("factory", "kernel"), [(optim.adam, "_fused_adam_"), (optim.adamw, "_fused_adamw_")]
)
@pytest.mark.parametrize("donate", [False, True])
def test_non_exact_adam_runs_one_kernel_call_per_flat_buffer(kernel_calls, factory, kernel, donate):
    calls = kernel_calls(kernel)
    params = {"a": torch.randn(3, 5), "b": torch.randn(7), "c": torch.randn(2, 2)}
    grads = _flat_views({k: torch.randn_like(v) for k, v in params.items()})
    opt = factory(1e-2, exact=False)
    state = opt.init(params)
    # Donated params of separate allocations are packed once; the step returns them packed.
    new_params, state = optim.step(opt, grads, state, dict(params), donate=donate)
    new_params, state = optim.step(opt, grads, state, new_params, donate=donate)
    assert calls == [[15 + 7 + 4], [15 + 7 + 4]]
    # Gradients in separate tensors keep the per-leaf call (tree order: a, b, c).
    optim.step(opt, {k: v.clone() for k, v in grads.items()}, state, new_params, donate=donate)
    assert calls[-1] == [15, 7, 4]
    if donate:  # with separate gradients no one-call update can follow: no copy either
        separate = {k: v.clone() for k, v in params.items()}
        apart = {k: g.clone() for k, g in grads.items()}
        updated, _ = optim.step(opt, apart, opt.init(separate), separate, donate=True)
        assert all(updated[k] is separate[k] for k in separate)
    # The default path always gives the kernel the per-leaf views.
    exact = factory(1e-2)
    optim.step(exact, grads, exact.init(params), params, donate=donate)
    assert calls[-1] == [15, 7, 4]


def test_non_exact_flag_is_checked_and_described():
    with pytest.raises(TypeError, match="`exact` must be True or False"):
        optim.adam(exact="no")
    assert repr(optim.adamw(1e-3, exact=False)) == "adamw(lr=0.001, exact=False)"


@given(
    lr=lrs,
    momentum=st.sampled_from([0.0, 0.9]),
    dampening=st.sampled_from([0.0, 0.1]),
    nesterov=flags,
    wd=decays,
    maximize=flags,
    donate=flags,
)
def test_sgd_equals_fused_torch(lr, momentum, dampening, nesterov, wd, maximize, donate):
    nesterov = nesterov and momentum > 0 and dampening == 0
    kwargs = dict(
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=wd,
        maximize=maximize,
    )
    ours = optim.sgd(lr, **kwargs)
    _assert_equal(*_run_both(torch.optim.SGD, dict(kwargs, lr=lr, fused=True), ours, donate=donate))


def test_sgd_with_momentum_equals_fused_torch():
    kwargs = dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False)
    ours = optim.sgd(0.05, **kwargs)
    _assert_equal(*_run_both(torch.optim.SGD, dict(kwargs, lr=0.05, fused=True), ours))


@given(
    lr=lrs,
    alpha=st.sampled_from([0.99, 0.9]),
    eps=st.sampled_from([1e-8, 1e-4]),
    wd=decays,
    momentum=st.sampled_from([0.0, 0.9]),
    centered=flags,
    maximize=flags,
    donate=flags,
)
def test_rmsprop_equals_single_tensor_torch(
    lr, alpha, eps, wd, momentum, centered, maximize, donate
):
    kwargs = dict(
        alpha=alpha,
        eps=eps,
        weight_decay=wd,
        momentum=momentum,
        centered=centered,
        maximize=maximize,
    )
    ours = optim.rmsprop(lr, **kwargs)
    ref = dict(kwargs, lr=lr, foreach=False)
    _assert_equal(*_run_both(torch.optim.RMSprop, ref, ours, donate=donate))


@given(
    lr=lrs,
    lr_decay=st.sampled_from([0.0, 0.01]),
    wd=decays,
    initial=st.sampled_from([0.0, 0.1]),
    eps=st.sampled_from([1e-10, 1e-4]),
    maximize=flags,
    donate=flags,
)
def test_adagrad_equals_fused_torch(lr, lr_decay, wd, initial, eps, maximize, donate):
    kwargs = dict(
        lr_decay=lr_decay,
        weight_decay=wd,
        initial_accumulator_value=initial,
        eps=eps,
        maximize=maximize,
    )
    ours = optim.adagrad(lr, **kwargs)
    ref = dict(kwargs, lr=lr, fused=True)
    _assert_equal(*_run_both(torch.optim.Adagrad, ref, ours, donate=donate))


@given(
    lr=st.sampled_from([1.0, 0.5]),
    rho=st.sampled_from([0.9, 0.5]),
    eps=st.sampled_from([1e-6, 1e-3]),
    wd=decays,
    maximize=flags,
    donate=flags,
)
def test_adadelta_equals_single_tensor_torch(lr, rho, eps, wd, maximize, donate):
    kwargs = dict(rho=rho, eps=eps, weight_decay=wd, maximize=maximize)
    ours = optim.adadelta(lr, **kwargs)
    ref = dict(kwargs, lr=lr, foreach=False)
    _assert_equal(*_run_both(torch.optim.Adadelta, ref, ours, donate=donate))


@given(
    lr=st.sampled_from([2e-3, 2e-2]),
    betas=st.sampled_from([(0.9, 0.999), (0.8, 0.9)]),
    eps=st.sampled_from([1e-8, 1e-3]),
    wd=decays,
    maximize=flags,
    donate=flags,
)
def test_adamax_equals_single_tensor_torch(lr, betas, eps, wd, maximize, donate):
    kwargs = dict(betas=betas, eps=eps, weight_decay=wd, maximize=maximize)
    ours = optim.adamax(lr, **kwargs)
    ref = dict(kwargs, lr=lr, foreach=False)
    _assert_equal(*_run_both(torch.optim.Adamax, ref, ours, donate=donate))


def test_schedules_equal_lambda_lr():
    """With base lr 1, LambdaLR(schedule) feeds torch the same floats fscale computes."""
    warm = schedules.linear_warmup(0.01, warmup_steps=10)
    _assert_equal(
        *_run_both(torch.optim.AdamW, dict(lr=1.0, fused=True), optim.adamw(warm), schedule=warm)
    )
    decay = schedules.cosine(0.1, total_steps=40, warmup_steps=5, final=0.001)
    _assert_equal(
        *_run_both(
            torch.optim.SGD,
            dict(lr=1.0, momentum=0.9, fused=True),
            optim.sgd(decay, momentum=0.9),
            schedule=decay,
        )
    )
