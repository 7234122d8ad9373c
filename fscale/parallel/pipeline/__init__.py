"""Pipeline parallelism: schedules as data, checked by simulation, run across processes.

`fscale.pipeline` builds the Step (`transform`); a schedule is a `Schedule` table
(`schedule`) written by a builder (`builders`) and checked before any collective runs
(`check`); each rank executes its rows (`runner`) with the stage-to-stage send/recv pair
(`transport`), after the first step's check of what the stages pass (`contract`); zero-bubble
schedules split each backward into its input and weight halves (`split_backward`); the layer
that joins it to the Plan protocol is `layer`, which applies the step's mixed-precision policy
and loss scale where the stages run (`precision`). `balance` cuts layers into even stages,
`batchnorm` keeps BatchNorm's statistics those of the whole batch, `chart` draws a schedule,
`timeline` measures the steps as they run (`measured_costs` and `measured_bubble` gather
what every rank measured), and `simulate` gives the time a schedule takes when
its actions cost what was measured.
"""

from fscale.parallel.pipeline.balance import balance_by_size as balance_by_size
from fscale.parallel.pipeline.balance import balance_by_time as balance_by_time
from fscale.parallel.pipeline.balance import partition as partition
from fscale.parallel.pipeline.batchnorm import DeferredBatchNorm as DeferredBatchNorm
from fscale.parallel.pipeline.batchnorm import deferred_batch_norm as deferred_batch_norm
from fscale.parallel.pipeline.builders import gpipe as gpipe
from fscale.parallel.pipeline.builders import interleaved as interleaved
from fscale.parallel.pipeline.builders import one_f_one_b as one_f_one_b
from fscale.parallel.pipeline.builders import zero_bubble as zero_bubble
from fscale.parallel.pipeline.chart import pipeline_chart as pipeline_chart
from fscale.parallel.pipeline.check import activation_peaks as activation_peaks
from fscale.parallel.pipeline.check import check_schedule as check_schedule
from fscale.parallel.pipeline.contract import StageContractError as StageContractError
from fscale.parallel.pipeline.layer import PipelinePlan as PipelinePlan
from fscale.parallel.pipeline.measured_bubble import measured_bubble as measured_bubble
from fscale.parallel.pipeline.measured_costs import measured_costs as measured_costs
from fscale.parallel.pipeline.schedule import Action as Action
from fscale.parallel.pipeline.schedule import Schedule as Schedule
from fscale.parallel.pipeline.schedule import ScheduleError as ScheduleError
from fscale.parallel.pipeline.schedule import from_orders as from_orders
from fscale.parallel.pipeline.simulate import Simulated as Simulated
from fscale.parallel.pipeline.simulate import simulate as simulate
from fscale.parallel.pipeline.timeline import ActionTime as ActionTime
from fscale.parallel.pipeline.timeline import StepTimeline as StepTimeline
from fscale.parallel.pipeline.timeline import Timeline as Timeline
from fscale.parallel.pipeline.timeline import record_timeline as record_timeline
from fscale.parallel.pipeline.transform import pipeline as pipeline

__all__ = [
    "Action",
    "ActionTime",
    "DeferredBatchNorm",
    "PipelinePlan",
    "Schedule",
    "ScheduleError",
    "Simulated",
    "StageContractError",
    "StepTimeline",
    "Timeline",
    "activation_peaks",
    "balance_by_size",
    "balance_by_time",
    "check_schedule",
    "deferred_batch_norm",
    "from_orders",
    "gpipe",
    "interleaved",
    "measured_bubble",
    "measured_costs",
    "one_f_one_b",
    "partition",
    "pipeline",
    "pipeline_chart",
    "record_timeline",
    "simulate",
    "zero_bubble",
]
