"""Checkpoint files: sharded, atomic, asynchronous saves that load under any plan and world size.

`save` writes the pieces of the full state each rank holds through torch.distributed.checkpoint;
`load` reads the pieces another plan needs; `latest` finds the newest complete checkpoint;
`wait_saves` waits for asynchronous saves. `export` and `inspect` serve the ``fscale
consolidate`` and ``fscale inspect`` commands.
"""

from fscale.ckpt.directory import latest as latest
from fscale.ckpt.load import load as load
from fscale.ckpt.manifest import CheckpointError as CheckpointError
from fscale.ckpt.save import save as save
from fscale.ckpt.save import wait_saves as wait_saves
