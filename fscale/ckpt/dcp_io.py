"""DCP's write and read of a checkpoint's pieces, with collectives or without, on every torch
fscale supports.

A checkpoint is written by all ranks together (their collectives on `process_group`), or by
one process alone (``group=None``: a single-process run, or one rank reading a checkpoint while
the others do something else). Since torch 2.7, `dcp.save` and `dcp.load` take ``no_dist`` for
the second case. Torch 2.6's decide it themselves, from whether torch.distributed is
initialised, so a read by one rank of a running world would wait in a collective the other
ranks never join; there the functions they call, ``_save_state_dict`` and ``_load_state_dict``,
take ``no_dist`` and are called directly. The state dicts here hold plain tensors (no
``Stateful`` objects), which is all the public functions would add.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

__all__ = ["read", "write"]


def write(values: dict[str, torch.Tensor], writer: Any, planner: Any, group: Any) -> None:
    """Write `values` through `writer` and `planner`: with the ranks of `group`, or (None) in
    this process alone."""
    _call(
        dcp.save, state_dict_saver._save_state_dict, values, planner, group, storage_writer=writer
    )


def read(values: dict[str, torch.Tensor], reader: Any, planner: Any, group: Any) -> None:
    """Read into `values` through `reader` and `planner`: with the ranks of `group`, or (None)
    in this process alone."""
    _call(
        dcp.load, state_dict_loader._load_state_dict, values, planner, group, storage_reader=reader
    )


def _call(
    public: Callable[..., Any],
    inner: Callable[..., Any],
    values: dict[str, torch.Tensor],
    planner: Any,
    group: Any,
    **storage: Any,
) -> None:
    common = {"planner": planner, "process_group": group, "no_dist": group is None, **storage}
    if _takes_no_dist(public):
        public(values, **common)
    else:
        inner(state_dict=values, **common)


@functools.cache
def _takes_no_dist(fn: Callable[..., Any]) -> bool:
    return "no_dist" in inspect.signature(fn).parameters
