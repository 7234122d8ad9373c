"""Gradient buckets (assignment, forward order, hook delivery) and exact memory accounting."""

import pytest
import torch

from fscale import memory
from fscale.parallel.buckets import GradBuckets, assign_buckets, forward_order


def _leaves(*sizes, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype) for n in sizes]


def test_buckets_fill_in_reverse_order_up_to_the_cap():
    leaves = _leaves(10, 10, 10, 30)  # 40, 40, 40, 120 bytes
    buckets = assign_buckets(leaves, bucket_bytes=80)
    assert [b.leaf_indices for b in buckets] == [[3], [2, 1], [0]]
    assert all(b.layout.data.device.type == "meta" for b in buckets)


def test_first_bucket_can_be_smaller():
    leaves = _leaves(10, 10, 10, 10)
    buckets = assign_buckets(leaves, bucket_bytes=1000, first_bucket_bytes=40)
    assert [b.leaf_indices for b in buckets] == [[3], [2, 1, 0]]


def test_buckets_split_by_dtype_and_pad_to_the_shard_count():
    leaves = _leaves(3) + _leaves(2, dtype=torch.float64) + _leaves(4)
    buckets = assign_buckets(leaves, bucket_bytes=10**6, num_shards=4)
    assert [b.leaf_indices for b in buckets] == [[2], [1], [0]]
    assert [b.numel for b in buckets] == [4, 4, 4]
    assert buckets[1].layout.dtype == torch.float64


def test_order_and_argument_errors():
    leaves = _leaves(1, 1)
    assert [b.leaf_indices for b in assign_buckets(leaves, 100, order=[1, 0])] == [[0, 1]]
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets(leaves, 100, order=[0, 0])
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(leaves, 0)


def test_forward_order_follows_dict_insertion_order():
    params = {"z.weight": torch.zeros(1), "a.weight": torch.zeros(1), "m": [torch.zeros(1), torch.zeros(1)]}
    # optree's leaf order is sorted: a.weight (0), m.0 (1), m.1 (2), z.weight (3).
    assert forward_order(params) == [3, 0, 1, 2]
    assert forward_order([torch.zeros(1), torch.zeros(1)]) == [0, 1]


def test_grad_buckets_write_into_flat_buffers_and_report_complete_buckets():
    leaves = [torch.ones(2, 2), torch.ones(3), torch.ones(1)]
    buckets = assign_buckets(leaves, bucket_bytes=16)  # [2, 1] then [0]
    ready = []
    collector = GradBuckets(buckets, 3, lambda b, data: ready.append((b.index, data.clone())))
    hooks = collector.hooks()
    returned = hooks[2](torch.full((1,), 5.0))
    assert ready == [] and torch.equal(returned, torch.full((1,), 5.0))
    hooks[1](torch.arange(3.0))
    assert ready[0][0] == 0 and torch.equal(ready[0][1], torch.tensor([5.0, 0.0, 1.0, 2.0]))
    hooks[0](torch.full((2, 2), 7.0))
    assert ready[1][0] == 1 and torch.equal(ready[1][1], torch.full((4,), 7.0))
    collector.flush()  # nothing pending: no second delivery
    assert len(ready) == 2


def test_flush_zeroes_leaves_that_got_no_gradient():
    leaves = [torch.ones(2), torch.ones(2)]
    ready = []
    collector = GradBuckets(assign_buckets(leaves, 100), 2, lambda b, d: ready.append(d.clone()),
                            keep_grads=False)
    dummy = collector.hooks()[1](torch.full((2,), 3.0))
    assert dummy.stride() == (0,) and torch.equal(dummy, torch.zeros(2))  # holds no memory
    collector.flush()
    assert torch.equal(ready[0], torch.tensor([3.0, 3.0, 0.0, 0.0]))


def test_tree_bytes_counts_each_storage_once():
    flat = torch.zeros(10)
    tied = torch.zeros(4)
    values = {"a": flat[:5], "b": flat[5:], "c": tied, "d": tied, "e": torch.zeros(()).expand(100)}
    assert memory.tree_bytes(values) == 10 * 4 + 4 * 4 + 4
    assert memory.tree_bytes({"none": None, "empty": torch.zeros(0)}) == 0
