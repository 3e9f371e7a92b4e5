"""callboard: schedule LLM API calls with actors.

>>> import callboard
>>> with callboard.System() as cb:          # a simulated provider on 127.0.0.1
...     result = cb.submit("Say hi", priority=callboard.Priority.HIGH).result()
...     result.ok, result.model
(True, 'sim-fast')
"""

from callboard._async import AsyncSystem
from callboard._stream import AsyncChatStream, ChatStream, StreamFailedError
from callboard._system import System
from callboard.config import BudgetSettings, RayCluster, SystemConfig
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price
from callboard.core.retry import RetryConfig
from callboard.core.settings import ModelSettings, SchedulerSettings, Secret, Timeouts
from callboard.logs import LOG_FORMAT, TaskLogFilter
from callboard.messages import (
    CallboardError,
    Cancelled,
    ChatMessage,
    Choice,
    ClusterUnreachableError,
    Completed,
    ConfigError,
    EmbeddingResult,
    Expired,
    Failed,
    FailureReason,
    GroupStats,
    InvalidRequestError,
    MalformedOutputError,
    Priority,
    QueueFullError,
    Rejected,
    RejectReason,
    Request,
    Result,
    Stats,
    StreamDelta,
    SystemStoppedError,
    TaskFuture,
    ToolCall,
    ToolCallDelta,
    UnavailableError,
    UnknownModelError,
    Usage,
    UsageError,
)
from callboard.runtime.sqlite_ledger import LedgerError
from callboard.supervisor.supervisor import RestartType, Strategy, SupervisorConfig

__all__ = [
    "LOG_FORMAT",
    "AsyncChatStream",
    "AsyncSystem",
    "BreakerConfig",
    "BudgetSettings",
    "CallboardError",
    "Cancelled",
    "ChatMessage",
    "ChatStream",
    "Choice",
    "ClusterUnreachableError",
    "Completed",
    "ConfigError",
    "EmbeddingResult",
    "Expired",
    "Failed",
    "FailureReason",
    "GroupStats",
    "InvalidRequestError",
    "LedgerError",
    "LimiterConfig",
    "MalformedOutputError",
    "ModelSettings",
    "Price",
    "Priority",
    "QueueFullError",
    "RayCluster",
    "RejectReason",
    "Rejected",
    "Request",
    "RestartType",
    "Result",
    "RetryConfig",
    "SchedulerSettings",
    "Secret",
    "Stats",
    "Strategy",
    "StreamDelta",
    "StreamFailedError",
    "SupervisorConfig",
    "System",
    "SystemConfig",
    "SystemStoppedError",
    "TaskFuture",
    "TaskLogFilter",
    "Timeouts",
    "ToolCall",
    "ToolCallDelta",
    "UnavailableError",
    "UnknownModelError",
    "Usage",
    "UsageError",
]
