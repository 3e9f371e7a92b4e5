"""A ``callboard run`` in progress: a bounded window of submits, one writer, interrupts.

``BatchRun`` submits the input's lines with at most ``--window`` in flight and
hands every result to one writer thread, the only one that writes the output.
``stop_interrupted`` is the path after Ctrl-C or SIGTERM: queued tasks end,
the calls in flight get ``STOP_WAIT_S`` to answer, and Ctrl-C again stops at
once.

What must hold: the writer has written everything it was given before the
output closes (``BatchRun.close``), however the run ends; a cancelled task
gets no line (it runs again on the next run); one line per id is written; a
result is only ever replaced by a line decided so (``RunPlan``), never by
accident; the summary counts ids, never more than the input has lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import queue
import shlex
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any, TypeAlias

from callboard._progress import RunProgress
from callboard._run_output import is_stream
from callboard._run_plan import Action, RunPlan
from callboard._signals import Interrupts
from callboard._system import System
from callboard.batch import Line, LineError, error_record, read_requests, result_record
from callboard.messages import Cancelled, Result, UsageError, on_done
from callboard.runtime.codec import dumps, request_digest
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.sqlite_ledger import LedgerDamagedError, SqliteLedger

__all__ = [
    "STOP_WAIT_S",
    "BatchRun",
    "OutputClosedError",
    "WriterFailedError",
    "rerun_command",
    "shown",
    "stop_interrupted",
    "stop_waiting",
]


STOP_WAIT_S = 30.0
"""After an interrupt, how long the calls in flight get to answer."""

POLL_S = 0.05
"""How often the main thread, while it waits, looks for a signal ``Interrupts`` noted."""


class WriterFailedError(OSError):
    """``BatchRun.write_error`` of a run whose writer raised (a bug): callboard's own
    failure, not the output's."""

    def __init__(self) -> None:
        super().__init__(errno.EIO, "callboard's writer failed, a bug: its traceback is logged")


log = guarded_logger(__name__)


def stop_interrupted(cb: System, job: BatchRun) -> None:
    """Stop after an interrupt: queued tasks end, the calls in flight get up to
    ``STOP_WAIT_S`` to answer. A Ctrl-C after the one that began the stop (or any, after
    a SIGTERM or SIGHUP) stops at once (those calls are sent again by the next run);
    further SIGTERMs change nothing. Counted from the signal that began it: a second
    Ctrl-C 2 ms after the first, noted before the stop began, was taken as seen, and
    the run waited for every call in flight; after a SIGTERM the hint said Ctrl-C would
    hurry it, and it did not (found by a hunt)."""
    again = " again" if job.interrupts.first == signal.SIGINT else ""
    print(
        f"callboard: stopping; waiting up to {STOP_WAIT_S:g} s for the calls in flight "
        f"(Ctrl-C{again} to stop at once)",
        file=sys.stderr,
    )
    began = 1 if job.interrupts.first == signal.SIGINT else 0
    stop_waiting(cb, job.interrupts, hurry_after=began)
    job.finish()


def stop_waiting(cb: System, interrupts: Interrupts, *, hurry_after: int | None = None) -> None:
    """``cb.stop(cancel=True, timeout=STOP_WAIT_S)``, on a thread of its own while this
    one waits in slices (a signal is only noted, see ``Interrupts``); with
    ``hurry_after``, a Ctrl-C past that many hurries it to stop at once (``stop`` called
    while a stop is under way)."""
    stopping = threading.Thread(
        target=cb.stop,
        kwargs={"cancel": True, "timeout": STOP_WAIT_S},
        name="callboard-stop",
        daemon=True,
    )
    stopping.start()
    while stopping.is_alive():
        stopping.join(POLL_S)
        if hurry_after is not None and interrupts.sigints > hurry_after:
            print("callboard: stopping at once", file=sys.stderr)
            cb.stop(cancel=True, timeout=0.0)  # returns once the stop under way has ended
            break
    stopping.join()


class OutputClosedError(Exception):
    """The output cannot be written any more (a pipe whose reader went away, a full disk):
    the run stops taking lines."""


