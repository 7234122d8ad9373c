"""Gradient buckets (assignment, forward order, hook delivery) and exact memory accounting."""

import pytest
import torch

from fscale import memory
from fscale.parallel.bucket_layout import layout_of
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
    params = {
        "z.weight": torch.zeros(1),
        "a.weight": torch.zeros(1),
        "m": [torch.zeros(1), torch.zeros(1)],
    }
    # optree's leaf order is sorted: a.weight (0), m.0 (1), m.1 (2), z.weight (3).
    assert forward_order(params) == [3, 0, 1, 2]
    assert forward_order([torch.zeros(1), torch.zeros(1)]) == [0, 1]
    # The same structure in another key order (cached per structure and key order).
    reordered = {key: params[key] for key in ("m", "z.weight", "a.weight")}
    assert forward_order(reordered) == [1, 2, 3, 0]
    assert forward_order(params) == [3, 0, 1, 2]


@pytest.mark.parametrize("compiling", [False, True])
def test_grad_buckets_write_into_flat_buffers_and_report_complete_buckets(compiling):
    leaves = [torch.ones(2, 2), torch.ones(3), torch.ones(1)]
    buckets = assign_buckets(leaves, bucket_bytes=16)  # [2, 1] then [0]
    ready = []
    collector = GradBuckets(buckets, 3, lambda b, data: ready.append((b.index, data.clone())))
    hooks = collector.hooks(compiling=compiling)
    returned = hooks[2](torch.full((1,), 5.0))
    assert ready == [] and torch.equal(returned, torch.full((1,), 5.0))
    hooks[1](torch.arange(3.0))
    assert ready[0][0] == 0 and torch.equal(ready[0][1], torch.tensor([5.0, 0.0, 1.0, 2.0]))
    hooks[0](torch.full((2, 2), 7.0))
    assert ready[1][0] == 1 and torch.equal(ready[1][1], torch.full((4,), 7.0))
    collector.flush()  # nothing pending: no second delivery
    assert len(ready) == 2


@pytest.mark.parametrize("compiling", [False, True])
def test_hooks_made_for_a_compiled_step_keep_dynamo_out(compiling):
    # Autograd calls the hooks of a compiled step where Dynamo would trace them (once per leaf
    # shape); those made for an eager step are plain calls, with no guard to pay.
    collector = GradBuckets(assign_buckets([torch.ones(2, 2)], 100), 1, lambda b, d: None)
    hook = collector.hooks(compiling=compiling)[0]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda g: hook(g * 2))(torch.ones(2, 2))
    skipped = [r for r in explained.break_reasons if "disable" in r.reason]
    assert len(skipped) == (1 if compiling else 0)
    assert torch.equal(collector.bucket_data(0), torch.full((4,), 2.0))


def test_flush_zeroes_leaves_that_got_no_gradient():
    leaves = [torch.ones(2), torch.ones(2)]
    ready = []
    collector = GradBuckets(
        assign_buckets(leaves, 100), 2, lambda b, d: ready.append(d.clone()), keep_grads=False
    )
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


def test_buckets_are_handed_out_in_index_order_whatever_order_they_complete_in():
    leaves = [torch.ones(2), torch.ones(2), torch.ones(2)]
    buckets = assign_buckets(leaves, bucket_bytes=8)  # one leaf each: [2], [1], [0]
    ready = []
    collector = GradBuckets(buckets, 3, lambda b, d: ready.append((b.index, d.clone())))
    hooks = collector.hooks()
    hooks[0](torch.full((2,), 3.0))  # bucket 2 completes first: it must wait for 0 and 1
    hooks[1](torch.full((2,), 2.0))
    assert ready == []
    hooks[2](torch.full((2,), 1.0))
    assert [index for index, _ in ready] == [0, 1, 2]
    assert [data.tolist() for _, data in ready] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_flush_hands_out_waiting_buckets_in_order_after_the_incomplete_one():
    leaves = [torch.ones(2), torch.ones(2)]
    buckets = assign_buckets(leaves, bucket_bytes=8)  # [1], [0]
    ready = []
    collector = GradBuckets(buckets, 2, lambda b, d: ready.append((b.index, d.tolist())))
    collector.hooks()[0](torch.full((2,), 5.0))  # bucket 1 complete; bucket 0 never arrives
    assert ready == []
    collector.flush()
    assert ready == [(0, [0.0, 0.0]), (1, [5.0, 5.0])]


