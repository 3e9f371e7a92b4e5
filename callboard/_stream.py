"""Streams as callers hold them: ``System.stream`` and ``AsyncSystem.stream``.

A stream is a task like any other (queued by priority, admitted by the model's
limiter and breaker, retried, charged to its budget) whose call sends
``"stream": true`` and passes each delta to a ``StreamChannel`` as it arrives.
``ChatStream`` iterates those deltas on the caller's thread; ``AsyncChatStream``
in the caller's asyncio loop. When the task ends the channel closes: iteration
ends after the last delta, and raises ``StreamFailedError`` (carrying the
result) if the task did not complete, so a stream cut short is never mistaken
for a whole answer. ``result()`` gives the final ``Result`` either way: the
assembled text, tool calls, usage and cost of a completed one.

Leaving early (``close()``, the ``with`` block's end, or dropping the stream)
abandons the channel: the call stops reading its socket there, and the task
ends ``Cancelled``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Self

from callboard.messages import CallboardError, Cancelled, Result, StreamDelta, on_done
from callboard.runtime.handoff import wrapped
from callboard.runtime.stream import END, StreamChannel

__all__ = ["AsyncChatStream", "ChatStream", "StreamFailedError"]


class StreamFailedError(CallboardError):
    """A stream's task ended without a whole answer (``result``: the ``Failed``,
    ``Expired``, ``Cancelled`` or ``Rejected``; a cut stream's ``Failed`` holds the text
    received in ``partial_text``)."""

    def __init__(self, result: Result) -> None:
        detail = getattr(result, "detail", "")
        reason = getattr(result, "reason", None)
        what = type(result).__name__ + (f" ({reason.value})" if reason is not None else "")
        super().__init__(f"the stream ended {what}" + (f": {detail}" if detail else ""))
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        """Made again from its result (which pickles): made from its message, it was
        not the same error."""
        return (type(self), (self.result,))


class _Stream:
    """What both kinds share: the task's future, its channel, and leaving early."""

    _left = True
    """Closed, or handed over to another handle (``AsyncChatStream.of``); True until
    ``__init__`` has made a stream there is to leave."""

    def __init__(
        self,
        future: Future[Result],
        channel: StreamChannel,
        cancel: Callable[[], object],
        *,
        closes: bool = True,
    ) -> None:
        """``closes``: the task's end closes the channel (False: another handle of the
        same stream already arranged it)."""
        self._future = future
        self._channel = channel
        self._cancel = cancel
        self.task_id: int = getattr(future, "task_id", 0)
        self.trace_id: str = getattr(future, "trace_id", "")
        """The task's trace id (what the gateway answers as ``x-request-id``)."""
        if closes:
            on_done(future, channel.close_on)
        self._left = False

    @property
    def model(self) -> str:
        """The model whose call is being read: once a delta has arrived, the one that
        said it (a stream that began is never called again). Before, the one called
        last in this process (on a cluster, where the call is made elsewhere: ""); ""
        before any call."""
        return self._channel.model

    def close(self) -> None:
        """Leave: nothing more is read; an unfinished task ends ``Cancelled``."""
        if self._left:
            return
        self._left = True
        self._channel.abandon()
        if not self._future.done():
            self._cancel()

    def __del__(self) -> None:
        """Dropped unread: the call must not wait for a reader that is gone. (A method,
        not a ``weakref.finalize``: that is four more objects a stream for the
        collector to walk while the stream is open, and two for an async one.)"""
        self.close()

    def _ended(self) -> None:
        """At the end: raise ``StreamFailedError`` unless the task completed (a future
        cancelled by hand ends ``Cancelled`` like any stream given up)."""
        future = self._future
        if future.cancelled():
            trace = getattr(future, "trace_id", "")
            said = "the stream's future was cancelled"
            raise StreamFailedError(Cancelled(task_id=self.task_id, trace_id=trace, detail=said))
        result = future.result()
        if not result.ok:
            raise StreamFailedError(result)


class ChatStream(_Stream):
    """A streamed answer: ``for delta in stream`` as it arrives, ``stream.result()``
    for the whole ``Result``."""

    def __iter__(self) -> Iterator[StreamDelta]:
        while (delta := self._channel.get()) is not END:
            yield delta
        self._ended()

    def result(self, timeout: float | None = None) -> Result:
        """The final result (waiting up to ``timeout`` seconds for it). Asked of a stream
        nobody reads, the deltas are dropped once the channel's 256 wait, so the call
        runs to its end without waiting for a reader (it never ended before); a reader
        that asked for a delta first reads them all (``StreamChannel.want_result``), and
        one that asks after they were dropped gets ``DeltasDroppedError``, not an empty
        stream."""
        self._channel.want_result()
        return self._future.result(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncChatStream(_Stream):
    """``ChatStream`` for asyncio: ``async for delta in stream``, ``await
    stream.result()``. Its own async iterator: a delta costs one coroutine (its
    ``__anext__``), not an async generator's step and the channel's ``aget`` besides."""

    @classmethod
    def of(cls, stream: ChatStream) -> AsyncChatStream:
        """The same stream, read in asyncio (``stream`` is not to be read any more)."""
        stream._left = True  # handed over: dropping it does not leave
        return cls(stream._future, stream._channel, stream._cancel, closes=False)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamDelta:
        channel = self._channel
        got = channel.next_or_waiter()
        while isinstance(got, asyncio.Future):
            try:
                await got  # shared by the readers of this loop (next_or_waiter)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    # the error is kept (by the channel's waiter, by the task) and its
                    # traceback keeps this frame: not the stream, which its reader may
                    # have held alone, and whose drop (``__del__``) ends the call
                    del self, channel, got
                    raise
                # another reader was cancelled while it awaited the waiter: ask again
            got = channel.next_or_waiter()
        if got is END:  # the channel closes when the task's future is done
            self._ended()
            raise StopAsyncIteration
        return got

    async def result(self) -> Result:
        """The final result. Giving up this wait (a timeout, a cancelled task) leaves
        the stream as it is, as ``ChatStream.result(timeout)`` does: another task may
        be reading it; ``close()`` leaves it. Of a stream nobody reads, as
        ``ChatStream.result``."""
        self._channel.want_result()
        return await wrapped(self._future, cancels=False)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
