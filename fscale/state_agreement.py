"""Ranks holding the same values: a cheap fingerprint of a state, compared across ranks at set-up.

`fscale.shard_state` cuts one full state into every rank's shard, and each rank cuts its own
copy: a rank that loaded another checkpoint (or another step's state) would silently train on
a different model. Each rank describes its copy, leaf by leaf, by path, shape, dtype and two
float64 statistics of the values (their sum and the sum of their absolute values: one pass
over memory, no hashing); the ranks exchange a digest of that description and, only when the
digests differ, the descriptions, so the error names the first leaf that differs and each
rank's value. Set-up traffic, not recorded in the comm ledger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fscale import spmd, tree

if TYPE_CHECKING:
    from fscale.distributed.mesh import Mesh

__all__ = ["check_same_values", "fingerprint"]


def fingerprint(values: Any) -> list[str]:
    """One line per leaf of `values`: path, shape, dtype and the float64 sum and |sum|."""
    lines = []
    paths, leaves, _ = tree.flatten_with_paths(values)
    with torch.no_grad():
        for path, leaf in zip(paths, leaves):
            if not isinstance(leaf, torch.Tensor):
                lines.append(f"{path}: {leaf!r}")
                continue
            wide = leaf.detach().to(torch.float64)
            lines.append(
                f"{path}: {tuple(leaf.shape)} {leaf.dtype} sum={float(wide.sum())!r} "
                f"abs={float(wide.abs().sum())!r}"
            )
    return lines


def check_same_values(values: Any, mesh: Mesh, axis: str, what: str, caller: str) -> None:
    """Raise on every rank of `axis` when the ranks' `values` differ, naming the first leaf."""
    if mesh.group(axis) is None:
        return
    everyone = spmd.lines_where_ranks_differ(fingerprint(values), mesh, axis, what, caller)
    if everyone is None:
        return
    for index in range(max(len(rank_lines) for rank_lines in everyone)):
        found = [
            rank_lines[index] if index < len(rank_lines) else "(none)" for rank_lines in everyone
        ]
        if len(set(found)) > 1:
            ranks = "; ".join(f"rank {r}: {v}" for r, v in enumerate(found))
            raise ValueError(
                f"{caller}: the ranks along axis {axis!r} were given different {what}; the "
                f"first leaf that differs is {ranks}. Every rank must pass the same values "
                "(load the same checkpoint, or consolidate on every rank first)."
            )
    sizes = ", ".join(
        f"rank {r}: {len(rank_lines)} leaves" for r, rank_lines in enumerate(everyone)
    )
    raise ValueError(
        f"{caller}: the ranks along axis {axis!r} were given different {what} ({sizes})"
    )
