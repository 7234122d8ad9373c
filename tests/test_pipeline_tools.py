"""Pipeline tools: balance by time and size, deferred BatchNorm, the schedule chart."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import fscale as fs
from fscale.parallel.pipeline import partition
from fscale.parallel.pipeline.builders import interleaved, zero_bubble
from fscale.testing import assert_trees_close, run_spmd


def _brute_force(costs, parts):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = [0, *cuts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or worst < best:
            best = worst
    return best


@pytest.mark.parametrize("seed", range(6))
def test_partition_minimises_the_largest_part(seed):
    g = torch.Generator().manual_seed(seed)
    costs = torch.rand(7, generator=g).tolist()
    for parts in (1, 2, 3, 7):
        sizes = partition(costs, parts)
        assert len(sizes) == parts and sum(sizes) == 7 and min(sizes) >= 1
        bounds = [0, *itertools.accumulate(sizes)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert worst == pytest.approx(_brute_force(costs, parts))


def test_balance_counts_the_head_and_the_loss():
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4096)
    )
    sample, targets = torch.randn(64, 8), torch.randint(0, 4096, (64,))
    by_size = fs.balance_by_size(layers, sample, 2)
    assert by_size == [4, 1]  # the 4096-wide head outweighs the rest
    by_time = fs.balance_by_time(
        layers, sample, 2, loss_fn=nn.functional.cross_entropy, targets=targets
    )
    assert sum(by_time) == 5 and by_time[1] <= 2
    with pytest.raises(ValueError, match="cannot cut 5 layers into 6"):
        fs.balance_by_size(layers, sample, 6)
    with pytest.raises(ValueError, match="give `loss_fn` and `targets` together"):
        fs.balance_by_time(layers, sample, 2, loss_fn=nn.functional.cross_entropy)
    with pytest.raises(TypeError, match=r"`layers` must be an nn\.Sequential"):
        fs.balance_by_time("layers", sample, 2)


def _batch_norm_statistics(micro_batches):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model = fs.deferred_batch_norm(plain, micro_batches)
    _, params, buffers = fs.functionalize(model)
    x, t = torch.randn(16, 4), torch.randn(16, 2)
    step = fs.pipeline(
        model,
        lambda out, tgt: ((out - tgt) ** 2).mean(),
        fs.optim.sgd(0.0),
        fs.Mesh(pp=2),
        micro_batches=micro_batches,
        balance=[2, 1],
    )
    state = step.init(params, buffers)
    for _ in range(2):
        state, _ = step(state, (x, t))
    full = fs.consolidate(step, state)
    reference = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    reference.load_state_dict({k: v for k, v in plain.state_dict().items() if k[0] in "01"})
    reference.train()
    for _ in range(2):  # lr 0: the same inputs reach the BatchNorm every step
        reference(x)
    names = ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    expected = {k: reference.state_dict()[k] for k in names}
    return {k: full.buffers[k] for k in expected}, expected


def test_deferred_batch_norm_statistics_are_the_whole_batch_s():
    for got, expected in run_spmd(_batch_norm_statistics, 2, 4):
        assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)


def test_deferred_batch_norm_checks_its_arguments():
    with pytest.raises(ValueError, match="`micro_batches` must be a positive int"):
        fs.DeferredBatchNorm(4, 0)
    with pytest.raises(TypeError, match=r"`module` must be an nn\.Module"):
        fs.deferred_batch_norm("bn", 2)
    converted = fs.deferred_batch_norm(nn.Sequential(nn.BatchNorm2d(3)), 2)
    assert isinstance(converted[0], fs.DeferredBatchNorm)
    converted.eval()
    assert converted(torch.ones(2, 3, 2, 2)).shape == (2, 3, 2, 2)


def test_pipeline_chart_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the chart draws with matplotlib")
    for schedule in (zero_bubble(4, 8), interleaved(2, 4, 2)):
        path = fs.pipeline_chart(schedule, tmp_path / f"{schedule.name}.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match="`schedule` must be a Schedule"):
        fs.pipeline_chart("1f1b", tmp_path / "x.png")


def test_chart_command(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the chart draws with matplotlib")
    import argparse

    from fscale.parallel.pipeline.chart import chart_arguments, chart_command

    parser = argparse.ArgumentParser()
    chart_arguments(parser)
    out = tmp_path / "c.png"
    args = parser.parse_args(["1f1b", "--ranks", "2", "--micro-batches", "4", "--output", str(out)])
    assert chart_command(args) == 0
    assert "rank 1 | .. F0 B0 B0" in capsys.readouterr().out
    assert out.exists()
