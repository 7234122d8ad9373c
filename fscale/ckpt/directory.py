"""The checkpoint directory: one committed subdirectory per step, written atomically.

``fscale.save(root, ...)`` writes ``root/.tmp-step_<n>`` (every rank its DCP files, then DCP's
``.metadata``, then rank 0 the manifest) and renames it to ``root/step_<n>`` in one
``os.replace``: a reader either finds the whole checkpoint under its final name or does not
find it. A directory is *complete* when it has its final name, a manifest and DCP's metadata;
anything else under ``root`` (a ``.tmp-`` directory left by a killed save) is ignored by
`latest` and removed by the next save (`remove_partial`). `prune` keeps the newest K.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from fscale.ckpt.manifest import MANIFEST, CheckpointError

__all__ = [
    "TMP_PREFIX",
    "checkpoints",
    "commit",
    "latest",
    "prune",
    "remove_partial",
    "resolve",
    "step_name",
]

TMP_PREFIX = ".tmp-"
DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_name(step: int) -> str:
    """The directory name of the checkpoint at step count `step`."""
    return f"step_{step:010d}"


def is_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file() and (directory / DCP_METADATA).is_file()


def checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every complete checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under `root`, or None (partial directories are ignored).

    Raises:
        CheckpointError: `root` is a file.
    """
    _check_not_file(Path(root), "latest", "root")
    found = checkpoints(root)
    return found[-1][1] if found else None


def resolve(path: str | os.PathLike[str], caller: str) -> Path:
    """The checkpoint `path` names: itself if it is one, else the newest under it.

    Raises:
        FileNotFoundError: nothing is at `path`.
        CheckpointError: `path` is a file, a partial checkpoint, or a directory without any
            complete checkpoint.
    """
    target = Path(path)
    _check_not_file(target, caller, "path")
    if not target.exists():
        raise FileNotFoundError(f"{caller}: `path` {str(target)!r} does not exist")
    if is_complete(target):
        return target
    if (target / MANIFEST).exists() or (target / DCP_METADATA).exists() or _is_step_dir(target):
        raise CheckpointError(
            f"{caller}: `path` {str(target)!r} is a partial checkpoint (its save did not "
            f"finish: {MANIFEST} or DCP's {DCP_METADATA} is missing); load the previous one, "
            "e.g. fscale.latest(root)"
        )
    newest = latest(target)
    if newest is None:
        raise CheckpointError(
            f"{caller}: `path` {str(target)!r} holds no complete checkpoint (directories "
            f"named step_<n> with {MANIFEST})"
        )
    return newest


def _is_step_dir(path: Path) -> bool:
    return bool(_STEP_DIR.fullmatch(path.name)) or path.name.startswith(TMP_PREFIX)


def _check_not_file(path: Path, caller: str, argument: str) -> None:
    if path.is_file():
        raise CheckpointError(
            f"{caller}: `{argument}` {str(path)!r} is a file; a checkpoint is a directory "
            "written by fscale.save"
        )


def remove_partial(root: Path) -> list[Path]:
    """Delete what killed saves left under `root`; returns what was removed."""
    removed = []
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.name.startswith(TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def commit(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final` atomically (replacing a checkpoint already there)."""
    _fsync_dir(tmp)
    old = None
    if final.exists():
        # os.replace cannot replace a non-empty directory: move the old one aside first, so
        # `final` is missing for an instant but never half-written.
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; returns what was removed."""
    doomed = [directory for _, directory in checkpoints(root)[:-keep_last]]
    for directory in doomed:
        # Renamed before deletion, so an interrupted delete leaves a partial directory that
        # `latest` ignores rather than a damaged checkpoint under a final name.
        aside = directory.with_name(f"{TMP_PREFIX}pruned-{directory.name}")
        os.replace(directory, aside)
        shutil.rmtree(aside, ignore_errors=True)
    return doomed


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
