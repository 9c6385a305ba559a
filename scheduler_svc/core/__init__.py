"""The scheduler's control plane: pure Python, no torch, grpc or zmq.

It runs unchanged inside the scheduler process, in tests and in the
simulator. ``Scheduler.schedule()`` builds one iteration; ``update()`` folds
an executor's sampled tokens back in and says what to tell clients.
"""

from scheduler_svc.core.admission import QueueFull
from scheduler_svc.core.block_manager import NEEDS_GROW, BlockManager, NoBlock
from scheduler_svc.core.config import ConfigError, SchedulerConfig
from scheduler_svc.core.plan import Event, ModelInfo, SchedulerOutput, StepRecord
from scheduler_svc.core.preemption import CostModel
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler

__all__ = [
    "NEEDS_GROW",
    "BlockManager",
    "ConfigError",
    "CostModel",
    "Event",
    "FinishReason",
    "ModelInfo",
    "NoBlock",
    "QueueFull",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepRecord",
]
