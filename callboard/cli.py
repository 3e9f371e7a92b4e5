"""The command line: ``callboard run``, ``shell``, ``mock``, ``bench`` and ``serve``.

``callboard run requests.jsonl -o results.jsonl`` turns a JSONL file of
requests into a JSONL file of results, one line per input id, appending; a
rerun with the same output skips the ids that already have a result (so an
interrupted run resumes: what it cancelled is not written, and runs again),
unless ``--retry-failed`` (results not completed) or ``--resend-changed``
(lines changed since their result) say to send them again; what each line
gets is ``RunPlan``'s decision. ``-`` is stdin or stdout. Without
``--config`` it runs on the built-in simulated provider. ``shell``, ``mock``,
``bench`` and ``serve`` (the gateway) have parsers of their own; ``main`` hands everything after
their name to them.

A run's exit status is an ``Exit``; ``EXIT_HELP`` says what each means (and
``run --help`` prints it from there).

What must hold: nothing is created, cut or appended before the paths, the
output's records and the ledger have been checked; one run at a time per
output (an advisory lock); each input id has one line in the output at the
end of a run that was not interrupted and not stopped early; the run never
ends in a traceback for a condition a user can meet.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import errno
import importlib.metadata
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO, cast

from callboard import logs
from callboard._progress import RunProgress
from callboard._run_batch import (
    STOP_WAIT_S,
    BatchRun,
    OutputClosedError,
    WriterFailedError,
    shown,
    stop_interrupted,
    stop_waiting,
)
from callboard._run_output import (
    OUTPUT_PEEK_LINES,
    check_paths,
    check_tail,
    count_lines,
    exclusive,
    fd_open,
    file_identity,
    is_stream,
    ledger_path,
    ledger_results,
    open_ledger,
    open_output,
    path_identity,
    read_our_output,
    repair_tail,
    spooled,
)
from callboard._run_plan import RunPlan
from callboard._signals import Interrupts, Terminated
from callboard._system import System
from callboard.batch import OutputState, compact_output, stale_errors
from callboard.config import RUN_SWITCH_INTERVAL_S, SystemConfig
from callboard.core.settings import FREE
from callboard.messages import ClusterUnreachableError, SystemStoppedError, UsageError
from callboard.runtime.collector import steady_heap
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.sqlite_ledger import SqliteLedger

log = guarded_logger("callboard.cli")


class Exit(enum.IntEnum):
    """How ``callboard run`` ends: its exit status (explained in ``EXIT_HELP``)."""

    COMPLETED = 0
    UNFINISHED = 1
    USAGE = 2
    INTERRUPTED = 130
    TERMINATED = 143


EXIT_HELP: Final[Mapping[Exit, str]] = {
    Exit.COMPLETED: "every input id ended completed in the output (this run's or earlier)",
    Exit.UNFINISHED: (
        "some did not: failed, expired, rejected or invalid lines (--retry-failed sends "
        "the failed ones again); input lines changed since their result, which was kept "
        "(--resend-changed); or the run stopped taking lines (the budget spent, the "
        "system failed, the output could not be written, callboard's writer failed) and "
        "a rerun sends the rest; "
        "or the output could not be rewritten with one line per id (a full disk: the "
        "next run does)"
    ),
    Exit.USAGE: (
        "usage error: bad arguments or config, an output that is not a callboard "
        "results file or is damaged, a ledger that is damaged (--rebuild-ledger) or not "
        "a ledger, the input given as output, another run holding OUTPUT.lock"
    ),
    Exit.INTERRUPTED: "interrupted by Ctrl-C: run the same command again to resume",
    Exit.TERMINATED: "stopped by SIGTERM (or SIGHUP: the terminal closed), as for Ctrl-C",
}

WINDOW = 2000
"""``--window``: requests submitted ahead of their results."""

_HANDED_OFF = ("shell", "mock", "bench", "serve")
"""Commands with parsers of their own: everything after the command goes to it."""

_SUMMARY = {
    "run": "the batch job: JSONL requests in, JSONL results out, resumable",
    "shell": "a Python REPL with a running system bound to cb",
    "mock": "the simulated OpenAI-compatible provider (127.0.0.1:8000)",
    "bench": "the load harness: scenarios against baselines, as ratios",
    "serve": "callboard behind OpenAI's and Anthropic's APIs: keys, priorities, tenants "
    "(127.0.0.1:8080)",
}

_DESCRIPTION = """\
Schedule LLM API calls: priorities, routing, rate limits, retries, circuit
breakers, budgets, and a ledger that loses no request. Without --config every
command runs on the built-in simulated provider (no API keys needed)."""

_EPILOG = """\
examples:
  callboard run examples/requests.jsonl -o results.jsonl
  callboard run requests.jsonl -o results.jsonl --config callboard.toml
  callboard shell
  callboard mock --port 8000 --latency 0.05
  callboard bench --quick

