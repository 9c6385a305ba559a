"""The scheduler's control plane: pure Python, no torch, grpc or zmq.

It runs unchanged inside the scheduler process and in tests (and later the
simulator). ``Scheduler.schedule()`` builds one iteration; ``update()`` folds
an executor's sampled tokens back in and says what to tell clients.
"""

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import ConfigError, SchedulerConfig
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.scheduler import (
    ModelInfo,
    RequestEvent,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
)

__all__ = [
    "BlockManager",
    "ConfigError",
    "FinishReason",
    "ModelInfo",
    "Request",
    "RequestEvent",
    "RequestStatus",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
