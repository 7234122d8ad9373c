"""Checkpoint boxes: ranges of a flattening and tensor-parallel shards as boxes of full leaves,
and expert-parallel states saved as their slices and loaded under other plans."""

import tempfile

import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import fscale as fs
from fscale.ckpt.boxes import range_boxes, range_pieces, split_pieces, whole_piece
from fscale.ckpt.export import read_leaves
from fscale.models import GPTConfig, MoEGPT, MoEGPTConfig, lm_loss
from fscale.parallel.moe.plan import is_expert_state
from fscale.parallel.tensor import Split, shard_tensor
from fscale.testing import assert_trees_equal, run_spmd

# ---- boxes --------------------------------------------------------------------------------


def _box(tensor, offsets, sizes):
    for dim, (start, size) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, start, size)
    return tensor


@given(st.lists(st.integers(1, 4), min_size=0, max_size=3), st.data())
def test_a_range_of_a_flattening_is_the_boxes_range_boxes_gives(shape, data):
    shape = tuple(shape)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    start = data.draw(st.integers(0, full.numel()))
    stop = data.draw(st.integers(start, full.numel()))
    boxes = range_boxes(shape, start, stop)
    assert len(boxes) <= 2 * max(len(shape) - 1, 0) + 1
    joined = [_box(full, offsets, sizes).reshape(-1) for offsets, sizes, _ in boxes]
    expected = full.reshape(-1)[start:stop]
    assert torch.equal(torch.cat(joined) if joined else expected[:0], expected)
    # The pieces view the 1-D values at the boxes' places in the range.
    pieces = range_pieces("leaf", shape, start, expected.clone())
    assert [p.offsets for p in pieces] == [offsets for offsets, _, _ in boxes]
    for piece in pieces:
        assert torch.equal(piece.values, _box(full, piece.offsets, piece.sizes))


@given(
    st.integers(1, 3),
    st.sampled_from([1, 2, 3]),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 1),
    st.data(),
)
def test_a_tensor_parallel_shard_is_placed_where_the_dense_tensor_holds_it(
    chunk, parts, size, dim, data
):
    shape = [3, 2]
    shape[dim] = chunk * parts * size
    dense = torch.arange(shape[0] * shape[1]).reshape(shape)
    split = Split(dim, parts)
    covered = torch.zeros(shape, dtype=torch.int64)
    for index in range(size):
        local = shard_tensor(dense, split, size, index)
        # A fragment of the local shard (as ZeRO over the tensor-parallel model holds it).
        start = data.draw(st.integers(0, local.numel()))
        for fragment in range_pieces("w", tuple(local.shape), start, local.reshape(-1)[start:]):
            for piece in split_pieces(fragment, dim, parts, size, index):
                assert piece.shape == tuple(shape)
                assert torch.equal(piece.values, _box(dense, piece.offsets, piece.sizes))
                _box(covered, piece.offsets, piece.sizes).add_(1)
        for piece in split_pieces(whole_piece("w", local), dim, parts, size, index):
            assert torch.equal(piece.values, _box(dense, piece.offsets, piece.sizes))
    assert int(covered.max()) <= 1  # the fragments of different ranks never overlap


def test_is_expert_state_matches_the_leaf_and_its_moments():
    names, shapes = ["blocks.1.mlp.experts.w_in"], [(2, 4, 4)]
    assert is_expert_state("blocks.1.mlp.experts.w_in", (2, 4, 4), names, shapes)
    assert is_expert_state("exp_avg.blocks.1.mlp.experts.w_in", (2, 4, 4), names, shapes)
    assert not is_expert_state("exp_avg.blocks.1.mlp.experts.w_in", (4, 4, 4), names, shapes)
    assert not is_expert_state("blocks.1.mlp.router.weight", (2, 4, 4), names, shapes)


# ---- expert parallel ----------------------------------------------------------------------


def _config():
    gpt = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=16)
    return MoEGPTConfig(gpt, num_experts=4, moe={"k": 2, "capacity": "fixed"})


def _moe_step(plan):
    """``"ep_fsdp"``: ep=2 x dp=2, FSDP over "dp"; ``"ep"``: ep=2 alone; ``"local"``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = fs.Mesh(dp=world // 2, ep=2) if plan != "local" else None
    model = MoEGPT(_config(), mesh=mesh, seed=3).double()
    apply, params, buffers = fs.functionalize(model)

    def loss_fn(params, buffers, batch, key):
        (logits, aux_loss), _ = apply(params, buffers, batch[0], key=key)
        return lm_loss(logits, batch[1]) + aux_loss

    step = fs.train_step(loss_fn, fs.optim.adam(1e-2))
    if plan == "ep_fsdp":
        step = fs.expert_parallel(fs.fully_shard(step, mesh, "dp"), mesh, "ep")
    elif plan == "ep":
        step = fs.expert_parallel(step, mesh, "ep")
    return apply, step, step.init(params, buffers)


def _moe_batch(index):
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(1000 * index + rank)
    tokens = torch.randint(0, 32, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _moe_train(step, state, first, count):
    for i in range(first, first + count):
        state, _ = step(state, _moe_batch(i))
    return state


def _moe_save_run(root):
    apply, step, state = _moe_step("ep_fsdp")
    state = _moe_train(step, state, 0, 2)
    fs.save(f"{root}/saved", state, step=step, model=apply)
    fs.save(f"{root}/uninterrupted", _moe_train(step, state, 2, 2), step=step)


def _moe_resume_run(root, plan):
    _, step, like = _moe_step(plan)
    state = fs.load(f"{root}/saved", like, step=step)
    fs.save(f"{root}/loaded-{plan}", state, step=step)
    if plan == "ep_fsdp":
        fs.save(f"{root}/resumed", _moe_train(step, state, 2, 2), step=step)


def test_an_expert_parallel_state_saves_its_slices_and_loads_under_other_plans():
    with tempfile.TemporaryDirectory() as root:
        run_spmd(_moe_save_run, 4, root)
        manifest, saved = read_leaves(f"{root}/saved")
        assert manifest.layout == "fully_shard"
        assert manifest.placements == ("expert_parallel over 'ep': 2 expert slices",)
        assert saved["params/blocks.1.mlp.experts.w_in"].shape == (4, 16, 16)  # every expert
        # The same plan and world size resume bit for bit.
        run_spmd(_moe_resume_run, 4, root, "ep_fsdp")
        assert_trees_equal(
            read_leaves(f"{root}/resumed")[1], read_leaves(f"{root}/uninterrupted")[1]
        )
        # Another world size and plan, and one process with every expert, read the same state.
        run_spmd(_moe_resume_run, 2, root, "ep")
        _moe_resume_run(root, "local")
        for plan in ("ep", "local"):
            assert_trees_equal(read_leaves(f"{root}/loaded-{plan}")[1], saved)