exit status:
  0    success
  1    run: some input ids did not end completed; bench: a scenario failed;
       mock, serve: it could not listen
  2    usage error (arguments, config, paths)
  130  run: interrupted by Ctrl-C
  143  run, bench: stopped by SIGTERM (run: or SIGHUP, its terminal closed)
  (mock stops with 0 on Ctrl-C or SIGTERM, serve on SIGHUP too; shell ends with
  what exit(n) says)

Each command's options and defaults: callboard COMMAND --help."""

_RUN_DESCRIPTION = f"""\
Submit every line of INPUT (one JSON object per line: "id", "prompt" or
"messages", optional "model" or "route", "priority", "max_tokens",
"temperature", "deadline_s", "metadata", "budget_tag"; OpenAI's batch shape
with "custom_id" and "body" is accepted too) and append one result line per
input id to OUTPUT. A bad line gets an error line naming its line number; the
other lines still run.

An embeddings line gives "input" (a text, or a list of texts) instead of a
prompt, with "model", "dimensions" and "encoding_format" if wanted (or
OpenAI's shape with "url": "/v1/embeddings"); its result line carries
"embedding" (for one text) or "embeddings" (a list), as floats unless the line
asked for base64. A line is one call: split an input larger than one call
(2048 texts by default) over several lines.

Resumable: run the same command again and the ids that already have a result
are skipped. A SQLite ledger beside the output (OUTPUT.ledger) makes the run
crash-safe, even against SIGKILL; the run holds OUTPUT.lock while it runs.
Ctrl-C (or SIGTERM, or SIGHUP unless nohup ignores it) stops taking lines and
gives the calls in flight up to
{STOP_WAIT_S:g} s to answer; Ctrl-C again stops at once.

Failed, expired and rejected results are kept until --retry-failed sends those
ids again. A line whose request changed since its result was written (each
result line keeps the sha256 of what it answered) is reported with its id and
keeps its old result until --resend-changed. A line without an "id" is keyed
"line-N" by its line number.

INPUT - reads stdin; -o - writes the results to stdout (no OUTPUT.lock, and no
ledger unless --ledger names one: with nothing to resume from, a rerun sends
every line again; with --ledger, the results it holds are written again
without being sent)."""


def _run_epilog() -> str:
    rows = (
        textwrap.fill(text, 79, initial_indent=f"  {int(code):<4} ", subsequent_indent=" " * 7)
        for code, text in EXIT_HELP.items()
    )
    return "exit status:\n" + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    with _unbroken_stderr():
        return _main(list(sys.argv[1:] if argv is None else argv))


@contextlib.contextmanager
def _unbroken_stderr() -> Iterator[None]:
    """The process's stderr as ``_Unbroken`` while a command runs (one replaced already,
    as by a test's capture, is left as it is). With none (the command started with
    ``2>&-``), a sink that discards what is written: ``print(..., file=None)`` prints
    to stdout, and ``callboard: ...`` lines went into ``-o -``'s results (a hunt)."""
    if sys.stderr is None:
        with _devnull_sink() as sink:
            sys.stderr = cast("TextIO", _Unbroken(sink))
            try:
                yield
            finally:
                sys.stderr = None  # as it was
        return
    if sys.stderr is not sys.__stderr__:
        yield
        return
    stream: TextIO = sys.__stderr__
    sys.stderr = cast("TextIO", _Unbroken(stream))
    try:
        yield
    finally:
        sys.stderr = stream


