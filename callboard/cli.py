"""The command line: ``callboard run | mock``.

``callboard run requests.jsonl -o results.jsonl`` turns a JSONL file of
requests into a JSONL file of results, one line per input id, appending; a
rerun with the same output skips the ids that already have a result (so an
interrupted run resumes: what it cancelled is not written, and runs again).
Without ``--config`` it runs on the built-in simulated provider. Exit status:
0 when every input id ends completed in the output, 1 when some do not, 2 for
a usage error (bad arguments or config, an output that is not ours, another
run holding OUTPUT.lock), 130 when interrupted (143 on SIGTERM, which stops
the run the same way).

What must hold: nothing is created, cut or appended before the paths, the
output's records and the ledger have been checked; one run at a time per
output (an advisory lock); each input id has one line in the output at the
end of a run that was not interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import queue
import signal
import sqlite3
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from callboard.messages import Cancelled, Request, Result, UsageError
from callboard.supervisor.filelock import LockHeldError, hold, lock_path
from callboard.supervisor.sqlite_ledger import LedgerError, SqliteLedger

from ._progress import RunProgress
from ._system import System
from .batch import (
    Line,
    LineError,
    NotOurOutputError,
    compact_output,
    done_ids,
    error_record,
    read_output,
    read_requests,
    result_record,
)
from .config import RUN_SWITCH_INTERVAL_S, SystemConfig
from .logs import LOG_FORMAT, TaskLogFilter

log = logging.getLogger("callboard.cli")

OUTPUT_PEEK_LINES = 10
"""Lines of an existing output read before its lock file is created."""

STOP_WAIT_S = 30.0
"""After an interrupt, how long the calls in flight get to answer."""

TAIL_BYTES = 1 << 20
"""How much of the output's end ``_repair_tail`` reads (a result line is far shorter)."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["mock"]:  # its own parser: argparse's REMAINDER drops leading options
        from callboard.bench.provider import run_mock

        return run_mock(argv[1:])
    if argv[:1] == ["shell"]:
        from .shell import main as shell_main

        return shell_main(argv[1:])
    if argv[:1] == ["bench"]:
        from callboard.bench.harness import main as bench_main

        return bench_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.addFilter(TaskLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=logging.WARNING - 10 * args.verbose, handlers=[handler])
    try:
        code: int = args.func(args)
    except UsageError as exc:
        print(f"callboard: error: {exc}", file=sys.stderr)
        return 2
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="callboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="JSONL requests in, JSONL results out (resumable)")
    run.add_argument("input", type=Path, help="requests, one JSON object per line")
    run.add_argument("-o", "--output", type=Path, required=True, help="results file (appended)")
    run.add_argument("--config", type=Path, help="callboard.toml (default: simulated provider)")
    run.add_argument(
        "--window",
        type=int,
        default=2000,
        help="requests submitted ahead of results (default 2000)",
    )
    run.add_argument(
        "--ledger",
        type=Path,
        help="SQLite ledger that makes the run crash-safe (default: OUTPUT.ledger)",
    )
    run.add_argument("--no-ledger", action="store_true", help="resume from the output file only")
    run.set_defaults(func=cmd_run)

    sub.add_parser("shell", help="a Python REPL with a running system bound to cb")
    sub.add_parser("bench", help="the load harness: scenarios and baselines, ratios")
    mock = sub.add_parser(
        "mock", help="run the simulated OpenAI-compatible provider", add_help=False
    )
    mock.add_argument("rest", nargs=argparse.REMAINDER)
    mock.set_defaults(func=cmd_mock)
    return parser


def cmd_mock(args: argparse.Namespace) -> int:
    from callboard.bench.provider import run_mock

    return run_mock(args.rest)


