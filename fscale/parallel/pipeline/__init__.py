"""Pipeline parallelism: schedules as data, checked by simulation, run across processes.

`fscale.pipeline` builds the Step (`transform`); a schedule is a `Schedule` table
(`schedule`) written by a builder (`builders`) and checked before any collective runs
(`check`); each rank executes its rows (`runner`) with the stage-to-stage send/recv pair
(`transport`), after the first step's check of what the stages pass (`contract`); the layer
that joins it to the Plan protocol is `layer`.
"""

from fscale.parallel.pipeline.builders import gpipe as gpipe
from fscale.parallel.pipeline.builders import interleaved as interleaved
from fscale.parallel.pipeline.builders import one_f_one_b as one_f_one_b
from fscale.parallel.pipeline.builders import zero_bubble as zero_bubble
from fscale.parallel.pipeline.check import activation_peaks as activation_peaks
from fscale.parallel.pipeline.check import check_schedule as check_schedule
from fscale.parallel.pipeline.contract import StageContractError as StageContractError
from fscale.parallel.pipeline.layer import PipelinePlan as PipelinePlan
from fscale.parallel.pipeline.schedule import Action as Action
from fscale.parallel.pipeline.schedule import Schedule as Schedule
from fscale.parallel.pipeline.schedule import ScheduleError as ScheduleError
from fscale.parallel.pipeline.schedule import from_orders as from_orders
from fscale.parallel.pipeline.transform import pipeline as pipeline

__all__ = [
    "Action",
    "PipelinePlan",
    "Schedule",
    "ScheduleError",
    "StageContractError",
    "activation_peaks",
    "check_schedule",
    "from_orders",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "pipeline",
    "zero_bubble",
]
