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
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from callboard._progress import RunProgress
from callboard._run_batch import BatchRun, Terminated, on_sigterm, stop_interrupted, terminated
from callboard._run_output import (
    OUTPUT_PEEK_LINES,
    check_paths,
    count_lines,
    exclusive,
    ledger_path,
    open_ledger,
    read_our_output,
    recoverable,
    repair_tail,
)
from callboard._system import System
from callboard.batch import compact_output, done_ids, result_record
from callboard.config import RUN_SWITCH_INTERVAL_S, SystemConfig
from callboard.logs import LOG_FORMAT, TaskLogFilter
from callboard.messages import Result, UsageError
from callboard.runtime.sqlite_ledger import SqliteLedger

log = logging.getLogger("callboard.cli")


_HANDED_OFF = ("mock", "shell", "bench")
"""Commands with parsers of their own: everything after the command goes to it."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose, at = _leading_verbosity(argv)
    if at < len(argv) and argv[at] in _HANDED_OFF:  # argparse's REMAINDER drops leading options
        if verbose:
            _configure_logging(verbose)
        return _hand_off(argv[at], argv[at + 1 :])
    parser = _parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    try:
        code: int = args.func(args)
    except UsageError as exc:
        print(f"callboard: error: {exc}", file=sys.stderr)
        return 2
    return code


def _leading_verbosity(argv: Sequence[str]) -> tuple[int, int]:
    """The ``-v`` count before the first other token, and that token's index."""
    verbose = 0
    for at, arg in enumerate(argv):
        if arg == "--verbose":
            verbose += 1
        elif len(arg) > 1 and arg == "-" + "v" * (len(arg) - 1):
            verbose += len(arg) - 1
        else:
            return verbose, at
    return verbose, len(argv)


def _configure_logging(verbose: int) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(TaskLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=logging.WARNING - 10 * verbose, handlers=[handler])


def _hand_off(command: str, rest: Sequence[str]) -> int:
    if command == "mock":
        from callboard.provider.server import run_mock

        return run_mock(rest)
    if command == "shell":
        from callboard.shell import main as shell_main

        return shell_main(rest)
    from callboard.bench.harness import main as bench_main

    return bench_main(rest)


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

    helps = {
        "shell": "a Python REPL with a running system bound to cb",
        "bench": "the load harness: scenarios and baselines, ratios",
        "mock": "run the simulated OpenAI-compatible provider",
    }
    funcs = {"shell": _cmd_shell, "bench": _cmd_bench, "mock": cmd_mock}
    for command in _HANDED_OFF:  # main() hands these off before parsing; listed for --help
        handed = sub.add_parser(command, help=helps[command], add_help=False)
        handed.add_argument("rest", nargs=argparse.REMAINDER)
        handed.set_defaults(func=funcs[command])
    return parser


def _cmd_shell(args: argparse.Namespace) -> int:
    return _hand_off("shell", args.rest)


def _cmd_bench(args: argparse.Namespace) -> int:
    return _hand_off("bench", args.rest)


def cmd_mock(args: argparse.Namespace) -> int:
    from callboard.provider.server import run_mock

    return run_mock(args.rest)


def cmd_run(args: argparse.Namespace) -> int:
    check_paths(args)
    if args.window < 1:
        raise UsageError("--window must be at least 1")
    config = None
    if args.config is not None:
        from callboard.toml_config import load_config

        config = load_config(args.config)
    config = config or SystemConfig()
    if config.switch_interval_s is None:  # this process is ours: shorter GIL hand-offs
        config = dataclasses.replace(config, switch_interval_s=RUN_SWITCH_INTERVAL_S)
    read_our_output(args.output, first=OUTPUT_PEEK_LINES)  # a file not ours gets no OUTPUT.lock
    with exclusive(args.output):
        statuses = read_our_output(args.output)  # again, holding the lock: before anything is cut
        repair_tail(args.output)
        ledger = None if args.no_ledger else open_ledger(args.ledger or ledger_path(args.output))
        done = done_ids(statuses)
        try:
            recovered = recoverable(ledger, args, done) if ledger is not None else {}
        except BaseException:
            if ledger is not None:
                ledger.close()
            raise
        return _run_batch(args, config, ledger, statuses=statuses, done=done, recovered=recovered)


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
    total = count_lines(args.input)
    with (
        System(config, ledger=ledger) as cb,
        args.output.open("a", encoding="utf-8") as out,
        RunProgress(total) as progress,
    ):
        job = BatchRun(cb, out, args.window, progress, statuses)
        for ident, result in recovered.items():  # results the output lacks (a crash between)
            if ident not in done:
                job.superseded |= statuses.get(ident) == "invalid"  # replaces an error line
                job.lines.put((result_record(ident, result), result))
        skip = done | set(recovered)
        try:
            with on_sigterm(terminated):
                job.feed(args.input, skip)
                job.finish()
        except KeyboardInterrupt as exc:
            job.interrupted = 143 if isinstance(exc, Terminated) else 130
            stop_interrupted(cb, job)
        finally:
            job.close()  # the writer is done before the output closes, whatever happened
    if job.superseded:  # a line fixed since an earlier run: its old record goes
        compact_output(args.output)
    return job.report(args, time.monotonic() - started, skipped=len(skip & job.seen))


def _run() -> None:  # pragma: no cover - console entry
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    _run()


__all__ = ["main"]