def cmd_run(args: argparse.Namespace) -> int:
    _check_paths(args)
    if args.window < 1:
        raise UsageError("--window must be at least 1")
    config = None
    if args.config is not None:
        from .toml_config import load_config

        config = load_config(args.config)
    config = config or SystemConfig()
    if config.switch_interval_s is None:  # this process is ours: shorter GIL hand-offs
        config = dataclasses.replace(config, switch_interval_s=RUN_SWITCH_INTERVAL_S)
    _read_output(args.output, first=OUTPUT_PEEK_LINES)  # a file not ours gets no OUTPUT.lock
    with _exclusive(args.output):
        statuses = _read_output(args.output)  # again, holding the lock: before anything is cut
        _repair_tail(args.output)
        ledger = None if args.no_ledger else _open_ledger(args.ledger or _ledger_path(args.output))
        done = done_ids(statuses)
        try:
            recovered = _recoverable(ledger, args, done) if ledger is not None else {}
        except BaseException:
            if ledger is not None:
                ledger.close()
            raise
        return _run_batch(args, config, ledger, statuses=statuses, done=done, recovered=recovered)


def _read_output(path: Path, *, first: int | None = None) -> dict[str, str]:
    try:
        return read_output(path, first=first)
    except NotOurOutputError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def _run_batch(
    args: argparse.Namespace,
    config: SystemConfig,
    ledger: SqliteLedger | None,
    *,
    statuses: dict[str, str],
    done: set[str],
    recovered: dict[str, Result],
) -> int:
    started = time.monotonic()
    total = _count_lines(args.input)
    with (
        System(config, ledger=ledger) as cb,
        args.output.open("a", encoding="utf-8") as out,
        RunProgress(total) as progress,
    ):
        job = _BatchRun(cb, out, args.window, progress, statuses)
        for ident, result in recovered.items():  # results the output lacks (a crash between)
            if ident not in done:
                job.superseded |= statuses.get(ident) == "invalid"  # replaces an error line
                job.lines.put((result_record(ident, result), result))
        skip = done | set(recovered)
        try:
            with _on_sigterm(_terminated):
                job.feed(args.input, skip)
                job.finish()
        except KeyboardInterrupt as exc:
            job.interrupted = 143 if isinstance(exc, _Terminated) else 130
            _stop_interrupted(cb, job)
        finally:
            job.close()  # the writer is done before the output closes, whatever happened
    if job.superseded:  # a line fixed since an earlier run: its old record goes
        compact_output(args.output)
    return job.report(args, time.monotonic() - started, skipped=len(skip & job.seen))


def _stop_interrupted(cb: System, job: _BatchRun) -> None:
    """Stop after an interrupt: queued tasks end, the calls in flight get up to
    ``STOP_WAIT_S`` to answer. Ctrl-C again stops at once (those calls are sent again by
    the next run); after that, and throughout on SIGTERM, further signals are ignored."""
    print(
        f"callboard: stopping; waiting up to {STOP_WAIT_S:g} s for the calls in flight "
        "(Ctrl-C again to stop at once)",
        file=sys.stderr,
    )
    try:
        with _on_sigterm(signal.SIG_IGN):  # a second SIGTERM must not cut the stop short
            cb.stop(cancel=True, timeout=STOP_WAIT_S)
    except KeyboardInterrupt:
        print("callboard: stopping at once", file=sys.stderr)
    with _ignoring(signal.SIGINT, signal.SIGTERM):
        cb.stop(cancel=True, timeout=0.0)  # finishes a stop cut short; else nothing to do
        job.finish()


@contextmanager
def _ignoring(*signals: signal.Signals) -> Iterator[None]:
    """Ignore ``signals`` for the block (main thread only, as for ``_on_sigterm``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = [(sig, signal.signal(sig, signal.SIG_IGN)) for sig in signals]
    try:
        yield
    finally:
        for sig, handler in before:
            signal.signal(sig, handler)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a container or service manager stopping us): stop as for Ctrl-C."""


def _terminated(_signum: int, _frame: object) -> None:
    raise _Terminated