def _devnull_sink() -> TextIO:
    """A text stream to /dev/null, on descriptor 2 where 2 is closed: no file the run
    opens later takes 2 (what a library writes there would go into it), and where
    stdout is closed too, 1 stays closed (``-o /dev/stdout`` is refused, not written
    into /dev/null)."""
    return os.fdopen(_devnull_at(2, os.O_WRONLY), "w", encoding="utf-8")  # the caller closes it


def _devnull_at(fd: int, flags: int) -> int:
    """/dev/null opened (``flags``) on descriptor ``fd`` where ``fd`` is closed, so no
    file opened later takes it; elsewhere, on a descriptor of its own. Its number."""
    devnull = os.open(os.devnull, flags)
    if devnull != fd and not fd_open(fd):
        os.dup2(devnull, fd)
        os.close(devnull)
        return fd
    return devnull


def _main(argv: list[str]) -> int:
    verbose, at = _leading_verbosity(argv)
    if at < len(argv) and argv[at] in _HANDED_OFF:  # argparse's REMAINDER drops leading options
        if verbose:
            logs.configure(verbose)
        if argv[at] in ("serve", "mock"):
            _servers_std()
        try:
            return _hand_off(argv[at], argv[at + 1 :], verbose)
        except KeyboardInterrupt as exc:  # Ctrl-C in a command that does not take it itself
            print("callboard: interrupted", file=sys.stderr)  # (the bench's children are
            return _status_of(exc)  # stopped on their way out): a traceback said it (a hunt)
    parser = _parser()
    args = parser.parse_args(argv)
    logs.configure(args.verbose)
    try:
        code: int = args.func(args)
    except (UsageError, ClusterUnreachableError) as exc:  # the configured cluster too
        print(f"callboard: error: {exc}", file=sys.stderr)
        return Exit.USAGE
    except RuntimeError as exc:
        if not _no_thread(exc):
            raise
        print(  # a traceback said only "can't start new thread" (found by a hunt)
            "callboard: error: cannot start a thread: this process is at its limit of "
            "threads or memory (ulimit -u, a container's pids limit, ulimit -v); nothing "
            "was lost: run again with room",
            file=sys.stderr,
        )
        return Exit.UNFINISHED
    except KeyboardInterrupt as exc:  # before the first line was taken: nothing sent is
        print("callboard: interrupted", file=sys.stderr)  # lost (the feed and its stop
        return _status_of(exc)  # handle it)
    return code


def _servers_std() -> None:
    """A server's stdin and stdout, where the process started with them closed (``<&-``,
    ``>&-``), on /dev/null: the event loop's own descriptors took 0 or 1 then, and libuv
    aborts (SIGABRT, exit 134) closing one at 2 or below; and the announcement had no
    stdout to go to (found by a hunt)."""
    for fd, flags, name in ((0, os.O_RDONLY, "stdin"), (1, os.O_WRONLY, "stdout")):
        if fd_open(fd):
            continue
        _devnull_at(fd, flags)
        if getattr(sys, name) is None:
            mode = "r" if fd == 0 else "w"
            setattr(sys, name, os.fdopen(fd, mode, encoding="utf-8", closefd=False))


def _no_thread(exc: RuntimeError) -> bool:
    """Whether ``exc`` is the interpreter's refusal to start a thread."""
    return "can't start new thread" in str(exc)


def _status_of(interrupt: KeyboardInterrupt) -> Exit:
    return Exit.TERMINATED if isinstance(interrupt, Terminated) else Exit.INTERRUPTED


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


