"""Purity enforced: donated states refused after use, failed donated updates, loss_fn writes."""

from __future__ import annotations

import pytest
import torch

import fscale as fs
from fscale.testing import assert_trees_equal


def _loss(p, b, batch, key):
    return ((p["w"] * batch).sum() - 1.0) ** 2 + (p["v"].sum() - 2.0) ** 2


def _params():
    return {"w": torch.ones(3), "v": torch.full((2,), 0.5, dtype=torch.float64)}


def test_a_state_given_to_a_donated_step_is_refused_afterwards():
    step = fs.train_step(_loss, fs.optim.sgd(0.1, momentum=0.9), donate=True)
    old = step.init(_params())
    new, _ = step(old, torch.ones(3))
    with pytest.raises(ValueError, match=r"given to a donated step \(donate=True\)"):
        step(old, torch.ones(3))
    with pytest.raises(ValueError, match="donated step"):
        step.gradients(old, torch.ones(3))
    grads, aux = step.gradients(new, torch.ones(3))
    with pytest.raises(ValueError, match="donated step"):
        step.apply_gradients(old, grads, aux)
    newer, _ = step(new, torch.ones(3))  # the returned state goes on
    assert int(newer.step) == 2


def test_a_non_donated_step_keeps_old_states_usable():
    step = fs.train_step(_loss, fs.optim.sgd(0.1, momentum=0.9))
    old = step.init(_params())
    a, _ = step(old, torch.ones(3))
    b, _ = step(old, torch.ones(3))
    assert_trees_equal(a.params, b.params)


def _failing_on_second_group(monkeypatch):
    """torch._fused_sgd_ that raises on its second call (the second dtype group)."""
    kernel = torch._fused_sgd_
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure in the float64 group")
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_sgd_", flaky)
    return calls


def test_a_donated_update_that_fails_part_way_marks_the_state_invalid(monkeypatch):
    step = fs.train_step(_loss, fs.optim.sgd(0.1, momentum=0.9), donate=True)
    state = step.init(_params())
    state, _ = step(state, torch.ones(3))
    calls = _failing_on_second_group(monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        step(state, torch.ones(3))
    assert len(calls) == 2  # the float32 group was updated, the float64 group was not
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"invalid.*failed part way.*injected failure"):
        step(state, torch.ones(3))


def test_a_non_donated_update_that_fails_leaves_the_state_valid(monkeypatch):
    step = fs.train_step(_loss, fs.optim.sgd(0.1, momentum=0.9))
    state = step.init(_params())
    state, _ = step(state, torch.ones(3))
    before = {k: v.clone() for k, v in state.params.items()}
    _failing_on_second_group(monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        step(state, torch.ones(3))
    monkeypatch.undo()
    assert_trees_equal(state.params, before)  # the copies were updated, not the state
    state, _ = step(state, torch.ones(3))
    assert int(state.step) == 2


@pytest.mark.parametrize("donate", [False, True])
def test_a_loss_that_writes_into_its_params_is_refused(donate):
    def writes_params(p, b, batch, key):
        with torch.no_grad():
            p["v"].mul_(0.5)
        return _loss(p, b, batch, key)

    step = fs.train_step(writes_params, fs.optim.sgd(0.1), donate=donate)
    state = step.init(_params())
    with pytest.raises(ValueError, match=r"loss_fn wrote into params leaf 'v' in place"):
        step(state, torch.ones(3))


def test_a_loss_that_writes_into_its_buffers_is_refused():
    def writes_buffers(p, b, batch, key):
        b["count"].add_(1)
        return _loss(p, b, batch, key)

    step = fs.train_step(writes_buffers, fs.optim.sgd(0.1))
    state = step.init(_params(), {"count": torch.zeros(())})
    with pytest.raises(ValueError, match=r"buffers leaf 'count' in place"):
        step(state, torch.ones(3))
    assert float(state.buffers["count"]) == 1.0  # the write happened: hence the error


def test_a_loss_that_returns_new_buffers_is_fine():
    def counts(p, b, batch, key):
        return _loss(p, b, batch, key), {"count": b["count"] + 1}

    step = fs.train_step(counts, fs.optim.sgd(0.1), donate=True)
    state = step.init(_params(), {"count": torch.zeros(())})
    for _ in range(3):
        state, _ = step(state, torch.ones(3))
    assert float(state.buffers["count"]) == 3.0
