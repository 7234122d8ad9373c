"""A small pipeline for the pipeline tests: an `nn.Sequential` of linear layers on two ranks,
mean squared error and Adam, with a reproducible batch."""

from __future__ import annotations

import torch

import fscale as fs
from fscale.parallel.pipeline import pipeline


def mse(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((out - targets) ** 2).mean()


def mlp_on_two_ranks(model, size, schedule, balance, micro_batches, batch_seed, **options):
    """`model` (an nn.Sequential of linear layers) as a pipeline on 2 ranks, MSE and Adam, with
    a batch of `size` samples; also its functional form."""
    apply, params, buffers = fs.functionalize(model)
    g = torch.Generator().manual_seed(batch_seed)
    batch = (
        torch.randn(size, model[0].in_features, generator=g),
        torch.randn(size, model[-1].out_features, generator=g),
    )
    step = pipeline(
        model,
        mse,
        fs.optim.adam(1e-2),
        fs.Mesh(pp=2),
        micro_batches=micro_batches,
        schedule=schedule,
        balance=balance,
        **options,
    )
    return step, (apply, params, buffers), batch
