"""Parallel strategies as Step transformations: data parallel (DDP), ZeRO, fully sharded."""

from fscale.parallel.data import data_parallel as data_parallel

__all__ = ["data_parallel"]
