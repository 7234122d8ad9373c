"""The ``fscale consolidate`` and ``fscale inspect`` commands (registered by `fscale.cli`).

``fscale consolidate CKPT OUT.safetensors`` writes the model's ``state_dict`` from a checkpoint
written under any plan and world size, in one CPU process; ``fscale inspect CKPT`` prints what
a checkpoint holds. CKPT is a checkpoint directory or a root (its newest checkpoint).
"""

from __future__ import annotations

import argparse
from typing import Any

from fscale.ckpt.export import describe, export
from fscale.ckpt.manifest import CheckpointError

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Add the checkpoint commands to `commands` (an argparse subparsers object).

    Each sets ``run`` on the parsed arguments: ``args.run(args)`` executes the command and
    returns its exit status.
    """
    consolidate = commands.add_parser(
        "consolidate",
        help="write a checkpoint's model state_dict as one safetensors file (CPU, any world size)",
    )
    consolidate.add_argument("checkpoint", help="a checkpoint directory or a checkpoint root")
    consolidate.add_argument("out", help="the .safetensors file to write")
    consolidate.set_defaults(run=run_consolidate)
    inspect = commands.add_parser("inspect", help="print what a checkpoint holds")
    inspect.add_argument("checkpoint", help="a checkpoint directory or a checkpoint root")
    inspect.add_argument("--no-leaves", action="store_true", help="omit the list of leaves")
    inspect.set_defaults(run=run_inspect)


def run_consolidate(args: argparse.Namespace) -> int:
    try:
        tensors = export(args.checkpoint, args.out)
    except (CheckpointError, FileNotFoundError) as error:
        raise SystemExit(f"fscale consolidate: {error}") from None
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({total} bytes) to {args.out}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    try:
        print(describe(args.checkpoint, leaves=not args.no_leaves))
    except (CheckpointError, FileNotFoundError) as error:
        raise SystemExit(f"fscale inspect: {error}") from None
    return 0
