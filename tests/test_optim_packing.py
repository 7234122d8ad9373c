"""Packed optimizer buffers: layouts recorded once per list of tensors; exact=False in steps."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import fscale as fs
import fscale.optim as optim
from fscale import models, tree
from fscale.optim import packing


def _views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(flat.split(sizes))


def _no_address_reads(monkeypatch) -> None:
    def refuse(self):
        raise AssertionError("a leaf's address was read")

    monkeypatch.setattr(torch.Tensor, "data_ptr", refuse)


def test_span_of_the_same_tensors_is_answered_without_reading_addresses(monkeypatch):
    flat = torch.arange(10.0)
    leaves = _views(flat, [3, 0, 7])
    whole = packing.span(leaves)
    assert whole is not None and torch.equal(whole, flat)
    _no_address_reads(monkeypatch)
    assert packing.span(list(leaves)) is whole
    assert packing.is_packed(leaves)
    assert packing.device_groups(leaves) == [[0, 1, 2]]


def test_a_changed_list_is_checked_again():
    flat = torch.arange(12.0)
    leaves = _views(flat, [4, 4, 4])
    assert packing.span(leaves) is not None
    assert packing.span([leaves[0], torch.zeros(4), leaves[2]]) is None  # a replaced leaf
    assert packing.span([leaves[0], leaves[2], leaves[1]]) is None  # another order
    assert packing.span(leaves[:2]) is not None  # a prefix is a span of its own
    separate = [torch.zeros(3), torch.zeros(4), torch.zeros(5)]
    assert packing.gradient_runs(separate) is None  # one run per leaf: nothing to merge
    runs = packing.gradient_runs([leaves[2], leaves[0], torch.zeros(3), leaves[1]])
    assert runs is not None and runs.numels == [12, 3] and list(runs.order) == [1, 3, 0, 2]
    late, early = _views(torch.zeros(6), [2, 4]), _views(torch.zeros(9), [4, 5])
    grads = [early[0], late[1], early[1], late[0]]
    runs = packing.gradient_runs(grads)
    assert runs is not None and runs.numels == [9, 6] and list(runs.order) == [0, 2, 3, 1]
    assert not packing.is_packed(grads) and packing.span(grads) is None
    mixed = flat.view(torch.int32)[:8]  # same bytes, another dtype
    assert packing.span([leaves[0], mixed[4:8]]) is None


def test_records_keep_no_buffer_alive():
    flat = torch.zeros(100)
    alive = weakref.ref(flat)
    leaves = _views(flat, [50, 50])
    assert packing.span(leaves) is not None
    packed = packing.packed_full(leaves)
    copies = packing.packed_copy(packed)
    packed_alive = weakref.ref(packed[0]._base)
    copies_alive = weakref.ref(copies[0]._base)
    del flat, leaves, packed, copies  # freed by reference counting: no cycle through a record
    assert alive() is None and packed_alive() is None and copies_alive() is None


def test_signatures_of_packed_buffers_are_shared_with_their_source():
    params = packing.packed_full([torch.zeros(4), torch.zeros(5)])  # recorded as built
    state = packing.packed_full(params)
    assert packing.signatures(state) is packing.signatures(params)
    assert packing.signatures([torch.zeros(2, 3), 1.0]) == [
        (torch.Size([2, 3]), torch.float32, torch.device("cpu")),
        None,
    ]


@pytest.mark.parametrize("donate", [True, False])
def test_non_exact_steps_after_the_first_read_no_leaf_address(monkeypatch, kernel_calls, donate):
    """The layout of params, state and gradients is decided once, not once per step."""
    sizes = [6, 1, 13, 4]
    params = dict(zip("abcd", (torch.randn(n) for n in sizes)))
    grads = dict(zip("abcd", _views(torch.randn(sum(sizes)), sizes)))
    calls = kernel_calls("_fused_adamw_")
    opt = optim.adamw(1e-2, exact=False)
    params, state = optim.step(opt, grads, opt.init(params), params, donate=donate)
    calls.clear()
    _no_address_reads(monkeypatch)
    for _ in range(3):
        params, state = optim.step(opt, grads, state, params, donate=donate)
    assert calls == [[sum(sizes)]] * 3


def _gpt():
    cfg = models.GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    return models.GPT(cfg), cfg


def _tokens(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)


def _packed_grads(grads):
    leaves, treedef = tree.flatten(grads)
    flat = torch.cat([g.reshape(-1) for g in leaves])
    views = flat.split([g.numel() for g in leaves])
    return tree.unflatten(treedef, [v.view(g.shape) for v, g in zip(views, leaves)])


@pytest.mark.parametrize("flat_grads", [False, True])
def test_non_exact_train_step_with_donation_is_close_to_torch(kernel_calls, flat_grads):
    """``train_step(..., donate=True)`` with ``adamw(exact=False)`` against eager nn.Module
    training with ``torch.optim.AdamW(fused=True)``: rtol 1e-4, atol 1e-5 after 10 steps.

    The step hands the optimizer autograd's gradients, separate tensors, so its update runs
    the per-tensor call; gradients packed into one buffer between `Step.gradients` and
    `Step.apply_gradients` get one call over the whole buffer.
    """
    model, cfg = _gpt()
    eager = copy.deepcopy(model)
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):
        logits, new_buffers = apply(params, buffers, batch[:, :-1], key=key)
        return models.lm_loss(logits, batch[:, 1:]), new_buffers

    calls = kernel_calls("_fused_adamw_")
    step = fs.train_step(loss_fn, optim.adamw(1e-2, exact=False), donate=True)
    state = step.init(params, buffers)
    torch_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, fused=True)
    ours = []
    for i in range(10):
        batch = _tokens(cfg, i)
        grads, aux = step.gradients(state, batch)
        if flat_grads:
            grads = _packed_grads(grads)
        state, _ = step.apply_gradients(state, grads, aux)
        ours.append(calls.pop())
        torch_opt.zero_grad()
        logits = eager(batch[:, :-1])
        models.lm_loss(logits, batch[:, 1:]).backward()
        torch_opt.step()
    numels = [p.numel() for p in tree.leaves(state.params)]
    assert ours == [[sum(numels)] if flat_grads else numels] * 10
    for name, p in eager.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-4, atol=1e-5)


def test_gradients_in_several_buffers_in_another_order_get_one_call_per_buffer(kernel_calls):
    """Buckets in reverse leaf order (as a reducer fills them): the state follows their order."""
    calls = kernel_calls("_fused_adam_")
    sizes = [5, 3, 8, 2]
    params = dict(zip("abcd", (torch.randn(n) for n in sizes)))
    exact_opt, opt = optim.adam(1e-2), optim.adam(1e-2, exact=False)
    exact, state = params, opt.init(params)
    exact_state, ours = exact_opt.init(params), dict(params)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        late, early = torch.randn(2 + 8, generator=g), torch.randn(3 + 5, generator=g)
        grads = {"d": late[:2], "c": late[2:], "b": early[:3], "a": early[3:]}
        exact, exact_state = optim.step(exact_opt, grads, exact_state, exact)
        calls.clear()
        given = ours
        ours, state = optim.step(opt, grads, state, ours, donate=True)
        assert calls == [[8, 10]]  # one span per buffer, the one holding "a" first
        if seed:  # packed in the buffers' order once, at the first step; in place after it
            assert all(ours[k] is given[k] for k in ours)
        torch.testing.assert_close(ours, exact, rtol=1e-6, atol=1e-7)


def _non_exact_under(strategies, steps):
    import torch.distributed as dist

    model, cfg = _gpt()
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):
        logits, new_buffers = apply(params, buffers, batch[:, :-1], key=key)
        return models.lm_loss(logits, batch[:, 1:]), new_buffers

    calls: list[list[int]] = []
    kernel = torch._fused_adamw_

    def recording(params, *args, **kwargs):
        calls.append([p.numel() for p in params])
        return kernel(params, *args, **kwargs)

    torch._fused_adamw_ = recording
    mesh = fs.Mesh(dp=dist.get_world_size())
    results = {}
    try:
        for strategy in strategies:
            for exact in (True, False):
                train = fs.train_step(loss_fn, optim.adamw(1e-2, exact=exact), donate=True)
                step = getattr(fs, strategy)(train, mesh)
                state = step.init(tree.map(torch.clone, params), buffers)
                for i in range(steps):
                    state, _ = step(state, _tokens(cfg, 10 * i + dist.get_rank()))
                results[strategy, exact] = (fs.consolidate(step, state).params, calls[-1])
    finally:
        torch._fused_adamw_ = kernel
    return results


def test_non_exact_data_parallel_and_shard_optimizer_update_each_bucket_in_one_call():
    """Both hand the optimizer views of their reduced buckets (data_parallel: whole buckets,
    shard_optimizer: this rank's shard of each): one span per bucket, within rounding of the
    exact path (rtol 1e-4, atol 1e-5 after 4 steps)."""
    from fscale.testing import run_spmd

    strategies = ("data_parallel", "shard_optimizer")
    for results in run_spmd(_non_exact_under, 2, strategies, 4):
        for strategy in strategies:
            exact, per_leaf = results[strategy, True]
            ours, per_bucket = results[strategy, False]
            assert len(per_bucket) < len(per_leaf)  # a few buckets, not one entry per leaf
            assert sum(per_bucket) == sum(per_leaf)
            for name in exact:
                torch.testing.assert_close(ours[name], exact[name], rtol=1e-4, atol=1e-5)
