"""The scheduler's control plane: pure Python, no torch, grpc or zmq.

It runs unchanged inside the scheduler process, in tests and in the
simulator. ``Scheduler.schedule()`` builds one iteration; ``update()`` folds
an executor's sampled tokens back in and says what to tell clients.
"""

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import ConfigError, SchedulerConfig
from scheduler_svc.core.preemption import CostModel
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.scheduler import (
    Event,
    ModelInfo,
    QueueFull,
    Scheduler,
    SchedulerOutput,
)

__all__ = [
    "BlockManager",
    "ConfigError",
    "CostModel",
    "Event",
    "FinishReason",
    "ModelInfo",
    "QueueFull",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
