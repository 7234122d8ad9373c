"""Point-to-point messages between ring neighbours of one host through shared memory: every
byte delivered, in any order of receipt, through rings smaller than the messages; bounded waits;
the pipeline's results unchanged against gloo's messages."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from fscale import distributed as fd
from fscale.distributed import shared_regions
from fscale.distributed.comm import resolve_comm
from fscale.distributed.doorbell import SPIN_SECONDS
from fscale.distributed.shared_channels import (
    RING_BYTES,
    Channels,
    ChannelTimeoutError,
    ChannelWaitError,
    open_channels,
    ring_neighbours,
)
from fscale.distributed.shared_setting import SHM_DIR, host_supports_shared_memory, unlink_region
from fscale.parallel.pipeline.transport import Mailbox
from fscale.testing import RankError, run_spmd

# Empty, one byte, around a record header, and past one ring (several records, wrapping).
SIZES = [0, 1, 63, 64, 65, 1000, 300_000, RING_BYTES, 3 * RING_BYTES + 17]


def _comm(world: int):
    return resolve_comm("pp", fd.Mesh(pp=world), "test")


def _payload(rank: int, index: int, size: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8) + rank + index


def test_ring_neighbours_are_the_next_and_previous_index_around_the_axis():
    assert ring_neighbours(0, 1) == ()
    assert ring_neighbours(0, 2) == (1,) and ring_neighbours(1, 2) == (0,)
    assert ring_neighbours(0, 3) == (1, 2)
    assert ring_neighbours(0, 4) == (1, 3) and ring_neighbours(2, 4) == (1, 3)
    assert host_supports_shared_memory() == os.access(SHM_DIR, os.W_OK)  # Linux x86-64 here
    assert 0 < SPIN_SECONDS < 1e-3


def test_a_region_s_name_is_removed_once_and_a_second_removal_is_harmless(tmp_path):
    region = tmp_path / "region"
    region.write_bytes(b"x")
    unlink_region(str(region))
    assert not region.exists()
    unlink_region(str(region))  # the finalizer after an explicit close


def _every_byte_case() -> list[bool]:
    comm = _comm(dist.get_world_size())
    channels = open_channels(comm)
    assert isinstance(channels, Channels)
    rank, size = comm.index, comm.size
    after, before = (rank + 1) % size, (rank - 1) % size
    assert channels.links(after) and channels.links(before) and not channels.links(rank)
    for index, n in enumerate(SIZES):  # all sent before any is received: sends never wait
        channels.send(after, 100 + index, _payload(rank, index, n))
    channels.send(after, 7, torch.tensor([1.5, -2.0]))  # one tag twice: taken oldest first
    channels.send(after, 7, torch.tensor([3.0]))
    ok = []
    for index, n in reversed(list(enumerate(SIZES))):  # received in the reverse order
        got = channels.receive(before, 100 + index, 60)
        ok.append(got.dtype == torch.uint8 and torch.equal(got, _payload(before, index, n)))
    ok.append(
        torch.equal(channels.receive(before, 7, 60).view(torch.float32), torch.tensor([1.5, -2.0]))
    )
    ok.append(torch.equal(channels.receive(before, 7, 60).view(torch.float32), torch.tensor([3.0])))
    channels.flush(60)
    ok.append(open_channels(comm) is channels)  # made once per group
    return ok


@pytest.mark.parametrize("world", [2, 3])
def test_every_message_arrives_whole_in_any_order_through_rings_smaller_than_it(world):
    for checks in run_spmd(_every_byte_case, world, timeout=120):
        assert all(checks), checks


def _never_sent_case() -> float:
    channels = open_channels(_comm(2))
    assert channels is not None
    start = time.monotonic()
    with pytest.raises(ChannelTimeoutError, match="message 5 from index") as raised:
        channels.receive(1 - dist.get_rank(), 5, 0.3)
    assert isinstance(raised.value, ChannelWaitError)  # what the pipeline's mailbox catches
    waited = time.monotonic() - start
    dist.barrier()
    return waited


def test_a_message_never_sent_times_out_within_the_patience():
    for waited in run_spmd(_never_sent_case, 2):
        assert 0.3 <= waited < 5


def _full_ring_case() -> bool:
    comm = _comm(2)
    channels = open_channels(comm)
    assert channels is not None
    big = torch.ones(2 * RING_BYTES, dtype=torch.uint8)
    if comm.index == 0:
        channels.send(1, 3, big)  # more than the ring: the rest waits for the reader
        with pytest.raises(ChannelTimeoutError, match="room for messages to index 1"):
            channels.flush(0.2)
    dist.barrier()
    if comm.index == 1:
        return torch.equal(channels.receive(0, 3, 60), big)  # the reader takes it all
    channels.flush(60)
    return True


def test_a_send_larger_than_the_ring_waits_for_its_reader_only_in_flush():
    assert run_spmd(_full_ring_case, 2, timeout=120) == [True, True]


def _mailbox_case() -> list[str]:
    comm = _comm(2)
    channels = open_channels(comm)
    mailbox = Mailbox(0.3, None, channels)
    errors = []
    if comm.index == 1:
        mailbox.post(torch.ones(3), comm, 0, 11)
    else:
        try:
            mailbox.receive(comm, (torch.Size([4]), torch.float32), 1, 11, "an activation")
        except ValueError as error:
            errors.append(str(error))
        try:
            mailbox.receive(comm, (torch.Size([2]), torch.float32), 1, 12, "a gradient")
        except fd.CollectiveTimeoutError as error:
            errors.append(str(error))
    mailbox.drain()
    dist.barrier()
    return errors


def test_the_mailbox_names_a_message_of_the_wrong_size_and_one_that_never_comes():
    errors = run_spmd(_mailbox_case, 2)[0]
    assert "holds 12 bytes, where a (4,) torch.float32 tensor has 16" in errors[0]
    assert "waited for a gradient from rank 1 (pp=1) in vain: the wait timed out" in errors[1]


def _placement_case(shared: bool) -> list[tuple[str, tuple[int, ...]]]:
    comm = _comm(2)
    channels = open_channels(comm) if shared else None
    # Messages travel as host tensors and arrive on the mailbox's device ("meta" stands in for
    # a GPU here: a rank whose stages run there).
    mailbox = Mailbox(60.0, None, channels, torch.device("meta"))
    found: list[tuple[str, tuple[int, ...]]] = []
    if comm.index == 1:
        mailbox.post(torch.ones(2, 3), comm, 0, 5)
        mailbox.post(torch.ones(3, dtype=torch.float64), comm, 0, 6)
    else:
        mailbox.expect(comm, (torch.Size([2, 3]), torch.float32), 1, 5)
        later = mailbox.receive_later(comm, (torch.Size([3]), torch.float64), 1, 6)
        arrived = (mailbox.receive(comm, (torch.Size([2, 3]), torch.float32), 1, 5), later())
        found = [(tensor.device.type, tuple(tensor.shape)) for tensor in arrived]
    mailbox.drain()
    return found


@pytest.mark.parametrize("shared", [True, False])
def test_a_received_message_is_placed_on_the_mailbox_s_device(shared):
    assert run_spmd(_placement_case, 2, shared)[0] == [("meta", (2, 3)), ("meta", (3,))]


def _setting_case(on: bool, on_rank_0: bool) -> bool:
    fd.set_shared_memory(on_rank_0 if dist.get_rank() == 0 else on)
    return open_channels(_comm(dist.get_world_size())) is not None


def test_channels_follow_the_setting_which_must_agree_and_need_two_ranks():
    assert run_spmd(_setting_case, 2, False, False) == [False, False]
    assert run_spmd(_setting_case, 1, True, True) == [False]
    with pytest.raises(RankError, match="share a host but not the setting"):
        run_spmd(_setting_case, 2, True, False)


def _unlinked_case() -> bool:
    made: list[str] = []
    mkstemp = shared_regions.tempfile.mkstemp

    def recorded(*args, **kwargs):
        fd_, path = mkstemp(*args, **kwargs)
        made.append(path)
        return fd_, path

    shared_regions.tempfile.mkstemp = recorded
    try:
        open_channels(_comm(2))
    finally:
        shared_regions.tempfile.mkstemp = mkstemp
    return len(made) == 1 and not os.path.exists(made[0])


def test_each_rank_s_region_is_unnamed_once_its_neighbours_mapped_it():
    assert run_spmd(_unlinked_case, 2) == [True, True]


def _exited_peer_case() -> tuple[float, str]:
    comm = _comm(2)
    channels = open_channels(comm)
    assert channels is not None
    gone = subprocess.Popen(["true"])
    gone.wait()
    channels._pids[1 - comm.index] = gone.pid  # as if the neighbour's process had ended
    mailbox = Mailbox(60.0, None, channels)
    start = time.monotonic()
    with pytest.raises(fd.CollectiveTimeoutError) as raised:
        mailbox.receive(comm, (torch.Size([1]), torch.float32), 1 - comm.index, 9, "the loss")
    return time.monotonic() - start, str(raised.value)


def test_a_neighbour_whose_process_ended_is_named_at_once_not_at_the_patience():
    for waited, message in run_spmd(_exited_peer_case, 2):
        assert waited < 5
        assert "in vain: the connection failed" in message and "has exited" in message


def _regions_case() -> list[bool]:
    comm = _comm(2)
    regions = shared_regions.open_regions(comm, 4096, "fscale-test-", "a test")
    assert isinstance(regions, shared_regions.Regions)
    regions.own[0] = 10 + comm.index  # a byte the peer reads through its own mapping
    dist.barrier()
    peer = shared_regions.map_region(regions.paths[1 - comm.index], 4096)
    seen = peer[0] == 10 + (1 - comm.index)
    dist.barrier()
    unlink_region(regions.path)
    return [seen, regions.pids[comm.index] == os.getpid(), len(set(regions.pids)) == 2]


def test_open_regions_gathers_every_rank_s_region_and_process_and_map_region_maps_a_peer_s():
    for checks in run_spmd(_regions_case, 2):
        assert all(checks), checks
