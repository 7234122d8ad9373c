"""Whether the ranks of an axis share one host (`fscale.distributed.hosts`)."""

import torch.distributed as dist

import fscale as fs
from fscale.distributed import hosts, setup_traffic
from fscale.testing import run_spmd


def test_host_id_names_this_machine_the_same_way_each_time():
    first = hosts.host_id()
    assert first == hosts.host_id()
    assert first.startswith(("boot:", "host:")) and len(first) > len("host:")


def test_a_mesh_of_one_rank_is_on_one_host_without_a_collective():
    assert hosts.on_one_host(fs.Mesh(dp=1), "dp")


def _ask_twice(names_per_rank):
    rank = dist.get_rank()
    mesh = fs.Mesh(dp=dist.get_world_size())
    gathers = []
    original_gather, original_id = setup_traffic.all_gather_objects, hosts.host_id

    def counted(*args, **kwargs):
        gathers.append(1)
        return original_gather(*args, **kwargs)

    hosts._ONE_HOST.clear()
    setup_traffic.all_gather_objects = counted
    if names_per_rank is not None:
        hosts.host_id = lambda: names_per_rank[rank]
    try:
        answers = [hosts.on_one_host(mesh, "dp"), hosts.on_one_host(mesh, "dp")]
    finally:
        setup_traffic.all_gather_objects, hosts.host_id = original_gather, original_id
        hosts._ONE_HOST.clear()
    return answers, len(gathers)


def test_ranks_on_this_machine_share_a_host_asked_once_per_group():
    for answers, gathers in run_spmd(_ask_twice, 2, None):
        assert answers == [True, True] and gathers == 1


def test_ranks_that_name_different_hosts_do_not_share_one():
    for answers, gathers in run_spmd(_ask_twice, 2, ["boot:a", "boot:b"]):
        assert answers == [False, False] and gathers == 1
