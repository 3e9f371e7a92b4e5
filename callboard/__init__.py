"""callboard: schedule LLM API calls with actors.

>>> import callboard
>>> with callboard.System() as cb:          # a simulated provider on 127.0.0.1
...     result = cb.submit("Say hi", priority=callboard.Priority.HIGH).result()
...     result.ok, result.model
(True, 'sim-fast')
"""

from callboard.actors.pricing import Price
from callboard.actors.settings import ModelSettings, SchedulerSettings, Secret, Timeouts
from callboard.messages import (
    CallboardError,
    Cancelled,
    ChatMessage,
    Completed,
    ConfigError,
    Expired,
    Failed,
    FailureReason,
    InvalidRequestError,
    Priority,
    QueueFullError,
    Rejected,
    RejectReason,
    Request,
    Result,
    SystemStoppedError,
    UnknownModelError,
    Usage,
    UsageError,
)
from callboard.messages._stats import Stats

from ._async import AsyncSystem
from ._system import System
from .config import SystemConfig
from .logs import LOG_FORMAT, TaskLogFilter

__all__ = [
    "LOG_FORMAT",
    "AsyncSystem",
    "CallboardError",
    "Cancelled",
    "ChatMessage",
    "Completed",
    "ConfigError",
    "Expired",
    "Failed",
    "FailureReason",
    "InvalidRequestError",
    "ModelSettings",
    "Price",
    "Priority",
    "QueueFullError",
    "RejectReason",
    "Rejected",
    "Request",
    "Result",
    "SchedulerSettings",
    "Secret",
    "Stats",
    "System",
    "SystemConfig",
    "SystemStoppedError",
    "TaskLogFilter",
    "Timeouts",
    "UnknownModelError",
    "Usage",
    "UsageError",
]
