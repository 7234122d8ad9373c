"""fscale.tree: pytree helpers and FlatBuffer round trips, shards, fragments and errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fscale as fs
from fscale import tree
from fscale.flat import FlatBuffer, Fragment, flat_copy


def test_helpers_follow_optree_order_and_name_paths():
    params = {"b": [torch.ones(1), torch.zeros(2)], "a": {"w": torch.ones(3)}, "none": None}
    assert [t.numel() for t in tree.leaves(params)] == [3, 1, 2]
    assert tree.paths(params) == ["a.w", "b.0", "b.1"]
    leaves, treedef = tree.flatten(params)
    rebuilt = tree.unflatten(treedef, leaves)
    assert tree.structure(rebuilt) == tree.structure(params)
    doubled = tree.map(lambda t: t * 2, params)
    assert torch.equal(doubled["a"]["w"], torch.full((3,), 2.0))
    named = tree.map_with_path(lambda path, t: path, params)
    assert named["b"][1] == "b.1"


def test_map_over_mismatched_trees_names_both_structures():
    with pytest.raises(ValueError, match="different structure"):
        tree.map(torch.add, {"a": torch.ones(1)}, {"b": torch.ones(1)})


def test_with_fields_equals_replace_and_names_an_unknown_field():
    state = fs.TrainState({"w": torch.ones(2)}, {}, None, torch.zeros(()), torch.zeros(2))
    changed = tree.with_fields(state, opt_state={"m": torch.zeros(2)}, step=torch.ones(()))
    assert type(changed) is fs.TrainState
    expected = state._replace(opt_state={"m": torch.zeros(2)}, step=torch.ones(()))
    assert tree.structure(changed) == tree.structure(expected)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(changed), tree.leaves(expected)))
    assert changed.params is state.params and state.opt_state is None  # a copy; no mutation
    assert tree.with_fields(state) == state
    with pytest.raises(TypeError, match=r"TrainState has no field\(s\) \['steps'\]"):
        tree.with_fields(state, steps=torch.ones(()))


def test_with_fields_survives_a_graph_break_in_a_compiled_function():
    # The result crosses a graph break into the next call: Dynamo before torch 2.13 rebuilt
    # `_replace`'s result there as an empty tuple.
    state = fs.TrainState({"w": torch.ones(2)}, {}, None, torch.zeros(()), torch.zeros(2))

    @torch.compiler.disable
    def outside(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def inner(state: fs.TrainState) -> torch.Tensor:
        return state.params["w"] * state.step

    def outer(state: fs.TrainState) -> torch.Tensor:
        changed = tree.with_fields(state, step=state.step + 2)
        outside(changed.step)
        return inner(changed)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(outer, backend="eager")(state), torch.full((2,), 2.0))


def test_unflatten_checks_the_leaf_count():
    _, treedef = tree.flatten({"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(ValueError, match="2 leaves but 1 values"):
        tree.unflatten(treedef, [torch.ones(1)])


shapes = st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)


@given(
    shapes=shapes,
    num_shards=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]),
)
def test_flatbuffer_round_trips_exactly_and_shards_evenly(shapes, num_shards, dtype):
    g = torch.Generator().manual_seed(len(shapes))
    tensors = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    flat = FlatBuffer(tensors, num_shards)
    assert flat.numel % num_shards == 0 and flat.numel >= flat.numel_unpadded
    assert flat.numel - flat.numel_unpadded < num_shards or flat.numel_unpadded == 0
    for original, view in zip(tensors, flat.views()):
        assert view.shape == original.shape and torch.equal(view, original)
        if view.numel():
            assert view.untyped_storage().data_ptr() == flat.data.untyped_storage().data_ptr()
    assert torch.all(flat.data[flat.numel_unpadded :] == 0)
    shards = [flat.shard(i) for i in range(num_shards)]
    assert all(s.numel() == flat.shard_size for s in shards)
    assert torch.equal(torch.cat(shards), flat.data)
    # Fragments of every shard tile every tensor exactly once, and fragment views hold its data.
    for i, original in enumerate(tensors):
        pieces = [flat.fragment_views(r, shards[r])[i] for r in range(num_shards)]
        frags = [flat.fragments(r)[i] for r in range(num_shards)]
        assert sum(f.numel for f in frags) == original.numel()
        assert all(f.shape == original.shape for f in frags)
        assert torch.equal(torch.cat(pieces), original.reshape(-1))


def test_fragments_hand_computed():
    flat = FlatBuffer([torch.zeros(2, 2), torch.zeros(3)], num_shards=2)  # 7 -> padded 8
    assert flat.shard_size == 4
    assert flat.fragments(0) == [
        Fragment(torch.Size([2, 2]), 0, 4),
        Fragment(torch.Size([3]), 0, 0),
    ]
    assert flat.fragments(1) == [
        Fragment(torch.Size([2, 2]), 4, 4),
        Fragment(torch.Size([3]), 0, 3),
    ]
    assert flat.fragments(1)[1].is_whole and not flat.fragments(0)[1].is_whole


def test_fragment_views_alias_the_shard_wherever_it_lies():
    flat = FlatBuffer([torch.arange(6.0), torch.arange(5.0)], num_shards=2)  # 11 -> 12
    expected = [
        [fv.tolist() for fv in flat.fragment_views(r, flat.shard(r).clone())] for r in range(2)
    ]
    assert expected == [[[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], []], [[], [0.0, 1.0, 2.0, 3.0, 4.0]]]
    # A shard inside a larger storage (one as_strided per fragment): writes land in the buffer.
    views = flat.fragment_views(1, flat.shard(1))
    views[1].fill_(-1.0)
    assert flat.views()[1].tolist() == [-1.0] * 5
    # A shard autograd tracks, or a strided one, is sliced: the same values.
    tracked = flat.shard(0).clone().requires_grad_()
    assert [v.tolist() for v in flat.fragment_views(0, tracked)] == expected[0]
    strided = torch.stack([flat.shard(0), flat.shard(0)], dim=1)[:, 0]
    assert [v.tolist() for v in flat.fragment_views(0, strided)] == expected[0]
    # The fragments are computed once per shard and handed out as a fresh list.
    flat.fragments(0).clear()
    assert len(flat.fragments(0)) == 2


def test_with_data_shares_the_layout():
    flat = FlatBuffer([torch.ones(2), torch.ones(3)], num_shards=2)
    grads = flat.with_data(torch.arange(6.0))
    assert [v.tolist() for v in grads.views()] == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    assert torch.equal(flat.empty_like().data, torch.zeros(6))
    with pytest.raises(ValueError, match="6 elements"):
        flat.with_data(torch.zeros(5))
    with pytest.raises(ValueError, match="dtype"):
        flat.with_data(torch.zeros(6, dtype=torch.float64))


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("align", [1, 4])
def test_views_of_a_differentiable_buffer_give_one_gradient_buffer(align):
    shapes = [(2, 3), (5,), (1,), (3, 1)]
    g = torch.Generator().manual_seed(0)
    flat = FlatBuffer([torch.randn(s, generator=g) for s in shapes], 3, align=align)
    grads = [torch.randn(s, generator=g) for s in shapes]
    grads[1][0] = -0.0  # a negative zero stays one: no zero buffer is added to it
    data = flat.data.clone().requires_grad_(True)
    views = flat.views(data)
    assert [v.shape for v in views] == [torch.Size(s) for s in shapes]
    assert all(torch.equal(v, w) for v, w in zip(views, flat.views()))
    with _CountOps() as ops:
        (got,) = torch.autograd.grad(views, [data], grads)
    expected = torch.zeros(flat.numel)
    for offset, grad in zip(flat.offsets, grads):
        expected[offset : offset + grad.numel()] = grad.reshape(-1)
    assert torch.equal(got, expected) and got[flat.offsets[1]].signbit()
    # One write of the whole buffer; slices would each zero-fill it and autograd sum them.
    assert "slice_backward" not in ops.names and "add" not in ops.names, ops.names


@pytest.mark.parametrize("align", [1, 4])
def test_views_alias_the_buffer_where_it_lies_in_its_storage(align):
    shapes = [(2, 3), (0, 4), (5,), (), (3, 1)]
    g = torch.Generator().manual_seed(1)
    flat = FlatBuffer([torch.randn(s, generator=g) for s in shapes], 2, align=align)
    storage = torch.zeros(flat.numel + 7)
    inside = storage[7:]  # a buffer that starts inside its storage
    inside.copy_(flat.data)
    strided = torch.zeros(2 * flat.numel)[::2]  # and one that is not contiguous
    strided.copy_(flat.data)
    for data in (flat.data, inside, strided):
        views = flat.views(data)
        for view, offset, shape in zip(views, flat.offsets, shapes):
            assert view.shape == torch.Size(shape)
            if view.numel() > 1:
                assert view.is_contiguous() == (data is not strided)
            assert torch.equal(view.reshape(-1), data[offset : offset + view.numel()])
        views[2].fill_(7.0)  # writes land in the buffer
        assert torch.equal(data[flat.offsets[2] : flat.offsets[2] + 5], torch.full((5,), 7.0))


@pytest.mark.parametrize("align", [1, 4])
def test_parameters_that_require_grad_pack_by_value(align):
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(5))]
    flat = FlatBuffer(params, 2, align=align)
    assert not flat.data.requires_grad
    assert all(torch.equal(v, p) for v, p in zip(flat.views(), params))


def test_flatbuffer_errors():
    with pytest.raises(ValueError, match="empty"):
        FlatBuffer([])
    with pytest.raises(ValueError, match="mix dtypes"):
        FlatBuffer([torch.ones(1), torch.ones(1, dtype=torch.float64)])
    with pytest.raises(ValueError, match="num_shards"):
        FlatBuffer([torch.ones(1)], 0)
    with pytest.raises(ValueError, match="num_shards"):
        FlatBuffer([torch.ones(1)], 2.0)
    with pytest.raises(TypeError, match="not a tensor"):
        FlatBuffer([[1.0]])
    with pytest.raises(IndexError, match="outside"):
        FlatBuffer([torch.ones(4)], 2).shard(2)
    if torch.device("meta") != torch.device("cpu"):
        with pytest.raises(ValueError, match="several devices"):
            FlatBuffer([torch.ones(1), torch.ones(1, device="meta")])


def test_group_by_dtype_keeps_first_seen_order():
    ts = [torch.ones(1), torch.ones(1, dtype=torch.float64), torch.ones(1)]
    assert FlatBuffer.group_by_dtype(ts) == {torch.float32: [0, 2], torch.float64: [1]}


def test_aligned_layout_starts_every_tensor_and_shard_on_the_boundary():
    from fscale.flat import aligned_elements

    tensors = [torch.arange(5.0), torch.arange(3.0), torch.arange(17.0)]
    flat = FlatBuffer(tensors, num_shards=2, align=aligned_elements(torch.float32))
    assert flat.offsets == [0, 16, 32] and flat.numel_unpadded == 49
    assert flat.shard_size % 16 == 0 and flat.numel == 2 * flat.shard_size == 64
    for original, view in zip(tensors, flat.views()):
        assert torch.equal(view, original)
    # The gaps are zero, and fragments still tile every tensor exactly once.
    assert torch.count_nonzero(flat.data) == sum(torch.count_nonzero(t) for t in tensors)
    for i, original in enumerate(tensors):
        pieces = [flat.fragment_views(r, flat.shard(r))[i] for r in range(2)]
        assert torch.equal(torch.cat(pieces), original)
    with pytest.raises(ValueError, match="align"):
        FlatBuffer(tensors, align=0)


@pytest.mark.parametrize("count", [1, 3])
def test_flat_copy_packs_new_memory_outside_autograd(count: int) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    tensors = [base.t(), torch.ones(5, requires_grad=True), torch.zeros(0)][:count]
    flat = flat_copy(tensors)
    assert torch.equal(flat, torch.cat([t.detach().reshape(-1) for t in tensors]))
    assert not flat.requires_grad
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert flat.untyped_storage().data_ptr() not in storages  # a collective may write into it
    flat.add_(1.0)
    assert torch.equal(base, torch.arange(24.0).reshape(4, 6))
