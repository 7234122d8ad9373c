"""Every rank of a pipeline takes the same whole batch: ranks given batches of different shapes
fail in bounded time, saying so, instead of parting ways (one rank checking the stages on the
new shapes while another runs the step) until the process group's timeout; ranks given batches
of the same shapes but other values fail at the first step instead of training one rank's
inputs against another's targets."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from mlp_pipeline import mlp_on_two_ranks
from torch import nn

from fscale.distributed import RankError, watchdog
from fscale.testing import run_spmd


def _step_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    step, (_, params, buffers), batch = mlp_on_two_ranks(model, 8, "1f1b", [2, 1], 4, 0)
    return step, step.init(params, buffers), batch


def _wider(batch, rank_given):
    """The batch with four more samples on rank `rank_given` only."""
    if dist.get_rank() != rank_given:
        return batch
    inputs, targets = batch
    return torch.cat([inputs, inputs[:4]]), torch.cat([targets, targets[:4]])


def _different_batches_at_the_first_step():
    step, state, batch = _step_and_batch()
    step(state, _wider(batch, 1))


def test_ranks_given_batches_of_different_shapes_at_the_first_step_fail_naming_each():
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_spmd(_different_batches_at_the_first_step, 2)
    text = str(caught.value)
    assert "StageContractError: pipeline: the ranks along 'pp' were given batches of different" in (
        text
    )
    # Each rank's first micro-batch: 8 samples in 4 micro-batches, and 12.
    assert "rank 0 (pp=0): inputs a tensor of shape (2, 4) and dtype torch.float32" in text
    assert "rank 1 (pp=1): inputs a tensor of shape (3, 4) and dtype torch.float32" in text
    assert "targets a tensor of shape (3, 2)" in text
    assert time.monotonic() - start < 20


def _other_values_on_rank_1(part):
    step, state, batch = _step_and_batch()
    if dist.get_rank() == 1:  # a loader that splits by global rank: rank 1's own samples
        batch = tuple(x + 1 if name in part else x for name, x in zip(("inputs", "targets"), batch))
    step(state, batch)


@pytest.mark.parametrize("part", ["inputs", "targets", "inputs and targets"])
def test_ranks_given_batches_of_the_same_shapes_but_other_values_fail_naming_which_part(part):
    with pytest.raises(RankError) as caught:
        run_spmd(_other_values_on_rank_1, 2, part)
    assert caught.value.ranks == (0, 1)
    text = str(caught.value)
    assert (
        "StageContractError: pipeline: the ranks along 'pp' were given batches of the same "
        f"shapes whose {part} differ (the first micro-batch of each, by the ranks that hold "
        "it):" in text
    )
    assert "  batch 1 on rank 0 (pp=0)\n  batch 2 on rank 1 (pp=1)\n" in text
    assert "DistributedSampler(num_replicas=mesh.size('dp'), rank=mesh.rank('dp'))" in text


def _a_rank_given_new_shapes_later(rank_given):
    previous = watchdog.collective_timeout()
    watchdog.set_collective_timeout(0.2)  # 1F1B, 2 ranks, 4 micro-batches: rank 0 waits 3 s
    try:
        step, state, batch = _step_and_batch()
        state, _ = step(state, batch)  # both ranks check the stages on this batch's shapes
        try:
            step(state, _wider(batch, rank_given))
        except watchdog.CollectiveTimeoutError:
            if dist.get_rank() == rank_given:
                raise
            # The peer's own bounded wait ended (that bound is tested elsewhere); it stays
            # until the pool ends it, so the only failure reported is the rank under test's.
            time.sleep(6)
    finally:
        watchdog.set_collective_timeout(previous)


@pytest.mark.parametrize("rank_given", [0, 1])
def test_a_rank_given_a_batch_of_new_shapes_alone_fails_within_the_collective_timeout(rank_given):
    # The first step agreed on the batch's shapes; at the second only `rank_given` sees new
    # ones and checks the stages again, while its peer runs the step. Without the agreement
    # that starts the check, the two waited for each other until gloo's "Timed out waiting
    # 60000ms for recv" on one rank and the pipeline's bound (the table's ticks times the
    # collective timeout) on the other, neither saying why.
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_spmd(_a_rank_given_new_shapes_later, 2, rank_given)
    assert caught.value.ranks == (rank_given,)
    text = str(caught.value)
    assert (
        f"pipeline: rank {rank_given} (pp={rank_given}) was given a batch whose first "
        "micro-batch (inputs a tensor of shape (3, 4) and dtype torch.float32, targets a tensor "
        "of shape (3, 2) and dtype torch.float32) is new to it" in text
    )
    assert "Give every rank of the pipeline axis the same whole batch." in text
    assert time.monotonic() - start < 20


def _every_rank_given_new_shapes():
    step, state, batch = _step_and_batch()
    smaller = (batch[0][:4], batch[1][:4])  # a last batch of half the size, on every rank
    losses = []
    for given in (batch, smaller, batch):  # new shapes, then the first ones again
        state, metrics = step(state, given)
        losses.append(float(metrics["loss"]))
    return losses


def test_every_rank_given_new_shapes_together_trains_on():
    first, second = run_spmd(_every_rank_given_new_shapes, 2)
    assert first == second  # the loss on every rank
    assert all(math.isfinite(loss) for loss in first)
    assert first[2] < first[0]  # the same batch, after two updates