def _hand_off(command: str, rest: Sequence[str], verbose: int = 0) -> int:
    if command == "mock":
        from callboard.provider.server import run_mock

        return run_mock(rest)
    if command == "shell":
        from callboard.shell import main as shell_main

        return shell_main(rest)
    if command == "serve":
        from callboard.gateway import main as serve_main

        # its logging is its own at any verbosity: ``callboard -v serve`` is ``serve -v``
        # (0 a clean stop, 1 cannot listen, 2 a bad config or argument)
        return serve_main([*("-v",) * verbose, *rest])
    from callboard.bench.harness import main as bench_main

    return bench_main(rest)


def version() -> str:
    """``callboard <version>``, from the installed package's metadata."""
    try:
        return f"callboard {importlib.metadata.version('callboard')}"
    except importlib.metadata.PackageNotFoundError:
        return "callboard (version unknown: the package is not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="callboard",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=version(), help="print the version and exit"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more of callboard's logging: -v info, -vv debug (default: warnings only); "
        "the HTTP libraries stay at warnings (-vvv: their info, never their debug)",
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND", title="commands")

    run = sub.add_parser(
        "run",
        help=_SUMMARY["run"],
        description=_RUN_DESCRIPTION,
        epilog=_run_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("input", type=Path, help="requests, one JSON object per line (- for stdin)")
    run.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        help="results file (appended; - for stdout; required)",
    )
    run.add_argument("--config", type=Path, help="callboard.toml (default: the simulated provider)")
    run.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help="requests submitted ahead of their results, at most the scheduler's capacity "
        f"(default: {WINDOW})",
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,  # so a count before the command (callboard -v run) stays
        help="as callboard -v: -v info, -vv debug",
    )
    kept = run.add_mutually_exclusive_group()
    kept.add_argument(
        "--ledger",
        type=Path,
        help="SQLite ledger that makes the run crash-safe (default: OUTPUT.ledger)",
    )
    kept.add_argument(
        "--no-ledger",
        action="store_true",
        help="keep no ledger: resume from the output file only (default: keep one)",
    )
    run.add_argument(
        "--retry-failed",
        action="store_true",
        help="send again the ids whose last result is not completed (failed, expired, "
        "rejected); completed ones are kept",
    )
    run.add_argument(
        "--resend-changed",
        action="store_true",
        help="send again the lines whose request changed since their result was written "
        "(default: keep the old result and name those ids)",
    )
    run.add_argument(
        "--rebuild-ledger",
        action="store_true",
        help="set a damaged ledger aside (renamed LEDGER.damaged) and start a new one with "
        "the rows of it that still read; ids the output holds are not sent again",
    )
    run.set_defaults(func=cmd_run)

    for command in _HANDED_OFF:  # main() hands these off before parsing; listed for --help
        handed = sub.add_parser(command, help=_SUMMARY[command], add_help=False)
        handed.add_argument("rest", nargs=argparse.REMAINDER)
        handed.set_defaults(func=lambda args, command=command: _hand_off(command, args.rest))
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    check_paths(args)
    if args.window < 1:
        raise UsageError("--window must be at least 1")
    stream = is_stream(args.output)
    if args.rebuild_ledger and (args.no_ledger or (stream and args.ledger is None)):
        raise UsageError("--rebuild-ledger: this run keeps no ledger to rebuild")
    config = None
    if args.config is not None:
        from callboard.toml_config import load_config

        config = load_config(args.config)
    config = config or SystemConfig()
    if config.switch_interval_s is None:  # this process is ours: shorter GIL hand-offs
        config = dataclasses.replace(config, switch_interval_s=RUN_SWITCH_INTERVAL_S)
    with contextlib.ExitStack() as files:
        source = files.enter_context(spooled(args.input))
        if stream:
            return _run_to_stream(args, config, source)
        read_our_output(args.output, first=OUTPUT_PEEK_LINES)  # not ours: no OUTPUT.lock
        check_tail(args.output)  # nor if its last line is none of ours
        files.enter_context(exclusive(args.output))
        state = read_our_output(args.output)  # again, holding the lock: before anything is cut
        repair_tail(args.output)
        ledger = None
        if not args.no_ledger:
            path = args.ledger or ledger_path(args.output)
            ledger = open_ledger(
                path,
                args.output,
                state,
                rebuild_it=args.rebuild_ledger,
                given=args.ledger is not None,
            )
        return _run_batch(args, config, source, state, ledger)