@contextmanager
def _on_sigterm(handler: Callable[[int, Any], Any] | int) -> Iterator[None]:
    """SIGTERM goes to ``handler`` for the block (from the main thread only: signal
    handlers cannot be set from another)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse paths that cannot work before anything is opened, created or cut."""
    if not args.input.is_file():
        raise UsageError(f"input file not found: {args.input}")
    out: Path = args.output
    if out.is_dir():
        raise UsageError(f"-o {out} is a directory; give a file")
    if not out.parent.is_dir():
        raise UsageError(f"the directory of -o {out} does not exist")
    if out.exists() and out.samefile(args.input):
        raise UsageError(f"-o {out} is the input file; give another file for the results")
    if args.ledger is not None and not args.ledger.parent.is_dir():
        raise UsageError(f"the directory of --ledger {args.ledger} does not exist")


@contextmanager
def _exclusive(output: Path) -> Iterator[None]:
    """Hold OUTPUT.lock for the run: a second run on the same output exits 2."""
    lock = lock_path(output)
    try:
        fd = hold(lock)
    except LockHeldError:
        raise UsageError(f"another callboard run is writing {output} (it holds {lock})") from None
    except OSError as exc:
        raise UsageError(f"cannot create {lock}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_ledger(path: Path) -> SqliteLedger:
    try:
        return SqliteLedger(path)
    except LedgerError as exc:
        raise UsageError(str(exc)) from None
    except (sqlite3.Error, OSError) as exc:
        raise UsageError(f"cannot open the ledger {path}: {exc}") from None


def _recoverable(
    ledger: SqliteLedger, args: argparse.Namespace, done: set[str]
) -> dict[str, Result]:
    """Final results the ledger holds for ids of this input, by id.

    Raises ``UsageError`` if the ledger answered an id of this input for another
    request: it belongs to another input (the output was removed, the ledger kept).
    """
    stored = {
        s.key: s
        for s in ledger.stored()
        if s.key is not None and s.result is not None and not isinstance(s.result, Cancelled)
    }
    found: dict[str, Result] = {}
    if not stored:
        return found
    for item in read_requests(args.input):
        s = stored.get(item.id)
        if s is None or isinstance(item, LineError) or s.result is None or item.id in done:
            continue  # (an id the output has is skipped anyway, whatever the ledger says)
        if _asks(s.request) != _asks(item.request):
            raise UsageError(
                f"the ledger {ledger.path} holds a result for id {item.id!r} (line "
                f"{item.number}) of another request: it belongs to another input. "
                "Delete it, or give --ledger another path"
            )
        found[item.id] = s.result
    return found


def _asks(request: Request) -> tuple[Any, ...]:
    return (request.messages, request.model, request.route)


def _ledger_path(output: Path) -> Path:
    return output.with_name(output.name + ".ledger")


class _BatchRun:
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


def _count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def _repair_tail(path: Path) -> None:
    """Cut a last line left incomplete by a crash, so appended lines start clean.

    Only a tail that begins like one of our records (``{"id":``) is cut; the rest of
    the file was checked by ``read_output`` already.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    line = _last_line(path)
    if line.endswith(b"\n"):
        return
    try:
        json.loads(line)
    except ValueError:  # torn mid-line: that id runs again
        if not line.startswith(b'{"id":'):
            raise UsageError(f"{path} does not end with a callboard result record") from None
        with path.open("r+b") as fh:
            fh.truncate(path.stat().st_size - len(line))
    else:  # complete but for its newline
        with path.open("ab") as fh:
            fh.write(b"\n")


def _last_line(path: Path) -> bytes:
    """The file's last line (with its newline, if it has one), read from the end in
    ``TAIL_BYTES`` steps however long it is."""
    with path.open("rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        fh.seek(end - 1)
        if fh.read(1) == b"\n":
            return b"\n"
        tail = b""
        at = end
        while at > 0:
            upto, at = at, max(0, at - TAIL_BYTES)
            fh.seek(at)
            tail = fh.read(upto - at) + tail
            cut = tail.rfind(b"\n")
            if cut >= 0:
                return tail[cut + 1 :]
        return tail


def _run() -> None:  # pragma: no cover - console entry
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    _run()


__all__ = ["main"]
