"""Logging for people (callboard/logs.py): the command line's ``configure`` (callboard's
loggers follow ``-v``, the libraries it drives never go below INFO, the handler
redacts), and, end to end, that ``callboard run`` against a server that echoes every
request back lets no secret reach stderr, a log record, the output or the ledger,
whether it came as an API key, in a base URL (its query or its userinfo) or in a
proxy's URL, on either transport.

The server (``loopback.echo``) is a loopback ``WireServer`` that repeats the URL and headers it
was sent in its answer's headers, in a completion's content (prompt ``ok``) and in a
400 error body (any other prompt).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from callboard.runtime import redact
from loopback import WireServer
from loopback import echo as echoing
from support import LogCollector, cli, fresh, records, write_lines

from callboard.cli import main
from callboard.logs import THIRD_PARTY, RedactingFilter, TaskLogFilter, configure

SECRET = "sk-cb-SECRET-7f3a9"  # noqa: S105 - a test value
PROXY_PASSWORD = "pr0xy-PW-c0ffee"  # noqa: S105 - a test value


# -- configure ----------------------------------------------------------------------


@contextlib.contextmanager
def bare_root() -> Iterator[logging.Logger]:
    """The root logger with no handler (as in a fresh ``callboard`` process) for the
    with block (pytest's own handlers included); its handlers and every level
    ``configure`` sets are put back after."""
    root = logging.getLogger()
    names = ["callboard", *THIRD_PARTY]
    saved = root.handlers[:], root.level, {n: logging.getLogger(n).level for n in names}
    root.handlers.clear()
    try:
        yield root
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(
    ("verbose", "ours", "theirs"),
    [
        (0, logging.WARNING, logging.WARNING),
        (1, logging.INFO, logging.WARNING),
        (2, logging.DEBUG, logging.WARNING),
        (3, logging.DEBUG, logging.INFO),
        (6, logging.DEBUG, logging.INFO),
    ],
)
def test_verbosity_turns_up_callboard_and_never_the_libraries_to_debug(
    verbose: int, ours: int, theirs: int
) -> None:
    with bare_root():
        configure(verbose)
        assert logging.getLogger("callboard.actors.model").getEffectiveLevel() == ours
        for name in ("httpcore.http11", "httpx", "aiohttp.client", "asyncio", "hpack.hpack"):
            assert logging.getLogger(name).getEffectiveLevel() == theirs, name


def test_the_handler_redacts_and_gives_every_record_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    redact.register([SECRET])
    with bare_root() as root:
        configure(2)
        (handler,) = root.handlers
        kinds = {type(f) for f in handler.filters}
        logging.getLogger("callboard.test_logs").debug("sending %s", f"Bearer {SECRET}")
        logging.getLogger("httpcore.test_logs").debug("headers %s", SECRET)  # held back
    assert {TaskLogFilter, RedactingFilter} <= kinds
    err = capsys.readouterr().err
    assert "[task=- trace=-] sending Bearer ***" in err
    assert "httpcore" not in err
    assert SECRET not in err


def test_a_warning_is_logged_and_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    redact.register([SECRET])
    with bare_root():
        configure(0)
        with warnings.catch_warnings():  # pytest makes warnings errors
            warnings.simplefilter("always")
            warnings.warn(f"unclosed session to {SECRET}", ResourceWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert "WARNING py.warnings" in err
    assert "unclosed session to ***" in err


def test_configure_again_replaces_its_own_handler() -> None:
    with bare_root() as root:
        configure(1)
        configure(2)
        assert len(root.handlers) == 1
        assert logging.getLogger("callboard").level == logging.DEBUG


def test_configure_leaves_logging_a_host_has_set_up() -> None:
    theirs = logging.NullHandler()
    with bare_root() as root:
        root.addHandler(theirs)
        root.setLevel(logging.DEBUG)
        configure(2)
        assert root.handlers == [theirs]
        assert root.level == logging.DEBUG


def test_a_host_that_configured_no_logging_sees_callboards_warnings_on_stderr() -> None:
    """What docs/operations.md says (it said callboard "prints nothing except in the
    CLI", found by a hunt): callboard adds no handler, so in a process that configured
    no logging Python's last resort prints its warnings and errors to stderr, the
    message alone, and nothing below; the logging HOWTO's default for a library, and
    what ``callboard shell`` shows without ``-v``. A NullHandler silences it."""
    probe = (
        "import logging, sys; sys.stderr = sys.stdout; import callboard; callboard.System; "
        "log = logging.getLogger('callboard.actors.model'); "
        "log.warning('m: breaker open'); log.info('an info'); "
        "logging.getLogger('callboard').addHandler(logging.NullHandler()); "
        "log.error('silenced')"
    )
    assert fresh(probe) == "m: breaker open"


# -- callboard run, end to end ------------------------------------------------------


@pytest.fixture
def echo() -> Iterator[WireServer]:
    with WireServer(echoing) as server:
        yield server


def _forms(secret: str, user: str | None = None) -> list[str]:
    """``secret`` as is, URL-quoted, and in Base64 (of ``user:secret`` for a Basic
    header), padded and not."""
    b64 = base64.b64encode((secret if user is None else f"{user}:{secret}").encode()).decode()
    return [secret, urllib.parse.quote(secret, safe=""), b64, b64.rstrip("=")]


def _setup(
    tmp_path: Path, echo: WireServer, where: str, transport: str
) -> tuple[str, dict[str, str], list[str]]:
    """The model's TOML, the environment it reads, and the forms that must not show."""
    toml = f'transport = "{transport}"\nretry = {{ max_attempts = 1 }}\n'
    if where == "api_key":
        return (
            f'base_url = "{echo.base_url}"\napi_key_env = "CB_TEST_KEY"\n{toml}',
            {"CB_TEST_KEY": SECRET},
            _forms(SECRET),
        )
    if where == "query":
        url = f"{echo.base_url}?api-version=1&key={SECRET}"
        return 'base_url_env = "CB_TEST_URL"\n' + toml, {"CB_TEST_URL": url}, _forms(SECRET)
    if where == "userinfo":
        url = f"http://bob:{SECRET}@127.0.0.1:{echo.port}/v1"
        return 'base_url_env = "CB_TEST_URL"\n' + toml, {"CB_TEST_URL": url}, _forms(SECRET, "bob")
    proxy = f"http://hunter:{PROXY_PASSWORD}@127.0.0.1:{echo.port}"
    return (
        f'base_url = "http://api.example.invalid/v1"\nproxy_env = "CB_TEST_PROXY"\n{toml}',
        {"CB_TEST_PROXY": proxy},
        _forms(PROXY_PASSWORD, "hunter"),
    )


def _run_args(tmp_path: Path, model_toml: str) -> tuple[list[Any], Path]:
    src = write_lines(
        tmp_path / "in.jsonl", [{"id": "a", "prompt": "ok"}, {"id": "b", "prompt": "x"}]
    )
    config = tmp_path / "c.toml"
    config.write_text(f"[models.m]\n{model_toml}", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    return ["-vv", "run", src, "-o", out, "--config", config], out


def _leaks(tmp_path: Path, forms: list[str], *texts: str) -> list[str]:
    """Where any of ``forms`` shows: in ``texts`` or in a file the run wrote."""
    found = [f"text[{i}]" for i, t in enumerate(texts) if any(f in t for f in forms)]
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix != ".toml":
            data = path.read_bytes()
            found += [path.name for f in forms if f.encode() in data]
    return found


@pytest.fixture
def run_main(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[[list[Any], dict[str, str]], tuple[int, str, str]]:
    """``run(args, env)``: the CLI's ``main`` in this process with ``env`` set; its exit
    status, stdout and stderr."""

    def run(args: list[Any], env: dict[str, str]) -> tuple[int, str, str]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code = main([str(a) for a in args])
        said = capsys.readouterr()
        return code, said.out, said.err

    return run


@pytest.mark.parametrize(
    "case",
    [
        ("api_key", "aiohttp"),
        ("api_key", "httpx"),
        ("query", "aiohttp"),
        ("query", "httpx"),
        ("userinfo", "aiohttp"),
        ("userinfo", "httpx"),
        ("proxy", "httpx"),
    ],
)
def test_a_run_against_an_echoing_server_shows_no_secret_anywhere(
    tmp_path: Path,
    echo: WireServer,
    debug_logs: LogCollector,
    run_main: Callable[[list[Any], dict[str, str]], tuple[int, str, str]],
    case: tuple[str, str],
) -> None:
    model_toml, env, forms = _setup(tmp_path, echo, *case)
    args, out = _run_args(tmp_path, model_toml)
    code, stdout, stderr = run_main(args, env)
    assert code == 1, stderr  # "a" completed, "b" failed with the echo as its error
    by_id = {r["id"]: r for r in records(out)}
    assert by_id["a"]["status"] == "completed"
    assert "***" in by_id["a"]["text"], "the echo came back, redacted"
    assert by_id["b"]["error"]["status_code"] == 400
    assert _leaks(tmp_path, forms, stdout, stderr, *debug_logs.lines) == []


def test_a_run_at_debug_verbosity_prints_no_secret(tmp_path: Path, echo: WireServer) -> None:
    model_toml, env, forms = _setup(tmp_path, echo, "api_key", "httpx")
    args, _ = _run_args(tmp_path, model_toml)
    proc = cli(*args, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "DEBUG callboard" in proc.stderr, "-vv was heard"
    assert " httpcore" not in proc.stderr, "the HTTP libraries stay at warnings"
    assert _leaks(tmp_path, forms, proc.stdout, proc.stderr) == []


def test_a_key_written_in_the_base_url_in_the_file_is_refused_unseen(
    tmp_path: Path,
    echo: WireServer,
    run_main: Callable[[list[Any], dict[str, str]], tuple[int, str, str]],
) -> None:
    args, out = _run_args(tmp_path, f'base_url = "{echo.base_url}?key={SECRET}"\n')
    code, _, err = run_main(args, {})
    assert code == 2
    assert "base_url_env" in err
    assert SECRET not in err
    assert not out.exists()
    assert echo.count() == 0