def _run_to_stream(args: argparse.Namespace, config: SystemConfig, source: Path) -> int:
    """A run writing to a stream: nothing to resume from but a ledger ``--ledger`` names."""
    state = OutputState()
    ledger = None
    if args.ledger is not None:
        ledger = open_ledger(args.ledger, args.output, state, rebuild_it=args.rebuild_ledger)
    else:
        print(
            f"callboard: results go to {shown(args.output)}: nothing to resume from, so a "
            "rerun sends every line again (--ledger PATH keeps the results, which a rerun "
            "writes again without sending them)",
            file=sys.stderr,
        )
    return _run_batch(args, config, source, state, ledger)


def _run_batch(
    args: argparse.Namespace,
    config: SystemConfig,
    source: Path,
    state: OutputState,
    ledger: SqliteLedger | None,
) -> int:
    if config.budget.close_on_refusals is None:  # a batch's lines are alike: its rest waits
        budget = dataclasses.replace(config.budget, close_on_refusals=True)
        config = dataclasses.replace(config, budget=budget)
    try:
        held = ledger_results(ledger, args.output) if ledger is not None else {}
    except BaseException:
        if ledger is not None:
            ledger.close()
        raise
    plan = RunPlan(
        output=state,
        ledger=held,
        retry_failed=args.retry_failed,
        resend_changed=args.resend_changed,
    )
    unpriced = _unpriced(config)
    started = time.monotonic()
    total = count_lines(source)
    interrupts = Interrupts()  # from here a signal is noted, and raised only where looked for
    # noted, not raised, to the summary's end: a signal as the run ends must not cut
    # the output's rewrite short, nor kill the process without a word (SIGTERM's default)
    with interrupts.noted():
        with (
            System(config, ledger=ledger) as cb,
            open_output(args.output) as out,
            RunProgress(total, unpriced=unpriced) as progress,
        ):
            written_to = None if is_stream(args.output) else file_identity(out)
            job = BatchRun(
                cb,
                out,
                args.window,
                progress,
                state.statuses,
                plan=plan,
                interrupts=interrupts,
                unpriced=unpriced,
            )
            stopped_early = untidy = False
            try:
                with steady_heap():  # the collector off the calls' path
                    stopped_early = not _feed(job, source)
                    job.finish()
            except KeyboardInterrupt as exc:
                job.interrupted = _status_of(exc)
                stop_interrupted(cb, job)
            finally:
                job.close()  # the writer is done before the output closes, whatever happened
        interrupts.raise_at = 2  # the actors are stopped: a second signal may cut the
        # tidy-up short (a rewrite goes through OUTPUT.compacting: the next run ends it)
        if written_to is not None and written_to != path_identity(args.output):
            job.output_lost = True  # nothing to tidy: the file at that name is not the one
        elif not is_stream(args.output):
            complete = not (stopped_early or job.interrupted)
            untidy = not _tidy(args.output, job, complete=complete, doubled=state.doubled > 0)
        elif (
            job.write_error is not None
            and str(args.output) == "-"
            and not isinstance(job.write_error, WriterFailedError)
        ):
            _silence_stdout()
        code = job.report(args, time.monotonic() - started)
    if interrupts.first and not job.interrupted:  # it came once the run had ended
        print("callboard: interrupted as the run ended (above: what it wrote)", file=sys.stderr)
        return Exit.TERMINATED if interrupts.terminated else Exit.INTERRUPTED
    return Exit.UNFINISHED if (stopped_early or untidy) and code == Exit.COMPLETED else code