def test_a_gradient_delivered_twice_is_an_error_not_a_premature_bucket():
    collector = GradBuckets(
        assign_buckets([torch.ones(2), torch.ones(2)], 100), 2, lambda b, d: None
    )
    hook = collector.hooks()[0]
    hook(torch.ones(2))
    with pytest.raises(RuntimeError, match="leaf 0 arrived twice"):
        hook(torch.ones(2))


def test_release_drops_a_handed_out_bucket_and_refuses_an_unused_one():
    leaves = [torch.ones(2), torch.ones(2)]
    buckets = assign_buckets(leaves, bucket_bytes=8)  # [1], [0]
    collector = GradBuckets(buckets, 2, lambda b, d: collector.release(b.index))
    hooks = collector.hooks()
    hooks[0](torch.ones(2))
    with pytest.raises(ValueError, match="bucket 1 has not been handed to `on_ready`"):
        collector.release(1)
    hooks[1](torch.ones(2))
    assert collector.bucket_data(0) is None and collector.bucket_data(1) is None


def test_assign_buckets_rejects_a_bad_shard_count():
    with pytest.raises(ValueError, match="`num_shards` must be a positive int"):
        assign_buckets([torch.ones(2)], 100, num_shards=0)


def test_fold_places_values_after_the_last_bucket():
    leaves = _leaves(3, 5)
    buckets = assign_buckets(leaves, bucket_bytes=4 * 4)  # one leaf per bucket
    seen = []
    collector = GradBuckets(buckets, 2, lambda b, flat: seen.append((b.index, flat.clone())))
    collector.fold(torch.tensor([7.0, 8.0]))
    hooks = collector.hooks()
    for leaf, hook in zip(leaves, hooks):
        hook(torch.full_like(leaf, float(leaf.numel())))
    last = buckets[-1]
    assert [index for index, _ in seen] == [0, 1]
    assert seen[0][1].numel() == buckets[0].numel  # only the last bucket carries them
    assert seen[1][1].numel() == last.numel + 2
    assert seen[1][1][last.numel :].tolist() == [7.0, 8.0]
    assert (seen[1][1][: last.numel] == 3.0).all()
    with pytest.raises(ValueError, match="before backward"):
        collector.fold(torch.tensor([1.0]))
    fresh = GradBuckets(buckets, 2, lambda b, flat: None)
    with pytest.raises(ValueError, match=r"`values` must be a 1-D torch\.float32"):
        fresh.fold(torch.tensor([1.0], dtype=torch.float64))
    flushed = []
    unused = GradBuckets(buckets, 2, lambda b, flat: flushed.append(flat.clone()))
    unused.fold(torch.tensor([5.0]))
    unused.flush()  # no gradient arrived: the folded value still travels
    assert flushed[-1].tolist() == [0.0] * last.numel + [5.0]


def test_bucket_views_alias_the_buffer_and_zeros_are_shared():
    leaves = [torch.zeros(2, 3), torch.zeros(5), torch.zeros(1, 4)]
    (bucket,) = assign_buckets(leaves, 1 << 20, num_shards=4)
    flat = torch.arange(40.0)[3 : 3 + bucket.numel]  # a buffer that starts inside its storage
    layout = bucket.layout
    packed = [leaves[i] for i in bucket.leaf_indices]  # last-used leaves first
    for view, offset, leaf in zip(layout.views(flat), layout.offsets, packed):
        expected = flat[offset : offset + leaf.numel()].view(leaf.shape)
        assert view.shape == expected.shape and torch.equal(view, expected)
        assert view.data_ptr() == expected.data_ptr()  # a view, not a copy
    # Gradients kept only in the buckets: autograd gets one stride-0 zero per shape.
    collector = GradBuckets([bucket], 3, lambda b, d: None, keep_grads=False)
    hooks = collector.hooks()
    zeros = [hook(torch.ones(leaf.shape)) for hook, leaf in zip(hooks, leaves)]
    assert all(z.stride() == (0,) * z.dim() and not z.any() for z in zeros)
    again = GradBuckets([bucket], 3, lambda b, d: None, keep_grads=False).hooks()[0]
    assert again(torch.ones(2, 3)) is zeros[0]


