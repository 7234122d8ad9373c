"""fscale.spmd: the helpers every multi-rank plan uses, public for strategy authors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fscale as fs
from fscale import spmd
from fscale.testing import RankError, assert_trees_equal, run_spmd


def _edges():
    rank = dist.get_rank()
    mesh = fs.Mesh(dp=dist.get_world_size())
    values = {"w": torch.full((3,), float(rank)), "n": torch.tensor([rank])}
    broadcast = spmd.broadcast_tree(values, mesh, "dp")
    mean = spmd.mean_floating_leaves(values, mesh, "dp")
    old = {"stat": torch.zeros(2), "frozen": torch.full((2,), float(rank))}
    new = {"stat": torch.full((2,), float(rank)), "frozen": old["frozen"]}
    buffers = spmd.average_updated_buffers(old, new, mesh, "dp")
    metrics = spmd.reduce_metrics(
        {"loss": torch.tensor(float(rank)), "count": torch.tensor(rank), "text": "x"}, mesh, "dp"
    )
    keys = [spmd.rank_key(fs.random.key(1), step, mesh, ("dp",)) for step in (0, 1)]
    return (
        values,
        broadcast,
        mean,
        buffers,
        metrics,
        keys,
        spmd.all_gather_objects(rank, mesh, "dp"),
    )


def test_edges_of_a_data_parallel_step():
    results = run_spmd(_edges, 2)
    for rank, (values, broadcast, mean, buffers, metrics, keys, gathered) in enumerate(results):
        assert_trees_equal(broadcast, {"w": torch.zeros(3), "n": torch.tensor([0])})
        assert_trees_equal(values["w"], torch.full((3,), float(rank)))  # inputs untouched
        assert_trees_equal(mean, {"w": torch.full((3,), 0.5), "n": torch.tensor([rank])})
        # A buffer the loss returned anew is averaged; one passed through is left alone.
        assert_trees_equal(
            buffers, {"stat": torch.full((2,), 0.5), "frozen": torch.full((2,), float(rank))}
        )
        assert_trees_equal(metrics["loss"], torch.tensor(0.5))
        assert metrics["count"] == rank and metrics["text"] == "x"
        assert gathered == [0, 1]
        assert not torch.equal(keys[0], keys[1])  # the step is folded in
    # ... and so is the rank: the same step differs across ranks, and replays exactly.
    assert not torch.equal(results[0][5][0], results[1][5][0])
    assert torch.equal(results[0][5][0], run_spmd(_edges, 2)[0][5][0])


def test_rank_key_without_data_axes_folds_only_the_step():
    key = fs.random.key(3)
    assert torch.equal(spmd.rank_key(key, 5, None, ()), fs.random.fold_in(key, 5))


def _disagree():
    rank = dist.get_rank()
    lines = spmd.describe_tree({"w": torch.zeros(2 + rank)})
    spmd.check_same_on_all_ranks(fs.Mesh(dp=2), "dp", lines, "the weights", "my_plan")


def test_ranks_that_disagree_fail_together_naming_the_difference():
    with pytest.raises(
        RankError,
        match=r"my_plan: the ranks along axis 'dp' disagree on the "
        r"weights.*w: \(2,\) float32.*w: \(3,\) float32",
    ):
        run_spmd(_disagree, 2)


def _lines_on_a_dp_by_tp_mesh():
    """On 2 x 2: the lines agree along dp and differ along tp (they name the tp index)."""
    mesh = fs.Mesh(dp=2, tp=2)
    lines = ["shared", f"tp={mesh.rank('tp')}"]
    along_dp = spmd.lines_where_ranks_differ(lines, mesh, "dp", "the lines", "my_plan")
    along_tp = spmd.lines_where_ranks_differ(lines, mesh, "tp", "the lines", "my_plan")
    return along_dp, along_tp


def test_lines_where_ranks_differ_come_only_from_an_axis_that_disagrees():
    for along_dp, along_tp in run_spmd(_lines_on_a_dp_by_tp_mesh, 4):
        assert along_dp is None
        assert along_tp == [["shared", "tp=0"], ["shared", "tp=1"]]
    assert spmd.lines_where_ranks_differ(["x"], fs.Mesh(dp=1), "dp", "x", "my_plan") is None


def test_describe_tree_and_check_axis():
    assert spmd.describe_tree({"a": torch.zeros(2, dtype=torch.int8), "b": 1.5}) == [
        "a: (2,) int8",
        "b: float",
    ]
    with pytest.raises(ValueError, match=r"no axis 'pp'.*fscale\.Mesh\(pp=world_size\)"):
        spmd.check_axis(fs.Mesh(dp=1), "pp", "my_plan")
    with pytest.raises(TypeError, match=r"my_plan: `mesh` must be an fscale\.Mesh"):
        spmd.check_axis("dp", "dp", "my_plan")


def _layer_counts_differ():
    rank = dist.get_rank()
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(2 + 2 * rank)])
    lines = spmd.describe_tree(dict(model.named_parameters()))
    spmd.check_same_on_all_ranks(fs.Mesh(dp=2), "dp", lines, "the parameter tree", "my_plan")


def test_a_model_with_another_layer_count_is_reported_by_leaf_count_and_names():
    with pytest.raises(RankError) as caught:
        run_spmd(_layer_counts_differ, 2)
    message = str(caught.value)
    assert "rank 0 has 4 entries, rank 1 has 8" in message
    assert "extra on rank 1: '2.bias', '2.weight', '3.bias' and 1 more" in message
    assert "missing on rank 1" not in message


def test_first_difference_pairs_leaves_by_name():
    a = ["w: (2,) float32", "b: (2,) float32"]
    assert spmd.first_difference(a, ["w: (3,) float32", "b: (2,) float32"]) == (
        "'w: (2,) float32' vs 'w: (3,) float32'"
    )
    assert spmd.first_difference(a, ["w: (2,) float32"], 2) == (
        "rank 0 has 2 entries, rank 2 has 1; missing on rank 2: 'b'"
    )
    assert spmd.first_difference(a, a[::-1]).endswith("the same names in another order")