def _unpriced(config: SystemConfig) -> frozenset[str]:
    """The configured models with no price (said once, here): their cost is unknown."""
    # FREE is ModelSettings' default: an explicit price, even of 0, is another object
    names = frozenset(m.name for m in config.models if m.price is FREE)
    for name in sorted(names):
        print(
            f"callboard: model {name!r} has no price in the config: its cost is unknown "
            f"(cost_usd null in its results); add [models.{_toml_key(name)}] price = "
            '{ input = "...", output = "..." } ($ per million tokens) to count it',
            file=sys.stderr,
        )
    return names


def _toml_key(name: str) -> str:
    """``name`` as a TOML key: bare if it can be, else quoted (``[models.gpt-4.1]`` named
    the table ``models.gpt-4`` and its table ``1``; found by a hunt)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _tidy(output: Path, job: BatchRun, *, complete: bool, doubled: bool) -> bool:
    """One line per id: drop the lines a result replaced (in this run, or in one that
    could not rewrite the file: ``doubled``), and (after a run that read the whole
    input) the error records of lines that have another id now. A rewrite that fails
    (a full disk) leaves the file as it was, said, and returns False (the run ends 1:
    the file holds two lines for some ids, which it ended 0 with; found by a hunt):
    the next run rewrites it."""
    stale = stale_errors(job.statuses, job.seen) if complete else set()
    if not (job.superseded or stale or doubled):
        return True
    try:
        compact_output(output, drop=stale)
    except OSError as exc:
        print(
            f"callboard: could not rewrite {output} with one line per id "
            f"({exc.strerror or exc}): it holds more than one line for some ids until "
            "the next run rewrites it",
            file=sys.stderr,
        )
        return False
    if stale:
        print(
            f"callboard: removed {len(stale)} error record(s) of lines that have another id "
            f"now ({', '.join(sorted(stale)[:10])})",
            file=sys.stderr,
        )
    return True


class _Unbroken:
    """stderr, whose reader may go away (``callboard run ... 2>&1 | head``, a pager
    quit, a log shipper that died) or whose disk fills: the first write it refuses
    points the descriptor at /dev/null, and that write and every later one are taken as
    written. What callboard says on stderr (progress, a line's error, the summary,
    logging) never stops a run:
    the progress line raised on the thread that writes results, which died, and every
    result after it was sent, paid for and never written (found by a hunt)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._refused(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._refused(exc)

    def _refused(self, exc: OSError) -> None:
        """A write refused: the reader gone (EPIPE), a full disk behind ``2>log`` (ENOSPC),
        a terminal hung up (EIO), ...: silenced for good; a non-blocking descriptor that
        is full for now (EAGAIN): this message is dropped, the next ones are tried."""
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
            self._silence()

    def _silence(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # a stream with no descriptor
            _to_devnull(self._stream.fileno())
        with contextlib.suppress(OSError, ValueError):  # what the refused write left
            self._stream.flush()  # in the buffer goes to /dev/null

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """stdout's reader went away: point it at /dev/null so the interpreter's last flush
    does not print a BrokenPipeError."""
    _to_devnull(sys.stdout.fileno())


def _to_devnull(fd: int) -> None:
    """Point the descriptor ``fd`` at /dev/null: what is written to it goes nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _feed(job: BatchRun, path: Path) -> bool:
    """Submit the input's lines; True if every line was taken, False once the system
    stops admitting (a spent budget, a supervisor that gave up) or the output cannot be
    written. The lines not sent get no result line: the next run sends them."""
    try:
        job.feed(path)
    except SystemStoppedError as exc:
        print(
            f"callboard: stopped taking lines: {exc} (the lines not sent run on the next run)",
            file=sys.stderr,
        )
        return False
    except OutputClosedError:
        stop_waiting(job.cb, job.interrupts)  # what is queued would go nowhere
        return False
    return True


def _run() -> None:  # pragma: no cover - console entry
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    _run()


__all__ = ["main"]