def test_a_small_last_bucket_is_written_after_backward_in_order_with_the_others():
    # Buckets [2], [1], [0] (one leaf each, 8 bytes); the last one (leaf 0) is within 8 bytes.
    leaves = [torch.ones(2), torch.ones(2), torch.ones(2)]
    buckets = assign_buckets(leaves, bucket_bytes=8)
    ready = []
    collector = GradBuckets(
        buckets, 3, lambda b, d: ready.append((b.index, d.tolist())), late_bytes=8
    )
    hooks = collector.hooks()
    assert hooks[0] is None and hooks[1] is not None and hooks[2] is not None
    hooks[2](torch.full((2,), 1.0))  # bucket 0 is handed out at once
    assert ready == [(0, [1.0, 1.0])]
    with pytest.raises(ValueError, match="pass the gradients autograd returned"):
        collector.flush()  # the late bucket's gradients would be lost
    assert ready == [(0, [1.0, 1.0])]
    # Leaf 1 never got a gradient: zeros, and the late bucket after it, in order.
    collector.flush([torch.full((2,), 3.0), None, None])
    assert ready == [(0, [1.0, 1.0]), (1, [0.0, 0.0]), (2, [3.0, 3.0])]


def test_the_late_bucket_adds_the_initial_gradients_and_flush_fills_what_it_lacked():
    leaves = [torch.ones(2), torch.ones(3)]
    buckets = assign_buckets(leaves, bucket_bytes=100)  # one bucket: leaves [1, 0]
    initial = [torch.full((2,), 10.0), torch.full((3,), 20.0)]
    ready = []
    collector = GradBuckets(
        buckets, 2, lambda b, d: ready.append(d.tolist()), initial=initial, late_bytes=20
    )
    assert collector.hooks() == [None, None]
    collector.flush([None, torch.full((3,), 1.0)])  # leaf 0 got none: its initial alone
    assert ready == [[21.0, 21.0, 21.0, 10.0, 10.0]]


def test_a_last_bucket_over_the_late_bytes_keeps_its_hooks():
    leaves = [torch.ones(2), torch.ones(2)]
    buckets = assign_buckets(leaves, bucket_bytes=8)  # [1], [0]: 8 bytes each
    ready = []
    collector = GradBuckets(buckets, 2, lambda b, d: ready.append(d.tolist()), late_bytes=7)
    assert all(hook is not None for hook in collector.hooks())
    # No late bucket: flush reads none of the gradients given, the hooks alone write them.
    collector.flush([torch.ones(2), torch.ones(2)])
    assert ready == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("sizes", [(3, 5, 2), (7,)])
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("aligned", [False, True])
def test_the_late_bucket_written_in_one_go_equals_the_leaf_by_leaf_write(sizes, fold, aligned):
    # The late bucket is built by one concatenation; the leaf-by-leaf write (a bucket with
    # hooks, the gradients delivered one at a time) is the reference: the same buffer, gaps
    # and padding, folded values and bits, for data_parallel's packed buckets and for
    # shard_optimizer's aligned ones (gaps between leaves, zeroed). A gradient is never the
    # buffer itself (a one-leaf bucket too): the collective writes into the buffer.
    leaves = [torch.zeros(n) for n in sizes]
    if aligned:
        layout, _ = layout_of({f"p{i}": leaf for i, leaf in enumerate(leaves)}, 1 << 20, 4)
        (bucket,) = layout.buckets
        assert bucket.layout.numel_unpadded > sum(sizes) or len(sizes) == 1  # has gaps
    else:
        (bucket,) = assign_buckets(leaves, 1 << 20, num_shards=4)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
    # A strided gradient, as autograd may return one.
    grads[0] = torch.randn(sizes[0] * 2, generator=torch.Generator().manual_seed(0))[::2]
    folded = torch.tensor([7.0, -0.0])
    late, hooked, allocated = [], [], []
    at_once = GradBuckets(
        [bucket],
        len(sizes),
        lambda b, d: late.append(d),
        late_bytes=1 << 20,
        on_allocate=allocated.append,
        zero_whole=aligned,
    )
    by_leaf = GradBuckets([bucket], len(sizes), lambda b, d: hooked.append(d), zero_whole=aligned)
    if fold:
        at_once.fold(folded)
        by_leaf.fold(folded)
    for hook, grad in zip(by_leaf.hooks(), grads):
        hook(grad)
    at_once.flush(grads)
    (expected,), (got,) = hooked, late
    assert got.shape == expected.shape
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert len(allocated) == 1 and allocated[0] is got and at_once.bucket_data(0) is got
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert got.untyped_storage().data_ptr() not in storages | {folded.untyped_storage().data_ptr()}


