"""Exact memory accounting: tree_bytes counts storages once; LiveBytes measures the live peak."""

from __future__ import annotations

import gc

import pytest
import torch

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
