"""callboard: schedule LLM API calls with actors.

>>> import callboard
>>> with callboard.System() as cb:          # a simulated provider on 127.0.0.1
...     result = cb.submit("Say hi", priority=callboard.Priority.HIGH).result()
...     result.ok, result.model
(True, 'sim-fast')
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final


def _check_the_layers_are_here() -> None:
    """Refuse, naming the way out, an import of this folder of a source checkout that
    no install maps the other layers into: after ``pip install .``, Python started in
    the checkout's root finds this folder first, without ``messages``, ``core`` and the
    rest beside it (``package_dir`` maps them in only when installed), and failed on
    the first of them with a bare ``ModuleNotFoundError`` (found by a docs audit). An
    install has them inside; an editable one maps them (one ``stat``, then one look)."""
    if (Path(__path__[0]) / "messages").is_dir():
        return
    if importlib.util.find_spec("callboard.messages") is None:
        raise ImportError(
            f"callboard is imported from its source folder {__path__[0]}, where its other "
            "layers are not mapped in: install it editable (pip install -e .), or start "
            "Python outside the checkout's root",
            name="callboard",
        )


_check_the_layers_are_here()

# What is frozen now is counted as the interpreter's own (``runtime.collector``): read
# at ``import callboard``, before a host that imported it can freeze anything of its
# own; loaded with ``System``, it took a host's freeze before forking for CPython's.
from callboard.runtime import collector as _collector  # noqa: E402, F401 - loaded for its count

if TYPE_CHECKING:  # what ``__getattr__`` loads, each name from its home, on first use
    from callboard._async import AsyncSystem
    from callboard._embed import EmbedFuture
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
    from callboard.runtime.sqlite_ledger import (
        LedgerDamagedError,
        LedgerError,
        LedgerTooNewError,
        LedgerUnavailableError,
    )
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
    "EmbedFuture",
    "EmbeddingResult",
    "Expired",
    "Failed",
    "FailureReason",
    "GroupStats",
    "InvalidRequestError",
    "LedgerDamagedError",
    "LedgerError",
    "LedgerTooNewError",
    "LedgerUnavailableError",
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

_HOMES: Final[dict[str, str]] = {
    "AsyncSystem": "callboard._async",
    "EmbedFuture": "callboard._embed",
    "AsyncChatStream": "callboard._stream",
    "ChatStream": "callboard._stream",
    "StreamFailedError": "callboard._stream",
    "System": "callboard._system",
    "BudgetSettings": "callboard.config",
    "RayCluster": "callboard.config",
    "SystemConfig": "callboard.config",
    "BreakerConfig": "callboard.core.breaker",
    "LimiterConfig": "callboard.core.limiter",
    "Price": "callboard.core.pricing",
    "RetryConfig": "callboard.core.retry",
    "ModelSettings": "callboard.core.settings",
    "SchedulerSettings": "callboard.core.settings",
    "Secret": "callboard.core.settings",
    "Timeouts": "callboard.core.settings",
    "LOG_FORMAT": "callboard.logs",
    "TaskLogFilter": "callboard.logs",
    "CallboardError": "callboard.messages",
    "Cancelled": "callboard.messages",
    "ChatMessage": "callboard.messages",
    "Choice": "callboard.messages",
    "ClusterUnreachableError": "callboard.messages",
    "Completed": "callboard.messages",
    "ConfigError": "callboard.messages",
    "EmbeddingResult": "callboard.messages",
    "Expired": "callboard.messages",
    "Failed": "callboard.messages",
    "FailureReason": "callboard.messages",
    "GroupStats": "callboard.messages",
    "InvalidRequestError": "callboard.messages",
    "MalformedOutputError": "callboard.messages",
    "Priority": "callboard.messages",
    "QueueFullError": "callboard.messages",
    "Rejected": "callboard.messages",
    "RejectReason": "callboard.messages",
    "Request": "callboard.messages",
    "Result": "callboard.messages",
    "Stats": "callboard.messages",
    "StreamDelta": "callboard.messages",
    "SystemStoppedError": "callboard.messages",
    "TaskFuture": "callboard.messages",
    "ToolCall": "callboard.messages",
    "ToolCallDelta": "callboard.messages",
    "UnavailableError": "callboard.messages",
    "UnknownModelError": "callboard.messages",
    "Usage": "callboard.messages",
    "UsageError": "callboard.messages",
    "LedgerDamagedError": "callboard.runtime.sqlite_ledger",
    "LedgerError": "callboard.runtime.sqlite_ledger",
    "LedgerTooNewError": "callboard.runtime.sqlite_ledger",
    "LedgerUnavailableError": "callboard.runtime.sqlite_ledger",
    "RestartType": "callboard.supervisor.supervisor",
    "Strategy": "callboard.supervisor.supervisor",
    "SupervisorConfig": "callboard.supervisor.supervisor",
}
"""Where each public name lives. ``import callboard`` loads none of them: the command's
start is quick, and a Ctrl-C during it ends the command quietly (``callboard._entry``)
rather than in a traceback out of an import."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif name.startswith("_"):
        raise AttributeError(f"module 'callboard' has no attribute {name!r}")
    else:  # a subpackage (``callboard.core``): loaded as ``import callboard.core`` would
        try:
            value = importlib.import_module(f"callboard.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"callboard.{name}":
                raise
            raise AttributeError(f"module 'callboard' has no attribute {name!r}") from None
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