@pytest.mark.parametrize("path", ["hooks", "late at once", "late leaf by leaf"])
@pytest.mark.parametrize("fold", [False, True])
def test_divide_by_divides_each_element_once_in_the_copy(path, fold):
    # A mean's division done while writing into the bucket: the same bits as the undivided
    # buffer divided afterwards, for hooked and late buckets (written at once, or leaf by leaf
    # when a leaf has no gradient, which is zeroed) and the folded values. 3 does not divide
    # exactly: a missed or repeated division would show.
    leaves = [torch.zeros(n) for n in (3, 5, 2)]
    (bucket,) = assign_buckets(leaves, 1 << 20, num_shards=4)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3, 5, 2)]
    if path == "late leaf by leaf":
        grads[1] = None
    late_bytes = 0 if path == "hooks" else 1 << 20
    folded = torch.tensor([7.0, 1.0])
    got, plain = [], []
    divided = GradBuckets(
        [bucket], 3, lambda b, d: got.append(d), late_bytes=late_bytes, divide_by=3
    )
    undivided = GradBuckets([bucket], 3, lambda b, d: plain.append(d), late_bytes=late_bytes)
    for collector in (divided, undivided):
        if fold:
            collector.fold(folded)
        for hook, grad in zip(collector.hooks(), grads):
            if hook is not None and grad is not None:
                hook(grad)
        collector.flush(grads)
    (expected,), (result,) = plain, got
    assert torch.equal(result.view(torch.int32), (expected / 3).view(torch.int32))
    with pytest.raises(ValueError, match="divide the sums afterwards"):
        GradBuckets([bucket], 3, lambda b, d: None, initial=grads, divide_by=2)
    with pytest.raises(ValueError, match="`divide_by` must be a positive int"):
        GradBuckets([bucket], 3, lambda b, d: None, divide_by=0)


@pytest.mark.parametrize("zero_whole", [False, True])
def test_without_overlap_no_hooks_run_and_flush_builds_every_bucket_in_order(zero_whole):
    leaves = [torch.ones(2), torch.ones(3), torch.ones(1)]
    buckets = assign_buckets(leaves, bucket_bytes=16, num_shards=2)  # [2, 1] then [0]
    ready = []
    collector = GradBuckets(
        buckets,
        3,
        lambda b, data: ready.append((b.index, data.tolist())),
        keep_grads=False,
        zero_whole=zero_whole,
        divide_by=2,
        overlap=False,
    )
    assert collector.hooks() == [None, None, None]
    with pytest.raises(ValueError, match="pass the gradients autograd returned"):
        GradBuckets(buckets, 3, lambda b, d: None, overlap=False).flush()
    # Leaf 1 got no gradient (unused): zeros in its place; every value divided by 2.
    collector.flush([torch.full((2,), 4.0), None, torch.full((1,), 6.0)])
    assert ready == [(0, [3.0, 0.0, 0.0, 0.0]), (1, [2.0, 2.0])]


def test_a_held_gradient_of_another_dtype_is_converted_into_its_bucket():
    (bucket,) = assign_buckets([torch.ones(2), torch.ones(1)], bucket_bytes=100)
    ready = []
    collector = GradBuckets([bucket], 2, lambda b, d: ready.append(d.clone()), keep_grads=False)
    hooks = collector.hooks()
    hooks[0](torch.full((2,), 1.5, dtype=torch.float64))
    hooks[1](torch.full((1,), 2.5))
    assert ready[0].dtype == torch.float32 and ready[0].tolist() == [2.5, 1.5, 1.5]
