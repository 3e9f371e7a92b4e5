"""The command line: ``callboard run | mock``.

``callboard run requests.jsonl -o results.jsonl`` turns a JSONL file of
requests into a JSONL file of results, one line per input id, appending; a
rerun with the same output skips the ids that already have a result (so an
interrupted run resumes). Without ``--config`` it runs on the built-in
simulated provider. Exit status: 0 when every line succeeded, 1 when some
line failed or was invalid, 2 for a usage error (bad arguments or config),
130 when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from callboard.messages import Cancelled, Result, UsageError
from callboard.supervisor.sqlite_ledger import SqliteLedger

from ._progress import RunProgress
from ._system import System
from .batch import Line, LineError, error_record, finished_ids, read_requests, result_record
from .config import RUN_SWITCH_INTERVAL_S, SystemConfig
from .logs import LOG_FORMAT, TaskLogFilter

log = logging.getLogger("callboard.cli")


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
    if not args.input.is_file():
        raise UsageError(f"input file not found: {args.input}")
    if args.window < 1:
        raise UsageError("--window must be at least 1")
    config = None
    if args.config is not None:
        from .toml_config import load_config

        config = load_config(args.config)
    config = config or SystemConfig()
    if config.switch_interval_s is None:  # this process is ours: shorter GIL hand-offs
        config = dataclasses.replace(config, switch_interval_s=RUN_SWITCH_INTERVAL_S)
    ledger = None if args.no_ledger else SqliteLedger(args.ledger or _ledger_path(args.output))
    _repair_tail(args.output)
    done = finished_ids(args.output)
    started = time.monotonic()
    total = _count_lines(args.input)
    with (
        System(config, ledger=ledger) as cb,
        args.output.open("a", encoding="utf-8") as out,
        RunProgress(total) as progress,
    ):
        job = _BatchRun(cb, out, args.window, progress)
        recovered = job.recover(ledger, done) if ledger is not None else set()
        try:
            job.feed(args.input, done | recovered)
        except KeyboardInterrupt:
            job.interrupted = True
            cb.stop(cancel=True, timeout=30)
        job.finish()
    return job.report(args, time.monotonic() - started, skipped=len(done | recovered))


def _ledger_path(output: Path) -> Path:
    return output.with_name(output.name + ".ledger")


class _BatchRun:
    """Submits lines within a bounded window; one writer thread writes every output line."""

    def __init__(self, cb: System, out: IO[str], window: int, progress: RunProgress) -> None:
        self.cb = cb
        self.out = out
        self.window = threading.BoundedSemaphore(window)
        self.lines: queue.SimpleQueue[tuple[dict[str, Any], Result | None] | None] = (
            queue.SimpleQueue()
        )
        self.counts: Counter[str] = Counter()
        self.progress = progress
        self.interrupted = False
        self.writer = threading.Thread(target=self._write, name="callboard-writer", daemon=True)
        self.writer.start()

    def recover(self, ledger: SqliteLedger, done: set[str]) -> set[str]:
        """Write results the ledger holds but the output lacks (a crash between the
        two); return every id whose outcome is final there, so none is sent again."""
        final: set[str] = set()
        for stored in ledger.stored():
            result = stored.result
            if stored.key is None or result is None or isinstance(result, Cancelled):
                continue
            final.add(stored.key)
            if stored.key not in done:
                self.lines.put((result_record(stored.key, result), result))
        return final

    def feed(self, path: Path, done: set[str]) -> None:
        for item in read_requests(path):
            if item.id in done:
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
        self.window.acquire()
        # in a batch the line id is the idempotency key: the ledger finds it by id
        request = dataclasses.replace(line.request, idempotency_key=line.id)
        future = self.cb.submit(request)
        future.add_done_callback(functools.partial(self._done, line.id))

    def _done(self, ident: str, future: Future[Result]) -> None:
        self.window.release()
        if not future.cancelled():
            result = future.result()
            self.lines.put((result_record(ident, result), result))

    def _invalid(self, error: LineError) -> None:
        print(f"callboard: {error.message}", file=sys.stderr)
        self.lines.put((error_record(error), None))

    def _write(self) -> None:
        while (item := self.lines.get()) is not None:
            record, result = item
            self.counts[record["status"]] += 1
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()
            self.progress.add(result)

    def finish(self) -> None:
        self.cb.drain(timeout=None if not self.interrupted else 30.0)
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
            return 130
        return 0 if total == c["completed"] else 1


def _count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def _repair_tail(path: Path) -> None:
    """Cut a last line left incomplete by a crash, so appended lines start clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:])
    except ValueError:  # torn mid-line: that id runs again
        path.write_bytes(data[:cut])
    else:  # complete but for its newline
        with path.open("ab") as fh:
            fh.write(b"\n")


def _run() -> None:  # pragma: no cover - console entry
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    _run()


__all__ = ["main"]
