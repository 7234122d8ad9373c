"""The manifest of a checkpoint: what fscale adds to DCP's metadata, and the checks on load.

DCP's ``.metadata`` says which bytes of which file hold which chunk of which 1-D leaf. The
manifest (``fscale.json``, written by rank 0 after every rank's data and DCP's metadata, just
before the directory is renamed into place) says what those leaves are: the format version,
the step count, the plan and world size that wrote it, how its ranks placed their pieces
(pipeline stages, expert slices, tensor-parallel shards), each leaf's full shape and dtype, and,
when the model was given to `fscale.save`, how the module's ``state_dict`` keys map to the
leaves (tied weights included), which is what an export needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fscale.ckpt.boxes import Piece
from fscale.functional import FunctionalModule, functionalize

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "Leaves",
    "Manifest",
    "check_matches",
    "dtype_name",
    "dtype_of",
    "join_leaves",
    "leaves_of",
    "model_entry",
    "read_manifest",
    "write_manifest",
]

MANIFEST = "fscale.json"
FORMAT_VERSION = 2
"""2: every leaf stored with its full shape (1: as its row-major flattening; still read)."""
_FORMAT = "fscale-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds (see the module docstring).

    Attributes:
        step: the state's step count.
        world_size: the number of ranks that wrote it.
        plan: the plan that wrote it, as ``print(step.plan)`` shows it.
        layout: how the writing ranks held the state (`fscale.ckpt.pieces.layout_kind`).
        leaves: ``{leaf key: (full shape, dtype name)}``.
        model: ``{"state_dict": {state_dict key: leaf key}, "module": class name}`` or None.
        version: the format version.
        placements: how the plan placed the ranks' pieces in the full model, one line each
            (`fscale.ckpt.placement.describe`).
    """

    step: int
    world_size: int
    plan: str
    layout: str
    leaves: dict[str, tuple[tuple[int, ...], str]]
    model: dict[str, Any] | None = None
    version: int = FORMAT_VERSION
    placements: tuple[str, ...] = ()

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        body["leaves"] = {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.leaves.items()}
        return json.dumps({"format": _FORMAT, **body}, indent=1)


def dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint names an unknown dtype {name!r}")
    return dtype


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write and fsync the manifest into `directory` (before it is committed)."""
    target = directory / MANIFEST
    with open(target, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> Manifest:
    """The manifest of the committed checkpoint `directory`.

    Raises:
        CheckpointError: no manifest (a partial directory), not valid JSON (truncated), not an
            fscale checkpoint, or a newer format version than this fscale reads.
    """
    target = directory / MANIFEST
    if not target.is_file():
        raise CheckpointError(
            f"{str(directory)!r} has no {MANIFEST}: it is not a complete fscale checkpoint "
            "(a save that did not finish leaves its directory without one)"
        )
    try:
        body = json.loads(target.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(
            f"{str(target)!r} is not valid JSON ({error}); the checkpoint is damaged"
        ) from None
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        raise CheckpointError(f"{str(target)!r} is not an fscale checkpoint manifest")
    version = body.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(directory)!r} has checkpoint format version {version!r}, newer than the "
            f"version {FORMAT_VERSION} this fscale reads; upgrade fscale to load it"
        )
    try:
        leaves = {
            key: (tuple(int(n) for n in entry["shape"]), str(entry["dtype"]))
            for key, entry in body["leaves"].items()
        }
        return Manifest(
            step=int(body["step"]),
            world_size=int(body["world_size"]),
            plan=str(body["plan"]),
            layout=str(body["layout"]),
            leaves=leaves,
            model=body.get("model"),
            version=version,
            placements=tuple(str(line) for line in body.get("placements", ())),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"{str(target)!r} lacks or garbles the field {error}; the checkpoint is damaged"
        ) from None


Leaves = dict[str, tuple[tuple[int, ...], str]]
"""``{leaf key: (full shape, dtype name)}``."""


def leaves_of(pieces: Sequence[Piece]) -> Leaves:
    """The full leaves `pieces` are boxes of."""
    return {p.key: (tuple(p.shape), dtype_name(p.dtype)) for p in pieces}


def join_leaves(per_rank: Sequence[Leaves], caller: str) -> Leaves:
    """The leaves of all ranks, sorted by key.

    Raises:
        CheckpointError: two ranks give one leaf different shapes or dtypes.
    """
    joined: Leaves = {}
    for rank, leaves in enumerate(per_rank):
        for key, entry in leaves.items():
            if joined.setdefault(key, entry) != entry:
                raise CheckpointError(
                    f"{caller}: the ranks disagree on the full leaf {key!r}: "
                    f"{list(joined[key][0])} {joined[key][1]} and, on rank {rank}, "
                    f"{list(entry[0])} {entry[1]}; every rank must describe the same model"
                )
    return dict(sorted(joined.items()))


def check_matches(manifest: Manifest, wanted: Leaves, where: str) -> None:
    """Raise a CheckpointError listing every leaf in which `manifest` and `wanted` differ.

    `wanted` are the full leaves of the state that will be loaded into (of all ranks).
    """
    saved = manifest.leaves
    lines = []
    # The model's leaves first: an optimizer state differs wherever its parameters do.
    for key in sorted(wanted.keys() | saved.keys(), key=lambda k: (k.startswith("opt_state"), k)):
        if key not in saved:
            lines.append(f"  - {key}: missing from the checkpoint")
        elif key not in wanted:
            lines.append(f"  + {key}: only in the checkpoint")
        elif wanted[key] != saved[key]:
            (shape, dtype), (saved_shape, saved_dtype) = wanted[key], saved[key]
            lines.append(
                f"  ~ {key}: checkpoint {list(saved_shape)} {saved_dtype}, "
                f"state {list(shape)} {dtype}"
            )
    if lines:
        shown = lines[:40] + ([f"  ... ({len(lines) - 40} more)"] if len(lines) > 40 else [])
        raise CheckpointError(
            f"load: the checkpoint {where!r} holds another model or optimizer than `like` "
            f"({len(lines)} differences; - missing, + extra, ~ shape or dtype):\n"
            + "\n".join(shown)
        )


def model_entry(model: Any, param_leaves: set[str]) -> dict[str, Any] | None:
    """``{"state_dict": {state_dict key: leaf key}, "module": name}`` for the manifest.

    Args:
        model: the `FunctionalModule` `fscale.functionalize` returned (or its ``nn.Module``),
            or None.
        param_leaves: the names of the full state's parameter leaves.

    Raises:
        TypeError: `model` is neither.
    """
    if model is None:
        return None
    if isinstance(model, nn.Module):
        model = functionalize(model)[0]
    if not isinstance(model, FunctionalModule):
        raise TypeError(
            "save: `model` must be the FunctionalModule fscale.functionalize returned (or the "
            f"nn.Module), got {type(model).__name__}"
        )
    leaf_of = {name: leaf for leaf, names in model.aliases.items() for name in names}
    mapping = {}
    for name in model.module.state_dict(keep_vars=True):
        leaf = leaf_of.get(name, name)
        group = "params" if leaf in param_leaves else "buffers"
        mapping[name] = f"{group}/{leaf}"
    return {"module": type(model.module).__name__, "state_dict": mapping}
