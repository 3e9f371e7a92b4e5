"""Scatter-gather and streaming: ``gather``, ``as_completed`` and their asyncio twins.

``gathered`` is the pattern, once (see ``_futures``): ``gather`` waits on it
blocking, ``agather`` awaits it. ``as_completed`` and ``aas_completed``
share how they find their futures and differ only in how they wait.

What must hold:

* Prompts go out as one burst (``submit_many``); ``gather`` answers in input
  order, ``as_completed`` / ``aas_completed`` in the order results end.
* Failures are results, never exceptions; only misuse raises (a
  ``UsageError`` before anything is sent) and so does the caller's own
  ``timeout`` (``TimeoutError``).
* When ``gather`` returns or raises, every task it submitted and that was
  not yet sent is cancelled (``cancel_unsent``).
* The asyncio twins never block the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, Literal, overload

from callboard._futures import (
    Decider,
    Steps,
    await_steps,
    bounded,
    collect,
    timing_out,
    wait_steps,
)
from callboard._submitter import (
    Face,
    cancel_unsent,
    checked_prompts,
    checked_seconds,
    submitter_of,
)
from callboard.messages import Result, UsageError
from callboard.runtime.handoff import wrapped

ReturnWhen = Literal["all", "first"]


def gathered(
    face: Face, prompts: Iterable[Any], return_when: ReturnWhen, fields: dict[str, Any]
) -> Steps[list[Result] | Result]:
    """Scatter ``prompts`` in one burst; all results in input order, or the first to end."""
    submitter = submitter_of(face)
    listed = _listed(prompts, "gather")
    if return_when not in ("all", "first"):
        raise UsageError(f"return_when must be 'all' or 'first', got {return_when!r}")
    if return_when == "first" and not listed:
        raise UsageError("gather(return_when='first') needs at least one prompt")
    futures = submitter.submit_many(listed, **fields)
    try:
        if return_when == "first":
            first: Result = yield Decider(futures, lambda _: True).decided
            return first
        everything: tuple[Result, ...] = yield collect(futures)
        return list(everything)
    finally:
        cancel_unsent(submitter, futures)


@overload
def gather(
    face: Face,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["all"] = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result]: ...
@overload
def gather(
    face: Face,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["first"],
    timeout: float | None = None,
    **fields: Any,
) -> Result: ...
def gather(
    face: Face,
    prompts: Iterable[Any],
    /,
    *,
    return_when: ReturnWhen = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result] | Result:
    """Scatter ``prompts`` (one burst), gather the results in input order.

    ``return_when="first"``: the first result to end, whatever it is; the
    others are cancelled if not yet sent. On ``timeout`` (``TimeoutError``)
    every task not yet sent is cancelled too.
    """
    within = bounded(fields, timeout)
    with timing_out(within, timeout):
        return wait_steps(gathered(face, prompts, return_when, within.fields), timeout)


@overload
async def agather(
    face: Face,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["all"] = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result]: ...
@overload
async def agather(
    face: Face,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["first"],
    timeout: float | None = None,
    **fields: Any,
) -> Result: ...
async def agather(
    face: Face,
    prompts: Iterable[Any],
    /,
    *,
    return_when: ReturnWhen = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result] | Result:
    """``gather`` for asyncio: the same results, awaited without blocking the loop."""
    within = bounded(fields, timeout)
    steps = gathered(face, prompts, return_when, within.fields)
    with timing_out(within, timeout):
        return await await_steps(steps, timeout, blocking=within.blocking)


def _listed(items: Iterable[Any], call: str) -> list[Any]:
    """The prompts (or futures) as a list; one prompt where many are wanted is an error,
    not a prompt per character, and so is anything that is not a collection."""
    return list(checked_prompts(items, call))


def _futures_of(
    face: Face | None, items: Iterable[Any], fields: dict[str, Any]
) -> list[Future[Result]]:
    items = _listed(items, "as_completed")
    prompts = [x for x in items if not isinstance(x, Future)]
    fresh: Iterator[Future[Result]] = iter(())
    if prompts:
        if face is None:
            raise UsageError("prompts given without a system to submit them to")
        fresh = iter(submitter_of(face).submit_many(prompts, **fields))
    return [x if isinstance(x, Future) else next(fresh) for x in items]


def _unsent_after(
    face: Face | None, given: list[Any], job: asyncio.Future[list[Future[Result]]]
) -> None:
    """The submit of an ``aas_completed`` whose reader left: what it sent is cancelled,
    never a future the caller gave (``given``) to be watched (found by a review)."""
    if face is not None and not job.cancelled() and job.exception() is None:
        theirs = {id(x) for x in given if isinstance(x, Future)}
        cancel_unsent(face, [f for f in job.result() if id(f) not in theirs])


def as_completed(
    face: Face | None,
    futures_or_prompts: Iterable[Future[Result] | Any],
    timeout: float | None = None,
    **fields: Any,
) -> Iterator[Result]:
    """Results as they end. Prompts are submitted now (one burst, with ``fields``).

    ``TimeoutError`` when ``timeout`` seconds pass before all have ended.
    """
    wait = checked_seconds(timeout, "timeout")  # before anything is sent
    deadline = None if wait is None else time.monotonic() + wait
    within = bounded(fields, wait)
    with timing_out(within, wait):
        futures = _futures_of(face, futures_or_prompts, within.fields)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return (f.result() for f in concurrent.futures.as_completed(futures, left))


def aas_completed(
    face: Face | None,
    futures_or_prompts: Iterable[Future[Result] | Any],
    timeout: float | None = None,
    **fields: Any,
) -> AsyncIterator[Result]:
    """``as_completed`` for asyncio: ``async for result in aas_completed(cb, prompts)``.
    The prompts are submitted now; with ``wait_s`` (a wait for room in the queue, no
    longer than ``timeout``), as the iteration begins, on a worker thread: the loop
    is never held (it was, for the whole wait; found by a review)."""
    wait = checked_seconds(timeout, "timeout")  # before anything is sent
    within = bounded(fields, wait)
    items = _listed(futures_or_prompts, "as_completed")
    ready = None if within.blocking else _futures_of(face, items, within.fields)

    async def stream() -> AsyncIterator[Result]:
        deadline = None if wait is None else time.monotonic() + wait
        futures = ready
        if futures is None:
            job = asyncio.ensure_future(asyncio.to_thread(_futures_of, face, items, within.fields))
            try:
                with timing_out(within, wait):
                    futures = await asyncio.shield(job)
            except asyncio.CancelledError:  # what it submits after all is not for anyone
                job.add_done_callback(functools.partial(_unsent_after, face, items))
                raise
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        waiters = [wrapped(f) for f in futures]
        try:
            for next_done in asyncio.as_completed(waiters, timeout=left):
                yield await next_done
        except asyncio.CancelledError:  # its reader was cancelled: what it submitted and
            if face is not None:  # is not sent yet is for nobody (it was all sent, and
                theirs = {id(x) for x in items if isinstance(x, Future)}  # paid; a hunt)
                cancel_unsent(face, [f for f in futures if id(f) not in theirs])
            raise

    return stream()
