"""Rematerialisation: trade compute for activation memory, under every grad path.

`checkpoint(fn)` (`fscale.remat.wrap`) returns a function or module whose forward keeps nothing
for backward but its inputs and whose backward runs it again; `checkpoint_call`
(`fscale.remat.engine`, the one recompute engine) is the same for one call with extra inputs.
Save policies and `name` (`fscale.remat.policy`) choose intermediates to keep instead of
recomputing; `track` (`fscale.remat.stats`) counts what is kept and recomputed. Inside a train
step the forward's last checkpointed call is not recomputed: backward begins with it, so it
keeps what its forward saved (`keep_last`, `fscale.remat.early_stop`). A forward that changes a
non-tensor argument (a key/value cache), which the recompute would change again, is refused
(`fscale.remat.mutation`).
"""

from fscale.remat.early_stop import keep_last as keep_last
from fscale.remat.engine import checkpoint_call as checkpoint_call
from fscale.remat.mutation import MutatedArgumentError as MutatedArgumentError
from fscale.remat.policy import SavePolicy as SavePolicy
from fscale.remat.policy import name as name
from fscale.remat.policy import save_matmuls as save_matmuls
from fscale.remat.policy import save_names as save_names
from fscale.remat.stats import RematStats as RematStats
from fscale.remat.stats import track as track
from fscale.remat.wrap import checkpoint as checkpoint

__all__ = [
    "MutatedArgumentError",
    "RematStats",
    "SavePolicy",
    "checkpoint",
    "checkpoint_call",
    "keep_last",
    "name",
    "save_matmuls",
    "save_names",
    "track",
]
