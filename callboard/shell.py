"""``callboard shell``: a Python REPL with a running system bound to ``cb``.

It starts a ``System`` (the simulated provider, or ``--config callboard.toml``),
opens ``code.InteractiveConsole`` with ``cb``, ``callboard``, ``messages``,
``Priority``, ``patterns`` and ``every`` in scope, and prints a banner of
things to try. Values are echoed in one bounded line (``short_repr``): a
result carrying a megabyte of text, or a ``Route`` of a thousand tasks, shows
as a line a person can read.

What must hold: the system is stopped (and any jobs actor the shell started)
however the console ends: end of input, ``exit()``, or an exception.
"""

from __future__ import annotations

import argparse
import builtins
import code
import dataclasses
import enum
import reprlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import callboard
from callboard import logs, messages, patterns
from callboard._system import System
from callboard.jobs import every
from callboard.messages import ClusterUnreachableError, Priority, UsageError

BANNER = """\
callboard shell: cb is a running System ({models}).
  f = cb.submit("Say hi", priority=Priority.HIGH); f.result()
  cb.ask("model:{first}", messages.GetState())
  cb.tell("queue", messages.Crash())        # the supervisor restarts it
  cb.supervision()["queue"]                 # restarts, last errors
  cb.stats()
  patterns.race(cb, "hi", models={models})
  every(cb, "30s", "ping", max_runs=3)
Ctrl-D (or exit()) stops the system and leaves."""


class _ShortRepr(reprlib.Repr):
    """``reprlib`` that also abbreviates dataclasses, enums and read-only mappings."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = 80
        self.maxother = 80
        self.maxlist = self.maxtuple = self.maxset = self.maxdict = 6
        self.maxlevel = 4

    def repr1(self, x: Any, level: int) -> str:
        if type(x) is float:
            return f"{x:.4g}"
        if isinstance(x, enum.Enum):
            return f"{type(x).__name__}.{x.name}"
        if isinstance(x, MappingProxyType):
            return self.repr1(dict(x), level)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return self._dataclass(x, level)
        return super().repr1(x, level)

    def _dataclass(self, x: Any, level: int) -> str:
        name = type(x).__name__
        if level <= 0:
            return f"{name}(...)"
        parts = [
            f"{f.name}={self.repr1(getattr(x, f.name), level - 1)}"
            for f in dataclasses.fields(x)
            if f.repr
        ]
        return f"{name}({', '.join(parts)})"


_SHORT = _ShortRepr()


def short_repr(value: object, limit: int = 600) -> str:
    """One line, at most ``limit`` characters, long strings and containers abbreviated."""
    text = _SHORT.repr(value).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 4] + " ..."


class CallboardConsole(code.InteractiveConsole):
    """An ``InteractiveConsole`` whose echoed values are ``short_repr`` lines."""

    def runcode(self, compiled: Any) -> None:
        saved = sys.displayhook
        sys.displayhook = _display
        try:
            super().runcode(compiled)
        finally:
            sys.displayhook = saved


def _display(value: object) -> None:
    if value is None:
        return
    builtins._ = value  # type: ignore[attr-defined]  # as the default hook does
    print(short_repr(value))  # noqa: T201 - the REPL's echo


def namespace(system: System) -> dict[str, Any]:
    """What the console has in scope."""
    return {
        "cb": system,
        "callboard": callboard,
        "messages": messages,
        "Priority": Priority,
        "patterns": patterns,
        "every": every,
        "__name__": "__console__",
    }


def banner(system: System) -> str:
    names = list(system.models)
    return BANNER.format(models=names, first=names[0] if names else "MODEL")


def make_console(system: System) -> CallboardConsole:
    return CallboardConsole(namespace(system), filename="<callboard>")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="callboard shell", description="A Python REPL with a running callboard as cb."
    )
    parser.add_argument("--config", type=Path, help="callboard.toml (default: simulated provider)")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="-v info, -vv debug logging"
    )
    return parser


def main(argv: Sequence[str] | None = None, *, make_system: Callable[..., System] = System) -> int:
    """Run the shell; returns the exit status (0, or what ``exit(n)`` asked for)."""
    args = _parser().parse_args(argv)
    if args.verbose:
        logs.configure(args.verbose)
    config = None
    try:
        if args.config is not None:
            from callboard.toml_config import load_config

            config = load_config(args.config)
        system = make_system(config)
    except (UsageError, ClusterUnreachableError) as exc:
        print(f"callboard shell: error: {exc}", file=sys.stderr)  # noqa: T201 - CLI error
        return 2
    status = 0
    try:
        make_console(system).interact(banner=banner(system), exitmsg="stopping callboard ...")
    except SystemExit as exc:  # exit() / quit() inside the console
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # noqa: T201 - exit("msg") says it, as Python does
    finally:
        system.stop(cancel=True)  # it ends the recurring jobs first
    return status


if __name__ == "__main__":
    sys.exit(main())