class BatchRun:
    """Submits lines within a bounded window; one writer thread writes every output line.

    What each line gets is ``plan``'s decision (``RunPlan.action``); the counts the
    summary shows are per id, so they never exceed the input's lines."""

    def __init__(
        self,
        cb: System,
        out: IO[str],
        window: int,
        progress: RunProgress,
        statuses: dict[str, str],
        *,
        plan: RunPlan,
        interrupts: Interrupts,
        unpriced: frozenset[str] = frozenset(),
    ) -> None:
        self.cb = cb
        self.interrupts = interrupts
        """Where a Ctrl-C or SIGTERM is noted: looked at between lines and while waiting."""
        self.out = out
        # no more ahead than the queue holds: past its capacity a line was refused
        # (queue_full), and written so, never sent by a rerun (found by a hunt)
        self.window = threading.BoundedSemaphore(min(window, cb.admission.capacity))
        self.lines: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self.plan = plan
        self.unpriced = unpriced
        """Models with no price: their cost is unknown, written as null."""
        self.statuses = statuses
        """Each id's last status in the output, kept up to date by the writer."""
        self.written: dict[str, str] = {}
        """The status of each id written by this run (the writer's)."""
        self.cancelled: set[str] = set()
        """Ids cancelled by an interrupt: not written, the next run sends them."""
        self.seen: set[str] = set()
        """The ids of this input."""
        self.skipped = 0
        """Lines whose result stands (or was kept, changed)."""
        self.refused_over_result = 0
        """Invalid lines whose id has a result from an earlier run (it stands)."""
        self.changed: list[str] = []
        """Ids whose line changed since their result, which was kept."""
        self.resent: set[str] = set()
        """Ids sent again though a final result was held (``Action.RESEND``); the summary
        counts those written (counted as sent, it said "40 of them sent again" of 27
        written, the rest cancelled by a Ctrl-C; found by a hunt)."""
        self.recovered = 0
        """Results written from the ledger (an earlier run's), not sent by this one."""
        self.superseded = False
        """A line written replaces an earlier one of its id: the output is compacted."""
        self.write_error: OSError | None = None
        self._showing = True
        """The progress line is shown (until it fails)."""
        self.unwritten = 0
        """Results not written because the output could not be written."""
        self.output_lost = False
        """The output file was removed or replaced while the run wrote to it: what it
        wrote went to a file no name leads to any more."""
        self.progress = progress
        self.interrupted = 0
        """The exit status of an interrupted run (130 for SIGINT, 143 for SIGTERM)."""
        self.writer = threading.Thread(target=self._write, name="callboard-writer", daemon=True)
        self.writer.start()

    def feed(self, path: Path) -> None:
        """Submit (or skip, or recover) every line of ``path`` as the plan says.
        Raises ``OutputClosedError`` once the output cannot be written."""
        for line in read_requests(path):
            self.interrupts.check()
            if self.write_error is not None:
                raise OutputClosedError(self.write_error)
            self.seen.add(line.id)
            if isinstance(line, LineError):
                self._refused(line)
                continue
            digest = request_digest(line.request)  # what the line asked, whatever the config
            item: Line | LineError = line
            also = None
            if line.embedding:  # sent with the model callboard chose for it, if it named none
                item = self._one_call(line)
                also = None if isinstance(item, LineError) else request_digest(item.request)
            action = self.plan.action(line.id, digest, also=also)
            if action is Action.SKIP:
                self._skip()
            elif action is Action.KEEP_CHANGED:
                self._skip()
                self.changed.append(line.id)
            elif action is Action.RECOVER and self._recover(line, digest):
                pass
            elif isinstance(item, LineError):  # to be sent, and it cannot be
                self._refused(item)
            else:  # (a RECOVER whose result does not read: asking again is the way)
                self._submit(item, digest, again=action is not Action.SEND)

    def _skip(self) -> None:
        """A line whose result stands: counted, and done on the progress bar."""
        self.skipped += 1
        self.progress.skip()

    def _one_call(self, line: Line) -> Line | LineError:
        """An embeddings line as it is sent: its model chosen if it names none, checked to
        fit one call; else its error. Its digest is the line's own, taken before: taken
        after, a config whose models were listed in another order reported the line as
        changed, and one with no embeddings model failed a line whose result stood
        (found by a hunt). A result written with that digest still answers the line
        (``RunPlan.action``'s ``also``)."""
        try:
            self.cb.policy.check(line.request)
            request = self.cb.batching.one_call(line.request)
        except UsageError as exc:
            return LineError(line.number, line.id, f"line {line.number}: {exc}")
        return dataclasses.replace(line, request=request)

    def _recover(self, line: Line, digest: str) -> bool:
        """Write the ledger's result for ``line`` (asking ``digest``) without sending, in
        place of the output's line if it has one; False if the result cannot be read
        (that is said)."""
        ident = line.id
        try:
            result = self.cb.ledger.kept_result(ident)
        except LedgerDamagedError as exc:
            print(f"callboard: {exc}; {ident} is sent again", file=sys.stderr)
            return False
        if result is None:  # not there any more (nothing but this run writes the ledger)
            return False
        self.superseded |= ident in self.statuses  # replaces the output's line
        self.lines.put((ident, self._record(line, result, digest), result, True))
        return True

    def _submit(self, line: Line, digest: str, *, again: bool = False) -> None:
        """Send ``line`` (``again``: its final result is held, and it is sent again), or
        write its error. Raises ``OutputClosedError`` once the output cannot be written:
        what would be sent after that would be paid for and thrown away (a run piped to
        ``head -1`` sent all of its 2,000 calls; found by a hunt)."""
        try:
            self.cb.policy.check(line.request)
            # in a batch the line id is the idempotency key: the ledger finds it by id
            request = dataclasses.replace(line.request, idempotency_key=line.id)
        except UsageError as exc:  # its error, not the run's (an id the key refuses
            # stopped every run of the batch at that line; found by a hunt)
            self._refused(LineError(line.number, line.id, f"line {line.number}: {exc}"))
            return
        if line.id in self.statuses:
            self.superseded = True  # fixed or sent again: its result replaces the old line
        while not self.window.acquire(timeout=POLL_S):  # a signal is seen within POLL_S
            self.interrupts.check()
            if self.write_error is not None:
                raise OutputClosedError(self.write_error)
        try:
            if again:  # reopened and counted only as it is sent (a review: counted
                self.cb.ledger.reopen((line.id,))  # before a wait the run stopped in)
            future = self.cb.submit(request)
        except BaseException:
            self.window.release()
            raise
        if again:
            self.resent.add(line.id)
        on_done(future, functools.partial(self._done, line, digest))

    def _done(self, line: Line, digest: str, future: Future[Result]) -> None:
        """On the thread that resolved the future (an actor's): hand the result to the
        writer, which makes its record (reading vectors is not an actor's work)."""
        self.window.release()
        if future.cancelled():
            return
        result = future.result()
        if isinstance(result, Cancelled):  # counted, not written: the next run sends it
            self.lines.put((line.id, None, result, False))
        else:
            self.lines.put((line.id, self._record(line, result, digest), result, False))

    def _record(self, line: Line, result: Result, digest: str) -> _Record:
        priced = result.model not in self.unpriced
        return functools.partial(
            result_record, line.id, result, digest=digest, priced=priced, embedding=line.embedding
        )

    def _refused(self, error: LineError) -> None:
        """A line that cannot be sent: its error line, unless its id has a result from an
        earlier run, which stands (an error line would replace it; one sent again with
        ``--resend-changed`` that now failed its check left two lines for its id, and
        said it was sent; found by a hunt)."""
        if self.statuses.get(error.id, "invalid") != "invalid":
            print(
                f"callboard: {error.message}; not sent: the result its id "
                f"{error.id!r} has from an earlier run stands",
                file=sys.stderr,
            )
            self.refused_over_result += 1
            self.progress.skip()
        else:
            self._invalid(error)

    def _invalid(self, error: LineError) -> None:
        print(f"callboard: {error.message}", file=sys.stderr)
        if self.statuses.get(error.id) == "invalid":
            self.progress.skip()
            return  # reported by an earlier run, and still invalid
        self.lines.put((error.id, functools.partial(error_record, error), None, False))

    def _write(self) -> None:
        """The writer's loop. Nothing raised here may end it: a thread that died here (the
        progress line raised) left the run sending lines whose results nobody wrote
        (found by a hunt). A record that cannot be made stops the run as a full disk
        does; a progress line that fails is shown no more."""
        while (item := self.lines.get()) is not None:
            ident, make, result, recovered = item
            if make is None:  # no line's result: counted apart, not as a failure in
                self.cancelled.add(ident)  # the table (a hunt), its calls' cost still spent
                if result is not None:
                    self._progress(functools.partial(self.progress.spent, result))
                continue
            if not self._put_made(make):
                self.unwritten += 1
                continue
            self.recovered += recovered
            self._progress(functools.partial(self.progress.add, result, recovered=recovered))

    def _progress(self, show: Callable[[], None]) -> None:
        """``show`` the progress, unless it failed before: then it is shown no more."""
        if not self._showing:
            return
        try:
            show()
        except Exception:
            log.exception("the run's progress failed (a bug); it is shown no more")
            self._showing = False

    def _put_made(self, make: _Record) -> bool:
        """Write the record ``make`` makes; False once the output cannot be written, or
        if the record cannot be made (a bug: the run stops taking lines)."""
        try:
            record = make()
        except Exception:
            log.exception("callboard's writer failed; the run stops taking lines")
            if self.write_error is None:
                self.write_error = WriterFailedError()
            return False
        return self._put(record)

    def _put(self, record: dict[str, Any]) -> bool:
        """Write one line; False once the output cannot be written. Whatever the write
        raises stops the run as a full disk does: an output that was no stream at all
        (stdout closed: None) raised AttributeError, the writer died, and every line
        was still sent and paid for, its result written nowhere (found by a hunt). The
        ledger keeps the answers of the calls in flight: the next run writes them."""
        if self.write_error is not None:
            return False
        try:
            self.out.write(dumps(record) + "\n")  # JSON, whatever a provider's numbers
            self.out.flush()
        except OSError as exc:  # the reader of a pipe went away, a full disk
            self.write_error = exc
            return False
        except Exception:  # a closed file (ValueError), no file at all: callboard's bug
            log.exception("callboard's writer failed; the run stops taking lines")
            self.write_error = WriterFailedError()
            return False
        ident = str(record["id"])
        self.written[ident] = self.statuses[ident] = record["status"]
        return True

    def finish(self) -> None:
        """Wait for every task, then for the writer to write their lines."""
        stopping = self.interrupted or self.write_error is not None  # nothing more is kept
        if stopping:
            self.cb.drain(timeout=STOP_WAIT_S)
        else:
            while not self.cb.drain(timeout=POLL_S):  # in slices: a signal is seen
                self.interrupts.check()
                if self.write_error is not None:  # what is left would go nowhere: its
                    stop_waiting(self.cb, self.interrupts)  # queued calls are not sent
                    break
        self.close()

    def close(self) -> None:
        """Stop the writer once it has written what it was given (idempotent)."""
        if self.writer.is_alive():
            self.lines.put(None)
            self.writer.join()

    def report(self, args: argparse.Namespace, elapsed: float) -> int:
        """The summary on stderr; the exit status."""
        counts = Counter(self.written.values())
        resent = sum(ident in self.written for ident in self.resent)
        self.progress.summary()
        parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        if self.cancelled:  # not written: a result line would make them final
            unsent = f"{len(self.cancelled)} cancelled or left unsent, not written"
            parts = f"{parts}; {unsent}" if parts else unsent
        print(
            f"callboard: {counts.total()} results in {elapsed:.1f} s ({parts or self._none_why()})"
            + (f"; {resent} of them sent again" if resent else "")
            + (
                f"; {self.recovered} of them from the ledger, not sent (nor counted in "
                "the cost and figures above)"
                if self.recovered
                else ""
            )
            + (f"; {self.skipped} already done, skipped" if self.skipped else "")
            + f" -> {shown(args.output)}",
            file=sys.stderr,
        )
        if self.write_error is not None:
            why = self.write_error.strerror or self.write_error
            print(
                f"callboard: stopped: cannot write {shown(args.output)} ({why}); the run stopped "
                f"taking lines, and {self.unwritten} result(s) could not be written",
                file=sys.stderr,
            )
        ledger = self.cb.ledger
        if isinstance(ledger, SqliteLedger) and ledger.not_durable:
            print(
                f"callboard: {ledger.not_durable} write(s) (a request or a result each) could "
                f"not be written to the ledger {ledger.path} (the log says why): the output "
                "has this run's results, but the run was not crash-safe while that lasted",
                file=sys.stderr,
            )
        if self.output_lost:
            print(
                f"callboard: {args.output} was removed or replaced while the run wrote to it: "
                "the results it wrote are not there; run the same command again to write "
                "them (the ones its ledger kept are not sent again)",
                file=sys.stderr,
            )
        if self.interrupted:
            resumable = args.ledger is not None or not is_stream(args.output)
            print(
                "callboard: interrupted; run the same command again to resume "
                "(finished ids are skipped)"
                if resumable
                else "callboard: interrupted; the results went to a stream, so a rerun sends "
                "every line again",
                file=sys.stderr,
            )
            return self.interrupted
        self._report_changed(args)
        unfinished = self._report_unfinished(args)
        failed = (
            unfinished
            or self.changed
            or self.write_error
            or self.refused_over_result
            or self.output_lost
        )
        return 0 if not failed else 1

    def _none_why(self) -> str:
        """Why a run wrote no result line."""
        if self.write_error is not None:
            return "none written"
        if self.interrupted:  # "nothing to do", then "interrupted; run it again to resume"
            return "interrupted before any was written"
        return "nothing to do"

    def _report_changed(self, args: argparse.Namespace) -> None:
        if not self.changed:
            return
        print(
            f"callboard: WARNING: {len(self.changed)} input line(s) changed since their "
            f"result was written; the old results are kept, not answers to these lines "
            f"(ids: {_some(self.changed)}). To send them again: "
            f"{rerun_command(args, '--resend-changed')}",
            file=sys.stderr,
        )

    def _report_unfinished(self, args: argparse.Namespace) -> int:
        """Say how many ids ended without a result to keep, and how to send them again."""
        ended = Counter(
            status
            for i in self.seen
            if (status := self.statuses.get(i, "")) not in ("completed", "invalid", "")
        )
        if ended:
            parts = ", ".join(f"{k} {v}" for k, v in sorted(ended.items()))
            print(
                f"callboard: {ended.total()} ids did not complete ({parts}); once the cause "
                f"is fixed, send them again: {rerun_command(args, '--retry-failed')}",
                file=sys.stderr,
            )
        return sum(1 for i in self.seen if self.statuses.get(i) != "completed")


_Record: TypeAlias = Callable[[], dict[str, Any]]
"""What makes an output record, called by the writer."""
_Item: TypeAlias = tuple[str, _Record | None, Result | None, bool]
"""For the writer: an id, what makes its output record (None: cancelled, not written),
its result (None for an invalid line), and whether that result came from the ledger
(an earlier run's: not sent, nor spent, by this one)."""


def _some(ids: list[str], shown: int = 10) -> str:
    more = len(ids) - shown
    return ", ".join(ids[:shown]) + (f" and {more} more" if more > 0 else "")


def rerun_command(args: argparse.Namespace, flag: str) -> str:
    """The ``callboard run`` command ``args`` came from, with ``flag`` added."""
    words = ["callboard", "run", str(args.input), "-o", str(args.output)]
    if args.config is not None:
        words += ["--config", str(args.config)]
    if args.ledger is not None:
        words += ["--ledger", str(args.ledger)]
    if args.no_ledger:
        words.append("--no-ledger")
    words.append(flag)
    return shlex.join(words)


def shown(output: Path) -> str:
    """The output as a person calls it: ``-`` is stdout."""
    return "stdout" if str(output) == "-" else str(output)
