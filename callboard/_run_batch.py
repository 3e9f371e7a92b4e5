"""A ``callboard run`` in progress: a bounded window of submits, one writer, interrupts.

``BatchRun`` submits the input's lines with at most ``--window`` in flight and
hands every result to one writer thread, the only one that writes the output.
``stop_interrupted`` is the path after Ctrl-C or SIGTERM: queued tasks end,
the calls in flight get ``STOP_WAIT_S`` to answer, and Ctrl-C again stops at
once.

What must hold: the writer has written everything it was given before the
output closes (``BatchRun.close``), however the run ends; a cancelled task
gets no line (it runs again on the next run); one line per id is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import queue
import signal
import sys
import threading
from collections import Counter
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any

from callboard._progress import RunProgress
from callboard._signals import Handler, handling
from callboard._system import System
from callboard.batch import Line, LineError, error_record, read_requests, result_record
from callboard.messages import Cancelled, Result, UsageError

__all__ = ["STOP_WAIT_S", "BatchRun", "Terminated", "on_sigterm", "stop_interrupted", "terminated"]


STOP_WAIT_S = 30.0
"""After an interrupt, how long the calls in flight get to answer."""


def stop_interrupted(cb: System, job: BatchRun) -> None:
    """Stop after an interrupt: queued tasks end, the calls in flight get up to
    ``STOP_WAIT_S`` to answer. Ctrl-C again stops at once (those calls are sent again by
    the next run); after that, and throughout on SIGTERM, further signals are ignored."""
    try:
        # inside the try: a second Ctrl-C may land while this is printed
        print(
            f"callboard: stopping; waiting up to {STOP_WAIT_S:g} s for the calls in flight "
            "(Ctrl-C again to stop at once)",
            file=sys.stderr,
        )
        with on_sigterm(signal.SIG_IGN):  # a second SIGTERM must not cut the stop short
            cb.stop(cancel=True, timeout=STOP_WAIT_S)
    except KeyboardInterrupt:
        print("callboard: stopping at once", file=sys.stderr)
    with _ignoring(signal.SIGINT, signal.SIGTERM):
        cb.stop(cancel=True, timeout=0.0)  # finishes a stop cut short; else nothing to do
        job.finish()


def _ignoring(*signals: signal.Signals) -> AbstractContextManager[None]:
    """Ignore ``signals`` for the block."""
    return handling(signal.SIG_IGN, *signals)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a container or service manager stopping us): stop as for Ctrl-C."""


def terminated(_signum: int, _frame: object) -> None:
    raise Terminated


def on_sigterm(handler: Handler) -> AbstractContextManager[None]:
    """SIGTERM goes to ``handler`` for the block."""
    return handling(handler, signal.SIGTERM)


class BatchRun:
    """Submits lines within a bounded window; one writer thread writes every output line."""

    def __init__(
        self,
        cb: System,
        out: IO[str],
        window: int,
        progress: RunProgress,
        statuses: dict[str, str],
    ) -> None:
        self.cb = cb
        self.out = out
        self.window = threading.BoundedSemaphore(window)
        self.lines: queue.SimpleQueue[tuple[dict[str, Any] | None, Result | None] | None] = (
            queue.SimpleQueue()
        )
        self.counts: Counter[str] = Counter()
        self.statuses = statuses
        """Each id's last status in the output, kept up to date by the writer."""
        self.seen: set[str] = set()
        """The ids of this input."""
        self.superseded = False
        self.progress = progress
        self.interrupted = 0
        """The exit status of an interrupted run (130 for SIGINT, 143 for SIGTERM)."""
        self.writer = threading.Thread(target=self._write, name="callboard-writer", daemon=True)
        self.writer.start()

    def feed(self, path: Path, skip: set[str]) -> None:
        for item in read_requests(path):
            self.seen.add(item.id)
            if item.id in skip:
                continue
            if isinstance(item, LineError):
                self._invalid(item)
                continue
            self._submit(item)

    def _submit(self, line: Line) -> None:
        try:
            self.cb.policy.check(line.request)
        except UsageError as exc:
            self._invalid(LineError(line.number, line.id, f"line {line.number}: {exc}"))
            return
        if self.statuses.get(line.id) == "invalid":
            self.superseded = True  # fixed since: its result replaces the old record
        self.window.acquire()
        # in a batch the line id is the idempotency key: the ledger finds it by id
        request = dataclasses.replace(line.request, idempotency_key=line.id)
        future = self.cb.submit(request)
        future.add_done_callback(functools.partial(self._done, line.id))

    def _done(self, ident: str, future: Future[Result]) -> None:
        self.window.release()
        if future.cancelled():
            return
        result = future.result()
        if isinstance(result, Cancelled):  # counted, not written: the next run sends it
            self.lines.put((None, result))
        else:
            self.lines.put((result_record(ident, result), result))

    def _invalid(self, error: LineError) -> None:
        print(f"callboard: {error.message}", file=sys.stderr)
        if self.statuses.get(error.id) == "invalid":
            return  # reported by an earlier run, and still invalid
        self.lines.put((error_record(error), None))

    def _write(self) -> None:
        while (item := self.lines.get()) is not None:
            record, result = item
            if record is None:
                self.counts["cancelled"] += 1
            else:
                self.counts[record["status"]] += 1
                self.statuses[str(record["id"])] = record["status"]
                self.out.write(json.dumps(record) + "\n")
                self.out.flush()
            self.progress.add(result)

    def finish(self) -> None:
        """Wait for every task, then for the writer to write their lines."""
        self.cb.drain(timeout=None if not self.interrupted else STOP_WAIT_S)
        self.close()

    def close(self) -> None:
        """Stop the writer once it has written what it was given (idempotent)."""
        if self.writer.is_alive():
            self.lines.put(None)
            self.writer.join()

    def report(self, args: argparse.Namespace, elapsed: float, *, skipped: int) -> int:
        c = self.counts
        total = sum(c.values())
        self.progress.summary()
        parts = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        print(
            f"callboard: {total} results in {elapsed:.1f} s ({parts or 'nothing to do'})"
            + (f"; {skipped} already done, skipped" if skipped else "")
            + f" -> {args.output}",
            file=sys.stderr,
        )
        if self.interrupted:
            print(
                "callboard: interrupted; run the same command again to resume "
                "(finished ids are skipped)",
                file=sys.stderr,
            )
            return self.interrupted
        unfinished = sum(1 for i in self.seen if self.statuses.get(i) != "completed")
        return 0 if unfinished == 0 else 1
