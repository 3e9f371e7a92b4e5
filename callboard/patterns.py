"""Patterns over a running system: scatter-gather, streaming, races, chains, callbacks.

Each pattern is a function taking a ``System`` (or an ``AsyncSystem``, or
any ``Submitter``) and using only the ``Submitter`` interface (``submit``,
``submit_many``, ``cancel``); the ``a``-prefixed twins (``agather``,
``arace``, ``achain``) and ``aas_completed`` are the asyncio variants,
which never block the loop. Each is written once, as steps that both twins
drive (``_futures``), and ``System`` and ``AsyncSystem`` expose these very
functions as their methods (``cb.gather(...)`` is ``gather(cb, ...)``).

What must hold:

* Failures are results (``result.ok`` is False), never exceptions; only
  misuse raises (a ``UsageError`` before anything is sent) and so does a
  caller's own ``timeout`` (``TimeoutError``).
* Nothing here runs on, or blocks, an actor thread: a done-callback on a
  result future only hands the result on (to a waiting caller, or to the
  ``CallbackRunner``), so a slow callback never stalls the system.
* User callbacks run on the ``CallbackRunner``: sync ones on a small bounded
  thread pool, async ones on the caller's event loop (or a dedicated loop
  thread). An exception in a callback is logged with the task and trace ids,
  never lost silently.
* "Cancel what was not sent" (``cancel_unsent``) asks the queue to cancel the
  waiting tasks: their futures resolve as ``Cancelled``. A task already sent
  runs to its end, its cost is counted in ``stats()``, and its real result
  is still reported where a pattern promises it (``RaceResult.losers``).
* A chain or a race shares one ``trace_id`` across all its tasks.

This module is the public face only: the code lives in private modules, one
concept each (``_submitter`` the interface, ``_futures`` the steps and their
two drivers, ``_callbacks``, ``_gather``, ``_race``, ``_chain``), and every
name is re-exported here. All of them log as ``callboard.patterns``.
"""

from callboard._callbacks import (
    CallbackRunner,
    ErrorCallback,
    ResultCallback,
    default_runner,
    fire_and_forget,
    when_done,
)
from callboard._chain import ChainResult, Stage, achain, chain
from callboard._gather import (  # noqa: F401 - ReturnWhen was importable here before the split
    ReturnWhen,
    aas_completed,
    agather,
    as_completed,
    gather,
)
from callboard._race import RaceResult, arace, race
from callboard._submitter import Submitter, cancel_unsent, new_trace_id

__all__ = [
    "CallbackRunner",
    "ChainResult",
    "ErrorCallback",
    "RaceResult",
    "ResultCallback",
    "Stage",
    "Submitter",
    "aas_completed",
    "achain",
    "agather",
    "arace",
    "as_completed",
    "cancel_unsent",
    "chain",
    "default_runner",
    "fire_and_forget",
    "gather",
    "new_trace_id",
    "race",
    "when_done",
]
