"""Host offload: optimizer state and master params (ZeRO-Offload), stage params (OffloadModel).

`offload_optimizer` (`fscale.offload.optimizer`) and `offload_params` (`fscale.offload.params`)
move the bulk of a model's memory from the accelerator to host memory and bring it back only
when needed, through one host-transfer engine (`fscale.offload.transfer`); the stages' copies
follow a `PrefetchSchedule` (`fscale.offload.schedule`).
"""

from fscale.offload.optimizer import OffloadState as OffloadState
from fscale.offload.optimizer import offload_optimizer as offload_optimizer
from fscale.offload.params import OffloadedStages as OffloadedStages
from fscale.offload.params import offload_params as offload_params
from fscale.offload.schedule import PrefetchSchedule as PrefetchSchedule
from fscale.offload.schedule import ResidencyEvent as ResidencyEvent

__all__ = [
    "OffloadState",
    "OffloadedStages",
    "PrefetchSchedule",
    "ResidencyEvent",
    "offload_optimizer",
    "offload_params",
]
