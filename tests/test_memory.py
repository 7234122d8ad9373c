"""Exact memory accounting: tree_bytes counts storages once; LiveBytes measures the live peak."""

from __future__ import annotations

import gc

import optree
import pytest
import torch

import fscale as fs
from fscale.memory import LiveBytes, tree_bytes


def test_tree_bytes_counts_each_storage_once():
    flat = torch.zeros(10)
    assert (
        tree_bytes({"a": flat[:4], "b": flat[4:], "c": torch.zeros(3, dtype=torch.float64)}) == 64
    )


def test_live_bytes_peak_follows_storages_until_their_last_view_dies():
    live = LiveBytes()
    first = torch.zeros(100)  # 400 bytes
    view = first[10:20]
    live.track(view)  # counts the whole storage it keeps alive
    assert live.live == 400 and live.peak == 400
    second = torch.zeros(50, dtype=torch.float64)  # 400 bytes
    live.track(second)
    assert live.live == 800 and live.peak == 800
    live.track(second[:5])  # the same storage again: counted once
    assert live.live == 800
    del first
    gc.collect()
    assert live.live == 800  # `view` still holds the storage
    del view
    gc.collect()
    live.sample()
    assert live.live == 400 and live.peak == 800
    del second
    gc.collect()
    third = torch.zeros(25)  # 100 bytes
    live.track(third)
    assert live.live == 100 and live.peak == 800
    assert repr(live) == "LiveBytes(live=100, peak=800)"


def test_live_bytes_rejects_what_is_not_a_tensor():
    with pytest.raises(
        TypeError, match=r"LiveBytes.track: `tensor` must be a torch.Tensor, got list"
    ):
        LiveBytes().track([1.0])


def _storages(values) -> set[int]:
    return {
        leaf.untyped_storage().data_ptr()
        for leaf in optree.tree_leaves(values)
        if isinstance(leaf, torch.Tensor) and leaf.numel() > 1
    }


@pytest.mark.parametrize("donate", [False, True])
def test_a_pure_step_holds_old_and_new_state_at_once_a_donated_one_does_not(donate):
    # What `donate=False` costs (fscale.parallel.ddp's docstring): the update writes new
    # parameter and optimizer-state buffers while the caller still holds the old ones.
    params = {"w": torch.randn(64, 32), "b": torch.randn(32)}

    def loss_fn(p, buffers, batch, key):
        return ((batch @ p["w"] + p["b"]) ** 2).mean()

    step = fs.train_step(loss_fn, fs.optim.adamw(1e-3), donate=donate)
    state = step.init({k: v.clone() for k, v in params.items()})
    state, _ = step(state, torch.randn(8, 64))  # the moments exist from here on
    old = (state.params, state.opt_state)
    old_bytes, old_storages = tree_bytes(old), _storages(old)
    new_state, _ = step(state, torch.randn(8, 64))
    new = (new_state.params, new_state.opt_state)
    numel = sum(v.numel() for v in params.values())
    assert old_bytes >= numel * 12  # float32 params and Adam's two moments
    shared = _storages(new) & old_storages
    if donate:
        assert shared == old_storages  # updated in place: nothing new held beside the old
    else:
        assert not shared
        assert tree_bytes((old, new)) == old_bytes + tree_bytes(new)
