"""PowerSGD (Vogels et al., 2019) as a data-parallel reduction hook: rank-r gradient compression.

Each gradient bucket, plus the error left over from the last step, is viewed as a matrix M and
all-reduced as two thin factors, P = mean(M Q) (orthonormalised) and Q = mean(Mᵀ P), so a rank-r
step moves r·(rows + cols) numbers instead of rows·cols. The error M − P Qᵀ is fed back next
step and Q warm-starts the next one; both live in the TrainState (`fs.parallel.HookState`).
At full rank P Pᵀ = I and the result is the mean gradient, as plain `data_parallel` gives.
"""

from __future__ import annotations

import math

import torch

import fscale as fs
from fscale.distributed import Pending, all_reduce


def _matrix_shape(numel: int) -> tuple[int, int]:
    rows = max(1, math.isqrt(numel))
    return rows, -(-numel // rows)


class PowerSGD:
    """``fs.data_parallel(step, mesh, reduce_hook=PowerSGD(rank=4))``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def init(self, bucket: fs.parallel.BucketInfo) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = _matrix_shape(bucket.numel)
        seeded = torch.Generator().manual_seed(bucket.index)  # the same Q on every rank
        q = torch.randn(cols, min(self.rank, rows), generator=seeded, dtype=bucket.dtype)
        error = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        return error, q.to(bucket.device)

    def __call__(self, flat_grad, bucket, state):
        error, q = state
        rows, cols = _matrix_shape(bucket.numel)
        m = torch.zeros(rows * cols, dtype=flat_grad.dtype, device=flat_grad.device)
        m[: bucket.numel] = flat_grad + error
        m = m.view(rows, cols)
        p = all_reduce(m @ q, bucket.axes, "mean", mesh=bucket.mesh)
        p = torch.linalg.qr(p).Q  # an orthonormal basis of the factor's columns
        q = all_reduce(m.T @ p, bucket.axes, "mean", mesh=bucket.mesh)
        approx = (p @ q.T).reshape(-1)[: bucket.numel]
        return Pending.ready(approx), (m.reshape(-1)[: bucket.numel] - approx, q)
