"""Mesh: named axes over the world, row-major layout, per-axis groups, clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fscale import distributed as fd
from fscale.testing.pool import run_spmd

# ---- one process, no torch.distributed -----------------------------------------------------


def test_one_process_meshes():
    assert not dist.is_initialized()
    empty = fd.Mesh()
    assert empty.axis_names == () and empty.shape == () and empty.coordinate == ()
    assert repr(empty) == "Mesh()"
    mesh = fd.Mesh(dp=1, tp=1)
    assert mesh.axis_names == ("dp", "tp") and mesh.shape == (1, 1)
    assert mesh.coordinate == (0, 0)
    assert mesh.size("dp") == 1 and mesh.rank("tp") == 0 and mesh.size(("dp", "tp")) == 1
    assert mesh.global_rank("dp", 0) == 0 and mesh.peers("tp") == (0,)
    assert mesh.group("dp") is None and mesh.device_mesh is None
    assert mesh.device_type == "cpu"
    assert fd.Mesh(dp=-1).shape == (1,)  # the rest of a one-process world
    assert repr(mesh) == "Mesh(dp=1, tp=1)"


def test_current_mesh_is_the_innermost_with_block():
    outer, inner = fd.Mesh(dp=1), fd.Mesh(tp=1)
    assert fd.current_mesh() is None
    with outer as entered:
        assert entered is outer and fd.current_mesh() is outer
        with inner:
            assert fd.current_mesh() is inner
            assert torch.equal(fd.all_reduce(torch.ones(2), "tp"), torch.ones(2))
        assert fd.current_mesh() is outer
    assert fd.current_mesh() is None


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"size of axis 'dp' must be a positive int .* got 0"):
        fd.Mesh(dp=0)
    with pytest.raises(ValueError, match=r"got -2"):
        fd.Mesh(dp=-2)
    with pytest.raises(TypeError, match=r"size of axis 'dp' must be an int, got 2.0"):
        fd.Mesh(dp=2.0)
    with pytest.raises(TypeError, match=r"must be an int, got True"):
        fd.Mesh(dp=True)
    with pytest.raises(ValueError, match=r"at most one axis may be -1, got \['dp', 'tp'\]"):
        fd.Mesh(dp=-1, tp=-1)


def test_product_must_equal_the_world_size():
    message = (
        r"Mesh\(dp=2, tp=2\) covers 4 ranks but torch.distributed is not initialized "
        r"\(a world of 1 process\)\. The product of the axis sizes must equal the world size: "
        r".*start 4 ranks \(fscale.launch or torchrun\)"
    )
    with pytest.raises(ValueError, match=message):
        fd.Mesh(dp=2, tp=2)
    with pytest.raises(ValueError, match=r"world size 1 is not divisible by .* product 2"):
        fd.Mesh(dp=-1, tp=2)


UNKNOWN_TP = r"unknown mesh axis 'tp': Mesh\(dp=1, pp=1\) has axes 'dp', 'pp'"


def test_unknown_axes_list_the_mesh_axes():
    mesh = fd.Mesh(dp=1, pp=1)
    for call in (mesh.size, mesh.rank, mesh.group, mesh.peers):
        with pytest.raises(ValueError, match=UNKNOWN_TP):
            call("tp")
    with pytest.raises(ValueError, match=r"has axes none; a one-process mesh still names"):
        fd.Mesh().size("dp")
    with pytest.raises(TypeError, match=r"`axis` must be an axis name \(str\)"):
        mesh.global_rank(("dp",), 0)
    with pytest.raises(ValueError, match=r"`index` 1 is outside axis 'dp' of size 1"):
        mesh.global_rank("dp", 1)
    with pytest.raises(ValueError, match=r"must name distinct axes"):
        mesh.size(("dp", "dp"))


def test_axes_resolved_once_answer_the_same_and_bad_ones_are_still_refused():
    mesh = fd.Mesh(dp=1, pp=1)
    assert [mesh.size("pp"), mesh.rank(("dp", "pp")), mesh.size(("dp", "pp"))] == [1, 0, 1]
    assert [mesh.size("pp"), mesh.rank(("dp", "pp")), mesh.size(("dp", "pp"))] == [1, 0, 1]
    for _ in range(2):  # a refused axis is not remembered as resolved
        with pytest.raises(ValueError, match=UNKNOWN_TP):
            mesh.size("tp")
        with pytest.raises(TypeError, match=r"`axis` must be an axis name or a tuple"):
            mesh.size(["dp"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`axis` must be an axis name \(str\)"):
        mesh.group(("dp",))  # resolved as a tuple for size, refused where one name is needed


# ---- real ranks ---------------------------------------------------------------------------


def _layout_2x2() -> dict:
    mesh = fd.Mesh(dp=2, pp=2)
    again = fd.Mesh(dp=2, pp=2)
    rank = torch.tensor([float(dist.get_rank())])
    return {
        "shape": mesh.shape,
        "coordinate": mesh.coordinate,
        "sizes": (mesh.size("dp"), mesh.size("pp"), mesh.size(("dp", "pp"))),
        "ranks": (mesh.rank("dp"), mesh.rank("pp"), mesh.rank(("pp", "dp"))),
        "dp_group": dist.get_process_group_ranks(mesh.group("dp")),
        "pp_group": dist.get_process_group_ranks(mesh.group("pp")),
        "dp_peers": mesh.peers("dp"),
        "pp_peer_1": mesh.global_rank("pp", 1),
        "shared_groups": again.group("dp") is mesh.group("dp"),
        "dp_sum": fd.all_reduce(rank, "dp", mesh=mesh).item(),
        "pp_sum": fd.all_reduce(rank, "pp", mesh=mesh).item(),
        "device_mesh": mesh.device_mesh.mesh_dim_names,
    }


def test_2x2_mesh_layout_groups_and_collectives():
    results = run_spmd(_layout_2x2, 4)
    # Row-major, dp outermost: rank = 2 * dp + pp.
    for rank, got in enumerate(results):
        dp, pp = divmod(rank, 2)
        assert got["shape"] == (2, 2)
        assert got["coordinate"] == (dp, pp)
        assert got["sizes"] == (2, 2, 4)
        assert got["ranks"] == (dp, pp, pp * 2 + dp)
        assert got["dp_group"] == [pp, pp + 2] == list(got["dp_peers"])
        assert got["pp_group"] == [2 * dp, 2 * dp + 1]
        assert got["pp_peer_1"] == 2 * dp + 1
        assert got["shared_groups"]
        assert got["dp_sum"] == pp + (pp + 2)
        assert got["pp_sum"] == 2 * dp + (2 * dp + 1)
        assert got["device_mesh"] == ("dp", "pp")


def _size_one_axis_in_the_middle() -> dict:
    mesh = fd.Mesh(dp=-1, pp=1, tp=2)
    return {
        "shape": mesh.shape,
        "coordinate": mesh.coordinate,
        "pp_group": mesh.group("pp"),
        "pp_peer": mesh.global_rank("pp", 0),
        "tp_peers": mesh.peers("tp"),
        "dp_peers": mesh.peers("dp"),
    }


def test_size_one_axes_need_no_group_and_keep_the_layout():
    for rank, got in enumerate(run_spmd(_size_one_axis_in_the_middle, 4)):
        dp, tp = divmod(rank, 2)
        assert got["shape"] == (2, 1, 2)
        assert got["coordinate"] == (dp, 0, tp)
        assert got["pp_group"] is None and got["pp_peer"] == rank
        assert got["tp_peers"] == (2 * dp, 2 * dp + 1)
        assert got["dp_peers"] == (tp, tp + 2)


def _wrong_product() -> str:
    try:
        fd.Mesh(dp=3)
    except ValueError as error:
        return str(error)
    return "no error"


def test_wrong_product_fails_on_every_rank_before_any_collective():
    for message in run_spmd(_wrong_product, 4):
        assert "Mesh(dp=3) covers 3 ranks but the default process group has 4 ranks" in message


def _one_rank_world() -> tuple:
    mesh = fd.Mesh(dp=1)
    return mesh.shape, mesh.group("dp"), fd.all_reduce(torch.ones(2), "dp", mesh=mesh).tolist()


def test_one_rank_world():
    assert run_spmd(_one_rank_world, 1) == [((1,), None, [1.0, 1.0])]
