"""Former home of the slot and mode swapping, now ``fscale.functional.slots``: re-exports."""

from fscale.functional.slots import Slot as Slot
from fscale.functional.slots import holding as holding
from fscale.functional.slots import mode as mode
from fscale.functional.slots import state_slots as state_slots
from fscale.functional.slots import training_modes as training_modes
