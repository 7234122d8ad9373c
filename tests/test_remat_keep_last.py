"""A forward's last checkpointed call keeps what its backward reads instead of recomputing it.

Backward begins with that call, so its recompute would rebuild its saved tensors at once; kept,
they are the forward's own, the same bits. Only the most recent top-level call keeps: the one
before it is released when the next begins, and a kept tensor changed in place since is
recomputed instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import fscale as fs
from fscale.models import GPT, GPTConfig, lm_loss
from fscale.remat import checkpoint, keep_last, track
from fscale.testing import assert_trees_equal


def _weights(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 6, generator=generator, requires_grad=True) for _ in range(count)]


def _recording_block(saved: list[StorageWeakRef]):
    """tanh(x @ w) @ w.T; records a weak reference to the tanh output, which backward reads."""

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(x @ w)
        saved.append(StorageWeakRef(hidden.untyped_storage()))
        return hidden @ w.t()

    return checkpoint(block)


def _forward(weights, x, saved):
    block = _recording_block(saved)
    for w in weights:
        x = block(x, w)
    return x.square().sum()


def _grads(weights, x, scope):
    saved: list[StorageWeakRef] = []
    with track() as stats, scope:
        loss = _forward(weights, x, saved)
        alive = [not ref.expired() for ref in saved]
        grads = torch.autograd.grad(loss, [x, *weights])
    return grads, stats.recomputations, alive, saved[: len(weights)]


def test_only_the_last_call_keeps_its_saved_tensors_and_the_gradients_are_the_same():
    weights, x = _weights(3), torch.randn(4, 6, requires_grad=True)
    grads, recomputed, alive, saved = _grads(weights, x, keep_last())
    reference, every_call, alive_without, _ = _grads(weights, x, keep_last(False))
    assert alive == [False, False, True]  # the earlier calls were released as the next began
    assert alive_without == [False, False, False]
    assert (recomputed, every_call) == (2, 3)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert all(ref.expired() for ref in saved)  # backward read the kept tensors, then let go
    # Without a scope (a plain autograd call) every checkpointed call is recomputed.
    plain_saved: list[StorageWeakRef] = []
    with track() as stats:
        torch.autograd.grad(_forward(weights, x, plain_saved), [x, *weights])
    assert stats.recomputations == 3


def test_a_later_call_that_keeps_nothing_still_releases_the_kept_one():
    # Inside a fully_shard unit that is gathered again in backward no checkpoint keeps (what
    # it kept would hold the gathered parameters); the call kept before it is no longer last.
    weights, x = _weights(2), torch.randn(4, 6, requires_grad=True)
    saved: list[StorageWeakRef] = []
    block = _recording_block(saved)
    with track() as stats, keep_last():
        y = block(x, weights[0])
        kept_before = not saved[0].expired()
        with keep_last(False):
            y = block(y, weights[1])
        alive = [not ref.expired() for ref in saved]
        torch.autograd.grad(y.sum(), [x, *weights])
    assert kept_before and alive == [False, False]
    assert stats.recomputations == 2


def test_a_kept_tensor_changed_in_place_is_recomputed_instead():
    (w,), x = _weights(1), torch.randn(4, 6, requires_grad=True)

    def grads(enabled: bool) -> tuple[tuple[torch.Tensor, ...], int]:
        with track() as stats, keep_last(enabled):
            y = checkpoint(lambda x, w: torch.tanh(x @ w))(x, w)  # tanh saves its output: y
            y.mul_(2)  # plain autograd would refuse this backward; the recompute serves it
            found = torch.autograd.grad(y.sum(), (x, w))
        return found, stats.recomputations

    (kept, recomputed), (reference, _) = grads(True), grads(False)
    assert recomputed == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, reference))


def test_nested_checkpoints_and_a_second_backward_keep_the_bits():
    weights, x = _weights(2, seed=1), torch.randn(4, 6, requires_grad=True)
    inner = checkpoint(lambda x, w: torch.tanh(x @ w) @ w.t())
    outer = checkpoint(lambda x, a, b: inner(inner(x, a), b))

    def grads(enabled: bool) -> list[tuple[torch.Tensor, ...]]:
        with keep_last(enabled):
            loss = outer(x, *weights).square().sum()
            first = torch.autograd.grad(loss, [x, *weights], retain_graph=True)
            return [first, torch.autograd.grad(loss, [x, *weights])]

    for kept, recomputed in zip(grads(True), grads(False)):
        assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


def test_a_train_step_recomputes_all_but_the_last_block_and_trains_the_same_bits():
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=3, dropout=0.1)
    batch = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator())

    def train(remat: bool, keep: bool):
        model = GPT(cfg, seed=0)
        if remat:
            model.blocks = nn.ModuleList(checkpoint(block) for block in model.blocks)
        apply, params, buffers = fs.functionalize(model)

        def loss_fn(params, buffers, tokens, key):
            logits, new_buffers = apply(params, buffers, tokens[:, :-1], key=key)
            return lm_loss(logits, tokens[:, 1:]), new_buffers

        step = fs.train_step(loss_fn, fs.optim.adamw(1e-2))
        state = step.init(params, buffers)
        with track() as stats, keep_last(keep):
            for _ in range(3):
                state, metrics = step(state, batch)
        return state, metrics["loss"], stats.recomputations

    plain, plain_loss, _ = train(remat=False, keep=True)
    kept, kept_loss, recomputed = train(remat=True, keep=True)
    every, every_loss, every_call = train(remat=True, keep=False)
    assert (recomputed, every_call) == (3 * 2, 3 * 3)  # three steps of three blocks
    assert_trees_equal(kept, every)
    assert_trees_equal(kept, plain)  # dropout's masks replayed: the un-checkpointed bits
    assert torch.equal(kept_loss, every_loss) and torch.equal(kept_loss, plain_loss)


def test_a_scope_left_open_keeps_nothing_after_a_tracking_reset():
    # A program that left a block open (an exception past its exit) must not make the next
    # program of a reused process keep what it saves.
    (w,), x = _weights(1), torch.randn(4, 6, requires_grad=True)
    left_open = keep_last()
    left_open.__enter__()  # not exited before the reset
    fs.tracking.reset()
    with track() as stats:
        torch.autograd.grad(checkpoint(lambda x, w: torch.tanh(x @ w))(x, w).sum(), (x, w))
    assert stats.recomputations == 1
    left_open.__exit__(None, None, None)  # leaving it after the reset does not fail


def test_keep_last_takes_a_bool():
    with pytest.raises(TypeError, match="`enabled` must be True or False"), keep_last(1):  # type: ignore[arg-type]
        pass
